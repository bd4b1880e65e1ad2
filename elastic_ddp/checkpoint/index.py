"""``index.json``: a checkpoint's table of contents (JSON; listed and hashed in the manifest).

It holds the shared state's trees (plain values inline, tensors as ``{"tensor": i}``), the dtype
and shape of every shared tensor, which of those differ across ranks (``per_rank``: stored by
every rank, see :mod:`elastic_ddp.checkpoint.divergence`), and for each data file the pieces it
holds, in order, and -- in the file that carries a rank's own data -- that rank's entry: the trees
and tensor specs of its per-rank objects. A data file is nothing but the raw, C-contiguous bytes of
its pieces back to back, then (in a rank's file) the whole per-rank tensors in ``per_rank`` order,
then its per-rank objects' tensors, so a reader needs no other metadata and nothing is ever
unpickled.

Size: a few hundred bytes per tensor and per file (~1 MB for a 1B-parameter model at thousands of
ranks); rank 0 writes it at commit and reads it at resume, then hands it to the other ranks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastic_ddp.checkpoint.layout import FilePlan, Piece
from elastic_ddp.checkpoint.tree import TensorSpec, TreeError, rebase

INDEX_NAME = "index.json"
# 2: per-rank tensors of shared objects (``per_rank``). Format 1 (no such tensors; rank entries held
# only explicitly per-rank objects) reads as format 2 with ``per_rank`` empty.
INDEX_FORMAT = 2
READABLE_FORMATS = (1, 2)


class IndexFormatError(ValueError):
    """``index.json`` is malformed or inconsistent. The message names what is wrong."""


@dataclass(frozen=True)
class RankState:
    """Rank ``rank``'s entry: the trees of its per-rank objects and their tensors' specs (in its file,
    after its pieces and its values of the index's per-rank tensors)."""

    rank: int
    state: dict[str, Any]
    tensors: tuple[TensorSpec, ...]

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "state": self.state, "tensors": [t.to_json() for t in self.tensors]}


@dataclass(frozen=True)
class IndexFile:
    """One data file: its writer, size, replicated pieces and, maybe, its writer's own state."""

    name: str
    writer: int
    size: int
    pieces: tuple[Piece, ...]
    rank_state: RankState | None = None

    def piece_offsets(self, specs: Sequence[TensorSpec]) -> list[int]:
        """Byte offset of each piece in the file."""
        out, pos = [], 0
        for p in self.pieces:
            out.append(pos)
            pos += (p.stop - p.start) * specs[p.tensor].itemsize
        return out

    def pieces_bytes(self, specs: Sequence[TensorSpec]) -> int:
        """Bytes of the pieces: where a rank's own values start in its file."""
        return sum((p.stop - p.start) * specs[p.tensor].itemsize for p in self.pieces)


@dataclass(frozen=True)
class Index:
    """The parsed, checked ``index.json``."""

    tensors: tuple[TensorSpec, ...]
    state: dict[str, Any]
    files: tuple[IndexFile, ...]
    per_rank: tuple[int, ...] = ()

    @property
    def own_names(self) -> list[str]:
        """Names of the per-rank objects (the same in every rank's entry)."""
        entry = next((f.rank_state for f in self.files if f.rank_state is not None), None)
        return list(entry.state) if entry is not None else []

    @property
    def has_per_rank(self) -> bool:
        return bool(self.per_rank) or any(f.rank_state is not None for f in self.files)

    def ranks(self) -> list[int]:
        """The ranks that have an entry (every rank of the save, when it held per-rank data)."""
        return sorted(f.rank_state.rank for f in self.files if f.rank_state is not None)

    def as_shared(self, rank: int) -> Index:
        """This index as if rank ``rank``'s per-rank data were stored once for everyone: its values of
        the per-rank tensors and its per-rank objects become pieces of its file and shared state.
        What a load at another world size restores (one rank's values, never a splice)."""
        if not self.has_per_rank:
            return self
        file = self.rank_file(rank)
        if file is None or file.rank_state is None:
            raise IndexFormatError(f"The index holds no entry of rank {rank}.")
        entry = file.rank_state
        base = len(self.tensors)
        added = [Piece(t, 0, self.tensors[t].numel) for t in self.per_rank if self.tensors[t].numel]
        added += [Piece(base + j, 0, spec.numel) for j, spec in enumerate(entry.tensors) if spec.numel]
        files = tuple(
            IndexFile(f.name, f.writer, f.size, f.pieces + tuple(added)) if f is file else IndexFile(f.name, f.writer, f.size, f.pieces)
            for f in self.files
        )
        state = {**self.state, **{name: rebase(tree, base) for name, tree in entry.state.items()}}
        return Index(self.tensors + entry.tensors, state, files)

    def to_bytes(self) -> bytes:
        data = {
            "format": INDEX_FORMAT,
            "tensors": [t.to_json() for t in self.tensors],
            "state": self.state,
            "per_rank": list(self.per_rank),
            "files": [
                {
                    "name": f.name,
                    "writer": f.writer,
                    "size": f.size,
                    "pieces": [[p.tensor, p.start, p.stop] for p in f.pieces],
                    "rank_state": f.rank_state.to_json() if f.rank_state else None,
                }
                for f in self.files
            ],
        }
        return json.dumps(data, separators=(",", ":")).encode()

    def rank_file(self, rank: int) -> IndexFile | None:
        return next((f for f in self.files if f.rank_state is not None and f.rank_state.rank == rank), None)


def build(
    specs: Sequence[TensorSpec],
    state: Mapping[str, Any],
    files: Sequence[FilePlan],
    rank_states: Mapping[int, tuple[str, RankState]],
    per_rank: Sequence[int] = (),
) -> Index:
    """The index of a save: ``files`` as planned, plus each rank's entry ``{rank: (file name, RankState)}``.

    A rank's entry (and its values of the ``per_rank`` tensors) goes into its first planned file when
    it has one, else into a file of its own (named in ``rank_states``).
    """
    per_rank_bytes = sum(specs[t].nbytes for t in per_rank)
    out = []
    placed = set()
    for f in files:
        rank_state = None
        entry = rank_states.get(f.writer)
        if entry is not None and entry[0] == f.name:
            rank_state = entry[1]
            placed.add(f.writer)
        size = f.nbytes + (per_rank_bytes + sum(t.nbytes for t in rank_state.tensors) if rank_state else 0)
        out.append(IndexFile(f.name, f.writer, size, f.pieces, rank_state))
    for rank, (name, rank_state) in sorted(rank_states.items()):
        if rank not in placed:
            size = per_rank_bytes + sum(t.nbytes for t in rank_state.tensors)
            out.append(IndexFile(name, rank, size, (), rank_state))
    return Index(tuple(specs), dict(state), tuple(out), tuple(sorted(per_rank)))


def _int(value: Any, where: str, what: str, lo: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise IndexFormatError(f"{where}: {what} must be an integer >= {lo}, not {value!r}.")
    return value


def parse(data: bytes, where: str) -> Index:
    """Parse and check ``index.json`` bytes; raises :class:`IndexFormatError` naming the problem.

    Checked: every piece lies inside its tensor, the pieces of each tensor that is not per-rank cover
    it exactly once (a per-rank tensor has no pieces), each file's size is the sum of what it holds,
    names are plain file names, and when per-rank tensors exist every file with a rank entry holds them.
    """
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IndexFormatError(f"{where} is not valid JSON: {exc}.") from None
    if not isinstance(raw, dict) or raw.get("format") not in READABLE_FORMATS:
        raise IndexFormatError(f"{where} is not an index of a format this version reads {READABLE_FORMATS}.")
    if not isinstance(raw.get("tensors"), list) or not isinstance(raw.get("files"), list):
        raise IndexFormatError(f"{where} lacks its 'tensors' or 'files' list.")
    if not isinstance(raw.get("state"), dict):
        raise IndexFormatError(f"{where} lacks its 'state' object.")
    try:
        specs = tuple(TensorSpec.from_json(t, f"{where}, tensor {i}") for i, t in enumerate(raw["tensors"]))
    except TreeError as exc:
        raise IndexFormatError(str(exc)) from None
    per_rank_raw = raw.get("per_rank", [])
    if not isinstance(per_rank_raw, list):
        raise IndexFormatError(f"{where}: 'per_rank' must be a list of tensor numbers.")
    per_rank = tuple(sorted(_int(t, where, "a per-rank tensor number") for t in per_rank_raw))
    if len(set(per_rank)) != len(per_rank) or any(t >= len(specs) for t in per_rank):
        raise IndexFormatError(f"{where}: 'per_rank' names tensors twice or beyond the {len(specs)} it lists.")
    per_rank_bytes = sum(specs[t].nbytes for t in per_rank)
    intervals: list[list[tuple[int, int]]] = [[] for _ in specs]
    files, names, ranks = [], set(), set()
    for entry in raw["files"]:
        if not isinstance(entry, dict):
            raise IndexFormatError(f"{where}: a file entry is not an object.")
        name = entry.get("name")
        if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or name in names:
            raise IndexFormatError(f"{where}: {name!r} is not a valid, unique file name.")
        names.add(name)
        at = f"{where}, file {name!r}"
        writer = _int(entry.get("writer"), at, "'writer'")
        size = _int(entry.get("size"), at, "'size'")
        pieces = []
        used = 0
        for item in entry.get("pieces") if isinstance(entry.get("pieces"), list) else [None]:
            if not isinstance(item, list) or len(item) != 3:
                raise IndexFormatError(f"{at}: a piece must be [tensor, start, stop].")
            t = _int(item[0], at, "a piece's tensor")
            if t >= len(specs):
                raise IndexFormatError(f"{at}: piece of tensor {t}, but the index has {len(specs)} tensors.")
            start, stop = _int(item[1], at, "a piece's start"), _int(item[2], at, "a piece's stop")
            if not start < stop <= specs[t].numel:
                raise IndexFormatError(f"{at}: piece [{start}, {stop}) does not fit tensor {t} of {specs[t].numel} elements.")
            intervals[t].append((start, stop))
            used += (stop - start) * specs[t].itemsize
            pieces.append(Piece(t, start, stop))
        rank_state = None
        if entry.get("rank_state") is not None:
            rs = entry["rank_state"]
            if not isinstance(rs, dict) or not isinstance(rs.get("state"), dict) or not isinstance(rs.get("tensors"), list):
                raise IndexFormatError(f"{at}: 'rank_state' must hold 'rank', 'state' and 'tensors'.")
            rank = _int(rs.get("rank"), at, "the per-rank state's rank")
            if rank in ranks:
                raise IndexFormatError(f"{at}: rank {rank} has per-rank state in two files.")
            ranks.add(rank)
            try:
                rank_specs = tuple(TensorSpec.from_json(t, f"{at}, per-rank tensor") for t in rs["tensors"])
            except TreeError as exc:
                raise IndexFormatError(str(exc)) from None
            used += per_rank_bytes + sum(s.nbytes for s in rank_specs)
            rank_state = RankState(rank, rs["state"], rank_specs)
        if used != size:
            raise IndexFormatError(f"{at}: it should hold {used} bytes but its size is given as {size}.")
        files.append(IndexFile(name, writer, size, tuple(pieces), rank_state))
    if per_rank and not ranks:
        raise IndexFormatError(f"{where}: it lists per-rank tensors but no rank's entry holds them.")
    if ranks and ranks != set(range(len(ranks))):
        raise IndexFormatError(f"{where}: the ranks with entries {sorted(ranks)} are not 0 .. {len(ranks) - 1}.")
    for t, spec in enumerate(specs):
        if t in per_rank:
            if intervals[t]:
                raise IndexFormatError(f"{where}: tensor {t} is per-rank but also has pieces.")
            continue
        end, exact = 0, True
        for start, stop in sorted(intervals[t]):
            exact = exact and start == end
            end = max(end, stop)
        if not exact or end != spec.numel:
            raise IndexFormatError(
                f"{where}: the pieces of tensor {t} do not cover its {spec.numel} elements exactly once "
                f"(pieces overlap, leave gaps or stop short)."
            )
    return Index(specs, raw["state"], tuple(files), per_rank)
