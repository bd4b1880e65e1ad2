"""A script in the shape of docs/your-model.md's skeleton (tests/workers/regression_skeleton.py: a
regression MLP, Adam, LambdaLR -- unlike both recipes) gets the guarantees under real torchrun:

* ``torchrun --standalone``: it trains, and the same command launched again (with more steps) resumes
  from its newest checkpoint -- the run is named after the script, not after torchrun's random id;
* two agents through etcd, one killed with its worker: the survivor resumes from the newest checkpoint
  and the job's history consumes exactly the samples of the data order, each step once.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_ddp.data import DataCursor, ElasticSampler, read_ledger
from tests.helpers.job import REPO, Job, env, resumed_steps, steps

pytestmark = pytest.mark.slow

SKELETON = REPO / "tests" / "workers" / "regression_skeleton.py"
SAMPLES, BATCH, SEED = 442, 8, 1337  # load_diabetes; the library's default seed


def expected_order(num_steps: int) -> list[list[int]]:
    sampler, cursor, batches = ElasticSampler(SAMPLES, BATCH, SEED), DataCursor(), []
    for _ in range(num_steps):
        indices, cursor = sampler.batch_at(cursor)
        batches.append(indices)
    return batches


def standalone(root: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(SKELETON), f"--run.root={root}", f"--train.global_batch_size={BATCH}", "--data.ledger=true",
        "--checkpoint.every_steps=10", "--logging.every_steps=5", *flags,
    ]  # fmt: skip
    return subprocess.run(command, env=env(), capture_output=True, text=True, timeout=240)


def test_standalone_trains_and_the_same_command_launched_again_resumes(tmp_path):
    first = standalone(tmp_path, "--train.max_steps=30")
    assert first.returncode == 0, (first.stdout + first.stderr)[-6000:]
    again = standalone(tmp_path, "--train.max_steps=40")
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-6000:]
    assert resumed_steps(output) == [30], output[-4000:]
    run_dir = tmp_path / SKELETON.stem  # named after the script: the same at every launch
    history = read_ledger(run_dir)
    assert [entry.all_indices for entry in history.values()] == expected_order(40)
    assert {entry.world_size for entry in history.values()} == {2}


def test_two_agents_through_etcd_one_killed_survivor_resumes_with_the_same_samples(etcd_endpoint, tmp_path):
    job = Job(
        etcd_endpoint, tmp_path, nnodes="1:2", recipe=SKELETON,
        flags=["--train.max_steps=100000", "--checkpoint.every_steps=5", "--data.ledger=true"],
    )  # fmt: skip
    try:
        job.add_node()
        victim = job.add_node()
        job.wait_for_commit(10, timeout=180)
        job.wait_for_step(12, world_size=2)
        mark, t0 = job.mark(), time.monotonic()
        victim.kill()
        job.wait_for_training_since(mark, t0, world_size=1)
        resumed = resumed_steps(job.output_since(mark))[-1]
        job.wait_until(lambda: any(s >= resumed + 5 and w == 1 for s, w in steps(job.output_since(mark))), 180,
                       "5 steps of the survivor")  # fmt: skip
        survivor = job.nodes[0]
        survivor.terminate()  # a stop checkpoint at an agreed step, then exit
        survivor.wait(timeout=120)
    finally:
        job.cleanup()
    history = read_ledger(job.run_dir)
    assert list(history) == list(range(1, len(history) + 1))
    assert [entry.all_indices for entry in history.values()] == expected_order(len(history))
    assert {e.world_size for s, e in history.items() if s <= resumed} == {2}
    assert {e.world_size for s, e in history.items() if s > resumed} == {1}
