"""The shard index: which shards a sharded source holds, how many records each, and which version of each.

Built once per list of shards (a pass over every shard but Parquet's, whose footers count their
rows) and stored as JSON -- at a URL the user names, or in a node-local cache keyed by the list --
so a resume reads one small file instead of rescanning the data. Each entry keeps the shard's size
and version (its ETag on an object store, its modification time on a file system): a shard that
changed since the index was built is refused when it is opened (:func:`check_unchanged`), since its
records would no longer be the ones the data order and the checkpoints count.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Iterable
from typing import Any

from elastic_ddp.checkpoint.storage import Storage
from elastic_ddp.data.shard_formats import ShardError, count_records

__all__ = [
    "INDEX_VERSION", "ShardEntry", "ShardIndex", "build_entries", "cache_dir", "check_unchanged", "default_index_url",
    "expand_urls", "load_or_build", "load_stored", "store", "version_of",
]  # fmt: skip

INDEX_VERSION = 1


@dataclass(frozen=True)
class ShardEntry:
    """One shard: its URL, its size in bytes, its version, its records (and Parquet's row groups).

    ``error`` (only where bad records are skipped): why the shard's readable records end before its
    end -- a stream that stops decoding; its ``records`` are those before the break."""

    url: str
    size: int
    version: str
    records: int
    row_groups: tuple[int, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class ShardIndex:
    """Every shard of a source, in the order the user listed them (globs sorted)."""

    format: str
    entries: tuple[ShardEntry, ...]
    skip_bad: bool = False  # counted with on_bad_record="skip": a shard's records end where it stops decoding

    @property
    def records(self) -> int:
        return sum(entry.records for entry in self.entries)

    @property
    def fingerprint(self) -> str:
        """A hash of the format and of every shard's URL, size, version and record count."""
        return hashlib.blake2b(self.to_json().encode(), digest_size=16).hexdigest()

    def to_json(self) -> str:
        entries = [{**asdict(e), "row_groups": list(e.row_groups)} for e in self.entries]
        body = {"version": INDEX_VERSION, "format": self.format, "entries": entries}
        if self.skip_bad:
            body["skip_bad"] = True
        return json.dumps(body, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> ShardIndex:
        try:
            raw = json.loads(text)
            if raw.get("version") != INDEX_VERSION:
                raise ValueError(f"index version {raw.get('version')!r}, expected {INDEX_VERSION}")
            entries = tuple(ShardEntry(**{**e, "row_groups": tuple(e["row_groups"])}) for e in raw["entries"])
            return cls(raw["format"], entries, bool(raw.get("skip_bad", False)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"The shard index {where} is not a shard index of this version: {exc}") from None


def expand_urls(urls: str | list[str], storage_options: dict[str, Any] | None = None) -> tuple[Any, list[str]]:
    """``(filesystem, URLs)``: every URL or glob expanded (a glob's matches sorted), in the order given.

    All URLs must be on one filesystem (one protocol). A glob that matches nothing, a URL that does
    not exist and a shard listed twice are errors naming it.
    """
    import fsspec

    given = [urls] if isinstance(urls, str) else list(urls)
    if not given:
        raise ValueError("Shards(urls=...) needs at least one URL or glob.")
    fs, _ = fsspec.core.url_to_fs(given[0], **(storage_options or {}))
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    found: list[str] = []
    for url in given:
        if fsspec.core.url_to_fs(url, **(storage_options or {}))[0].protocol != fs.protocol:
            raise ValueError(f"Shard URL {url!r} is on another filesystem than {given[0]!r}; all shards must share one.")
        path = fs._strip_protocol(url)
        matches = sorted(fs.glob(path)) if fsspec.core.has_magic(path) else ([path] if fs.exists(path) else [])
        if not matches:
            raise ValueError(f"Shard URL {url!r} matches no file.")
        found += matches
    shown = [p if protocol in ("file", "local") else f"{protocol}://{p}" for p in found]
    duplicates = sorted({u for u in shown if shown.count(u) > 1})
    if duplicates:
        raise ValueError(f"Shards listed more than once: {duplicates[:5]}; each shard may be listed once.")
    return fs, shown


def version_of(info: dict[str, Any]) -> str:
    """A shard's version from fsspec's ``info()``: the ETag where the store has one, else the mtime."""
    for key in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "created"):
        if info.get(key) is not None:
            return str(info[key]).strip('"')
    return ""


def check_unchanged(entry: ShardEntry, info: dict[str, Any]) -> None:
    """``ShardError`` unless the shard's size and version are still those of its index entry."""
    size, version = int(info.get("size") or 0), version_of(info)
    if (size, version) != (entry.size, entry.version):
        raise ShardError(
            f"Shard {entry.url} changed since the shard index was built: size {entry.size}, version "
            f"{entry.version!r} then; size {size}, version {version!r} now. Its records would not be the ones the "
            "data order and the checkpoints count. Restore the shard, or start a new run over the new data."
        )


def build_entries(fs: Any, urls: list[str], fmt: str, skip_bad: bool, shards: Iterable[int]) -> dict[int, ShardEntry]:
    """The index entries of shards ``shards`` (positions in ``urls``): one pass over each (Parquet: its footer)."""
    entries = {}
    for shard in shards:
        url = urls[shard]
        path = fs._strip_protocol(url)
        info = fs.info(path)
        error = ""
        try:
            records, groups = count_records(fs, path, fmt, url=url, skip_bad=skip_bad)
        except ShardError as exc:
            if not skip_bad or exc.record is None:
                raise
            records, groups, error = exc.record, [], str(exc)  # the records before the break are kept
        entries[shard] = ShardEntry(url, int(info.get("size") or 0), version_of(info), records, tuple(groups), error)
    return entries


def cache_dir() -> Path:
    """This node's cache of shard indexes and unit counts (``$XDG_CACHE_HOME/elastic_ddp``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")) / "elastic_ddp"


def default_index_url(urls: list[str], fmt: str, skip_bad: bool = False) -> str:
    """The node-local cache file of the index of this list of shards."""
    key = hashlib.blake2b(json.dumps([fmt, urls, *(["skip_bad"] if skip_bad else [])]).encode(), digest_size=12).hexdigest()
    return str(cache_dir() / "shard-index" / f"{key}.json")


def load_stored(where: str, urls: list[str], fmt: str, skip_bad: bool = False) -> ShardIndex | None:
    """The index stored at ``where`` when it is the index of exactly these shards in this format,
    counted the same way (``skip_bad``); else ``None``.

    A stored index is trusted for the record counts; each shard's size and version are checked
    against it when the shard is opened for reading (:func:`check_unchanged`)."""
    storage = Storage(where)
    if not storage.exists(where):
        return None
    index = ShardIndex.from_json(storage.read_bytes(where).decode(), where)
    if index.format == fmt and [e.url for e in index.entries] == urls and index.skip_bad == skip_bad:
        return index
    return None


def store(index: ShardIndex, where: str) -> None:
    storage = Storage(where)
    if storage.is_local:
        os.makedirs(os.path.dirname(storage.fs._strip_protocol(where)), exist_ok=True)
    storage.write_bytes_atomic(where, index.to_json().encode())


def load_or_build(fs: Any, urls: list[str], fmt: str, index_url: str | None = None, skip_bad: bool = False) -> ShardIndex:
    """The index of ``urls`` (in one process): read from ``index_url`` (default:
    :func:`default_index_url`, see :func:`load_stored`), else built and written there."""
    where = index_url or default_index_url(urls, fmt, skip_bad)
    index = load_stored(where, urls, fmt, skip_bad)
    if index is None:
        entries = build_entries(fs, urls, fmt, skip_bad, range(len(urls)))
        index = ShardIndex(fmt, tuple(entries[i] for i in range(len(urls))), skip_bad)
        store(index, where)
    return index
