"""The global data cursor and the world-size-independent order of samples, in O(1) memory.

The cursor counts samples, not steps or per-rank positions: ``(epoch, consumed)`` says how far the
*job* got, so a checkpoint written by 4 ranks resumes on 3 without repeating or skipping a sample.
Which samples make up a step depends on the cursor only; the world size only decides how the
step's global batch is split (:func:`rank_slice`).

The order of an epoch is a keyed pseudo-random permutation computed per position (a Feistel
network over the next power of four with cycle walking, keyed by the seed and the epoch), not a
stored list: a rank computes the indices of its own share of a step in O(share) time and no
memory per sample, however large the dataset and however many loader workers hold a copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from elastic_ddp.data.seeds import derive_seed

__all__ = ["ORDER_VERSION", "DataCursor", "ElasticSampler", "micro_batches", "rank_slice"]

# Names the permutation algorithm; stored with the cursor so that a checkpoint is never resumed
# with another algorithm's order (which would silently repeat and skip samples).
ORDER_VERSION = "feistel-6r-v1"
_ROUNDS = 6


@dataclass(frozen=True)
class DataCursor:
    """How far the job got through the data: ``consumed`` samples of epoch ``epoch`` are done.

    Independent of world size and of the global batch size.
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
        return cls(epoch=int(state["epoch"]), consumed=int(state["consumed"]))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (multiplication wraps modulo 2**64, as intended)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class ElasticSampler:
    """The order in which the job consumes samples, ``global_batch_size`` per optimizer step.

    Epoch ``e`` visits all ``num_samples`` samples once, in the order of a permutation keyed by
    ``derive_seed("order", seed, e, round)`` -- the same in every process, on every platform. A
    global batch that runs past the end of an epoch continues with the next epoch's order, so no
    step is short and no sample is dropped or repeated within an epoch.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples ({num_samples}) must be positive: the dataset holds no sample.")
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size ({global_batch_size}) must be positive.")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        # The permutation acts on [0, 4**half_bits) >= num_samples (at most 4x larger, so cycle
        # walking takes < 4 rounds of the network on average).
        self._half_bits = max(1, (max(num_samples - 1, 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self._half_bits) - 1)
        self._keys: dict[int, list[np.uint64]] = {}

    # Positions of the order one sample takes (a packed sample of a sharded source takes several).
    _units_per_sample = 1

    def _round_keys(self, epoch: int) -> list[np.uint64]:
        keys = self._keys.get(epoch)
        if keys is None:
            keys = [np.uint64(derive_seed("order", self.seed, epoch, r)) for r in range(_ROUNDS)]
            if len(self._keys) >= 4:  # a step spans at most a few epochs; keep the cache tiny
                self._keys.pop(min(self._keys))
            self._keys[epoch] = keys
        return keys

    def indices(self, epoch: int, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """The sample indices at ``positions`` (each in ``0..num_samples-1``) of ``epoch``'s order."""
        pos = np.asarray(positions, dtype=np.uint64)
        if pos.size and int(pos.max()) >= self.num_samples:
            raise IndexError(f"Positions must be below num_samples ({self.num_samples}); got {int(pos.max())}.")
        keys, half, mask, limit = self._round_keys(epoch), np.uint64(self._half_bits), self._mask, np.uint64(self.num_samples)
        out = pos.copy()
        pending = np.ones(out.shape, dtype=bool)
        while pending.any():
            x = out[pending]
            left, right = x >> half, x & mask
            for key in keys:
                left, right = right, left ^ (_mix(right ^ key) & mask)
            x = (left << half) | right
            out[pending] = x
            pending[pending] = x >= limit  # cycle walking: re-encrypt what fell outside the domain
        return out.astype(np.int64)

    def permutation(self, epoch: int) -> list[int]:
        """The whole order of ``epoch`` (O(num_samples): for tests and audits, not for training)."""
        return self.indices(epoch, np.arange(self.num_samples)).tolist()

    def batch_at(self, cursor: DataCursor) -> tuple[list[int], DataCursor]:
        """The next global batch from ``cursor``: its sample indices and the cursor after it."""
        indices = self.slice_at(cursor, 0, self.global_batch_size)
        return indices, self.advance(cursor, 1)

    def slice_at(self, cursor: DataCursor, start: int, stop: int) -> list[int]:
        """Positions ``start..stop-1`` of the global batch that begins at ``cursor`` (O(stop - start))."""
        return self.shares(cursor, start, stop, 1)[0]

    def shares(self, cursor: DataCursor, start: int, stop: int, steps: int) -> list[list[int]]:
        """``slice_at(advance(cursor, k), start, stop)`` for ``k`` in ``0..steps-1``, computed at once.

        The permutation costs tens of array operations per call whatever the number of positions (a
        quarter of a millisecond for a rank's share of one step): computed for many steps at once, its
        cost per step is a few microseconds, not a share of a fast step's time.
        """
        self._check(cursor)
        if not 0 <= start <= stop <= self.global_batch_size:
            raise ValueError(f"A slice {start}:{stop} of a global batch of {self.global_batch_size} is out of range.")
        if steps < 0:
            raise ValueError(f"steps ({steps}) must not be negative.")
        stride = self._units_per_sample
        within = np.arange(start, stop, dtype=np.int64) * stride
        per_step = np.arange(steps, dtype=np.int64) * (self.global_batch_size * stride)
        firsts = (cursor.consumed + per_step[:, None] + within[None, :]).ravel()
        # A global batch that runs past the end of an epoch continues with the next epoch's order.
        epochs, positions = cursor.epoch + firsts // self.num_samples, firsts % self.num_samples
        out = np.empty(firsts.size, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            where = epochs == epoch
            out[where] = self.indices(epoch, positions[where])
        return out.reshape(steps, stop - start).tolist()

    def advance(self, cursor: DataCursor, steps: int) -> DataCursor:
        """The cursor ``steps`` global batches after ``cursor`` (O(1))."""
        self._check(cursor)
        if steps < 0:
            raise ValueError(f"steps ({steps}) must not be negative.")
        total = cursor.consumed + steps * self.global_batch_size
        # A finished epoch is stored as the start of the next, so equal positions compare equal.
        return DataCursor(cursor.epoch + total // self.num_samples, total % self.num_samples)

    def _check(self, cursor: DataCursor) -> None:
        if cursor.consumed >= self.num_samples:
            raise ValueError(
                f"The data cursor is at sample {cursor.consumed} of epoch {cursor.epoch}, but an epoch "
                f"has only {self.num_samples} samples: the dataset changed since the checkpoint was written."
            )


def rank_bounds(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, stop)`` of ``rank``'s contiguous share of a global batch of ``batch_size``.

    The first ``batch_size % world_size`` ranks get one sample more than the others; ranks beyond
    the batch size get none. The shares of ranks 0..world_size-1 tile the batch in order.
    """
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank ({rank}) must be in 0..world_size-1 (world_size {world_size}).")
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def rank_slice(global_indices: Sequence[int], rank: int, world_size: int) -> list[int]:
    """This rank's contiguous share of a global batch (see :func:`rank_bounds`)."""
    start, stop = rank_bounds(len(global_indices), rank, world_size)
    return list(global_indices[start:stop])


def micro_batches(rank_indices: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    """Split a rank's samples into the fewest micro-batches of at most ``micro_batch_size``, evenly.

    A share of ``s`` samples gives ``k = ceil(s / micro_batch_size)`` micro-batches; the first
    ``s % k`` hold ``s // k + 1`` samples, the others ``s // k`` (11 with a limit of 10: 6, 5;
    25: 9, 8, 8). Concatenated, they are ``rank_indices`` in order. ``micro_batch_size == 0`` means
    one micro-batch of everything. No samples give no micro-batches
    (:class:`~elastic_ddp.data.loader.StepBatches` then adds a zero-weight dummy).
    """
    if micro_batch_size < 0:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) must not be negative.")
    items = list(rank_indices)
    if not items:
        return []
    count = -(-len(items) // micro_batch_size) if micro_batch_size else 1
    # Balanced, not greedy: a greedy cut leaves a remainder as small as 1 sample (11 = 10 + 1),
    # which BatchNorm cannot normalise in training mode. The cut is the one that splits a global
    # batch over ranks, applied to the rank's share.
    bounds = (rank_bounds(len(items), i, count) for i in range(count))
    return [items[start:stop] for start, stop in bounds]
