"""``elastic-ddp ckpt``: list, verify and export checkpoints from the command line.

``add_parser(subparsers)`` registers the ``ckpt`` command; the top-level CLI then calls
``args.func(args)``, which returns the process exit status. ``python -m elastic_ddp.checkpoint.cli``
runs the same commands stand-alone.

Exit status: 0 success, 1 a checkpoint failed verification or is not a checkpoint, 2 usage.
Remote URLs use the standard AWS configuration (environment, profile, ``AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import sys
from typing import Any

import torch

from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.errors import CheckpointError
from elastic_ddp.checkpoint.catalog import list_checkpoints, read_checkpoint, read_index, verify_checkpoint
from elastic_ddp.checkpoint.sharded import read_state
from elastic_ddp.checkpoint.storage import Storage, StorageError, normalize_url
from elastic_ddp.checkpoint.tree import TreeError

# The state a training run registers its model under; export writes it as plain weights.
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
        "export", help="Write a verified checkpoint's model weights (the state named 'model') as one plain torch.save file."
    )
    p_export.add_argument("checkpoint_url", help="A checkpoint directory.")
    p_export.add_argument("out", help="Output file (local path); torch.load(OUT, weights_only=True) reads it.")
    p_export.set_defaults(func=cmd_export)
    return parser


def cmd_list(args: argparse.Namespace) -> int:
    try:
        infos = list_checkpoints(Storage(args.url))
    except StorageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([info.to_json() for info in infos], indent=1))
        return 0
    if not infos:
        print(f"No committed checkpoints under {args.url}.")
        return 0
    print(f"{'step':>10}  {'world':>5}  {'bytes':>12}  {'saved (UTC)':<19}  url")
    for info in infos:
        when = datetime.datetime.fromtimestamp(info.time, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        print(f"{info.step:>10}  {info.world_size:>5}  {info.bytes:>12}  {when:<19}  {info.url}")
    return 0


def _open_verified(checkpoint_url: str) -> tuple[Storage, Any] | int:
    url = normalize_url(checkpoint_url)
    try:
        storage = Storage(url)
        info = read_checkpoint(storage, url)
        result = verify_checkpoint(storage, info)
    except (CheckpointError, StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not result.ok:
        print(
            f"FAILED: checkpoint {url} is not intact: file {result.bad_file!r}: {result.reason}.",
            file=sys.stderr,
        )
        return 1
    return storage, info


def cmd_verify(args: argparse.Namespace) -> int:
    opened = _open_verified(args.checkpoint_url)
    if isinstance(opened, int):
        return opened
    _, info = opened
    print(f"OK: checkpoint {info.url} (step {info.step}, {len(info.manifest['files'])} files, {info.bytes} bytes).")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    opened = _open_verified(args.checkpoint_url)
    if isinstance(opened, int):
        return opened
    storage, info = opened
    try:
        index = read_index(storage, info)
        if MODEL_STATE not in index.state:
            print(f"error: {info.url} holds no state named {MODEL_STATE!r} (it holds {sorted(index.state)}).", file=sys.stderr)
            return 1
        # Only the files holding the model's pieces are read (each checked as it streams in).
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            weights = read_state(storage, info.url, index, mf.file_records(info.manifest), [MODEL_STATE], pool)[MODEL_STATE]
    except (CheckpointError, StorageError, TreeError) as exc:
        print(f"error: reading the model from {info.url} failed: {exc}", file=sys.stderr)
        return 1
    torch.save(weights, args.out)
    print(f"Wrote {len(weights)} tensors of step {info.step} to {args.out}.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastic-ddp")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
