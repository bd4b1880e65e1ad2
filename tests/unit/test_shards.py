"""Sharded sources (``elastic_ddp.data.Shards``) on local files: the order is a function of the shard index
and the cursor alone (every record once per epoch; the same global batches at any world size and after a
resume), each rank reads the records the order names, the index is built once, and bad data is a
``ShardError`` naming the shard and the record."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from elastic_ddp.data import DataCursor, ShardError, Shards, StepBatches
from elastic_ddp.data import shard_index as shard_index_module
from tests.helpers.shards import record_id, shard_sizes, write_shards

FORMATS = ["jsonl", "parquet", "webdataset"]


@pytest.fixture(autouse=True)
def _index_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def source(tmp_path, fmt: str, shards: int = 10, **options) -> Shards:
    glob = write_shards(str(tmp_path / fmt), fmt, shard_sizes(shards))
    return Shards(glob, fmt, shards_in_flight=3, shuffle_window=12, **options)


def collate(samples):
    return samples


def global_batches(data: Shards, world_size: int, steps: int, start=DataCursor(), start_step=0, batch=16):
    """Each step's global batch (the ranks' shares concatenated) and the records read for it."""
    order = data.order(batch, seed=5)
    per_rank = [
        list(StepBatches(data, order, start, rank=r, world_size=world_size, num_steps=steps, start_step=start_step,
                         micro_batch_size=4, collate_fn=collate))  # fmt: skip
        for r in range(world_size)
    ]
    indices, read = [], []
    for step in zip(*per_rank, strict=True):
        indices.append([i for b in step for i in b.rank_indices])
        read.append([record_id(data.format, s) for b in step for m in b.micro_batches for s in m.data])
    return indices, read, per_rank[0][-1].cursor_after


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_record_once_per_epoch_and_each_sample_is_the_record_named(tmp_path, fmt):
    data = source(tmp_path, fmt)
    total = len(data)
    assert total == sum(shard_sizes(10))
    indices, read, _ = global_batches(data, 3, steps=-(-2 * total // 16))
    stream = [i for step in indices for i in step]
    assert indices == read  # each sample is the record its index names
    assert sorted(stream[:total]) == list(range(total))
    assert sorted(stream[total : 2 * total]) == list(range(total))
    assert stream[:total] != stream[total : 2 * total]  # another order each epoch
    assert stream[:total] != sorted(stream[:total])  # shuffled


def test_the_global_batches_do_not_depend_on_the_world_size_or_a_resume(tmp_path):
    data = source(tmp_path, "jsonl")
    at3, _, _ = global_batches(data, 3, steps=30)
    at2, _, cut = global_batches(data, 2, steps=11)
    at4, read4, _ = global_batches(data, 4, steps=19, start=cut, start_step=11)
    assert at2 + at4 == at3
    assert at4 == read4


def test_a_window_mixes_the_shards_in_flight(tmp_path):
    data = source(tmp_path, "jsonl")
    order = data.order(16, seed=5)
    first_window = order.slice_at(DataCursor(), 0, 12)
    assert len({data.locate(i)[0] for i in first_window}) == 3


def test_the_index_is_built_once_and_stored(tmp_path, monkeypatch):
    data = source(tmp_path, "jsonl")
    assert len(data) > 0
    monkeypatch.setattr(shard_index_module, "count_records", lambda *a, **k: pytest.fail("the data was rescanned"))
    again = Shards(data.urls, "jsonl", shards_in_flight=3, shuffle_window=12)
    assert len(again) == len(data) and again._fingerprint == data._fingerprint


def test_an_explicit_index_url_is_where_the_index_goes(tmp_path):
    data = source(tmp_path, "parquet", index_url=str(tmp_path / "idx" / "corpus.json"))
    assert len(data) == sum(shard_sizes(10))
    stored = json.loads((tmp_path / "idx" / "corpus.json").read_text())
    assert [e["records"] for e in stored["entries"]] == shard_sizes(10)
    assert all(sum(e["row_groups"]) == e["records"] for e in stored["entries"])


def read_all(data: Shards) -> None:
    data.__getitems__(list(range(len(data))))


def test_a_corrupt_line_names_the_shard_and_the_record(tmp_path):
    data = source(tmp_path, "jsonl")
    url, _ = data.locate(30)
    path = url
    lines = gzip.decompress(open(path, "rb").read()).decode().splitlines()
    lines[4] = '{"id": 1, "x": [1, 2'
    open(path, "wb").write(gzip.compress(("\n".join(lines) + "\n").encode()))
    fresh = Shards(data.urls, "jsonl", shards_in_flight=3, shuffle_window=12, index_url=str(tmp_path / "rebuilt.json"))
    with pytest.raises(ShardError, match=rf"Shard {path}, record 4 \(line 5\): not valid JSON"):
        len(fresh)  # building the index reads every record


def test_a_truncated_shard_is_an_error_naming_it_and_the_record(tmp_path):
    data = source(tmp_path, "jsonl")
    len(data)
    url, _ = data.locate(30)
    _replace_keeping_version(url, open(url, "rb").read()[:-20])
    # gzip hands out the cut last line before it sees the stream end early: that line is not JSON.
    with pytest.raises(ShardError, match=rf"Shard {url}(, record \d+ \(line \d+\): not valid JSON| is corrupt or truncated at record \d+)"):
        read_all(data)


def test_a_truncated_tar_is_an_error_naming_it(tmp_path):
    data = source(tmp_path, "webdataset")
    len(data)
    url, _ = data.locate(30)
    _replace_keeping_version(url, open(url, "rb").read()[:3000])
    with pytest.raises(ShardError, match=rf"Shard {url} (is corrupt or truncated at record \d+|ends at record \d+)"):
        read_all(data)


def test_a_changed_shard_is_refused(tmp_path):
    data = source(tmp_path, "parquet")
    len(data)
    url, _ = data.locate(30)
    with open(url, "ab") as f:
        f.write(b"more")
    with pytest.raises(ShardError, match=rf"Shard {url} changed since the shard index was built: size \d+"):
        read_all(data)


def test_a_missing_shard_is_an_error_naming_it(tmp_path):
    data = source(tmp_path, "webdataset")
    len(data)
    url, _ = data.locate(30)
    os.unlink(url)
    with pytest.raises(ShardError, match=rf"Shard {url} is missing \(record 0 was to be read from it\)"):
        read_all(data)


def test_a_glob_that_matches_nothing_and_a_bad_format_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"matches no file"):
        Shards(str(tmp_path / "none-*.jsonl"))
    with pytest.raises(ValueError, match=r"format='csv'"):
        Shards(str(tmp_path / "x"), "csv")


def test_a_transform_applies_to_each_record_and_must_not_filter(tmp_path):
    data = source(tmp_path, "jsonl", transform=lambda r: r["id"] * 10)
    assert data.__getitems__([5, 0]) == [50, 0]
    dropping = Shards(data.urls, "jsonl", transform=lambda r: None)
    with pytest.raises(ValueError, match=r"returned None for shard .*part-00000.jsonl.gz, record 0"):
        dropping[0]


def test_a_hugging_face_streaming_dataset_over_parquet_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    glob = write_shards(str(tmp_path / "hf"), "parquet", shard_sizes(6))
    stream = datasets.load_dataset("parquet", data_files=glob, split="train", streaming=True)
    data = Shards.from_hf(stream, shards_in_flight=2, shuffle_window=8)
    assert len(data) == sum(shard_sizes(6)) and data.format == "parquet"
    assert [r["id"] for r in data.__getitems__(list(range(len(data))))] == list(range(len(data)))
    with pytest.raises(TypeError, match=r"a map, filter, shuffle or take"):
        Shards.from_hf(stream.map(lambda r: r))


def _replace_keeping_version(path: str, data: bytes) -> None:
    # A shard damaged in place after the index was built, its size and mtime as the index has them
    # (what a torn upload over an object of the same ETag cannot give, but a disk can).
    stat = os.stat(path)
    padded = data + b"\0" * (stat.st_size - len(data))
    with open(path, "wb") as f:
        f.write(padded)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
