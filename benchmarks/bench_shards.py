"""Sharded sources: ``edp.Shards`` read in its shuffled, resumable order vs a plain sequential reader.

The same JSONL.gz shards, on local disk and then on a loopback S3 server (moto, through s3fs). The
plain reader is what a script does without this package: each shard in turn, opened with fsspec,
decompressed, every line parsed with ``json.loads``. ``Shards`` reads the records of whole global
batches in its order (a seeded permutation of the shards, blocks of ``shards_in_flight`` shards, a
shuffle window over each block), as one rank of a one-rank job does: every record once. Its shard
index is built before the timing (it is built once per dataset; its cost is its own row); loading the
stored index is timed. Both sides parse every line with the standard library's JSON decoder into the
same values: ``Shards`` calls the decoder without ``json.loads``'s per-call encoding sniff, which is
part of why it can pass the plain reader. Both make one HEAD and one GET per shard on S3.
"""

from __future__ import annotations

import json
import time

import fsspec

from benchmarks.bench_checkpoint import on_s3
from benchmarks.common import Context, Result, Target, alternate, ratios, row
from tests.helpers.shards import encode

NAME = "shards"
TITLE = "Sharded source (edp.Shards, shuffled and resumable) vs a plain sequential reader of the same JSONL.gz shards"


def _write(root: str, shards: int, records: int) -> str:
    fs, path = fsspec.core.url_to_fs(root)
    fs.makedirs(path, exist_ok=True)
    for s in range(shards):
        rows = [{"id": s * records + i, "text": f"document {s}/{i} " + "lorem ipsum " * 20} for i in range(records)]
        with fs.open(f"{path}/part-{s:05d}.jsonl.gz", "wb") as out:
            out.write(encode("jsonl", rows))
    return f"{root}/part-*.jsonl.gz"


def _plain(glob: str) -> dict[str, float]:
    fs, _ = fsspec.core.url_to_fs(glob)
    start, count = time.perf_counter(), 0
    for path in sorted(fs.glob(fs._strip_protocol(glob))):
        with fs.open(path, "rb", compression="infer") as lines:
            for line in lines:
                json.loads(line)
                count += 1
    return {"records_per_s": count / (time.perf_counter() - start)}


def _shards(glob: str, index_url: str, batch: int) -> dict[str, float]:
    from elastic_ddp.data import DataCursor, Shards

    start = time.perf_counter()
    data = Shards(glob, "jsonl", shards_in_flight=8, shuffle_window=1024, index_url=index_url)
    order, cursor, count = data.order(batch, seed=1), DataCursor(), 0
    while count < len(data):
        count += len(data.__getitems__(order.slice_at(cursor, 0, batch)))
        cursor = order.advance(cursor, 1)
    data.close()
    return {"records_per_s": count / (time.perf_counter() - start)}


def _measure(ctx: Context, glob: str, index_url: str) -> tuple[dict, float]:
    from elastic_ddp.data import Shards

    start = time.perf_counter()
    Shards(glob, "jsonl", index_url=index_url).prepare()
    index_s = time.perf_counter() - start
    measured = alternate({"plain": lambda i: _plain(glob), "shards": lambda i: _shards(glob, index_url, 256)}, ctx.repeats)
    return measured, index_s


def run(ctx: Context) -> Result:
    shards, records = (8, 500) if ctx.smoke else (64, 4000)
    local_root = str(ctx.scratch("shards"))
    local, local_index = _measure(ctx, _write(local_root, shards, records), f"{local_root}/index.json")
    s3, s3_index = on_s3(lambda root, env: _measure(ctx, _write(root, shards, records), f"{root}/index.json"))
    rows = []
    for where, measured, index_s in (("local disk", local, local_index), ("S3 (moto)", s3, s3_index)):
        plain, ours = measured["plain"]["records_per_s"], measured["shards"]["records_per_s"]
        rows += [
            row(f"{where}: plain sequential reader", plain, "records/s"),
            row(f"{where}: edp.Shards in its order", ours, "records/s"),
            row(f"{where}: edp.Shards / plain", ratios(ours, plain), "ratio", Target(">=", 0.9, "≥ 0.9")),
            row(f"{where}: building the shard index (once per dataset)", [index_s], "s"),
        ]
    return Result(
        NAME, TITLE,
        params={"shards": shards, "records_per_shard": records, "global_batch_size": 256, "shards_in_flight": 8,
                "shuffle_window": 1024, "repeats": ctx.repeats},
        samples={"local": local, "s3": s3},
        rows=rows,
        notes=["One process reads every record once (a one-rank job): the shuffled order costs what it adds "
               "to a sequential read. At W ranks each rank reads the chunks that hold its records (docs/data.md).",
               "Both parse every line with Python's json decoder (the same values); Shards skips json.loads's per-call "
               "encoding sniff and whitespace regexes, so a ratio above 1 is a faster parse, not skipped work."],
    )  # fmt: skip
