"""Sharded sources for the tests: JSONL(.gz), Parquet and WebDataset shards whose every record carries its
own index in the source (``id``), so a test or a worker can check it got exactly the records the order named."""

from __future__ import annotations

import gzip
import io
import json
import math
import tarfile
from typing import Any

import fsspec


def record(i: int) -> dict[str, Any]:
    x = [math.sin(i), math.cos(i), (i % 97) / 97]
    return {"id": i, "x": x, "y": 2 * x[0] - x[1] + 0.5 * x[2]}


VOCABULARY = 101  # what a packed test's model sees of a token: token % VOCABULARY


def tokens(record: dict[str, Any]) -> list[int]:
    """A record as a document of 0..5 tokens that name it (``id * 10 + t``): documents of ragged lengths,
    some empty, whose every token says which record it came from."""
    return [record["id"] * 10 + t for t in range(record["id"] % 6)]


def shard_sizes(shards: int, base: int = 20) -> list[int]:
    """Unequal shard sizes (one empty), so blocks and windows have ragged ends."""
    return [0 if s == 3 else base + (s * 7) % 11 for s in range(shards)]


def write_shards(root: str, fmt: str, sizes: list[int]) -> str:
    """Write shards ``part-00000...`` under ``root`` (a local path or an fsspec URL); returns their glob."""
    fs, path = fsspec.core.url_to_fs(root)
    fs.makedirs(path, exist_ok=True)
    first = 0
    suffix = {"jsonl": "jsonl.gz", "parquet": "parquet", "webdataset": "tar"}[fmt]
    for s, size in enumerate(sizes):
        records = [record(i) for i in range(first, first + size)]
        first += size
        with fs.open(f"{path}/part-{s:05d}.{suffix}", "wb") as out:
            out.write(encode(fmt, records))
    return f"{root}/part-*.{suffix}"


def encode(fmt: str, records: list[dict[str, Any]]) -> bytes:
    if fmt == "jsonl":
        return gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode(), mtime=0)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        sink = io.BytesIO()
        table = pa.Table.from_pylist(records, schema=pa.schema([("id", pa.int64()), ("x", pa.list_(pa.float64())),
                                                                ("y", pa.float64())]))  # fmt: skip
        pq.write_table(table, sink, row_group_size=6)
        return sink.getvalue()
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w") as tar:
        for r in records:
            for ext, data in (("json", json.dumps(r).encode()), ("cls", str(r["id"] % 3).encode())):
                info = tarfile.TarInfo(f"sample{r['id']:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return sink.getvalue()


def record_id(fmt: str, sample: dict[str, Any]) -> int:
    """The ``id`` a read sample carries, whatever its format."""
    return json.loads(sample["json"])["id"] if fmt == "webdataset" else sample["id"]
