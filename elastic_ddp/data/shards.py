"""``Shards``: a sharded source (JSONL, Parquet, Arrow, WebDataset files, local or in an object store)
that ``run.steps()`` trains on exactly once per epoch, at any world size.

To the loader it is a map-style dataset whose index ``i`` is the ``i``-th record of the source (the
records of the shards in the order listed) and whose order is :class:`~elastic_ddp.data.shard_order.ShardOrder`'s,
not a permutation of the indices: ``run.steps()`` asks it for :meth:`Shards.order`. A rank reads only
the chunks (``chunk_records`` consecutive records of a shard) that hold its records, each shard
forward from where its reader stands; a chunk is read once and kept while its shuffle window may
still need it. With a ``filter`` or packing (``pack_tokens``), a sample is a kept record or a
fixed-length sequence of tokens, and the order is :class:`~elastic_ddp.data.shard_units.UnitOrder`'s
over the units each record counts. See docs/data.md, "Sharded sources".
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastic_ddp.data.shard_formats import FORMATS, ShardError, read_records
from elastic_ddp.data.shard_index import (
    ShardIndex, build_entries, check_unchanged, default_index_url, expand_urls, load_or_build, load_stored, store,
)  # fmt: skip
from elastic_ddp.data.shard_order import ShardOrder, shard_order_version
from elastic_ddp.data.shard_units import (
    RecordUnits, UnitOrder, assemble, callable_key, count_shards, load_meta, load_or_build_units, local_units, open_units,
    store_units, units_of,
)  # fmt: skip

__all__ = ["ShardError", "Shards"]


# A record the filter rejects, in a chunk read for its neighbours; no sample is ever one.
_DROPPED = object()


class _Reader:
    """A shard's records from ``position`` on, read forward; reopened only to go back."""

    def __init__(self, records: Iterator[Any], position: int) -> None:
        self.records, self.position = records, position


class Shards:
    """A sharded source for ``run.steps()``: ``Shards("s3://bucket/corpus/*.jsonl.gz", format="jsonl")``.

    ``urls``: fsspec URLs or globs (one filesystem; a glob's matches sorted), shards in that order.
    ``format``: ``"jsonl"`` (one JSON value per line; ``.gz``/``.zst``/``.bz2``/``.xz`` decompressed by
    suffix), ``"parquet"`` (a row as a dict), ``"arrow"`` (Arrow IPC streams, as `datasets` writes them),
    ``"webdataset"`` (tar files; the members sharing a key as ``{"__key__": ..., ext: bytes}``).
    ``shards_in_flight``: shards whose records are interleaved by one shuffle window (a block), and
    about the number of shards a rank has open; ``shuffle_window``: records per window (a
    ``shards_in_flight``-th of it from each shard). ``transform``: applied to each record as it is
    read (tokenise, decode); it must return a sample for every record it is given. ``filter``: a
    predicate on the raw record; the records it rejects are never trained on. ``pack_tokens``: pack
    the documents into sequences of this many tokens, a sample each (a ``torch.long`` tensor of that
    length): ``transform`` must return each kept record's token ids (a tokeniser, with the separator
    token it wants), and the documents are concatenated in the data order and cut every
    ``pack_tokens`` tokens, a document's rest opening the next sample. With a filter or packing, each
    record's sample count or token count is taken once, with the shard index, and stored beside it
    (the filter and transform then run over every record once; see docs/data.md).
    ``on_bad_record``: ``"error"`` (the default) or ``"skip"``: a record that does not decode (a
    JSONL line that is not JSON), or the rest of a shard whose stream stops decoding, is found when
    the index is built and left out like a filtered record; the run reports every skip (a warning,
    the ledger, a TensorBoard event). A shard missing, or changed since the index, is still an
    error. ``index_url``:
    where the shard index is stored (default: a node-local cache). ``storage_options``: for fsspec
    (``endpoint_url``, credentials).

    Every record read is checked: a missing shard, one changed since the index was built (size or
    ETag), one that is truncated or does not decode raise :class:`ShardError` naming the shard and the
    record, before any step trains on it.
    """

    def __init__(
        self,
        urls: str | list[str],
        format: str = "jsonl",  # noqa: A002 -- the contract's spelling
        *,
        shards_in_flight: int = 8,
        shuffle_window: int = 1024,
        transform: Callable[[Any], Any] | None = None,
        filter: Callable[[Any], bool] | None = None,  # noqa: A002 -- the name users know from datasets
        pack_tokens: int | None = None,
        on_bad_record: str = "error",
        index_url: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if format not in FORMATS:
            raise ValueError(f"Shards(format={format!r}): expected one of {', '.join(FORMATS)}.")
        if shards_in_flight < 1 or shuffle_window < shards_in_flight:
            raise ValueError(
                f"Shards(shards_in_flight={shards_in_flight}, shuffle_window={shuffle_window}): shards_in_flight must be "
                ">= 1 and shuffle_window at least shards_in_flight (a window takes records from each shard in flight)."
            )
        if pack_tokens is not None and (isinstance(pack_tokens, bool) or not isinstance(pack_tokens, int) or pack_tokens < 1):
            raise ValueError(f"Shards(pack_tokens={pack_tokens!r}): expected a number of tokens >= 1, or None.")
        if pack_tokens is not None and transform is None:
            raise ValueError(
                "Shards(pack_tokens=...) needs transform=: a function that returns each record's token ids (the "
                "packer cuts their concatenation every pack_tokens tokens)."
            )
        if on_bad_record not in ("error", "skip"):
            raise ValueError(f"Shards(on_bad_record={on_bad_record!r}): expected 'error' or 'skip'.")
        self.format = format
        self.shards_in_flight = shards_in_flight
        self.chunk_records = -(-shuffle_window // shards_in_flight)
        self.transform = transform
        self.filter = filter
        self.pack_tokens = pack_tokens
        self.skip_bad = on_bad_record == "skip"
        self.index_url = index_url
        self.fs, self.urls = expand_urls(urls, storage_options)
        self._index: ShardIndex | None = None
        self._units: RecordUnits | None = None  # with a filter or packing: each record's units
        self._unit_order: UnitOrder | None = None  # the order packed samples are read in
        self._offsets: np.ndarray | None = None  # the first record index of each shard
        self._readers: OrderedDict[int, _Reader] = OrderedDict()
        self._chunks: OrderedDict[tuple[int, int], list[Any]] = OrderedDict()

    @classmethod
    def from_hf(cls, dataset: Any, **options: Any) -> Shards:
        """A ``Shards`` over the files of a Hugging Face streaming dataset (``load_dataset(builder,
        data_files=..., split=..., streaming=True)``) whose builder is ``parquet``, ``json`` (JSON
        lines) or ``arrow``; ``options`` as for the constructor (``transform=`` for what ``map`` did).

        The dataset must be as loaded: a ``map``, ``filter``, ``shuffle`` or ``take`` applied to it
        lives in the stream, not in its files, so it is refused (pass the function as ``transform``).
        """
        formats = {"parquet": "parquet", "json": "jsonl", "arrow": "arrow"}
        source = getattr(dataset, "_ex_iterable", None)
        builder = getattr(getattr(dataset, "info", None), "builder_name", None)
        if builder not in formats:
            raise TypeError(
                f"Shards.from_hf() takes a streaming dataset of a {', '.join(formats)} builder; this one's builder "
                f"is {builder!r}."
            )
        kwargs = getattr(source, "kwargs", None) or {}
        files = kwargs.get("files", kwargs.get("base_files"))
        if type(source).__name__ != "ArrowExamplesIterable" or not files:
            raise TypeError(
                f"Shards.from_hf(): the dataset is a {type(source).__name__} stream, not its files as loaded; a map, "
                "filter, shuffle or take applied to it cannot be resumed from the files. Pass load_dataset(..., "
                "streaming=True) itself, with the map's function as Shards.from_hf(ds, transform=...)."
            )
        return cls([str(f) for f in files], formats[builder], **options)

    # ------------------------------------------------------------------------------------ index

    def prepare(self, group: Any = None) -> ShardIndex:
        """Load or build the shard index, and with a filter, packing or skipping each record's units
        (collective over ``group`` when a process group exists: rank 0 reads them where they are
        stored and every rank gets its copy; where they are not, every rank scans a 1/W share of the
        shards and all gather the results, and rank 0 stores them -- the data is scanned once)."""
        if self._index is None:
            self._index = self._prepare_index(group)
        if self._counts_units and self._units is None:
            self._units = self._prepare_units(group)
        return self._index

    def _prepare_index(self, group: Any) -> ShardIndex:
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return load_or_build(self.fs, self.urls, self.format, self.index_url, self.skip_bad)
        where = self.index_url or default_index_url(self.urls, self.format, self.skip_bad)

        def read_stored() -> str | None:
            index = load_stored(where, self.urls, self.format, self.skip_bad)
            return None if index is None else index.to_json()

        stored = self._from_rank0(group, read_stored)
        if stored is not None:
            return ShardIndex.from_json(stored, "(from rank 0)")
        entries = self._in_parallel(group, lambda shards: build_entries(self.fs, self.urls, self.format, self.skip_bad,
                                                                        shards))  # fmt: skip
        index = ShardIndex(self.format, tuple(entries), self.skip_bad)
        self._from_rank0(group, lambda: store(index, where))
        return index

    def _from_rank0(self, group: Any, work: Callable[[], Any]) -> Any:
        """``work()``'s result on rank 0, broadcast; its error raised on every rank, not only on rank 0
        while the others wait."""
        box: list[Any] = [None]
        if dist.get_rank(group) == 0:
            try:
                box[0] = work()
            except (ShardError, ValueError, TypeError, OSError) as exc:
                box[0] = exc
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _in_parallel(self, group: Any, work: Callable[[range], dict[int, Any]]) -> list[Any]:
        """``work(shards)`` for every shard, shared out: rank ``r`` of ``W`` does shards ``r, r+W, ...``
        and every rank gathers all the results, in shard order. A scan of the data -- the index's
        count, the units' -- then takes 1/W of the time it takes one rank. A failure on any rank is
        raised on every rank."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        try:
            mine: Any = work(range(rank, len(self.urls), world))
        except (ShardError, ValueError, TypeError, OSError) as exc:
            mine = exc
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, mine, group=group)
        failures = [part for part in parts if isinstance(part, BaseException)]
        if failures:
            raise failures[0]
        merged = {shard: result for part in parts for shard, result in part.items()}
        return [merged[shard] for shard in range(len(self.urls))]

    @property
    def _counts_units(self) -> bool:
        return self.filter is not None or self.pack_tokens is not None or self.skip_bad

    def _prepare_units(self, group: Any) -> RecordUnits:
        """Each record's units under this filter and transform: read from beside the index, or taken --
        each shard read once, by one rank -- and stored there; each node keeps a local copy to map."""
        where = self.index_url or default_index_url(self.urls, self.format, self.skip_bad)
        packed = self.pack_tokens is not None
        key = f"{callable_key(self.filter)}-{callable_key(self.transform) if packed else 'records'}"
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return open_units(where, *load_or_build_units(self.fs, self._index, where, key, self.filter,
                                                          self.transform, packed))  # fmt: skip
        meta = self._from_rank0(group, lambda: load_meta(self._index, where, key))
        if meta is None:
            parts = self._in_parallel(group, lambda shards: count_shards(self.fs, self._index, shards, self.filter,
                                                                         self.transform, packed))  # fmt: skip
            meta, data = assemble(self._index, key, dict(enumerate(parts)))
            self._from_rank0(group, lambda: store_units(where, meta, data))
            return open_units(where, meta, data)
        # A node without a copy (the index on rank 0's disk) gets rank 0's bytes: one broadcast, only
        # at a start where some node lacks them.
        missing = torch.tensor([local_units(where, meta) is None], dtype=torch.int64)
        dist.all_reduce(missing, op=dist.ReduceOp.MAX, group=group)
        data = self._from_rank0(group, lambda: Path(local_units(where, meta)).read_bytes()) if int(missing) else None
        return open_units(where, meta, data)

    @property
    def index(self) -> ShardIndex:
        return self.prepare() if self._index is None else self._index

    @property
    def skipped(self) -> list[dict[str, Any]]:
        """The bad records left out (``on_bad_record="skip"``): ``shard``, ``record``, ``reason``, and
        ``rest`` where the shard stops decoding there."""
        return [] if self.units is None else list(self.units.skipped)

    @property
    def units(self) -> RecordUnits | None:
        """Each record's units (with a filter or packing; ``None`` otherwise)."""
        self.prepare()
        return self._units

    @property
    def _fingerprint(self) -> str:
        # The checkpoint's name for the data: every shard's URL, size, version and record count, and
        # with a filter or packing every record's units (another tokeniser, other samples).
        if self.units is None:
            return self.index.fingerprint
        return hashlib.blake2b(f"{self.index.fingerprint}/{self.units.digest}".encode(), digest_size=16).hexdigest()

    @property
    def order_version(self) -> str:
        records = shard_order_version(self.shards_in_flight, self.chunk_records)
        return records if not self._counts_units else f"{records}/units-v1/sample={self.pack_tokens or 1}"

    def order(self, global_batch_size: int, seed: int) -> ShardOrder | UnitOrder:
        """The job's order of this source's samples (what ``run.steps()`` uses instead of a permutation)."""
        counts = [entry.records for entry in self.index.entries]
        records = ShardOrder(counts, global_batch_size, seed, shards_in_flight=self.shards_in_flight,
                             chunk_records=self.chunk_records)  # fmt: skip
        if self.units is None:
            return records
        self._unit_order = UnitOrder(records, self.units, self.pack_tokens or 1, global_batch_size)
        return self._unit_order

    def __len__(self) -> int:
        """Samples an epoch: records; kept records with a filter; tokens with packing (the cursor's unit)."""
        return self.index.records if self.units is None else self.units.total

    def locate(self, index: int) -> tuple[str, int]:
        """``(shard URL, record number in it)`` of record ``index``."""
        shard, record = self._where(index)
        return self.index.entries[shard].url, record

    def _where(self, index: int) -> tuple[int, int]:
        if not 0 <= index < self.index.records:
            raise IndexError(f"Record {index} is outside 0..{self.index.records - 1} of this source.")
        offsets = self._record_offsets()
        shard = int(np.searchsorted(offsets, index, side="right")) - 1
        return shard, index - int(offsets[shard])

    def _record_offsets(self) -> np.ndarray:
        if self._offsets is None:
            self._offsets = np.cumsum([0, *(e.records for e in self.index.entries)])
        return self._offsets

    # ---------------------------------------------------------------------------------- reading

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """The samples ``indices`` names, in order: records (each chunk they fall in read once), or with
        packing the sequences that start at those units (:meth:`UnitOrder.pieces`)."""
        if self.pack_tokens is not None:
            return self._packed(indices)
        samples = self._records(indices)
        if self._counts_units:
            for index, sample in zip(indices, samples):
                if sample is _DROPPED:
                    self._changed_units(index, 0, 1)
        return samples

    def _records(self, indices: list[int]) -> list[Any]:
        if not indices:
            return []
        wanted = np.asarray(indices, dtype=np.int64)
        if int(wanted.min()) < 0 or int(wanted.max()) >= self.index.records:
            raise IndexError(
                f"Record indices must be in 0..{self.index.records - 1}; got {int(wanted.min())}..{int(wanted.max())}."
            )
        shards = np.searchsorted(self._record_offsets(), wanted, side="right") - 1
        records = wanted - self._record_offsets()[shards]
        numbers = records // self.chunk_records
        keys = list(zip(shards.tolist(), numbers.tolist()))
        chunks = {key: self._chunk(*key) for key in dict.fromkeys(keys)}  # each chunk once, in order
        within = (records - numbers * self.chunk_records).tolist()
        return [chunks[key][r] for key, r in zip(keys, within)]

    def _chunk(self, shard: int, number: int) -> list[Any]:
        key = (shard, number)
        if key in self._chunks:
            self._chunks.move_to_end(key)
            return self._chunks[key]
        entry = self.index.entries[shard]
        first = number * self.chunk_records
        wanted = min(self.chunk_records, entry.records - first)
        reader = self._readers.pop(shard, None)
        if reader is None or reader.position > first:
            reader = self._open(shard, first)
        if reader.position < first:  # records of this shard no step of this rank needs
            reader.position += sum(1 for _ in islice(reader.records, first - reader.position))
        records = list(islice(reader.records, wanted)) if reader.position == first else []
        reader.position += len(records)
        if len(records) < wanted:
            raise ShardError(
                f"Shard {entry.url} ends at record {reader.position}, but its index counts {entry.records} "
                "records: it is truncated."
            )
        if self.transform is not None or self._counts_units:
            records = [self._transformed(r, entry.url, first + i) for i, r in enumerate(records)]
        self._readers[shard] = reader
        while len(self._readers) > 2 * self.shards_in_flight:  # a step may straddle two blocks
            self._readers.popitem(last=False)[1].records.close()
        self._chunks[key] = records
        while len(self._chunks) > 2 * self.shards_in_flight:  # two windows' chunks
            self._chunks.popitem(last=False)
        return records

    def _open(self, shard: int, first: int) -> _Reader:
        entry = self.index.entries[shard]
        path = self.fs._strip_protocol(entry.url)
        self.fs.invalidate_cache(path)  # the shard's size and version now, not as a listing cached them
        # read_records raises the ShardError of a missing shard, and of a changed one from the info its
        # open fetched anyway (no request of its own: on an object store, a HEAD per shard).
        records = read_records(self.fs, path, self.format, first, url=entry.url, skip_bad=self.skip_bad,
                               check=lambda info: check_unchanged(entry, info))  # fmt: skip
        return _Reader(records, first)

    def _packed(self, samples: list[int]) -> list[torch.Tensor]:
        # A packed sample's records depend on the order (its seed): the one order() last handed out.
        if self._unit_order is None:
            raise RuntimeError("A packed source reads samples in an order: call order(global_batch_size, seed) first.")
        pieces = [self._unit_order.pieces(sample) for sample in samples]
        records = sorted({record for sample in pieces for record, _, _ in sample})
        by_record = dict(zip(records, self._records(records)))
        counts, out = self._units.counts, []
        for sample in pieces:
            parts = []
            for record, lo, hi in sample:
                held = by_record[record]
                expected = int(counts[record])
                if held is _DROPPED or len(held) != expected:
                    self._changed_units(record, 0 if held is _DROPPED else len(held), expected)
                parts.append(held[lo:hi])
            out.append(torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False)))
        return out

    def _changed_units(self, record: int, now: int, then: int) -> None:
        url, number = self.locate(record)
        raise ShardError(
            f"Shard {url}, record {number}: the filter and transform give it {now} units now, {then} when its units "
            "were counted. The filter or transform changed since (another tokeniser, another threshold), so the "
            "counted samples are no longer these records. Keep them as they were, or start a new run, whose index "
            "counts them again (a changed function gets its own counts; delete the index's .units-* files if only "
            "its data changed)."
        )

    def _transformed(self, record: Any, url: str, position: int) -> Any:
        if self._counts_units:
            units, sample = units_of(record, self.filter, self.transform, self.pack_tokens is not None)
            return _DROPPED if units == 0 and sample is None else sample
        sample = self.transform(record)
        if sample is None:
            raise ValueError(
                f"Shards(transform=...) returned None for shard {url}, record {position}; a transform must return a "
                "sample for every record (a record to leave out is Shards(filter=...)'s to reject)."
            )
        return sample

    def close(self) -> None:
        """Close every open shard and drop the cached chunks."""
        for reader in self._readers.values():
            reader.records.close()
        self._readers.clear()
        self._chunks.clear()

    def __getstate__(self) -> dict[str, Any]:
        # Loader workers get the source without its open files and cached chunks.
        return {**self.__dict__, "_readers": OrderedDict(), "_chunks": OrderedDict()}

    def __repr__(self) -> str:
        digest = hashlib.blake2b("\0".join(self.urls).encode(), digest_size=4).hexdigest()
        return f"Shards({len(self.urls)} {self.format} shards, first {self.urls[0]!r}, list {digest})"
