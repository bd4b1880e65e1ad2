"""Reading the records of one shard file, in order, from a given record on: JSONL, Parquet, Arrow, WebDataset.

A *record* is what a shard holds one of: a JSONL line parsed as JSON (a dict), a Parquet or Arrow row
as a dict of its columns, a WebDataset sample (the tar members that share a key, as ``{"__key__":
key, extension: bytes, ...}``). Record ``i`` of a shard is the same record at every read, which is
what the shard index counts and the data order names.

Every failure to read is a :class:`ShardError` that names the shard and the record at which reading
stopped: a file that is missing, truncated (fewer records than its index counts), or corrupt (a
compressed stream or a file structure that does not decode, a line that is not JSON).
"""

from __future__ import annotations

import json
import tarfile
import zlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["FORMATS", "BadRecord", "ShardError", "count_records", "read_records"]

FORMATS = ("jsonl", "parquet", "arrow", "webdataset")


class ShardError(ValueError):
    """A shard could not be read as its index describes it. The message names the shard and the record.

    ``record``: where the shard stops decoding (the records before it read), when the error is one."""

    def __init__(self, message: str, record: int | None = None) -> None:
        super().__init__(message)
        self.record = record


class BadRecord:
    """A record that does not decode, read with ``skip_bad``: it counts as a record and is never a sample."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"BadRecord({self.reason!r})"


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} is not a shard format; expected one of {', '.join(FORMATS)}.")


def read_records(
    fs: Any,
    path: str,
    fmt: str,
    start: int = 0,
    url: str | None = None,
    skip_bad: bool = False,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> Iterator[Any]:
    """The records of shard ``path`` (on fsspec filesystem ``fs``) from record ``start`` to its end.

    Records before ``start`` are passed over without being parsed (Parquet: whole row groups are
    not read). JSONL is decompressed by its suffix (``.gz``, ``.zst``, ``.bz2``, ``.xz``: fsspec's
    ``compression="infer"``). ``url`` names the shard in errors (default: ``path``). With
    ``skip_bad``, a JSONL line that is not JSON is a :class:`BadRecord` instead of an error (a
    stream that stops decoding is still a ``ShardError``, its ``record`` where it stopped).
    ``check`` is called with the shard's fsspec ``info()`` once the file is open, before a record is
    read; it raises to refuse the shard.
    """
    from fsspec.compression import compr
    from fsspec.core import get_compression
    from fsspec.spec import AbstractBufferedFile

    _check_format(fmt)
    name = url or path
    position = start
    try:
        with fs.open(path, "rb") as file:
            if check is not None:
                # An object store's file made a HEAD request to open: its info is current, and s3fs
                # requires its ETag of every ranged read of the file (a shard replaced while it is
                # read fails its next read). A HEAD of our own would cost a round trip per shard
                # opened: a third of the time of reading a small shard on a loopback S3 server.
                check(file.details if isinstance(file, AbstractBufferedFile) else fs.info(path))
            if fmt == "parquet":
                yield from _parquet(file, start)
                return
            if fmt == "arrow":
                yield from _arrow(file, start)
                return
            # What fs.open(compression="infer") does, on the file opened (and closed) here.
            with compr[get_compression(path, "infer") if fmt == "jsonl" else None](file, mode="r") as stream:
                reader = _jsonl(stream, start, name, skip_bad) if fmt == "jsonl" else _webdataset(stream, start)
                for position, record in reader:
                    yield record
                    position += 1  # the record a failure of the next read is at
    except ShardError:
        raise
    except FileNotFoundError:
        raise ShardError(f"Shard {name} is missing (record {position} was to be read from it).") from None
    except (EOFError, zlib.error, tarfile.TarError, OSError, ValueError, ImportError) as exc:
        # gzip raises EOFError/BadGzipFile (an OSError) on a cut or damaged stream; pyarrow an
        # ArrowInvalid (a ValueError) or OSError; tarfile a ReadError.
        raise ShardError(
            f"Shard {name} is corrupt or truncated at record {position}: {type(exc).__name__}: {exc}", position
        ) from exc


def count_records(
    fs: Any, path: str, fmt: str, url: str | None = None, skip_bad: bool = False
) -> tuple[int, list[int]]:
    """``(records, row_groups)`` of a shard: Parquet's from its footer (the rows of each row group),
    every other format's by reading it once to the end (which also proves it decodes; ``skip_bad``
    counts a line that is not JSON as a record, see :func:`read_records`)."""
    _check_format(fmt)
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq

            with fs.open(path, "rb") as file:
                meta = pq.ParquetFile(file).metadata
                groups = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        except FileNotFoundError:
            raise ShardError(f"Shard {url or path} is missing.") from None
        except (OSError, ValueError) as exc:
            raise ShardError(f"Shard {url or path} is not a readable Parquet file: {type(exc).__name__}: {exc}") from exc
        return sum(groups), groups
    return sum(1 for _ in read_records(fs, path, fmt, url=url, skip_bad=skip_bad)), []


# The decoder json.loads uses (the default one), called without the layers json.loads puts around it.
_raw_decode = json.JSONDecoder().raw_decode


def _loads(line: bytes) -> Any:
    """``json.loads(line)``: the same value, or the same error.

    A UTF-8 line that starts with its value is decoded and scanned by json's decoder directly,
    without json.loads's encoding sniff and whitespace regexes (about half the time of parsing a
    short line); any other line (leading whitespace, a BOM or another encoding, data after the
    value, not JSON) is json.loads's to parse or refuse.
    """
    try:
        text = line.decode()
        value, end = _raw_decode(text)
    except ValueError:  # a UnicodeDecodeError or a JSONDecodeError
        return json.loads(line)
    if end < len(text) and text[end:].strip(" \t\n\r"):  # json's whitespace; anything else is "Extra data"
        return json.loads(line)
    return value


def _jsonl(file: Any, start: int, name: str, skip_bad: bool = False) -> Iterator[tuple[int, Any]]:
    # A record is a line that is not blank; blank lines (a trailing newline) count for nothing.
    position = 0
    for number, line in enumerate(file, 1):
        if not line.strip():
            continue
        if position >= start:
            try:
                record = _loads(line)
            except ValueError as exc:
                reason = f"Shard {name}, record {position} (line {number}): not valid JSON: {exc}"
                if not skip_bad:
                    raise ShardError(reason) from None
                record = BadRecord(reason)
            yield position, record
        position += 1


def _webdataset(file: Any, start: int) -> Iterator[tuple[int, Any]]:
    # WebDataset's convention: a member's key is its path up to the first dot of its file name,
    # the rest its extension; consecutive members with one key are one sample.
    position, sample = 0, None
    with tarfile.open(fileobj=file, mode="r|*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            directory, _, base = member.name.rpartition("/")
            stem, _, ext = base.partition(".")
            key = f"{directory}/{stem}" if directory else stem
            if sample is None or sample["__key__"] != key:
                if sample is not None:
                    if position >= start:
                        yield position, sample
                    position += 1
                sample = {"__key__": key}
            if position >= start:
                sample[ext] = tar.extractfile(member).read()
    if sample is not None and position >= start:
        yield position, sample


def _parquet(file: Any, start: int) -> Iterator[Any]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(file)
    first = 0
    for group in range(parquet.metadata.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if first + rows > start:  # a row group wholly before start is never read
            yield from parquet.read_row_group(group).to_pylist()[max(start - first, 0) :]
        first += rows


def _arrow(file: Any, start: int) -> Iterator[Any]:
    # Arrow IPC stream files, as Hugging Face `datasets` writes them (`*.arrow`).
    import pyarrow as pa

    first = 0
    for batch in pa.ipc.open_stream(file):
        if first + batch.num_rows > start:
            yield from batch.to_pylist()[max(start - first, 0) :]
        first += batch.num_rows
