"""Sharded sources end to end: ``tests/workers/shards_worker.py`` under torchrun through etcd, its shards and
its shard index in an S3 API server (moto).

* 64 shards -- JSONL.gz, Parquet, WebDataset on S3, a Hugging Face streaming dataset over Parquet files --
  packed into sequences of 8 tokens (shuffle window on): 3 ranks killed with kill -9 past
  the step-20 checkpoint, resumed on 3 ranks to step 30 (each step's loss the uninterrupted run's), on 2 to
  step 45, then on 4 to step 60 (past the end of the first epoch): every step trained on the uninterrupted
  run's sequences, and the ledger's sequences cover every token of every record once in the first epoch.
  The uninterrupted run reads the JSONL copy, once for all four: every format trains on the same
  sequences with the same losses.
* A record that does not decode, skipped on request (``on_bad_record="skip"``): never trained on, every other
  record once an epoch, and the skip in the job's log, the ledger and TensorBoard's events.
* A shard overwritten by a corrupt copy in the bucket after the index was built: the relaunched job ends
  with a message naming the shard, before any step trains on it, and the last committed checkpoint verifies.
"""

from __future__ import annotations

import gzip
import json
import uuid
from pathlib import Path

import fsspec
import pytest

from elastic_ddp.data import DataCursor, ShardOrder, Shards, read_ledger, read_skipped
from tests.fixtures.s3 import BUCKET
from tests.helpers.job import REPO, Job, one_node_job, resumed_steps
from tests.helpers.shards import encode, record, record_id, shard_sizes, tokens, write_shards
from tests.unit.test_metrics import texts

WORKER = REPO / "tests" / "workers" / "shards_worker.py"
SHARDS, BATCH, SEED, PACK, STEPS = 64, 32, 1337, 8, 60
SIZES = shard_sizes(SHARDS)  # 1,568 records: 49 steps an epoch; packed, 3,916 tokens: 15.3 steps an epoch


def shards_job(endpoint: str, root: Path, run_id: str, data: str, fmt: str, *, nproc: int, attempt: str,
               flags=(), env_=None) -> Job:  # fmt: skip
    extra = {"SHARDS_URL": data, "SHARDS_FORMAT": fmt, "SHARDS_INDEX": f"{data.rpartition('/')[0]}/index.json",
             **(env_ or {})}  # fmt: skip
    return one_node_job(
        endpoint, root, run_id, nproc=nproc, attempt=attempt, recipe=WORKER, extra_env=extra,
        flags=[f"--train.global_batch_size={BATCH}", f"--train.seed={SEED}", "--data.ledger=true",
               "--checkpoint.every_steps=10", *flags],
    )  # fmt: skip


PACKED = {"SHARDS_PACK": str(PACK)}


@pytest.fixture(scope="module")
def uninterrupted(etcd_server, s3_server, tmp_path_factory):
    """The ledger of an uninterrupted packed run over the JSONL copy on the S3 API server."""
    root = tmp_path_factory.mktemp("uninterrupted")
    data = write_shards(f"s3://{BUCKET}/{uuid.uuid4().hex}/corpus", "jsonl", SIZES)
    whole = shards_job(etcd_server.endpoint, root, "whole", data, "jsonl", nproc=3, attempt="whole",
                       flags=[f"--train.max_steps={STEPS}"], env_=PACKED).finish(timeout=240)  # fmt: skip
    assert "Checkpoint committed" in whole
    return read_ledger(root / "whole")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "webdataset", "hf-parquet"])
def test_packed_shards_killed_at_3_ranks_resumed_at_3_then_2_then_4_every_token_once_per_epoch(
    etcd_endpoint, s3_url, tmp_path, fmt, uninterrupted
):
    # On the S3 API server; a Hugging Face streaming dataset over local Parquet files.
    files = "parquet" if fmt == "hf-parquet" else fmt
    data = write_shards(str(tmp_path / "corpus") if fmt == "hf-parquet" else f"{s3_url}/corpus", files, SIZES)
    first = shards_job(etcd_endpoint, tmp_path, "sh", data, fmt, nproc=3, attempt="first",
                       env_={**PACKED, "ELASTIC_DDP_FAULT": "hang@25:rank=0:restart=0"})  # fmt: skip
    try:
        first.wait_for_commit(20, timeout=240)
        first.wait_for_step(24)
        first.nodes[0].kill()  # kill -9 of the agent and its workers
    finally:
        first.cleanup()
    # The same size: the resumed steps' losses are the uninterrupted run's, bit for bit.
    output = shards_job(etcd_endpoint, tmp_path, "sh", data, fmt, nproc=3, attempt="second",
                        flags=["--train.exit_at_step=30"], env_=PACKED).finish(timeout=240)  # fmt: skip
    (resumed,) = resumed_steps(output)
    assert 20 <= resumed <= 24, output[-4000:]
    output = shards_job(etcd_endpoint, tmp_path, "sh", data, fmt, nproc=2, attempt="third",
                        flags=["--train.exit_at_step=45"], env_=PACKED).finish(timeout=240)  # fmt: skip
    assert resumed_steps(output) == [30], output[-4000:]
    output = shards_job(etcd_endpoint, tmp_path, "sh", data, fmt, nproc=4, attempt="fourth",
                        flags=[f"--train.max_steps={STEPS}"], env_=PACKED).finish(timeout=240)  # fmt: skip
    assert resumed_steps(output) == [45], output[-4000:]
    history, reference = read_ledger(tmp_path / "sh"), uninterrupted
    assert [entry.world_size for entry in history.values()] == [3] * 30 + [2] * 15 + [4] * (STEPS - 45)
    # Every step trained on the sequences of the uninterrupted run, at 3, 2 and 4 ranks alike.
    assert [e.all_indices for e in history.values()] == [e.all_indices for e in reference.values()]
    assert [e.loss for e in history.values()][:30] == [e.loss for e in reference.values()][:30]
    # Exactly once: the sequences run on without a gap, and cover every token of every record once an epoch.
    starts = [i for entry in history.values() for i in entry.all_indices]
    assert starts == list(range(0, STEPS * BATCH * PACK, PACK))
    source = Shards(data, files, shards_in_flight=4, shuffle_window=16, pack_tokens=PACK,
                    transform=lambda r: tokens({"id": record_id(files, r)}), index_url=str(tmp_path / "audit.json"))  # fmt: skip
    order, per_epoch = source.order(BATCH, SEED), len(source)
    stream = [record_index * 10 + t for start in starts for record_index, lo, hi in order.pieces(start) for t in range(lo, hi)]
    every_token = sorted(t for i in range(sum(SIZES)) for t in tokens(record(i)))
    assert len(every_token) == per_epoch and len(stream) > 3 * per_epoch
    for epoch in range(3):  # every token of every record once an epoch
        assert sorted(stream[epoch * per_epoch : (epoch + 1) * per_epoch]) == every_token, epoch


@pytest.mark.slow
def test_a_shard_corrupted_after_the_index_was_built_ends_the_job_naming_it_and_the_checkpoint_stays(
    etcd_endpoint, s3_url, tmp_path
):
    data = write_shards(f"{s3_url}/corpus", "jsonl", SIZES)
    shards_job(etcd_endpoint, tmp_path, "bad", data, "jsonl", nproc=3, attempt="first",
               flags=["--train.exit_at_step=10"]).finish(timeout=240)  # fmt: skip
    # The shard that holds the first record of step 11, overwritten by a cut (corrupt) copy: a new ETag.
    order = ShardOrder(SIZES, BATCH, SEED, shards_in_flight=4, chunk_records=4)
    first_record = order.slice_at(order.advance(DataCursor(), 10), 0, 1)[0]
    shard = next(s for s in range(SHARDS) if sum(SIZES[: s + 1]) > first_record)
    url = f"{s3_url}/corpus/part-{shard:05d}.jsonl.gz"
    with fsspec.open(url, "wb") as out:
        out.write(encode("jsonl", [record(i) for i in range(sum(SIZES[:shard]), sum(SIZES[: shard + 1]))])[:-25])
    job = shards_job(etcd_endpoint, tmp_path, "bad", data, "jsonl", nproc=3, attempt="again")
    code = job.nodes[0].wait(timeout=240)
    output = job.output()
    job.cleanup()
    assert code != 0, output[-4000:]
    assert f"Shard {url} changed since the shard index was built" in output, output[-4000:]
    assert max(read_ledger(tmp_path / "bad")) == 10  # no step trained on it
    assert job.stop_and_verify_checkpoints() >= 1  # step 10's checkpoint, intact


@pytest.mark.slow
def test_a_bad_record_skipped_on_request_is_reported_in_the_log_the_ledger_and_tensorboard(
    etcd_endpoint, s3_url, tmp_path
):
    data = write_shards(f"{s3_url}/corpus", "jsonl", SIZES)
    url = f"{s3_url}/corpus/part-00005.jsonl.gz"
    first = sum(SIZES[:5])
    lines = [json.dumps(record(i)) for i in range(first, first + SIZES[5])]
    lines[2] = '{"id": 3, "x": [1'  # record 2 of shard 5 does not decode
    with fsspec.open(url, "wb") as out:
        out.write(gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0))
    job = shards_job(etcd_endpoint, tmp_path, "skip", data, "jsonl", nproc=3, attempt="first",
                     flags=["--train.max_steps=50"], env_={"SHARDS_BAD": "skip"})  # fmt: skip
    output = job.finish(timeout=240)
    assert "The sharded source skips 1 bad record(s)" in output and f"Shard {url}, record 2 (line 3)" in output
    [skipped] = read_skipped(tmp_path / "skip")
    assert (skipped["shard"], skipped["record"]) == (url, 2)
    history = read_ledger(tmp_path / "skip")
    consumed = [i for entry in history.values() for i in entry.all_indices]
    per_epoch = sum(SIZES) - 1
    assert len(consumed) > per_epoch and first + 2 not in consumed
    assert sorted(consumed[:per_epoch]) == [i for i in range(sum(SIZES)) if i != first + 2]
    events = [text for _, text in texts(tmp_path / "skip" / "tensorboard", "events")]
    assert any("skips 1 bad record(s)" in text for text in events), events
