"""The sharded writer and reader, usable on any directory URL with any set of participating ranks.

Writing (each participating rank, no collective inside):

    snap = snapshot(state_dicts, rank_state_dicts)         # trees + tensors, in traversal order
    writer = ShardWriter(files_per_writer=2, min_file_bytes=16 << 20)   # keep it: plans are cached
    job = writer.prepare(snap, rank=r, writers=[...])      # this rank's files and their sources
    staged = stager.stage(job.sources, copy=...)           # staging.ShareStager
    report = write_files(storage, dir_url, staged, pool, sync=..., rank=r)  # [FileRecord]
    # one rank gathers the reports, then: index.build(...) -> index.json, then a manifest

Reading (each rank that holds files; then exchange.distribute to the others):

    holders = layout.assign_holders([(f.name, f.writer, f.size) ...], readers, by_writer=...)
    held = read_files(storage, dir_url, files_to_read, file_records(manifest), pool)  # verified as read
    dests, finish = destinations(index, names, templates)  # where each wanted tensor goes
    exchange.distribute(index, holders, held, dests, rank, transport); finish()
    trees = {name: restore_tree(index, name, dests)}       # then obj.load_state_dict(trees[name])
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.errors import CheckpointVerificationError
from elastic_ddp.checkpoint.index import Index, RankState
from elastic_ddp.checkpoint.layout import Layout, file_name, plan
from elastic_ddp.checkpoint.shards import read_file, write_file
from elastic_ddp.checkpoint.staging import Source, Staged, as_buffer, byte_view
from elastic_ddp.checkpoint.storage import Storage, StorageError, join
from elastic_ddp.checkpoint.tree import Path, TensorSpec, TreeError, flatten_named, leaf, path_text, unflatten


@dataclass(frozen=True)
class Snapshot:
    """One rank's state at a save: encoded trees (plain values inline) and the tensors they name.

    ``digest`` covers the replicated tensors' paths, dtypes and shapes: equal on every rank when
    they really hold the same state (the leader refuses to commit otherwise).
    """

    state: dict[str, Any]
    tensors: tuple[torch.Tensor, ...]
    specs: tuple[TensorSpec, ...]
    rank_state: dict[str, Any] | None
    rank_tensors: tuple[torch.Tensor, ...]
    digest: str


def snapshot(state: Mapping[str, Any], rank_state: Mapping[str, Any] | None) -> Snapshot:
    """Encode ``{name: state_dict}`` (replicated) and ``rank_state`` (this rank's own, or None).

    Raises :class:`TreeError` naming the path of a value a checkpoint cannot hold.
    """
    trees, tensors, paths = flatten_named(state)
    specs = tuple(TensorSpec.of(t) for t in tensors)
    digest = hashlib.sha256(
        json.dumps([[path_text(p), s.to_json()] for p, s in zip(paths, specs)]).encode()
    ).hexdigest()
    rank_trees, rank_tensors = None, []
    if rank_state:
        rank_trees, rank_tensors, _ = flatten_named(rank_state)
    return Snapshot(trees, tuple(tensors), specs, rank_trees, tuple(rank_tensors), digest)


@dataclass(frozen=True)
class WriteJob:
    """What one rank writes in one save: its files' sources, and what the leader needs to index them."""

    layout: Layout
    sources: dict[str, list[Source]]
    rank_file: str | None
    rank_entry: RankState | None


class ShardWriter:
    """Plans (cached across saves) which files a rank writes and what goes into each."""

    def __init__(self, *, files_per_writer: int, min_file_bytes: int) -> None:
        self.files_per_writer = files_per_writer
        self.min_file_bytes = min_file_bytes
        self._plans: dict[tuple[Any, ...], Layout] = {}

    def layout(self, specs: Sequence[TensorSpec], writers: Sequence[int]) -> Layout:
        key = (tuple(specs), tuple(writers))
        found = self._plans.get(key)
        if found is None:
            found = plan(specs, writers, files_per_writer=self.files_per_writer, min_file_bytes=self.min_file_bytes)
            self._plans = {key: found}  # one state shape at a time: the previous plan is dropped
        return found

    def prepare(self, snap: Snapshot, *, rank: int, writers: Sequence[int]) -> WriteJob:
        layout = self.layout(snap.specs, writers)
        mine = layout.files_of(rank)
        sources: dict[str, list[Source]] = {
            f.name: [(snap.tensors[p.tensor], p.start, p.stop) for p in f.pieces] for f in mine
        }
        rank_file, rank_entry = None, None
        if snap.rank_state is not None:
            rank_file = mine[0].name if mine else file_name(rank, 0)
            sources.setdefault(rank_file, []).extend((t, 0, t.numel()) for t in snap.rank_tensors)
            rank_entry = RankState(rank, snap.rank_state, tuple(TensorSpec.of(t) for t in snap.rank_tensors))
        return WriteJob(layout, sources, rank_file, rank_entry)


def write_files(
    storage: Storage,
    dir_url: str,
    staged: Staged,
    pool: concurrent.futures.Executor,
    *,
    sync: bool,
    rank: int,
) -> list[mf.FileRecord]:
    """Write this rank's staged files into ``dir_url`` in parallel; their sizes and checksums.

    Waits for every write to end before raising the first failure, so nothing is still being
    written when the caller cleans up.
    """
    staged.wait_ready()
    futures = {
        name: pool.submit(write_file, storage, join(dir_url, name), buffers, sync=sync, fault_rank=rank)
        for name, buffers in staged.files.items()
    }
    concurrent.futures.wait(futures.values())
    return [mf.FileRecord(name, *future.result()) for name, future in futures.items()]


def files_to_read(index: Index, holders: Mapping[str, int], rank: int) -> list[str]:
    return [f.name for f in index.files if holders.get(f.name) == rank]


def read_files(
    storage: Storage,
    dir_url: str,
    names: Iterable[str],
    expected: Mapping[str, mf.FileRecord],
    pool: concurrent.futures.Executor,
) -> dict[str, torch.Tensor]:
    """Read the files ``names`` into host buffers, each verified against ``expected`` as it streams.

    ``expected``: the manifest's records (:func:`manifest.file_records`). Raises
    :class:`CheckpointVerificationError` (naming the file and how it differs; a missing or
    unreadable file included) once every read has ended.
    """

    def one(name: str) -> torch.Tensor:
        record = expected.get(name)
        if record is None:
            raise CheckpointVerificationError(f"The manifest does not list {name!r}.", name, "the manifest does not list it")
        buffer = torch.empty(record.size, dtype=torch.uint8)
        url = join(dir_url, name)
        try:
            read_file(storage, url, as_buffer(buffer), expected=record)
        except FileNotFoundError:
            raise CheckpointVerificationError(f"The file {url!r} is missing.", name, "the file is missing") from None
        except StorageError as exc:
            raise CheckpointVerificationError(str(exc), name, f"reading failed: {exc}") from exc
        return buffer

    futures = {name: pool.submit(one, name) for name in names}
    concurrent.futures.wait(futures.values())
    return {name: future.result() for name, future in futures.items()}


def tensor_paths(index: Index, names: Iterable[str]) -> dict[int, Path]:
    """``{tensor index: path}`` of the replicated tensors under the state names ``names``."""
    found: dict[int, Path] = {}

    def note(i: int, path: Path) -> None:
        if not 0 <= i < len(index.tensors) or i in found:
            raise TreeError(f"The index refers to tensor {i} at {path_text(path)!r}, which it does not hold once.")
        found[i] = path

    for name in names:
        unflatten(index.state[name], note, (name,), where="index.json")
    return found


def destinations(
    index: Index, names: Iterable[str], templates: Mapping[str, Any]
) -> tuple[dict[int, torch.Tensor], Callable[[], None]]:
    """Where each replicated tensor under ``names`` is loaded: the template's own tensor at the same
    path (loaded in place) or, where the template has none, a new CPU tensor.

    Returns the destinations and a ``finish()`` to call after they are filled (it copies into
    templates that are not contiguous). Raises :class:`TreeError` naming a tensor whose dtype or
    shape differs between the checkpoint and the template.
    """
    dests: dict[int, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, path in tensor_paths(index, names).items():
        spec = index.tensors[i]
        target = leaf(templates[path[0]], path[1:])
        if not isinstance(target, torch.Tensor):
            dests[i] = torch.empty(spec.shape, dtype=spec.dtype)
            continue
        if target.dtype != spec.dtype or tuple(target.shape) != spec.shape:
            raise TreeError(
                f"{path_text(path)!r} is {spec.dtype} of shape {list(spec.shape)} in the checkpoint but "
                f"{target.dtype} of shape {list(target.shape)} here."
            )
        if target.is_contiguous():
            dests[i] = target.detach()
        else:
            dests[i] = torch.empty_like(target, memory_format=torch.contiguous_format)
            copies.append((dests[i], target))

    def finish() -> None:
        with torch.no_grad():
            for filled, target in copies:
                target.copy_(filled)

    return dests, finish


def restore_tree(index: Index, name: str, dests: Mapping[int, torch.Tensor]) -> Any:
    """The state dict ``name`` as saved, with its tensors taken from ``dests``."""
    return unflatten(index.state[name], lambda i, _: dests[i], (name,), where="index.json")


def restore_rank_state(index: Index, rank: int, held: torch.Tensor, templates: Mapping[str, Any]) -> dict[str, Any]:
    """Rank ``rank``'s own state dicts from its file's bytes ``held`` (into the templates' tensors where they fit)."""
    file = index.rank_file(rank)
    if file is None or file.rank_state is None:
        raise TreeError(f"The checkpoint holds no per-rank state of rank {rank}.")
    rank_state = file.rank_state
    offsets = file.rank_offsets(index.tensors)

    def tensor(i: int, path: Path) -> torch.Tensor:
        if not 0 <= i < len(rank_state.tensors):
            raise TreeError(f"Per-rank tensor {i} at {path_text(path)!r} is not in the index.")
        spec = rank_state.tensors[i]
        target = leaf(templates.get(path[0]), path[1:])
        fits = isinstance(target, torch.Tensor) and target.dtype == spec.dtype and tuple(target.shape) == spec.shape
        out = target.detach() if fits and target.is_contiguous() else torch.empty(spec.shape, dtype=spec.dtype)
        byte_view(out, 0, out.numel()).copy_(held[offsets[i] : offsets[i] + spec.nbytes])
        return out

    missing = sorted(set(templates) - set(rank_state.state))
    if missing:
        raise TreeError(f"The per-rank state of rank {rank} has no {', '.join(repr(m) for m in missing)}.")
    return {name: unflatten(rank_state.state[name], tensor, (name,), where="index.json") for name in templates}


def read_state(
    storage: Storage, dir_url: str, index: Index, expected: Mapping[str, mf.FileRecord], names: Iterable[str],
    pool: concurrent.futures.Executor,
) -> dict[str, Any]:
    """One process, no process group: the state dicts ``names`` with new CPU tensors.

    Reads (and verifies) only the files that hold pieces of those states.
    """
    names = list(names)
    dests, _ = destinations(index, names, {name: None for name in names})
    needed = [f.name for f in index.files if any(p.tensor in dests for p in f.pieces)]
    held = read_files(storage, dir_url, needed, expected, pool)
    for file in index.files:
        if file.name not in held:
            continue
        for piece, off in zip(file.pieces, file.piece_offsets(index.tensors)):
            if piece.tensor in dests:
                view = byte_view(dests[piece.tensor], piece.start, piece.stop)
                view.copy_(held[file.name][off : off + view.numel()])
    return {name: restore_tree(index, name, dests) for name in names}

