"""Per-step batches for one rank, as a pure function of the starting cursor.

The training loop owns the cursor. :class:`StepBatches` only *reads* it: step ``k`` of the loader is
computed from ``(start cursor, k)`` alone, so worker processes and prefetching can run ahead freely,
and a batch that was prepared but never trained on is never counted. The cursor to checkpoint is
always ``cursor_after`` of the last step the loop completed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch.utils.data import DataLoader, Dataset

from elastic_ddp.data.sampler import (
    ByteWindows,
    DataCursor,
    ElasticSampler,
    micro_batches,
    rank_loss_scale,
    rank_slice,
)
from elastic_ddp.data.seeds import sample_seeds


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward of a rank: ``x``, ``y`` (``int64 [b, block_size]``), the samples'
    dropout ``seeds`` (``int64 [b]``) and loss ``weight`` (``float32 [b]``).

    The rank's loss of this micro-batch is ``(per_sample_loss(logits, y) * weight).sum()``. A
    ``dummy`` micro-batch (a rank with no samples this step) has weight 0: it only keeps the rank in
    DDP's gradient all-reduce.
    """

    indices: list[int]
    x: torch.Tensor
    y: torch.Tensor
    seeds: torch.Tensor
    weight: torch.Tensor
    dummy: bool = False

    def pin_memory(self) -> MicroBatch:
        # DataLoader's pin-memory thread calls this (it does not know our dataclass otherwise).
        return replace(
            self,
            x=self.x.pin_memory(),
            y=self.y.pin_memory(),
            seeds=self.seeds.pin_memory(),
            weight=self.weight.pin_memory(),
        )


@dataclass(frozen=True)
class StepBatch:
    """Everything one rank needs for optimizer step ``step``.

    ``global_indices``: the step's samples over all ranks, in order; ``rank_indices``: this rank's
    contiguous share; ``micro_batches``: at least one; ``cursor_after``: the data cursor to store in
    a checkpoint taken after this step.
    """

    step: int
    global_indices: list[int]
    rank_indices: list[int]
    micro_batches: list[MicroBatch]
    cursor_after: DataCursor

    def pin_memory(self) -> StepBatch:
        return replace(self, micro_batches=[mb.pin_memory() for mb in self.micro_batches])


def make_step_batch(
    windows: ByteWindows,
    sampler: ElasticSampler,
    cursor: DataCursor,
    step: int,
    rank: int,
    world_size: int,
    micro_batch_size: int = 0,
    seed: int | None = None,
) -> StepBatch:
    """The batch of step ``step`` for ``rank``, starting at ``cursor`` (a pure function).

    ``seed`` (default ``sampler.seed``) seeds the samples' dropout masks together with ``step``.
    """
    seed = sampler.seed if seed is None else seed
    global_indices, cursor_after = sampler.batch_at(cursor)
    mine = rank_slice(global_indices, rank, world_size)
    scale = rank_loss_scale(world_size, sampler.global_batch_size)
    batches = []
    for chunk in micro_batches(mine, micro_batch_size):
        x, y = windows.gather(chunk)
        weight = torch.full((len(chunk),), scale, dtype=torch.float32)
        batches.append(MicroBatch(chunk, x, y, sample_seeds(seed, step, chunk), weight))
    if not batches:
        # More ranks than samples: this rank still has to join DDP's all-reduce, or the others hang.
        # It forwards a real sample with weight 0, so its gradient contribution is exactly zero.
        chunk = global_indices[:1]
        x, y = windows.gather(chunk)
        weight = torch.zeros(1, dtype=torch.float32)
        batches.append(MicroBatch(chunk, x, y, sample_seeds(seed, step, chunk), weight, dummy=True))
    return StepBatch(step, global_indices, mine, batches, cursor_after)


class _StepDataset(Dataset):
    """Map-style view: item ``k`` is the batch of step ``start_step + k``; workers index it by k."""

    def __init__(self, batches: StepBatches) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return self.batches.num_steps

    def __getitem__(self, offset: int) -> StepBatch:
        return self.batches.batch(offset)


class StepBatches:
    """Iterate this rank's :class:`StepBatch` for steps ``start_step .. start_step + num_steps - 1``.

    Step ``start_step + k`` begins at ``sampler.advance(start, k)``. With ``num_workers > 0`` the
    batches are built by a ``DataLoader`` over a map-style dataset indexed by ``k``, each worker
    preparing up to ``prefetch_batches`` ahead; the batches and their ``cursor_after`` are identical
    to ``num_workers == 0``. Tensors are pinned when ``pin_memory`` (default: CUDA is available).
    """

    def __init__(
        self,
        windows: ByteWindows,
        sampler: ElasticSampler,
        start: DataCursor,
        *,
        rank: int,
        world_size: int,
        num_steps: int,
        start_step: int = 0,
        micro_batch_size: int = 0,
        num_workers: int = 0,
        prefetch_batches: int = 2,
        seed: int | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        if num_steps < 0:
            raise ValueError(f"num_steps ({num_steps}) must not be negative.")
        if num_workers < 0 or prefetch_batches < 1:
            raise ValueError(
                f"num_workers ({num_workers}) must be >= 0 and prefetch_batches ({prefetch_batches}) >= 1."
            )
        # Validate rank, world size, micro-batch size and the cursor up front, not in a worker.
        rank_slice([], rank, world_size)
        micro_batches([], micro_batch_size)
        sampler.advance(start, 0)
        self.windows = windows
        self.sampler = sampler
        self.start = start
        self.rank = rank
        self.world_size = world_size
        self.num_steps = num_steps
        self.start_step = start_step
        self.micro_batch_size = micro_batch_size
        self.num_workers = num_workers
        self.prefetch_batches = prefetch_batches
        self.seed = sampler.seed if seed is None else seed
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory

    def __len__(self) -> int:
        return self.num_steps

    def batch(self, offset: int) -> StepBatch:
        """The batch ``offset`` steps after the start (what the iterator yields at position offset)."""
        if not 0 <= offset < self.num_steps:
            raise IndexError(f"Step offset {offset} is outside 0..{self.num_steps - 1}.")
        return make_step_batch(
            self.windows,
            self.sampler,
            self.sampler.advance(self.start, offset),
            self.start_step + offset,
            self.rank,
            self.world_size,
            self.micro_batch_size,
            self.seed,
        )

    def __iter__(self) -> Iterator[StepBatch]:
        if self.num_workers == 0:
            for offset in range(self.num_steps):
                batch = self.batch(offset)
                yield batch.pin_memory() if self.pin_memory else batch
            return
        loader = DataLoader(
            _StepDataset(self),
            batch_size=None,  # each item already is a whole step; no collation
            shuffle=False,  # the order is the step order; shuffling happened in the sampler
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_batches,
            pin_memory=self.pin_memory,
        )
        yield from loader
