"""``elastic-ddp ckpt``: list, verify and export checkpoints from the command line.

``add_parser(subparsers)`` registers the ``ckpt`` command; the top-level CLI then calls
``args.func(args)``, which returns the process exit status. ``python -m elastic_ddp.tools.checkpoint``
runs the same commands stand-alone.

Exit status: 0 success, 1 a checkpoint failed verification, is not a checkpoint or does not hold
what ``export`` was asked for (an object name, a rank, an object the format can hold), 2 usage.
Remote URLs use the standard AWS configuration (environment, profile, ``AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import sys
from typing import Any


from elastic_ddp.checkpoint import export as ex
from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.errors import CheckpointError
from elastic_ddp.checkpoint.catalog import (
    CheckpointInfo,
    list_checkpoints,
    read_checkpoint,
    read_index,
    verify_checkpoint,
)
from elastic_ddp.checkpoint.index import Index, IndexFormatError
from elastic_ddp.checkpoint.objects import object_tensors, open_objects
from elastic_ddp.checkpoint.sharded import describe_per_rank
from elastic_ddp.checkpoint.storage import Storage, StorageError, normalize_url
from elastic_ddp.checkpoint.tree import TreeError

# The state a training run registers its model under; export writes it unless told otherwise.
MODEL_STATE = "model"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``ckpt`` with its sub-commands ``list``, ``verify`` and ``export`` on ``subparsers``."""
    parser = subparsers.add_parser("ckpt", help="List, verify and export checkpoints.")
    sub = parser.add_subparsers(dest="ckpt_command", required=True)

    p_list = sub.add_parser("list", help="List the committed checkpoints under a URL, oldest first.")
    p_list.add_argument("url", help="The checkpoint root (checkpoint.url): a path or fsspec URL.")
    p_list.add_argument("--json", action="store_true", help="Print a JSON list instead of a table.")
    p_list.set_defaults(func=cmd_list)

    p_verify = sub.add_parser("verify", help="Check every file of one checkpoint against its manifest.")
    p_verify.add_argument("checkpoint_url", help="A checkpoint directory, e.g. runs/x/checkpoints/step-000000100.")
    p_verify.set_defaults(func=cmd_verify)

    p_export = sub.add_parser(
        "export",
        help="Write objects of a verified checkpoint (default: the model's weights) as torch.save, safetensors or DCP.",
        description=(
            "Verify a checkpoint, then write the state dicts of the objects it holds -- by default the one named "
            "'model'. --format torch (default): plain torch.save files of tensors and plain values that "
            "torch.load(OUT, weights_only=True) reads. --format safetensors: the tensors only, keyed by their "
            "paths joined with '.' (a model's state_dict keys); the plain values left out are listed. --format "
            "dcp: a torch.distributed.checkpoint directory (torch.distributed.checkpoint.format_utils."
            "dcp_to_torch_save converts it). One object: OUT is the file (a directory for dcp). Several "
            "--object, or --all: OUT is a directory that gets one NAME.pt, NAME.safetensors or NAME/ per object."
        ),
    )
    p_export.add_argument("checkpoint_url", metavar="CHECKPOINT", help="A checkpoint directory.")
    p_export.add_argument(
        "out", metavar="OUT",
        help="Output (local path): the file (dcp: directory) for one object, a directory of them for several.",
    )  # fmt: skip
    which = p_export.add_mutually_exclusive_group()
    which.add_argument(
        "--object", dest="objects", action="append", metavar="NAME",
        help=f"Export the object registered under NAME (repeatable; default {MODEL_STATE!r}): e.g. model, optimizer, "
        "scheduler, data, or a name given to run.setup() such as ema.",
    )  # fmt: skip
    which.add_argument("--all", action="store_true", help="Export every object the checkpoint holds.")
    p_export.add_argument(
        "--rank", type=int, default=0, metavar="R",
        help="For what differs across ranks (BatchNorm statistics, per-rank objects): rank R's values (default 0).",
    )  # fmt: skip
    p_export.add_argument(
        "--format", choices=ex.FORMATS, default="torch",
        help="torch (default): torch.save files; safetensors: tensors only (plain values are listed, not written); "
        "dcp: torch.distributed.checkpoint directories.",
    )  # fmt: skip
    p_export.set_defaults(func=cmd_export)
    return parser


def cmd_list(args: argparse.Namespace) -> int:
    try:
        infos = list_checkpoints(Storage(args.url))
    except StorageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([{**info.to_json(), "init_from": info.manifest.get("init_from")} for info in infos], indent=1))
        return 0
    if not infos:
        print(f"No committed checkpoints under {args.url}.")
        return 0
    print(f"{'step':>10}  {'world':>5}  {'bytes':>12}  {'saved (UTC)':<19}  url")
    for info in infos:
        when = datetime.datetime.fromtimestamp(info.time, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        print(f"{info.step:>10}  {info.world_size:>5}  {info.bytes:>12}  {when:<19}  {info.url}")
    # One line per source rather than a column: a URL and a digest would make every row unreadable.
    sources: dict[tuple[str, str, str], list[int]] = {}
    for info in infos:
        source = info.manifest.get("init_from")
        if source is not None:
            sources.setdefault((source["url"], source["format"], source["blake3"]), []).append(info.step)
    for (url, fmt, digest), steps in sources.items():
        which = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        print(f"Initialised from {url} ({fmt}, BLAKE3 {digest}): {which}.")
    return 0


def _open(checkpoint_url: str) -> tuple[Storage, CheckpointInfo] | int:
    """The checkpoint's storage and manifest, or (after printing why) exit status 1."""
    url = normalize_url(checkpoint_url)
    try:
        storage = Storage(url)
        return storage, read_checkpoint(storage, url)
    except (CheckpointError, StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _check_intact(storage: Storage, info: CheckpointInfo) -> int:
    """0 if every file of the checkpoint matches its manifest, else (after printing which) 1."""
    try:
        result = verify_checkpoint(storage, info)
    except (CheckpointError, StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not result.ok:
        print(
            f"FAILED: checkpoint {info.url} is not intact: file {result.bad_file!r}: {result.reason}.",
            file=sys.stderr,
        )
        return 1
    return 0


def _open_verified(checkpoint_url: str) -> tuple[Storage, CheckpointInfo] | int:
    opened = _open(checkpoint_url)
    if isinstance(opened, int):
        return opened
    failed = _check_intact(*opened)
    return failed if failed else opened


def cmd_verify(args: argparse.Namespace) -> int:
    opened = _open_verified(args.checkpoint_url)
    if isinstance(opened, int):
        return opened
    _, info = opened
    print(f"OK: checkpoint {info.url} (step {info.step}, {len(info.manifest['files'])} files, {info.bytes} bytes).")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    opened = _open(args.checkpoint_url)
    if isinstance(opened, int):
        return opened
    storage, info = opened
    try:
        index = read_index(storage, info)
    except (CheckpointError, StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    # What was asked for is checked before the checkpoint is read in full.
    problem, names = _chosen_objects(args, index, info)
    to_dir = args.all or len(names) > 1
    if problem is None:
        problem = _check_rank(args.rank, index, info) or _check_out(args.out, to_dir=to_dir, fmt=args.format)
    skipped: list[str] = []
    if problem is None and args.format == "safetensors":
        problem, names, skipped = _safetensors_objects(index.as_shared(args.rank), names, info, every=args.all)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    failed = _check_intact(storage, info)
    if failed:
        return failed
    try:
        per_rank = describe_per_rank(index, names)
        # Nothing is read yet: each object streams from the checkpoint's files into its export
        # (every file checked as it streams), so the export holds a few buffers, never the state.
        states = open_objects(storage, info.url, index.as_shared(args.rank), mf.file_records(info.manifest), names)
    except (CheckpointError, StorageError, TreeError, IndexFormatError) as exc:
        print(f"error: reading {', '.join(map(repr, names))} from {info.url} failed: {exc}", file=sys.stderr)
        return 1
    suffix = ex.SUFFIXES[args.format]
    targets = {name: os.path.join(args.out, f"{name}{suffix}") for name in names} if to_dir else {names[0]: args.out}
    written: dict[str, ex.Written] = {}
    try:
        if to_dir:
            os.makedirs(args.out, exist_ok=True)
        for name, path in targets.items():
            written[name] = ex.write(args.format, name, states.pop(name), path, metadata=_metadata(info, name, args.rank))
    except ex.ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: writing the export to {args.out} failed: {exc}", file=sys.stderr)
        return 1
    print(_summary(info, written, targets, out_dir=args.out if to_dir else None, per_rank=per_rank, rank=args.rank))
    if skipped:
        print(f"Skipped (no tensors; safetensors holds tensors only): {', '.join(map(repr, skipped))}.")
    return 0


def _metadata(info: CheckpointInfo, name: str, rank: int) -> dict[str, str]:
    """The safetensors header's metadata: ``format: pt`` (what Hugging Face loaders check for), then
    where the tensors come from. The run name is there when the run's identity records it."""
    out = {"format": "pt", "step": str(info.step), "object": name, "rank": str(rank), "checkpoint": info.url}
    if "run.name" in info.identity:
        out["run"] = str(info.identity["run.name"])
    return out


def _summary(
    info: CheckpointInfo, written: dict[str, ex.Written], targets: dict[str, str], *, out_dir: str | None, per_rank: str,
    rank: int,
) -> str:  # fmt: skip
    """What an export wrote, what a format could not hold, and whose values of what differs across ranks."""

    def what(name: str) -> str:
        count = f"{written[name].tensors} tensor{'s' if written[name].tensors != 1 else ''}"
        return f"{name!r} ({count}, {written[name].bytes} bytes)"

    if out_dir is not None:
        lines = [f"Wrote {len(targets)} objects of step {info.step} to {out_dir}:"]
        lines += [f"  {what(name)} -> {path}" for name, path in targets.items()]
    else:
        [(name, path)] = targets.items()
        lines = [f"Wrote {what(name)} of step {info.step} to {path}."]
    for name, done in written.items():
        if done.left_out:
            shown = ", ".join(done.left_out[:8]) + (f" and {len(done.left_out) - 8} more" if len(done.left_out) > 8 else "")
            lines.append(
                f"Left out of {name!r} (safetensors holds tensors only): {len(done.left_out)} plain "
                f"value{'s' if len(done.left_out) != 1 else ''}: {shown}."
            )
    if per_rank:
        lines.append(
            f"Per-rank values (they differed across the {info.world_size} ranks of the save): {per_rank}. "
            f"Exported: rank {rank}'s" + ("." if rank else " (--rank R for another rank's).")
        )
    elif rank:
        lines.append(f"The exported objects hold no per-rank values: they are the same for every rank, {rank} included.")
    return "\n".join(lines)


def _objects_of(index: Index) -> list[str]:
    """Every object a checkpoint holds, in the order it was registered (per-rank objects last)."""
    return list(index.state) + [name for name in index.own_names if name not in index.state]


def _chosen_objects(args: argparse.Namespace, index: Index, info: CheckpointInfo) -> tuple[str | None, list[str]]:
    """``(problem, names)``: the objects to export, or why the request cannot be met."""
    available = _objects_of(index)
    names = available if args.all else list(dict.fromkeys(args.objects or [MODEL_STATE]))
    if not names:
        return f"{info.url} holds no objects.", []
    held = ", ".join(map(repr, available)) or "nothing"
    for name in names:
        if name not in available:
            close = difflib.get_close_matches(name, available, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"{info.url} holds no object named {name!r}{hint}; it holds {held}.", names
    if args.all or len(names) > 1:
        # Names come from the checkpoint: each becomes a file name inside OUT, so none may leave it.
        for name in names:
            if name in ("", ".", "..") or any(c in name for c in ("/", "\\", "\0")):
                return f"the object name {name!r} in {info.url} cannot be used as a file name.", names
    return None, names


def _check_rank(rank: int, index: Index, info: CheckpointInfo) -> str | None:
    """Why ``--rank`` names no rank of the save, or None. A checkpoint without per-rank data has no
    rank entries; it holds the same values for every rank of the save."""
    ranks = index.ranks() or list(range(info.world_size))
    if rank in ranks:
        return None
    valid = f"the only valid rank is {ranks[0]}" if len(ranks) == 1 else f"the valid ranks are {ranks[0]} to {ranks[-1]}"
    return f"--rank {rank} has no entry in {info.url} (saved at world size {info.world_size}): {valid}."


def _check_out(out: str, *, to_dir: bool, fmt: str) -> str | None:
    """Why ``out`` cannot take the export, or None: a directory of outputs for several objects; for one
    object a file (torch, safetensors) or a directory that does not exist or is empty (dcp)."""
    if to_dir and os.path.exists(out) and not os.path.isdir(out):
        return f"{out} is a file; exporting several objects (or --all) writes a directory of NAME{ex.SUFFIXES[fmt] or '/'} outputs."
    if to_dir:
        return None
    if fmt == "dcp":
        if os.path.exists(out) and not os.path.isdir(out):
            return f"{out} is a file; --format dcp writes a directory."
        if os.path.isdir(out) and os.listdir(out):
            return f"{out} is a directory that is not empty; --format dcp writes a new (or empty) directory."
        return None
    if os.path.isdir(out):
        return f"{out} is a directory; exporting one object writes a file (--all or several --object write a directory)."
    return None


def _safetensors_objects(
    index: Index, names: list[str], info: CheckpointInfo, *, every: bool
) -> tuple[str | None, list[str], list[str]]:
    """``(problem, names, skipped)`` for a safetensors export, which cannot hold an object without
    tensors: with ``--all`` such objects (a scheduler, the data position) are skipped; one named
    with ``--object`` is an error, as is ``--all`` when no object holds a tensor."""
    empty = [name for name in names if not object_tensors(index, name)]
    if not empty:
        return None, names, []
    if every and len(empty) < len(names):
        return None, [name for name in names if name not in empty], empty
    which = f"the object {empty[0]!r}" if not every else f"none of the objects ({', '.join(map(repr, empty))})"
    return (
        f"{which} in {info.url} holds no tensors, and a safetensors file holds nothing else: export it with "
        "--format torch or --format dcp.",
        names,
        [],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic-ddp")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
