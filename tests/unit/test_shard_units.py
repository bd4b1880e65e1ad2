"""Filtered and packed sharded sources (``Shards(filter=..., pack_tokens=...)``): the samples are a function of the
shard index, the seed and the cursor alone. Every kept record once per epoch; every token of every kept document
once per epoch, in the data order, cut every ``pack_tokens``; the same global batches at any world size and after
a resume; each record's units counted once; a transform or filter that changed since is an error naming the record."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from elastic_ddp.data import DataCursor, ShardError, ShardOrder, Shards, StepBatches
from elastic_ddp.data import shard_units as shard_units_module
from tests.helpers.ranks import run_ranks
from tests.helpers.shards import record_id, shard_sizes, tokens, write_shards

SEED, BATCH, LENGTH = 5, 6, 7


@pytest.fixture(autouse=True)
def _index_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def odd(record: dict) -> bool:
    return record["id"] % 2 == 1


def source(tmp_path, fmt="jsonl", **options) -> Shards:
    glob = write_shards(str(tmp_path / fmt), fmt, shard_sizes(10))
    return Shards(glob, fmt, shards_in_flight=3, shuffle_window=12, **options)


def record_order(data: Shards, epoch: int) -> list[int]:
    """Every record of ``epoch`` in the data order, filtered or not (the order of records the units follow)."""
    counts = [entry.records for entry in data.index.entries]
    return ShardOrder(counts, BATCH, SEED, shards_in_flight=3, chunk_records=data.chunk_records).permutation(epoch)


def run_steps(data: Shards, world_size: int, steps: int, start=DataCursor(), start_step=0):
    """Each step's global batch of samples (the ranks' shares concatenated) and the cursor after."""
    order = data.order(BATCH, seed=SEED)
    per_rank = [
        list(StepBatches(data, order, start, rank=r, world_size=world_size, num_steps=steps, start_step=start_step,
                         micro_batch_size=2, collate_fn=lambda samples: samples))  # fmt: skip
        for r in range(world_size)
    ]
    batches = [[s for b in step for m in b.micro_batches for s in m.data] for step in zip(*per_rank, strict=True)]
    return batches, per_rank[0][-1].cursor_after


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "webdataset"])
def test_packed_samples_are_the_documents_of_the_data_order_cut_every_pack_tokens(tmp_path, fmt):
    data = source(tmp_path, fmt, transform=lambda r: tokens({"id": record_id(fmt, r)}), pack_tokens=LENGTH)
    total = sum(len(tokens({"id": i})) for i in range(data.index.records))
    assert len(data) == total  # the cursor's unit: tokens an epoch
    steps = -(-2 * total // (BATCH * LENGTH)) + 1  # past the end of the second epoch
    batches, _ = run_steps(data, 3, steps)
    stream = [t for e in range(3) for i in record_order(data, e) for t in tokens({"id": i})]
    produced = torch.cat([s for batch in batches for s in batch]).tolist()
    assert all(s.dtype == torch.long and s.shape == (LENGTH,) for batch in batches for s in batch)
    assert produced == stream[: len(produced)]
    # Each epoch: every token of every document once (a sequence may straddle two epochs).
    assert sorted(produced[:total]) == sorted(stream[:total]) and len(set(produced[:total])) == total


def test_packed_batches_do_not_depend_on_the_world_size_or_a_resume(tmp_path):
    data = source(tmp_path, transform=tokens, pack_tokens=LENGTH)
    at3, _ = run_steps(data, 3, 40)
    at2, cut = run_steps(data, 2, 13)
    resumed = Shards(data.urls, "jsonl", shards_in_flight=3, shuffle_window=12, transform=tokens, pack_tokens=LENGTH)
    at4, _ = run_steps(resumed, 4, 27, start=cut, start_step=13)
    flat = lambda batches: [s.tolist() for batch in batches for s in batch]  # noqa: E731
    assert flat(at2) + flat(at4) == flat(at3)
    # The carry-over: a document cut at a step's end goes on in the next step's first sample.
    assert cut.consumed % LENGTH == 0 and cut.consumed == 13 * BATCH * LENGTH % len(data)


def test_a_filter_leaves_out_the_records_it_rejects_and_keeps_the_order_of_the_rest(tmp_path):
    data = source(tmp_path, filter=odd)
    kept = [i for i in range(data.index.records) if i % 2 == 1]
    assert len(data) == len(kept)
    batches, _ = run_steps(data, 3, -(-2 * len(kept) // BATCH))
    ids = [s["id"] for batch in batches for s in batch]
    expected = [i for e in range(3) for i in record_order(data, e) if i % 2 == 1]
    assert ids == expected[: len(ids)]
    assert sorted(ids[: len(kept)]) == kept
    order = data.order(BATCH, seed=SEED)
    assert order.slice_at(DataCursor(), 0, BATCH) == ids[:BATCH]  # the ledger's indices are the records'


def test_units_are_counted_once_and_a_changed_function_counts_them_again(tmp_path, monkeypatch):
    data = source(tmp_path, transform=tokens, pack_tokens=LENGTH)
    assert len(data) > 0
    taken = []
    real = shard_units_module.count_shards
    monkeypatch.setattr(shard_units_module, "count_shards", lambda *a, **k: taken.append(1) or real(*a, **k))
    again = Shards(data.urls, "jsonl", shards_in_flight=3, shuffle_window=12, transform=tokens, pack_tokens=LENGTH)
    assert len(again) == len(data) and again._fingerprint == data._fingerprint and not taken

    def longer(record):
        return tokens(record) + [0]

    other = Shards(data.urls, "jsonl", shards_in_flight=3, shuffle_window=12, transform=longer, pack_tokens=LENGTH)
    assert len(other) == len(data) + data.index.records and taken == [1]
    assert other._fingerprint != data._fingerprint and other.index.fingerprint == data.index.fingerprint
    # A checkpoint names the kind of samples its cursor counts: records, kept records or tokens.
    plain = Shards(data.urls, "jsonl", shards_in_flight=3, shuffle_window=12)
    filtered = Shards(data.urls, "jsonl", shards_in_flight=3, shuffle_window=12, filter=odd)
    assert len({plain.order_version, filtered.order_version, data.order_version}) == 3


def test_a_tokeniser_that_changed_since_the_units_were_counted_is_an_error_naming_the_record(tmp_path):
    vocabulary = {"extra": 0}

    def tokenise(record):
        return tokens(record) + [0] * vocabulary["extra"]

    data = source(tmp_path, transform=tokenise, pack_tokens=LENGTH)
    len(data)
    vocabulary["extra"] = 1  # what the cache key cannot see: a tokeniser object's state
    again = Shards(data.urls, "jsonl", shards_in_flight=3, shuffle_window=12, transform=tokenise, pack_tokens=LENGTH)
    order = again.order(BATCH, seed=SEED)
    with pytest.raises(ShardError, match=r"Shard .*part-\d+\.jsonl\.gz, record \d+: the filter and transform give it \d+ units now"):
        again.__getitems__(order.slice_at(DataCursor(), 0, BATCH))


def test_packing_needs_a_transform_that_returns_token_ids(tmp_path):
    with pytest.raises(ValueError, match=r"pack_tokens=\.\.\.\) needs transform="):
        source(tmp_path, pack_tokens=8)
    with pytest.raises(ValueError, match=r"pack_tokens=0"):
        source(tmp_path, transform=tokens, pack_tokens=0)
    with pytest.raises(ShardError, match=r"record 0: the source's filter or transform failed on it: TypeError: .*one-dimensional"):
        len(source(tmp_path, transform=lambda r: [[1, 2]], pack_tokens=8))


def _rewrite(path: str, lines: list[str], cut: int = 0) -> None:
    data = gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0)
    open(path, "wb").write(data[: len(data) - cut] if cut else data)


def test_skipping_bad_records_leaves_out_a_line_that_is_not_json_and_names_it(tmp_path):
    plain = source(tmp_path)
    url, _ = plain.locate(30)
    lines = gzip.decompress(open(url, "rb").read()).decode().splitlines()
    bad_id = json.loads(lines[4])["id"]
    lines[4] = '{"id": 1, "x": [1, 2'
    _rewrite(url, lines)
    with pytest.raises(ShardError, match=r"record 4 \(line 5\): not valid JSON"):
        len(Shards(plain.urls, "jsonl", shards_in_flight=3, shuffle_window=12, index_url=str(tmp_path / "strict.json")))
    data = Shards(plain.urls, "jsonl", shards_in_flight=3, shuffle_window=12, on_bad_record="skip")
    assert len(data) == plain.index.records - 1
    assert [(s["shard"], s["record"]) for s in data.skipped] == [(url, 4)] and "not valid JSON" in data.skipped[0]["reason"]
    batches, _ = run_steps(data, 3, -(-len(data) // BATCH))
    ids = [s["id"] for batch in batches for s in batch][: len(data)]
    assert sorted(ids) == [i for i in range(plain.index.records) if i != bad_id]


def test_skipping_bad_records_keeps_a_cut_shard_up_to_its_break(tmp_path):
    plain = source(tmp_path)
    url, _ = plain.locate(30)
    lines = gzip.decompress(open(url, "rb").read()).decode().splitlines()
    _rewrite(url, lines, cut=40)
    data = Shards(plain.urls, "jsonl", shards_in_flight=3, shuffle_window=12, on_bad_record="skip")
    rest = [s for s in data.skipped if s.get("rest")]
    assert len(rest) == 1 and rest[0]["shard"] == url and "corrupt or truncated" in rest[0]["reason"]
    kept = next(e.records for e in data.index.entries if e.url == url)
    assert 0 < kept < len(lines) and len(data) == plain.index.records - len(lines) + kept - (len(data.skipped) - 1)
    batches, _ = run_steps(data, 2, -(-len(data) // BATCH))
    ids = [s["id"] for batch in batches for s in batch][: len(data)]
    assert len(set(ids)) == len(data)  # every kept record once, none of the cut shard's lost tail
    # A shard changed since the index is still an error, skipping or not.
    with open(plain.urls[0], "ab") as f:
        f.write(b"more")
    again = Shards(plain.urls, "jsonl", shards_in_flight=3, shuffle_window=12, on_bad_record="skip")
    with pytest.raises(ShardError, match=r"changed since the shard index was built"):
        run_steps(again, 1, -(-len(data) // BATCH))


PARALLEL_SCRIPT = """
    import json, sys
    sys.path.insert(0, sys.argv[6])  # the repository, for tests.helpers
    import torch.distributed as dist
    from elastic_ddp.data import Shards
    from elastic_ddp.data import shard_formats
    from tests.helpers.shards import tokens

    rank, store, glob, index, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", store=dist.FileStore(store, 3), rank=rank, world_size=3)
    opened = []
    real = shard_formats.read_records
    def counting(fs, path, *args, **kwargs):
        opened.append(path)
        return real(fs, path, *args, **kwargs)
    shard_formats.read_records = counting
    import elastic_ddp.data.shard_units as units_module
    units_module.read_records = counting
    data = Shards(glob, "jsonl", shards_in_flight=3, shuffle_window=12, transform=tokens, pack_tokens=7, index_url=index)
    data.prepare()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"opened": opened, "index": data.index.to_json(), "units": data.units.counts.tolist(),
                   "fingerprint": data._fingerprint}, f)
    dist.destroy_process_group()
"""


def test_ranks_build_the_index_and_the_units_in_parallel_each_shard_scanned_once(tmp_path):
    glob = write_shards(str(tmp_path / "jsonl"), "jsonl", shard_sizes(10))
    index, out = str(tmp_path / "idx" / "index.json"), str(tmp_path / "out")
    repo = str(Path(__file__).resolve().parents[2])
    run_ranks(tmp_path, PARALLEL_SCRIPT, 3, glob, index, out, repo)
    results = [json.loads(open(f"{out}.{rank}").read()) for rank in range(3)]
    alone = Shards(glob, "jsonl", shards_in_flight=3, shuffle_window=12, transform=tokens, pack_tokens=7,
                   index_url=str(tmp_path / "alone.json"))  # fmt: skip
    assert all(r["index"] == alone.index.to_json() for r in results)  # what one process builds
    assert all(r["units"] == alone.units.counts.tolist() and r["fingerprint"] == alone._fingerprint for r in results)
    # Each shard read twice in all (the index's count, then the units'), by one rank: 1/3 of the scan each.
    opened = [path for r in results for path in r["opened"]]
    assert sorted(opened) == sorted(2 * [path for path in alone.urls])
    assert all(len(r["opened"]) < len(opened) for r in results)
    # Stored: the next start reads them and scans nothing.
    run_ranks(tmp_path, PARALLEL_SCRIPT, 3, glob, index, out, repo)
    assert all(json.loads(open(f"{out}.{rank}").read())["opened"] == [] for rank in range(3))


def test_packed_samples_are_the_same_read_by_loader_workers(tmp_path):
    data = source(tmp_path, transform=tokens, pack_tokens=LENGTH)
    order = data.order(BATCH, seed=SEED)
    in_process = [s.tolist() for s in data.__getitems__(order.slice_at(DataCursor(), 0, BATCH))]
    workers = list(StepBatches(data, order, DataCursor(), rank=0, world_size=1, num_steps=1, micro_batch_size=BATCH,
                               num_workers=2, collate_fn=lambda samples: samples))  # fmt: skip
    assert [s.tolist() for m in workers[0].micro_batches for s in m.data] == in_process


def test_a_filter_that_keeps_nothing_is_refused_with_what_to_do(tmp_path):
    data = source(tmp_path, filter=lambda record: False)
    with pytest.raises(ValueError, match=r"holds 0 units an epoch .* nothing to train on"):
        data.order(BATCH, seed=SEED)


def test_counts_stored_beside_a_remote_index_are_fetched_by_a_node_without_them(tmp_path, monkeypatch):
    index_url = f"memory://units-{tmp_path.name}/index.json"  # an index store other than this node's disk
    data = source(tmp_path, filter=odd, index_url=index_url)
    kept = len(data)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "another-node"))
    taken = []
    real = shard_units_module.count_shards
    monkeypatch.setattr(shard_units_module, "count_shards", lambda *a, **k: taken.append(1) or real(*a, **k))
    again = Shards(data.urls, "jsonl", shards_in_flight=3, shuffle_window=12, filter=odd, index_url=index_url)
    assert len(again) == kept and not taken
    assert again.units.path.startswith(str(tmp_path / "another-node"))
