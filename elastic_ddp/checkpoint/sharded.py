"""The sharded writer and reader, usable on any directory URL with any set of participating ranks.

Writing (each participating rank, no collective inside):

    snap = snapshot(state_dicts, synced=..., all_max=...)  # trees + tensors; what differs across ranks
    writer = ShardWriter(files_per_writer=2, min_file_bytes=16 << 20)   # keep it: plans are cached
    job = writer.prepare(snap, rank=r, writers=[...])      # this rank's files and their sources
    staged = stager.stage(job.sources, copy=...)           # staging.ShareStager
    report = write_files(storage, dir_url, staged, pool, sync=..., rank=r)  # [FileRecord]
    # one rank gathers the reports, then: index.build(...) -> index.json, then a manifest

Reading (each rank that holds files; then exchange.distribute to the others):

    holders = layout.assign_holders([(f.name, f.writer, f.size) ...], readers, by_writer=...)
    held = read_files(storage, dir_url, files_to_read, file_records(manifest), pool)  # verified as read
    dests, finish = destinations(index, names, templates)  # where each wanted tensor goes (place)
    exchange.distribute(index, holders, held, dests, rank, transport)  # the tensors stored once
    restore_rank_values(held[own file][after its pieces:], ...)  # this rank's own values (same world size)
    finish()
    trees = {name: restore_tree(index, name, dests)}       # then obj.load_state_dict(trees[name])
    # At another world size: index.as_shared(0) first -- rank 0's per-rank values, for everyone.
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
from elastic_ddp.checkpoint.divergence import AllMax, Split, classify, describe
from elastic_ddp.checkpoint.index import Index, RankState
from elastic_ddp.checkpoint.layout import Layout, file_name, plan
from elastic_ddp.checkpoint.shards import file_record, read_file, write_file
from elastic_ddp.checkpoint.staging import Source, Staged, as_buffer, byte_view
from elastic_ddp.checkpoint.storage import Storage, join
from elastic_ddp.checkpoint.tree import Path, TensorSpec, TreeError, leaf, path_text, unflatten


@dataclass(frozen=True)
class Snapshot:
    """One rank's state at a save: encoded trees (plain values inline) and the tensors they name.

    ``state``/``tensors``: the shared objects (alike in structure on every rank); ``per_rank``: the
    indices of their tensors whose values differ across ranks (each rank stores its own);
    ``own_state``/``own_tensors``: this rank's per-rank objects (see
    :mod:`~elastic_ddp.checkpoint.divergence`). ``digest`` covers the shared tensors' paths, dtypes
    and shapes and what is per-rank: equal on every rank when they saved alike (the leader refuses
    to commit otherwise).
    """

    state: dict[str, Any]
    tensors: tuple[torch.Tensor, ...]
    specs: tuple[TensorSpec, ...]
    per_rank: tuple[int, ...]
    own_state: dict[str, Any]
    own_tensors: tuple[torch.Tensor, ...]
    digest: str

    @property
    def has_per_rank(self) -> bool:
        return bool(self.per_rank or self.own_state)


def snapshot(
    state: Mapping[str, Any], *, synced: Callable[[Path], bool] | None = None, all_max: AllMax | None = None,
    classifier: Callable[..., Split] = classify,
) -> Snapshot:
    """Encode ``{name: state_dict}`` and decide (collectively, through ``all_max``) what of it differs
    across ranks; see :func:`elastic_ddp.checkpoint.divergence.classify` for the arguments.
    ``classifier``: :func:`~elastic_ddp.checkpoint.divergence.classify`, or a
    :class:`~elastic_ddp.checkpoint.divergence.Classifier` that reuses the last save's decision.

    Raises :class:`TreeError` naming the path of a value a checkpoint cannot hold.
    """
    split = classifier(state, synced=synced, all_max=all_max)
    specs = split.specs
    per_rank = tuple(sorted(split.per_rank))
    digest = hashlib.sha256(
        json.dumps([[[path_text(p), s.to_json()] for p, s in zip(split.paths, specs)], per_rank, sorted(split.own)]).encode()
    ).hexdigest()
    return Snapshot(split.shared, split.tensors, specs, per_rank, split.own, split.own_tensors, digest)


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

    def layout(self, specs: Sequence[TensorSpec], writers: Sequence[int], per_rank: Sequence[int] = ()) -> Layout:
        """The plan of the tensors stored once: ``specs`` but the ``per_rank`` ones (pieces keep the
        tensors' indices in ``specs``)."""
        key = (tuple(specs), tuple(writers), tuple(per_rank))
        found = self._plans.get(key)
        if found is None:
            found = plan(specs, writers, files_per_writer=self.files_per_writer, min_file_bytes=self.min_file_bytes,
                         skip=per_rank)  # fmt: skip
            self._plans = {key: found}  # one state shape at a time: the previous plan is dropped
        return found

    def prepare(self, snap: Snapshot, *, rank: int, writers: Sequence[int]) -> WriteJob:
        layout = self.layout(snap.specs, writers, snap.per_rank)
        mine = layout.files_of(rank)
        sources: dict[str, list[Source]] = {
            f.name: [(snap.tensors[p.tensor], p.start, p.stop) for p in f.pieces] for f in mine
        }
        rank_file, rank_entry = None, None
        if snap.has_per_rank:
            # After this rank's pieces: its values of the per-rank tensors, then its per-rank objects.
            rank_file = mine[0].name if mine else file_name(rank, 0)
            extra = [snap.tensors[t] for t in snap.per_rank] + list(snap.own_tensors)
            sources.setdefault(rank_file, []).extend((t, 0, t.numel()) for t in extra)
            rank_entry = RankState(rank, snap.own_state, tuple(TensorSpec.of(t) for t in snap.own_tensors))
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
        record = file_record(expected, name)
        buffer = torch.empty(record.size, dtype=torch.uint8)
        read_file(storage, join(dir_url, name), as_buffer(buffer), expected=record)
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
    """Where each replicated tensor under ``names`` is loaded (see :func:`place`)."""
    return place(tensor_paths(index, names), index.tensors, templates)


def place(
    paths: Mapping[int, Path], specs: Sequence[TensorSpec], templates: Mapping[str, Any], *,
    where: str = "in the checkpoint", end: str = ".",
) -> tuple[dict[int, torch.Tensor], Callable[[], None]]:  # fmt: skip
    """The placement rule of a restore, durable or from node memory: where each saved tensor
    ``i`` (``paths[i]`` its path, ``specs[i]`` its dtype and shape) is loaded -- the template's own
    tensor at the same path (loaded in place) or, where the template has none, a new CPU tensor.

    Returns the destinations and a ``finish()`` to call after they are filled (it copies into
    templates that are not contiguous). Raises :class:`TreeError` naming a tensor whose dtype or
    shape differs between the saved state (``where``: "in the checkpoint", "in node memory") and the
    template; ``end`` closes that message.
    """
    dests: dict[int, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, path in paths.items():
        spec = specs[i]
        target = leaf(templates[path[0]], path[1:])
        if not isinstance(target, torch.Tensor):
            dests[i] = torch.empty(spec.shape, dtype=spec.dtype)
            continue
        if target.dtype != spec.dtype or tuple(target.shape) != spec.shape:
            raise TreeError(
                f"{path_text(path)!r} is {spec.dtype} of shape {list(spec.shape)} {where} but "
                f"{target.dtype} of shape {list(target.shape)} here{end}"
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


def describe_per_rank(index: Index, names: Iterable[str] | None = None) -> str:
    """What an index holds per rank (of the objects ``names``, default all), in words for messages;
    "" when nothing."""
    names = list(index.state) + index.own_names if names is None else list(names)
    paths = tensor_paths(index, [name for name in names if name in index.state])
    objects = [name for name in names if name in index.own_names]
    return describe([path_text(paths[t]) for t in index.per_rank if t in paths], objects)


def restore_tree(index: Index, name: str, dests: Mapping[int, torch.Tensor]) -> Any:
    """The state dict ``name`` as saved, with its tensors taken from ``dests``."""
    return unflatten(index.state[name], lambda i, _: dests[i], (name,), where="index.json")


def restore_rank_values(
    section: torch.Tensor, per_rank: Sequence[int], specs: Sequence[TensorSpec], dests: Mapping[int, torch.Tensor],
    own_state: Mapping[str, Any], own_specs: Sequence[TensorSpec], templates: Mapping[str, Any], where: str,
) -> dict[str, Any]:  # fmt: skip
    """From one rank's per-rank bytes ``section`` -- its values of the ``per_rank`` tensors (of
    ``specs``), then its per-rank objects' tensors (``own_specs``), back to back, as a durable file
    and a memory-tier part both hold them after their pieces -- fill those tensors' ``dests`` and
    return the per-rank objects' trees (``own_state``, those in ``templates``), their tensors loaded
    into the templates' own where they fit. ``where`` names the source in messages."""
    pos = 0
    for t in per_rank:
        size = specs[t].nbytes
        if t in dests:
            byte_view(dests[t], 0, dests[t].numel()).copy_(section[pos : pos + size])
        pos += size
    offsets = []
    for spec in own_specs:
        offsets.append(pos)
        pos += spec.nbytes

    def tensor(i: int, path: Path) -> torch.Tensor:
        if not 0 <= i < len(own_specs):
            raise TreeError(f"Per-rank tensor {i} at {path_text(path)!r} is not in {where}.")
        spec = own_specs[i]
        target = leaf(templates.get(path[0]), path[1:])
        fits = isinstance(target, torch.Tensor) and target.dtype == spec.dtype and tuple(target.shape) == spec.shape
        out = target.detach() if fits and target.is_contiguous() else torch.empty(spec.shape, dtype=spec.dtype)
        with torch.no_grad():
            byte_view(out, 0, out.numel()).copy_(section[offsets[i] : offsets[i] + spec.nbytes])
        return out

    return {name: unflatten(tree, tensor, (name,), where=where) for name, tree in own_state.items() if name in templates}


def read_state(
    storage: Storage, dir_url: str, index: Index, expected: Mapping[str, mf.FileRecord], names: Iterable[str],
    pool: concurrent.futures.Executor, *, rank: int = 0,
) -> dict[str, Any]:
    """One process, no process group: the state dicts ``names`` with new CPU tensors (per-rank data:
    rank ``rank``'s values).

    Reads (and verifies) only the files that hold pieces of those states. Raises
    :class:`~elastic_ddp.checkpoint.index.IndexFormatError` if the checkpoint holds per-rank data but
    no entry of ``rank`` (``index.ranks()`` lists those it holds).
    """
    index = index.as_shared(rank)
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

