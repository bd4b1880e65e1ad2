"""Who writes which bytes of the replicated state, and who reads which file back: pure functions.

The replicated state's tensors, laid end to end in traversal order, form one virtual byte stream.
:func:`plan` cuts that stream into contiguous segments of (nearly) equal size -- cuts fall on element
boundaries, so a large tensor may be split between writers -- and gives each writer up to
``files_per_writer`` consecutive segments, one file each. Every rank computes the same plan from the
same tensor specs without talking to the others, so a rank stages and writes only its own share:
``total / writers`` bytes, never a whole replica.

Cost at scale: the plan is O(tensors + files) and cached by the caller across saves. With many ranks
the segments would shrink below what storage handles well (per-request overhead on object stores),
so no file is planned smaller than ``min_file_bytes``: fewer writers then, spread evenly over the
ranks (ranks are node-major under torchrun, so the writers spread over the nodes).

:func:`assign_holders` decides which rank reads each file at load time: every file is read by
exactly one rank, so a resume reads each byte once in total.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from elastic_ddp.checkpoint.tree import TensorSpec


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened tensor ``tensor`` (an index into the spec list)."""

    tensor: int
    start: int
    stop: int


@dataclass(frozen=True)
class FilePlan:
    """One data file: written by rank ``writer``, holding ``pieces`` back to back (``nbytes`` in all)."""

    name: str
    writer: int
    pieces: tuple[Piece, ...]
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """The files of a checkpoint's replicated state, in stream order."""

    files: tuple[FilePlan, ...]

    def files_of(self, writer: int) -> list[FilePlan]:
        return [f for f in self.files if f.writer == writer]

    def share_bytes(self, writer: int) -> int:
        return sum(f.nbytes for f in self.files_of(writer))


def file_name(writer: int, k: int) -> str:
    """The name of writer ``writer``'s ``k``-th file."""
    return f"shard-{writer:05d}-{k:02d}.bin"


def plan(
    specs: Sequence[TensorSpec], writers: Sequence[int], *, files_per_writer: int, min_file_bytes: int,
    skip: Sequence[int] = (),
) -> Layout:  # fmt: skip
    """Split the replicated tensors ``specs`` over ``writers`` (see the module docstring).

    ``skip``: indices of tensors left out of the stream (each rank stores those itself); pieces keep
    the indices of ``specs``.
    """
    if skip:
        skipped = set(skip)
        kept = [i for i in range(len(specs)) if i not in skipped]
        sub = plan([specs[i] for i in kept], writers, files_per_writer=files_per_writer, min_file_bytes=min_file_bytes)
        return Layout(tuple(
            FilePlan(f.name, f.writer, tuple(Piece(kept[p.tensor], p.start, p.stop) for p in f.pieces), f.nbytes)
            for f in sub.files
        ))  # fmt: skip
    if not writers:
        raise ValueError("A checkpoint layout needs at least one writer rank.")
    if files_per_writer < 1:
        raise ValueError(f"files_per_writer ({files_per_writer}) must be at least 1.")
    sizes = [s.nbytes for s in specs]
    total = sum(sizes)
    if total == 0:
        return Layout(())
    n_max = len(writers) * files_per_writer
    wanted = math.ceil(total / min_file_bytes) if min_file_bytes > 0 else n_max
    n_segments = max(1, min(n_max, wanted))
    n_writers = math.ceil(n_segments / files_per_writer)
    chosen = [writers[i * len(writers) // n_writers] for i in range(n_writers)]

    # Byte offset where each tensor starts in the stream, and the cut points rounded down to elements.
    starts = [0] * len(specs)
    for i in range(1, len(specs)):
        starts[i] = starts[i - 1] + sizes[i - 1]
    cuts = [0]
    t = 0
    for j in range(1, n_segments):
        target = j * total // n_segments
        while starts[t] + sizes[t] <= target:
            t += 1
        itemsize = specs[t].itemsize
        cuts.append(max(cuts[-1], starts[t] + (target - starts[t]) // itemsize * itemsize))
    cuts.append(total)

    files = []
    t = 0
    for i, writer in enumerate(chosen):
        k = 0
        for j in range(i * n_segments // n_writers, (i + 1) * n_segments // n_writers):
            lo, hi = cuts[j], cuts[j + 1]
            if hi <= lo:
                continue
            pieces = []
            while t < len(specs) and starts[t] + sizes[t] <= lo:
                t += 1
            u = t
            while u < len(specs) and starts[u] < hi:
                if sizes[u]:
                    a, b = max(lo, starts[u]), min(hi, starts[u] + sizes[u])
                    itemsize = specs[u].itemsize
                    pieces.append(Piece(u, (a - starts[u]) // itemsize, (b - starts[u]) // itemsize))
                u += 1
            files.append(FilePlan(file_name(writer, k), writer, tuple(pieces), hi - lo))
            k += 1
    return Layout(tuple(files))


def assign_holders(files: Sequence[tuple[str, int, int]], readers: Sequence[int], *, by_writer: bool) -> dict[str, int]:
    """``{file name: reader rank}`` for files given as ``(name, writer, size)``.

    ``by_writer`` (a load at the saving world size): each file goes back to the rank that wrote it,
    so each rank finds its own per-rank state among the files it reads. Otherwise the files are
    spread by size, largest first, each to the reader with the fewest bytes so far (ties: the
    earliest in ``readers``): at most the largest file above an even split.
    """
    if not readers:
        raise ValueError("Loading a checkpoint needs at least one reader rank.")
    if by_writer:
        members = set(readers)
        missing = sorted({w for _, w, _ in files if w not in members})
        if missing:
            raise ValueError(f"Files were written by ranks {missing}, which are not among the readers {list(readers)}.")
        return {name: writer for name, writer, _ in files}
    heap = [(0, i, r) for i, r in enumerate(readers)]  # (bytes so far, position, rank): already a heap
    holders = {}
    for name, _, size in sorted(files, key=lambda f: (-f[2], f[0])):
        load, i, reader = heapq.heappop(heap)
        holders[name] = reader
        heapq.heappush(heap, (load + size, i, reader))
    return holders
