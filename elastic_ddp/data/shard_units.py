"""Samples that are not one per record: records filtered out or skipped, documents packed into fixed-length sequences.

Each record of a sharded source counts a number of *units*: 0 when ``filter`` drops it (or, with
``on_bad_record="skip"``, when it does not decode); else 1, or,
with packing, the length of the token sequence its ``transform`` returns. The counts are taken once,
with the shard index (:func:`load_or_build_units`), and stored beside it.

The epoch's *unit stream* is the records' units in :class:`~elastic_ddp.data.shard_order.ShardOrder`'s
order; the stream runs on from one epoch into the next. Sample ``k`` is the stream's units
``[k*L, (k+1)*L)`` (``L`` = ``pack_tokens``, or 1 without packing, when a sample is one kept record).
So the cursor counts units and stays the map-style :class:`~elastic_ddp.data.sampler.DataCursor`
(epoch, units consumed): the packer's carry-over -- the part of a document the last sample did not
take -- *is* the cursor's place inside that document, and every sample is a function of the index,
the seed and the cursor alone, at any world size. No token is dropped or repeated within an epoch;
a sequence may end in one epoch's last document and go on with the next epoch's first.

Locating unit ``u`` of an epoch reads no data: the blocks' unit totals come from the shards' totals,
a block's windows' from its shards' per-record counts (4 bytes a record, memory-mapped), and the
place in a window from the window's own records (at most ``shuffle_window`` of them).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np

from elastic_ddp.checkpoint.storage import Storage
from elastic_ddp.data.sampler import DataCursor, ElasticSampler
from elastic_ddp.data.shard_formats import BadRecord, ShardError, read_records
from elastic_ddp.data.shard_index import ShardIndex, cache_dir
from elastic_ddp.data.shard_order import ShardOrder

__all__ = [
    "RecordUnits", "UnitOrder", "assemble", "callable_key", "count_shards", "load_meta", "load_or_build_units",
    "local_units", "open_units", "store_units", "units_of",
]  # fmt: skip

UNITS_VERSION = 1


def callable_key(function: Callable[..., Any] | None) -> str:
    """Names a filter or transform for the cache of unit counts: its qualified name and a hash of its
    code, constants, defaults and the simple values it closes over. A change of code (another tokeniser
    call, another threshold) gives another key, so the counts are taken again; what the key cannot see
    (a tokeniser object's vocabulary) is caught when a record is read (see :func:`units_of`)."""
    if function is None:
        return "-"
    code = getattr(function, "__code__", None)
    parts: list[Any] = [getattr(function, "__module__", ""), getattr(function, "__qualname__", type(function).__name__)]
    if code is not None:
        parts += [code.co_code.hex(), repr([c for c in code.co_consts if isinstance(c, (int, float, str, bytes, bool))])]
    simple = (int, float, str, bytes, bool, type(None))
    parts.append(repr([d for d in (getattr(function, "__defaults__", None) or ()) if isinstance(d, simple)]))
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, simple):
            parts.append(repr(value))
    return hashlib.blake2b(json.dumps(parts).encode(), digest_size=8).hexdigest()


def units_of(record: Any, keep: Callable[[Any], bool] | None, transform: Callable[[Any], Any] | None,
             packed: bool) -> tuple[int, Any]:  # fmt: skip
    """``(units, sample)`` of a raw record: 0 (and ``None``) when it is a :class:`BadRecord` or ``keep``
    drops it; with packing the length of ``transform(record)``, a one-dimensional sequence of token
    ids; else 1."""
    if isinstance(record, BadRecord) or (keep is not None and not keep(record)):
        return 0, None
    sample = transform(record) if transform is not None else record
    if not packed:
        return 1, sample
    tokens = np.asarray(sample)
    if tokens.ndim != 1 or not (tokens.size == 0 or np.issubdtype(tokens.dtype, np.integer)):
        raise TypeError(
            f"Shards(pack_tokens=...): the transform must return a one-dimensional sequence of token ids for every "
            f"record it keeps; it returned {type(sample).__name__} of shape {tokens.shape} and dtype {tokens.dtype}."
        )
    return int(tokens.size), tokens


@dataclass
class RecordUnits:
    """Each record's units (``counts[i]`` for record ``i`` of the source) and each shard's total."""

    counts: np.ndarray  # int32, one per record (memory-mapped when read from a file)
    per_shard: np.ndarray  # int64, one per shard
    digest: str  # names the counts (and the file they are stored in)
    path: str = ""  # the local file ``counts`` maps, for processes that reopen it
    skipped: list[dict[str, Any]] = field(default_factory=list)  # bad records skipped (see count_shards)

    @property
    def total(self) -> int:
        return int(self.per_shard.sum())

    def __getstate__(self) -> dict[str, Any]:
        # A memory map pickles as a copy of its data: loader workers reopen the file instead.
        return {**self.__dict__, "counts": None} if self.path else dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.counts is None:
            self.counts = np.load(self.path, mmap_mode="r")


def count_shards(fs: Any, index: ShardIndex, shards: Iterable[int], keep: Callable[[Any], bool] | None,
                 transform: Callable[[Any], Any] | None, packed: bool) -> dict[int, tuple[np.ndarray, list[dict[str, Any]]]]:  # fmt: skip
    """Per shard of ``shards``: each record's units, and the records skipped as bad (``shard``,
    ``record``, ``reason``; a shard that stops decoding: ``record`` its first unreadable one, ``rest``
    true). Reads each of those shards once."""
    parts = {}
    for shard in shards:
        entry = index.entries[shard]
        counts = np.zeros(entry.records, dtype=np.int32)
        skipped: list[dict[str, Any]] = []
        seen = 0
        records = read_records(fs, fs._strip_protocol(entry.url), index.format, url=entry.url, skip_bad=index.skip_bad)
        # Never past the counted records: a shard that stops decoding raises at its break.
        for seen, record in enumerate(islice(records, entry.records), 1):
            if isinstance(record, BadRecord):
                skipped.append({"shard": entry.url, "record": seen - 1, "reason": record.reason})
                continue
            try:
                counts[seen - 1] = units_of(record, keep, transform, packed)[0]
            except Exception as exc:
                raise ShardError(
                    f"Shard {entry.url}, record {seen - 1}: the source's filter or transform failed on it: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        records.close()
        if seen < entry.records:
            raise ShardError(f"Shard {entry.url} holds {seen} records, but its index counts {entry.records}: it changed.")
        if entry.error:
            skipped.append({"shard": entry.url, "record": entry.records, "rest": True, "reason": entry.error})
        parts[shard] = counts, skipped
    return parts


def assemble(index: ShardIndex, key: str, parts: dict[int, tuple[np.ndarray, list[dict[str, Any]]]]) -> tuple[dict[str, Any], bytes]:
    """``(meta, .npy bytes)`` of the counts of every shard (``parts``, from :func:`count_shards`)."""
    shards = range(len(index.entries))
    data = _npy_bytes(np.concatenate([np.zeros(0, dtype=np.int32), *(parts[i][0] for i in shards)]))
    meta = {"version": UNITS_VERSION, "index": index.fingerprint, "key": key,
            "per_shard": [int(parts[i][0].sum(dtype=np.int64)) for i in shards],
            "digest": hashlib.blake2b(data, digest_size=16).hexdigest(),
            "skipped": [item for i in shards for item in parts[i][1]]}  # fmt: skip
    return meta, data


def _local_copy(where: str, digest: str) -> str:
    """Where this node keeps the counts named ``digest``: beside a local index, else in the node's cache."""
    storage = Storage(where)
    if storage.is_local:
        return f"{storage.fs._strip_protocol(where)}.units-{digest}.npy"
    return str(cache_dir() / "shard-units" / f"{digest}.npy")


def _save_local(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Storage(path).write_bytes_atomic(path, data)


def _npy_bytes(counts: np.ndarray) -> bytes:
    sink = io.BytesIO()
    np.save(sink, np.ascontiguousarray(counts, dtype=np.int32))
    return sink.getvalue()


def load_meta(index: ShardIndex, where: str, key: str) -> dict[str, Any] | None:
    """The stored ``meta`` (``digest``, ``per_shard``, ``skipped``) of ``index``'s counts under the
    filter and transform named ``key`` (``{where}.units-{key}.json``); ``None`` when there is none
    for this index."""
    storage = Storage(where)
    meta_url = f"{where}.units-{key}.json"
    if storage.exists(meta_url):
        meta = json.loads(storage.read_bytes(meta_url).decode())
        if meta.get("version") == UNITS_VERSION and meta.get("index") == index.fingerprint:
            return meta
    return None


def store_units(where: str, meta: dict[str, Any], data: bytes) -> None:
    """Store counts taken: as ``{where}.units-{digest}.npy`` (a local index: this node's copy), with ``meta``."""
    storage = Storage(where)
    if storage.is_local:
        _save_local(_local_copy(where, meta["digest"]), data)
    else:
        storage.write_bytes_atomic(f"{where}.units-{meta['digest']}.npy", data)
    storage.write_bytes_atomic(f"{where}.units-{meta['key']}.json", json.dumps(meta).encode())


def load_or_build_units(fs: Any, index: ShardIndex, where: str, key: str, keep: Callable[[Any], bool] | None,
                        transform: Callable[[Any], Any] | None, packed: bool) -> tuple[dict[str, Any], bytes | None]:  # fmt: skip
    """The unit counts of ``index`` (in one process): ``(meta, data)``, read (:func:`load_meta`; ``data``
    ``None``: :func:`open_units` fetches it) or taken -- every record read once -- and stored."""
    meta = load_meta(index, where, key)
    if meta is not None:
        return meta, None
    meta, data = assemble(index, key, count_shards(fs, index, range(len(index.entries)), keep, transform, packed))
    store_units(where, meta, data)
    return meta, data


def local_units(where: str, meta: dict[str, Any]) -> str | None:
    """The node-local file of ``meta``'s counts, fetched from a remote index store if need be; ``None``
    when this node cannot get it by itself (the index is on another node's disk)."""
    path = _local_copy(where, meta["digest"])
    if os.path.exists(path):
        return path
    storage = Storage(where)
    remote = f"{where}.units-{meta['digest']}.npy"
    if storage.is_local or not storage.exists(remote):
        return None
    _save_local(path, storage.read_bytes(remote))
    return path


def open_units(where: str, meta: dict[str, Any], data: bytes | None = None) -> RecordUnits:
    """The counts of ``meta`` from this node's copy: written from ``data`` when given and missing, else
    fetched from the index's store (:func:`local_units`)."""
    path = _local_copy(where, meta["digest"])
    if data is not None and not os.path.exists(path):
        _save_local(path, data)
    if local_units(where, meta) is None:
        raise ShardError(
            f"The unit counts {meta['digest']} of the shard index {where} are neither on this node ({path}) nor in "
            "the index's store. Delete the index's .units-* files to have them counted again."
        )
    counts = np.load(path, mmap_mode="r")
    per_shard = np.asarray(meta["per_shard"], dtype=np.int64)
    if counts.dtype != np.int32 or counts.ndim != 1:
        raise ValueError(f"{path} does not hold unit counts (int32); delete it to have them taken again.")
    return RecordUnits(counts, per_shard, meta["digest"], path, meta.get("skipped", []))


class UnitOrder(ElasticSampler):
    """The order of a source whose samples are ``sample_units`` consecutive units of the unit stream (see
    the module docstring), ``global_batch_size`` samples a step. ``num_samples`` is the epoch's units.

    A sample's id, what the loader hands to ``Shards.__getitems__`` and the ledger records: with
    ``sample_units == 1`` the index of the record it is; otherwise ``epoch * num_samples + u`` -- its
    first unit ``u`` of epoch ``epoch``, i.e. its first unit in the stream of all epochs (:meth:`pieces`
    names the records and units it holds).
    """

    def __init__(self, records: ShardOrder, units: RecordUnits, sample_units: int, global_batch_size: int) -> None:
        if sample_units < 1:
            raise ValueError(f"pack_tokens ({sample_units}) must be >= 1.")
        total = units.total
        if total < sample_units:
            raise ValueError(
                f"The source holds {total} units an epoch (kept records or tokens), fewer than one sample of "
                f"{sample_units}: nothing to train on."
            )
        super().__init__(total, global_batch_size, records.seed)
        self.records, self.units, self.sample_units = records, units, sample_units
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._entries: OrderedDict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()

    # ----------------------------------------------------------------------------- the stream's layout

    def _block_starts(self, epoch: int) -> np.ndarray:
        """The unit at which each block of ``epoch`` starts (and the epoch's total, last)."""
        if epoch not in self._blocks:
            perm, _ = self.records._epoch(epoch)
            k = self.records.shards_in_flight
            sizes = np.add.reduceat(self.units.per_shard[perm], np.arange(0, len(perm), k))
            _put(self._blocks, epoch, np.concatenate([[0], np.cumsum(sizes)]), 2)
        return self._blocks[epoch]

    def _window_starts(self, epoch: int, block: int) -> np.ndarray:
        """The unit (from the block's start) at which each window of the block starts, and its total."""
        key = (epoch, block)
        if key not in self._windows:
            layout, chunk = self.records._block(epoch, block), self.records.chunk_records
            totals = np.zeros(len(layout.lengths), dtype=np.int64)
            for j, shard in enumerate(layout.shards.tolist()):
                first = int(self.records.offsets[shard])
                cumulative = np.concatenate([[0], np.cumsum(self.units.counts[first : first + int(layout.counts[j])],
                                                            dtype=np.int64)])  # fmt: skip
                ends = np.minimum(np.arange(1, len(totals) + 1) * chunk, layout.counts[j])
                starts = np.minimum(np.arange(len(totals)) * chunk, layout.counts[j])
                totals += cumulative[ends] - cumulative[starts]
            _put(self._windows, key, np.concatenate([[0], np.cumsum(totals)]), 4)
        return self._windows[key]

    def _entries_of(self, epoch: int, block: int, q: int) -> tuple[np.ndarray, np.ndarray]:
        """Window ``q``'s records in their shuffled order, and the unit at which each starts in it."""
        key = (epoch, block, q)
        if key not in self._entries:
            layout = self.records._block(epoch, block)
            lengths = layout.lengths[q]
            v = self.records._window(epoch, block, q, int(lengths.sum()))
            within = np.concatenate([[0], np.cumsum(lengths)])
            j = np.searchsorted(within, v, side="right") - 1
            ids = self.records.offsets[layout.shards[j]] + q * self.records.chunk_records + v - within[j]
            starts = np.concatenate([[0], np.cumsum(self.units.counts[ids], dtype=np.int64)])
            _put(self._entries, key, (ids, starts), 16)
        return self._entries[key]

    def _window_at(self, epoch: int, unit: int) -> tuple[int, int, int]:
        """``(block, window, the window's first unit in the epoch)`` holding unit ``unit`` of ``epoch``."""
        blocks = self._block_starts(epoch)
        # side="right" passes over blocks and windows of no units (empty or wholly filtered).
        b = int(np.searchsorted(blocks, unit, side="right")) - 1
        windows = self._window_starts(epoch, b)
        q = int(np.searchsorted(windows, unit - blocks[b], side="right")) - 1
        return b, q, int(blocks[b] + windows[q])

    def pieces(self, sample: int) -> list[tuple[int, int, int]]:
        """The records a packed sample holds, in order: ``(record index, first unit, end unit)``."""
        epoch, unit = divmod(sample, self.num_samples)
        out: list[tuple[int, int, int]] = []
        need = self.sample_units
        while need:
            b, q, first = self._window_at(epoch, unit)
            ids, starts = self._entries_of(epoch, b, q)
            at, end = unit - first, min(unit - first + need, int(starts[-1]))
            for t in range(int(np.searchsorted(starts, at, side="right")) - 1, len(ids)):
                lo, hi = max(at, int(starts[t])), min(end, int(starts[t + 1]))
                if lo >= end:
                    break
                if hi > lo:
                    out.append((int(ids[t]), lo - int(starts[t]), hi - int(starts[t])))
            need -= end - at
            unit = first + end
            if unit == self.num_samples:
                epoch, unit = epoch + 1, 0
        return out

    def records_at(self, epoch: int, units: np.ndarray) -> np.ndarray:
        """The record holding each unit of ``units`` (of ``epoch``): a kept record, when a unit is one."""
        out = np.empty(units.shape, dtype=np.int64)
        for i, unit in enumerate(units.tolist()):
            b, q, first = self._window_at(epoch, unit)
            ids, starts = self._entries_of(epoch, b, q)
            out[i] = ids[int(np.searchsorted(starts, unit - first, side="right")) - 1]
        return out

    # ------------------------------------------------------------------------- ElasticSampler's interface

    def indices(self, epoch: int, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """The sample ids at ``positions`` (units, each below ``num_samples``) of ``epoch``."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and int(pos.max()) >= self.num_samples:
            raise IndexError(f"Positions must be below num_samples ({self.num_samples}); got {int(pos.max())}.")
        if self.sample_units == 1:
            return self.records_at(epoch, pos)
        return epoch * self.num_samples + pos

    @property
    def _units_per_sample(self) -> int:  # ElasticSampler.shares: a sample's first unit every sample_units
        return self.sample_units

    def advance(self, cursor: DataCursor, steps: int) -> DataCursor:
        self._check(cursor)
        if steps < 0:
            raise ValueError(f"steps ({steps}) must not be negative.")
        total = cursor.consumed + steps * self.global_batch_size * self.sample_units
        return DataCursor(cursor.epoch + total // self.num_samples, total % self.num_samples)

    def permutation(self, epoch: int) -> list[int]:
        """The samples of ``epoch`` in order (for audits): its kept records, or the ids of the packed
        samples that start in it (an id is the sample's first unit in the stream of all epochs)."""
        if self.sample_units == 1:
            return super().permutation(epoch)
        length, first = self.sample_units, epoch * self.num_samples
        return list(range(-(-first // length) * length, first + self.num_samples, length))


def _put(cache: OrderedDict, key: object, value: object, limit: int) -> None:
    cache[key] = value
    while len(cache) > limit:
        cache.popitem(last=False)
