"""A script in the shape of docs/your-model.md's skeleton (tests/workers/regression_skeleton.py: a
regression MLP, Adam, LambdaLR -- unlike both recipes) gets the guarantees under real torchrun:

* ``torchrun --standalone``: it trains, and the same command launched again (with more steps) resumes
  from its newest checkpoint -- the run is named after the script, not after torchrun's random id;
* ``torchrun --standalone --max-restarts=3`` with one worker killed: the agent restarts the group,
  which resumes from the newest checkpoint and trains to the end (each round gets a worker store
  of its own, so the restarted workers can connect);
* two agents through etcd, one killed with its worker: the survivor resumes from the newest checkpoint
  and the job's history consumes exactly the samples of the data order, each step once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_ddp.data import read_ledger
from tests.helpers.data import data_order
from tests.helpers.job import REPO, Job, env, resumed_steps, steps
from tests.helpers.nodes import descendants, start_node, wait_for

pytestmark = pytest.mark.slow

SKELETON = REPO / "tests" / "workers" / "regression_skeleton.py"
SAMPLES, BATCH, SEED = 442, 8, 1337  # load_diabetes; the library's default seed


def expected_order(num_steps: int) -> list[list[int]]:
    return data_order(SAMPLES, BATCH, SEED, num_steps)


def standalone_command(root: Path, *flags: str, torchrun_flags: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *torchrun_flags,
        str(SKELETON), f"--run.root={root}", f"--train.global_batch_size={BATCH}", "--data.ledger=true",
        "--checkpoint.every_steps=10", "--logging.every_steps=5", *flags,
    ]  # fmt: skip


def standalone(root: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(standalone_command(root, *flags), env=env(), capture_output=True, text=True, timeout=240)


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


def test_standalone_recovers_a_killed_worker_and_finishes(tmp_path):
    # torch shares the agent's TCPStore with the workers by default; restarted workers of a
    # --standalone agent then failed to connect ("Connection refused") until --max-restarts was spent.
    command = standalone_command(tmp_path, "--train.max_steps=60", torchrun_flags=("--max-restarts=3", "--monitor-interval=0.5"))
    node = start_node(command, env(), tmp_path / "agent.log")
    try:
        wait_for(lambda: "Checkpoint committed at" in node.output() and steps(node.output())[-1:] >= [(15, 2)],
                 180, what="step 15 and a committed checkpoint")  # fmt: skip
        workers = [pid for pid in descendants(node.pid) if SKELETON.name in Path(f"/proc/{pid}/cmdline").read_text()]
        os.kill(workers[-1], signal.SIGKILL)
        code = node.wait(timeout=240)
    finally:
        node.cleanup()
    output = node.output()
    assert code == 0, output[-6000:]
    assert resumed_steps(output), f"the restarted group did not resume from a checkpoint\n{output[-4000:]}"
    assert max(s for s, _ in steps(output)) == 60, output[-4000:]
    history = read_ledger(tmp_path / SKELETON.stem)
    assert [entry.all_indices for entry in history.values()] == expected_order(60)


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
