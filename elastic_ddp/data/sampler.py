"""Samples, the global data cursor and the world-size-independent order of samples.

The cursor counts samples, not steps or per-rank positions: ``(epoch, consumed)`` says how far the
*job* got, so a checkpoint written by 4 ranks resumes on 3 without repeating or skipping a sample.
Which samples make up a step depends on the cursor only; the world size only decides how the
step's global batch is split (:func:`rank_slice`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elastic_ddp.data.seeds import derive_seed


class ByteWindows:
    """Next-byte prediction samples cut from a 1-D ``uint8`` corpus.

    Sample ``i`` is the window ``corpus[i*block_size : i*block_size + block_size + 1]``: ``x`` is its
    first ``block_size`` bytes, ``y`` the same shifted by one (both ``int64``). Windows do not overlap,
    so an epoch reads every byte once; ``len`` is the number of full windows.
    """

    def __init__(self, corpus: torch.Tensor, block_size: int) -> None:
        if corpus.dim() != 1 or corpus.dtype != torch.uint8:
            raise ValueError(
                f"The corpus must be a 1-D uint8 tensor, not {corpus.dtype} of shape {tuple(corpus.shape)}."
            )
        if block_size <= 0:
            raise ValueError(f"block_size ({block_size}) must be positive.")
        if corpus.numel() < block_size + 1:
            raise ValueError(
                f"The corpus ({corpus.numel()} bytes) is shorter than one sample "
                f"(block_size + 1 = {block_size + 1} bytes)."
            )
        self.corpus = corpus
        self.block_size = block_size
        self._offsets = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return (self.corpus.numel() - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.gather([index])
        return x[0], y[0]

    def gather(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``indices`` stacked: ``x, y`` of shape ``[len(indices), block_size]``."""
        count = len(self)
        bad = [i for i in indices if not 0 <= i < count]
        if bad:
            raise IndexError(f"Sample indices {bad[:5]} are outside 0..{count - 1}.")
        starts = torch.as_tensor(list(indices), dtype=torch.int64) * self.block_size
        windows = self.corpus[starts[:, None] + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]


@dataclass(frozen=True)
class DataCursor:
    """How far the job got through the data: ``consumed`` samples of epoch ``epoch`` are done.

    Independent of world size and of the global batch size. Store ``state_dict()`` in a checkpoint
    and continue with ``DataCursor.from_state_dict(...)``.
    """

    epoch: int = 0
    consumed: int = 0

    def __post_init__(self) -> None:
        for name in ("epoch", "consumed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"DataCursor.{name} must be a non-negative int, not {value!r}.")

    def state_dict(self) -> dict[str, int]:
        """A JSON-able dict; :meth:`from_state_dict` turns it back into the cursor."""
        return {"epoch": self.epoch, "consumed": self.consumed}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> DataCursor:
        missing = {"epoch", "consumed"} - set(state)
        if missing:
            raise ValueError(f"A data cursor state needs keys {sorted(missing)}; got {dict(state)!r}.")
        return cls(epoch=state["epoch"], consumed=state["consumed"])


class ElasticSampler:
    """The order in which the job consumes samples, ``global_batch_size`` per optimizer step.

    Epoch ``e`` visits all ``num_samples`` samples once, in ``torch.randperm`` order from a CPU
    generator seeded with ``derive_seed("order", seed, e)`` (the same in every process for a given
    torch version). A global batch that runs past the end of an epoch continues with the next
    epoch's order, so no step is short and no sample is dropped or repeated within an epoch.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        if num_samples <= 0:
            raise ValueError(
                f"num_samples ({num_samples}) must be positive: the corpus holds no full sample."
            )
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size ({global_batch_size}) must be positive.")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def permutation(self, epoch: int) -> list[int]:
        """The sample order of ``epoch``: a permutation of ``range(num_samples)`` (a fresh list)."""
        return list(self._order(epoch))

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            generator = torch.Generator().manual_seed(derive_seed("order", self.seed, epoch))
            order = torch.randperm(self.num_samples, generator=generator).tolist()
            # A batch needs at most its own epoch and the following ones; keep two epochs cached.
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return order

    def batch_at(self, cursor: DataCursor) -> tuple[list[int], DataCursor]:
        """The next global batch from ``cursor``: its sample indices and the cursor after it."""
        self._check(cursor)
        epoch, consumed = cursor.epoch, cursor.consumed
        indices: list[int] = []
        while len(indices) < self.global_batch_size:
            if consumed == self.num_samples:
                epoch, consumed = epoch + 1, 0
            take = min(self.global_batch_size - len(indices), self.num_samples - consumed)
            indices += self._order(epoch)[consumed : consumed + take]
            consumed += take
        return indices, self._normalize(epoch, consumed)

    def advance(self, cursor: DataCursor, steps: int) -> DataCursor:
        """The cursor ``steps`` global batches after ``cursor`` (O(1); no permutation is built)."""
        self._check(cursor)
        if steps < 0:
            raise ValueError(f"steps ({steps}) must not be negative.")
        total = cursor.consumed + steps * self.global_batch_size
        return self._normalize(cursor.epoch + total // self.num_samples, total % self.num_samples)

    def _normalize(self, epoch: int, consumed: int) -> DataCursor:
        # A finished epoch is stored as the start of the next, so equal positions compare equal.
        if consumed == self.num_samples:
            return DataCursor(epoch + 1, 0)
        return DataCursor(epoch, consumed)

    def _check(self, cursor: DataCursor) -> None:
        if cursor.consumed > self.num_samples:
            raise ValueError(
                f"The data cursor is at sample {cursor.consumed} of epoch {cursor.epoch}, but an epoch "
                f"has only {self.num_samples} samples: the corpus or block_size changed since the "
                "checkpoint was written."
            )


def rank_slice(global_indices: Sequence[int], rank: int, world_size: int) -> list[int]:
    """This rank's contiguous share of a global batch.

    The first ``len(global_indices) % world_size`` ranks get one sample more than the others; ranks
    beyond the batch size get none. Concatenating the slices of ranks 0..world_size-1 gives
    ``global_indices`` back in order.
    """
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank ({rank}) must be in 0..world_size-1 (world_size {world_size}).")
    base, extra = divmod(len(global_indices), world_size)
    start = rank * base + min(rank, extra)
    return list(global_indices[start : start + base + (rank < extra)])


def rank_loss_scale(world_size: int, global_batch_size: int) -> float:
    """The weight of each per-sample loss on a rank: ``world_size / global_batch_size``.

    DDP *averages* gradients over ranks. If each rank's loss is the *sum* of its per-sample losses
    times this weight, the average over ranks is ``sum over the global batch / global_batch_size``:
    exactly the global-batch mean, however unevenly the batch is split (10 samples on 3 ranks:
    4, 3, 3) and however many micro-batches a rank uses. The per-rank mean loss would instead weight
    the samples of the ranks with fewer samples more heavily.
    """
    if world_size <= 0 or global_batch_size <= 0:
        raise ValueError(
            f"world_size ({world_size}) and global_batch_size ({global_batch_size}) must be positive."
        )
    return world_size / global_batch_size


def micro_batches(rank_indices: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    """Split a rank's samples into consecutive micro-batches of at most ``micro_batch_size``.

    ``micro_batch_size == 0`` means one micro-batch of everything. No samples give no micro-batches
    (:class:`~elastic_ddp.data.loader.StepBatches` then adds a zero-weight dummy).
    """
    if micro_batch_size < 0:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) must not be negative.")
    items = list(rank_indices)
    if not items:
        return []
    size = micro_batch_size or len(items)
    return [items[start : start + size] for start in range(0, len(items), size)]
