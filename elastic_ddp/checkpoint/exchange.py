"""Getting the replicated state from the ranks that read it to every rank, over the process group.

At a resume each data file was read (and verified) by one rank, its *holder*. :func:`distribute`
walks the files in index order and broadcasts each piece from its holder into the destination
tensors of every rank:

* a large piece (>= :data:`DIRECT_BYTES`) is broadcast straight into its destination when that is
  on the transport device (no staging copy on the receivers), in slices of at most :data:`PACK_BYTES`;
* runs of smaller, adjacent pieces are packed into one buffer of at most :data:`PACK_BYTES` (one
  contiguous byte range of the file), broadcast once and unpacked, so a model's thousands of small
  tensors cost tens of collectives, not thousands.

The transport is chosen once per load by the caller: on GPUs the default (NCCL) group with buffers
on the rank's device -- restore runs before training, in the main thread, so that group is free --
and on CPUs the manager's gloo group with host buffers. The schedule depends only on the index and
the set of wanted tensors, which every rank has alike, so all ranks issue the same collectives.

Bytes moved: every rank receives each wanted byte once (NCCL and gloo broadcasts are pipelined);
nothing is read from storage here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint.index import Index
from elastic_ddp.checkpoint.staging import byte_view

DIRECT_BYTES = 4 << 20
PACK_BYTES = 64 << 20


@dataclass(frozen=True)
class Transport:
    """Where broadcast buffers live and which group carries them.

    ``src(r)`` maps a rank of the checkpoint's group to the rank ``dist.broadcast`` expects.
    ``group`` None with ``distributed`` False: one process, pieces are copied locally.
    """

    device: torch.device
    group: Any
    src: Callable[[int], int]
    distributed: bool


def distribute(
    index: Index,
    holders: Mapping[str, int],
    held: Mapping[str, torch.Tensor],
    dests: Mapping[int, torch.Tensor],
    rank: int,
    transport: Transport,
) -> int:
    """Fill every tensor in ``dests`` (by tensor index; contiguous, of the saved dtype and shape).

    ``holders``: file name -> rank that read it; ``held``: this rank's read buffers (uint8, host).
    Returns the number of bytes this rank received or copied into destinations.
    """
    specs = index.tensors
    pack: torch.Tensor | None = None
    moved = 0

    def send(buffer: torch.Tensor, holder: int) -> None:
        if transport.distributed:
            dist.broadcast(buffer, src=transport.src(holder), group=transport.group)

    for file in index.files:
        wanted = [(p, off) for p, off in zip(file.pieces, file.piece_offsets(specs)) if p.tensor in dests]
        if not wanted:
            continue
        holder = holders[file.name]
        source = held.get(file.name) if holder == rank else None
        if holder == rank and source is None:
            # Sending anyway would broadcast an uninitialised buffer into every rank's state.
            raise RuntimeError(f"Rank {rank} is to send checkpoint file {file.name}, but holds no read buffer of it.")
        batch: list[tuple[Any, int]] = []

        def flush() -> None:
            nonlocal pack, moved
            if not batch:
                return
            lo = batch[0][1]
            hi = batch[-1][1] + _nbytes(batch[-1][0], specs)
            if source is not None and transport.device.type == "cpu":
                buffer = source[lo:hi]  # the holder sends straight from what it read
            else:
                if pack is None or pack.numel() < hi - lo:
                    pack = torch.empty(max(hi - lo, min(PACK_BYTES, _total(index, dests))), dtype=torch.uint8,
                                       device=transport.device)  # fmt: skip
                buffer = pack[: hi - lo]
                if source is not None:
                    buffer.copy_(source[lo:hi])
            send(buffer, holder)
            for piece, off in batch:
                view = byte_view(dests[piece.tensor], piece.start, piece.stop)
                view.copy_(buffer[off - lo : off - lo + view.numel()])
                moved += view.numel()
            batch.clear()

        for piece, off in wanted:
            size = _nbytes(piece, specs)
            if size >= DIRECT_BYTES:
                flush()
                dest = dests[piece.tensor]
                whole = byte_view(dest, piece.start, piece.stop)
                # In slices of at most PACK_BYTES: bounded collectives, and a bounded temporary
                # where the destination is not on the transport device.
                for lo in range(0, size, PACK_BYTES):
                    view = whole[lo : lo + PACK_BYTES]
                    on_device = dest.device == transport.device
                    target = view if on_device else torch.empty_like(view, device=transport.device)
                    if source is not None:
                        target.copy_(source[off + lo : off + lo + view.numel()])
                    send(target, holder)
                    if not on_device:
                        view.copy_(target)
                moved += size
                continue
            contiguous = batch and batch[-1][1] + _nbytes(batch[-1][0], specs) == off
            if batch and (not contiguous or off + size - batch[0][1] > PACK_BYTES):
                flush()
            batch.append((piece, off))
        flush()
    return moved


def _nbytes(piece: Any, specs: Any) -> int:
    return (piece.stop - piece.start) * specs[piece.tensor].itemsize


def _total(index: Index, dests: Mapping[int, torch.Tensor]) -> int:
    return sum(index.tensors[t].nbytes for t in dests)
