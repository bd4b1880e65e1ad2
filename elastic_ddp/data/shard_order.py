"""The world-size-independent order of a sharded source's records, computed from the shard index alone.

Epoch ``e`` of a source of ``n`` shards:

1. the shards in a seeded permutation (``derive_seed("shards", seed, e)``), cut into *blocks* of
   ``shards_in_flight`` consecutive shards;
2. each shard cut into *chunks* of ``chunk_records`` consecutive records; window ``q`` of a block is
   chunk ``q`` of each of its shards (those that have one), and its records are taken in a seeded
   permutation (``derive_seed("window", seed, e, block, q)``) -- the shuffle window, of up to
   ``shards_in_flight x chunk_records`` records drawn from every shard of the block;
3. the epoch's stream is block 0's windows in turn, then block 1's, and so on.

A record's *index* is its position in the source: the records of shard 0, then of shard 1, ... (the
shards in the order the user listed them), so the ledger's indices name records for good and each
epoch holds each index once. Position ``p`` of an epoch maps to a record with a few binary searches
over the index's counts -- no record is read to order them -- so the cursor stays the map-style one
(:class:`~elastic_ddp.data.sampler.DataCursor`: epoch, records consumed) and a resume at any world size
seeks instead of replaying. The chunk is also the unit a reader fetches: a shard is read forward,
chunk after chunk, whichever rank asks (see :class:`~elastic_ddp.data.shards.Shards`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from elastic_ddp.data.sampler import ElasticSampler
from elastic_ddp.data.seeds import derive_seed

__all__ = ["ShardOrder", "shard_order_version"]


def shard_order_version(shards_in_flight: int, chunk_records: int) -> str:
    """Names the order and its parameters; stored with the cursor, so a resume under another is refused."""
    return f"shards-v1/block={shards_in_flight}/chunk={chunk_records}"


def _generator(*parts: int | str) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(derive_seed(*parts)))


class _Block:
    """One block of an epoch: its shards, window sizes and window starts (positions in the block)."""

    def __init__(self, shards: np.ndarray, counts: np.ndarray, chunk: int) -> None:
        self.shards = shards
        self.counts = counts[shards]
        windows = int(-(-self.counts.max() // chunk)) if len(shards) else 0
        # lengths[q, j]: records of shard j in window q.
        self.lengths = np.clip(self.counts[None, :] - np.arange(windows)[:, None] * chunk, 0, chunk)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths.sum(axis=1))])


class ShardOrder(ElasticSampler):
    """:class:`ElasticSampler`'s interface (``slice_at``, ``advance``, ``batch_at``) over a sharded
    source's records in the order of the module docstring. ``counts``: each shard's records, in the
    order the shards were listed."""

    def __init__(
        self, counts: Sequence[int], global_batch_size: int, seed: int, *, shards_in_flight: int, chunk_records: int
    ) -> None:
        if shards_in_flight < 1 or chunk_records < 1:
            raise ValueError(f"shards_in_flight ({shards_in_flight}) and chunk_records ({chunk_records}) must be >= 1.")
        self.counts = np.asarray(counts, dtype=np.int64)
        super().__init__(int(self.counts.sum()), global_batch_size, seed)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self.shards_in_flight = shards_in_flight
        self.chunk_records = chunk_records
        self.version = shard_order_version(shards_in_flight, chunk_records)
        # Small caches: a step touches one or two epochs, a few blocks and windows.
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._blocks: OrderedDict[tuple[int, int], _Block] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's shard permutation and its block starts (positions in the epoch)."""
        if epoch not in self._epochs:
            perm = _generator("shards", self.seed, epoch).permutation(len(self.counts))
            sizes = np.add.reduceat(self.counts[perm], np.arange(0, len(perm), self.shards_in_flight))
            _put(self._epochs, epoch, (perm, np.concatenate([[0], np.cumsum(sizes)])), 2)
        return self._epochs[epoch]

    def _block(self, epoch: int, block: int) -> _Block:
        key = (epoch, block)
        if key not in self._blocks:
            perm, _ = self._epoch(epoch)
            k = self.shards_in_flight
            _put(self._blocks, key, _Block(perm[block * k : (block + 1) * k], self.counts, self.chunk_records), 4)
        return self._blocks[key]

    def _window(self, epoch: int, block: int, q: int, size: int) -> np.ndarray:
        key = (epoch, block, q)
        if key not in self._windows:
            _put(self._windows, key, _generator("window", self.seed, epoch, block, q).permutation(size), 16)
        return self._windows[key]

    def indices(self, epoch: int, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """The record indices at ``positions`` (each in ``0..num_samples-1``) of ``epoch``'s stream."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and int(pos.max()) >= self.num_samples:
            raise IndexError(f"Positions must be below num_samples ({self.num_samples}); got {int(pos.max())}.")
        _, block_starts = self._epoch(epoch)
        out = np.empty(pos.shape, dtype=np.int64)
        blocks = np.searchsorted(block_starts, pos, side="right") - 1
        # Vectorised per (block, window): a step's positions fall in a few of each.
        for b in np.unique(blocks).tolist():
            in_block = blocks == b
            block = self._block(epoch, b)
            t = pos[in_block] - block_starts[b]
            windows = np.searchsorted(block.starts, t, side="right") - 1
            ids = np.empty(t.shape, dtype=np.int64)
            for q in np.unique(windows).tolist():
                in_window = windows == q
                lengths = block.lengths[q]
                v = self._window(epoch, b, q, int(lengths.sum()))[t[in_window] - block.starts[q]]
                within = np.concatenate([[0], np.cumsum(lengths)])
                j = np.searchsorted(within, v, side="right") - 1
                ids[in_window] = self.offsets[block.shards[j]] + q * self.chunk_records + v - within[j]
            out[in_block] = ids
        return out


def _put(cache: OrderedDict, key: object, value: object, limit: int) -> None:
    cache[key] = value
    while len(cache) > limit:
        cache.popitem(last=False)
