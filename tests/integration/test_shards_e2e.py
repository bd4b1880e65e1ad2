"""Sharded sources end to end: ``tests/workers/shards_worker.py`` under torchrun through etcd, its shards and
its shard index in an S3 API server (moto).

* 64 JSONL.gz shards (shuffle window on): 3 ranks killed with kill -9 past the step-20 checkpoint, resumed
  on 2 ranks to step 40, then on 4 to step 60 (past the end of the first epoch): the ledger's history holds
  every record of every shard once per epoch, each step's global batch the one the order names.
* A shard replaced in the bucket after the index was built: the relaunched job ends with a message naming
  the shard, before any step trains on it, and the last committed checkpoint verifies.
"""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest

from elastic_ddp.data import DataCursor, ShardOrder, exactly_once_problems, read_ledger
from tests.helpers.job import REPO, Job, one_node_job, resumed_steps
from tests.helpers.shards import encode, record, shard_sizes, write_shards

WORKER = REPO / "tests" / "workers" / "shards_worker.py"
SHARDS, BATCH, SEED = 64, 32, 1337
SIZES = shard_sizes(SHARDS)  # 1,568 records: 49 steps an epoch


def shards_job(endpoint: str, root: Path, run_id: str, data: str, fmt: str, *, nproc: int, attempt: str,
               flags=(), env_=None) -> Job:  # fmt: skip
    extra = {"SHARDS_URL": data, "SHARDS_FORMAT": fmt, "SHARDS_INDEX": f"{data.rpartition('/')[0]}/index.json",
             **(env_ or {})}  # fmt: skip
    return one_node_job(
        endpoint, root, run_id, nproc=nproc, attempt=attempt, recipe=WORKER, extra_env=extra,
        flags=[f"--train.global_batch_size={BATCH}", f"--train.seed={SEED}", "--data.ledger=true",
               "--checkpoint.every_steps=10", *flags],
    )  # fmt: skip


def expected_order(num_steps: int) -> list[list[int]]:
    order, cursor, batches = ShardOrder(SIZES, BATCH, SEED, shards_in_flight=4, chunk_records=4), DataCursor(), []
    for _ in range(num_steps):
        indices, cursor = order.batch_at(cursor)
        batches.append(indices)
    return batches


@pytest.mark.slow
def test_jsonl_gz_shards_on_s3_killed_at_3_ranks_resumed_at_2_then_4_every_record_once_per_epoch(
    etcd_endpoint, s3_url, tmp_path
):
    data = write_shards(f"{s3_url}/corpus", "jsonl", SIZES)
    first = shards_job(etcd_endpoint, tmp_path, "sh", data, "jsonl", nproc=3, attempt="first",
                       env_={"ELASTIC_DDP_FAULT": "hang@25:rank=0:restart=0"})  # fmt: skip
    try:
        first.wait_for_commit(20, timeout=240)
        first.wait_for_step(24)
        first.nodes[0].kill()
    finally:
        first.cleanup()
    output = shards_job(etcd_endpoint, tmp_path, "sh", data, "jsonl", nproc=2, attempt="second",
                        flags=["--train.exit_at_step=40"]).finish(timeout=240)  # fmt: skip
    (resumed,) = resumed_steps(output)
    assert 20 <= resumed <= 24, output[-4000:]  # the durable checkpoint, or the memory tier's newer state
    output = shards_job(etcd_endpoint, tmp_path, "sh", data, "jsonl", nproc=4, attempt="third",
                        flags=["--train.max_steps=60"]).finish(timeout=240)  # fmt: skip
    assert resumed_steps(output) == [40], output[-4000:]
    history = read_ledger(tmp_path / "sh")
    assert not exactly_once_problems(history, sum(SIZES)), exactly_once_problems(history, sum(SIZES))
    assert [entry.all_indices for entry in history.values()] == expected_order(60)
    assert len({i for entry in history.values() for i in entry.all_indices}) == sum(SIZES)  # epoch 0: every record
    assert [entry.world_size for entry in history.values()] == [3] * resumed + [2] * (40 - resumed) + [4] * 20


@pytest.mark.slow
def test_a_shard_replaced_after_the_index_was_built_ends_the_job_naming_it_and_the_checkpoint_stays(
    etcd_endpoint, s3_url, tmp_path
):
    data = write_shards(f"{s3_url}/corpus", "jsonl", SIZES)
    shards_job(etcd_endpoint, tmp_path, "bad", data, "jsonl", nproc=3, attempt="first",
               flags=["--train.exit_at_step=10"]).finish(timeout=240)  # fmt: skip
    # The shard that holds the first record of step 11, rewritten in place (a new ETag).
    order = ShardOrder(SIZES, BATCH, SEED, shards_in_flight=4, chunk_records=4)
    first_record = order.slice_at(order.advance(DataCursor(), 10), 0, 1)[0]
    shard = next(s for s in range(SHARDS) if sum(SIZES[: s + 1]) > first_record)
    url = f"{s3_url}/corpus/part-{shard:05d}.jsonl.gz"
    with fsspec.open(url, "wb") as out:
        out.write(encode("jsonl", [record(i + 1) for i in range(sum(SIZES[:shard]), sum(SIZES[: shard + 1]))]))
    job = shards_job(etcd_endpoint, tmp_path, "bad", data, "jsonl", nproc=3, attempt="again")
    code = job.nodes[0].wait(timeout=240)
    output = job.output()
    job.cleanup()
    assert code != 0, output[-4000:]
    assert f"Shard {url} changed since the shard index was built" in output, output[-4000:]
    assert max(read_ledger(tmp_path / "bad")) == 10  # no step trained on it
    assert job.stop_and_verify_checkpoints() >= 1  # step 10's checkpoint, intact
