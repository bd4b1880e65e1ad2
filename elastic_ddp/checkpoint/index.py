"""``index.json``: a checkpoint's table of contents (JSON; listed and hashed in the manifest).

It holds the replicated state's trees (plain values inline, tensors as ``{"tensor": i}``), the
dtype and shape of every replicated tensor, and for each data file the pieces it holds, in order,
and -- in a file of a rank's own -- that rank's per-rank state. A data file is nothing but the raw,
C-contiguous bytes of its pieces back to back, followed by the whole per-rank tensors, so a
reader needs no other metadata and nothing is ever unpickled.

Size: a few hundred bytes per tensor and per file (~1 MB for a 1B-parameter model at thousands of
ranks); rank 0 writes it at commit and reads it at resume, then hands it to the other ranks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastic_ddp.checkpoint.layout import FilePlan, Piece
from elastic_ddp.checkpoint.tree import TensorSpec, TreeError

INDEX_NAME = "index.json"
INDEX_FORMAT = 1


class IndexFormatError(ValueError):
    """``index.json`` is malformed or inconsistent. The message names what is wrong."""


@dataclass(frozen=True)
class RankState:
    """Rank ``rank``'s own state: its trees and the tensors that follow the pieces in its file."""

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

    def rank_offsets(self, specs: Sequence[TensorSpec]) -> list[int]:
        """Byte offset of each per-rank tensor in the file (after the pieces)."""
        pos = sum((p.stop - p.start) * specs[p.tensor].itemsize for p in self.pieces)
        out = []
        for spec in self.rank_state.tensors if self.rank_state else ():
            out.append(pos)
            pos += spec.nbytes
        return out


@dataclass(frozen=True)
class Index:
    """The parsed, checked ``index.json``."""

    tensors: tuple[TensorSpec, ...]
    state: dict[str, Any]
    files: tuple[IndexFile, ...]

    def to_bytes(self) -> bytes:
        data = {
            "format": INDEX_FORMAT,
            "tensors": [t.to_json() for t in self.tensors],
            "state": self.state,
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
) -> Index:
    """The index of a save: replicated ``files`` as planned, plus ``{rank: (file name, RankState)}``.

    A rank's state goes into its first replicated file when it has one, else into a file of its own
    (named in ``rank_states``).
    """
    out = []
    placed = set()
    for f in files:
        rank_state = None
        entry = rank_states.get(f.writer)
        if entry is not None and entry[0] == f.name:
            rank_state = entry[1]
            placed.add(f.writer)
        size = f.nbytes + (sum(t.nbytes for t in rank_state.tensors) if rank_state else 0)
        out.append(IndexFile(f.name, f.writer, size, f.pieces, rank_state))
    for rank, (name, rank_state) in sorted(rank_states.items()):
        if rank not in placed:
            out.append(IndexFile(name, rank, sum(t.nbytes for t in rank_state.tensors), (), rank_state))
    return Index(tuple(specs), dict(state), tuple(out))


def _int(value: Any, where: str, what: str, lo: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise IndexFormatError(f"{where}: {what} must be an integer >= {lo}, not {value!r}.")
    return value


def parse(data: bytes, where: str) -> Index:
    """Parse and check ``index.json`` bytes; raises :class:`IndexFormatError` naming the problem.

    Checked: every piece lies inside its tensor, the pieces of each tensor cover it exactly once,
    each file's size is the sum of what it holds, names are plain file names.
    """
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IndexFormatError(f"{where} is not valid JSON: {exc}.") from None
    if not isinstance(raw, dict) or raw.get("format") != INDEX_FORMAT:
        raise IndexFormatError(f"{where} is not an index of format {INDEX_FORMAT}.")
    if not isinstance(raw.get("tensors"), list) or not isinstance(raw.get("files"), list):
        raise IndexFormatError(f"{where} lacks its 'tensors' or 'files' list.")
    if not isinstance(raw.get("state"), dict):
        raise IndexFormatError(f"{where} lacks its 'state' object.")
    try:
        specs = tuple(TensorSpec.from_json(t, f"{where}, tensor {i}") for i, t in enumerate(raw["tensors"]))
    except TreeError as exc:
        raise IndexFormatError(str(exc)) from None
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
            used += sum(s.nbytes for s in rank_specs)
            rank_state = RankState(rank, rs["state"], rank_specs)
        if used != size:
            raise IndexFormatError(f"{at}: it should hold {used} bytes but its size is given as {size}.")
        files.append(IndexFile(name, writer, size, tuple(pieces), rank_state))
    for t, spec in enumerate(specs):
        end, exact = 0, True
        for start, stop in sorted(intervals[t]):
            exact = exact and start == end
            end = max(end, stop)
        if not exact or end != spec.numel:
            raise IndexFormatError(
                f"{where}: the pieces of tensor {t} do not cover its {spec.numel} elements exactly once "
                f"(pieces overlap, leave gaps or stop short)."
            )
    return Index(specs, raw["state"], tuple(files))
