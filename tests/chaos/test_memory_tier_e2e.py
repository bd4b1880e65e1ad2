"""The memory tier under real torchrun agents and etcd: a hard node loss costs at most one step.

Two nodes (one torchrun agent and one worker each) train recipes/train_classifier.py for
``MAX_STEPS`` steps with a durable checkpoint every 50 steps and a save to node memory after every
step (``--checkpoint.memory_every_steps=1``: the tiny model's steps take milliseconds, so the
default budget would space saves out; the interval policy has unit tests of its own). Each node
gets a memory directory of its own, as two machines would. A node is killed with SIGKILL (agent
and workers) at a random step while training runs freely:

* the node hosting rank 0, with ``--nnodes=2``: the survivor waits for a replacement machine (a
  fresh memory dir) and both resume from the survivor's memory -- at the last completed step or
  the one before -- and the final parameters equal the uninterrupted run's bitwise;
* the other node, with ``--nnodes=1:2``: the survivor resumes alone from its memory, and the ledger
  shows the same samples every step as the uninterrupted run at 2 ranks;
* every node: new machines (fresh memory) resume from the newest durable checkpoint, as before.

Each resume's tier and steps redone are read from ``failures.jsonl`` and checked against the
steps the logs showed before the kill. Added test time: 69 s on a shared 2-core machine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch

from elastic_ddp.checkpoint.manager import list_checkpoints
from elastic_ddp.checkpoint.storage import Storage
from elastic_ddp.contract import ENV_FAULT
from elastic_ddp.data import read_ledger
from elastic_ddp.tools import checkpoint as ckpt_cli
from tests.helpers.job import CLASSIFIER, Job, report, resumed_steps
from tests.helpers.nodes import worker_pids

pytestmark = pytest.mark.slow

MAX_STEPS, DURABLE_EVERY = 200, 50
# Where a node joining a running job is awaited (after the step the test first waits for, 15-40).
HOLD = 60
FLAGS = [
    f"--train.max_steps={MAX_STEPS}", "--train.global_batch_size=16", "--data.ledger=true",
    f"--checkpoint.every_steps={DURABLE_EVERY}", "--checkpoint.keep_last=10", "--checkpoint.memory_every_steps=1",
    "--checkpoint.memory_overhead=0.02",
]  # fmt: skip


def start(endpoint: str, root: Path, run_id: str, attempt: str, nnodes: str, machines: list[str], flags=FLAGS,
          extra_env: dict[str, str] | None = None) -> Job:  # fmt: skip
    job = Job(endpoint, root, nnodes=nnodes, run_id=run_id, rdzv_id=f"{run_id}-{attempt}-{uuid.uuid4().hex[:6]}",
              recipe=CLASSIFIER, flags=flags, extra_env=dict(extra_env or {}))  # fmt: skip
    for machine in machines:
        add_machine(job, root, machine)
    return job


def add_machine(job: Job, root: Path, machine: str) -> None:
    job.add_node(flags=[f"--checkpoint.memory_dir={root / f'shm-{machine}'}"])


def rank0_node(job: Job):
    hosts = [node for node in job.nodes if "[rank0]" in node.output()]
    assert len(hosts) == 1, job.output()[-4000:]
    return hosts[0]


def resume_records(job: Job) -> list[dict]:
    lines = (job.run_dir / "failures.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "resume"]


def final_weights(job: Job, out_dir: Path) -> dict[str, torch.Tensor]:
    out = out_dir / f"{job.rdzv_id}-weights.pt"
    ckpt = job.run_dir / "checkpoints" / f"step-{MAX_STEPS:09d}"
    assert ckpt_cli.main(["ckpt", "export", str(ckpt), str(out)]) == 0
    return torch.load(out, weights_only=True)


def memory_dirs(root: Path, machine: str) -> list[Path]:
    return [p for p in (root / f"shm-{machine}").glob("*") if (p / "run.json").is_file()]


@pytest.fixture(scope="module")
def reference(etcd_server, tmp_path_factory):
    """The uninterrupted run on two nodes: its ledger and final parameters."""
    root = tmp_path_factory.mktemp("memory-reference")
    job = start(etcd_server.endpoint, root, "reference", "only", "2", ["a", "b"])
    job.finish()
    history = read_ledger(job.run_dir)
    assert list(history) == list(range(1, MAX_STEPS + 1))
    assert memory_dirs(root, "a") == [] and memory_dirs(root, "b") == []  # freed at a normal end
    return history, final_weights(job, root)


def kill_at_random_step(job: Job, victim_is_rank0: bool) -> tuple[int, list[int], float, object]:
    """Kill one node at a random step; (last step logged before, mark, kill time, survivor)."""
    step = random.randint(15, 40)
    print(f"killing the node {'with' if victim_is_rank0 else 'without'} rank 0 at step >= {step}")
    job.wait_for_step(step, world_size=2)
    host = rank0_node(job)
    victim = host if victim_is_rank0 else next(n for n in job.nodes if n is not host)
    survivor = next(n for n in job.nodes if n is not victim)
    mark, t0 = job.mark(), time.monotonic()
    victim.kill()
    return job.last_step(), mark, t0, survivor


def check_memory_resume(job: Job, before: int, after_mark: str) -> tuple[int, int]:
    """The resume after the kill came from node memory and redid at most one step; (step, steps redone)."""
    resumed = resumed_steps(after_mark)
    assert resumed, after_mark[-4000:]
    [record] = resume_records(job)
    assert record["tier"] == "memory" and record["source"].startswith("memory:node"), record
    assert record["step"] == resumed[-1]
    # The logs (rank 0's line after each completed step) agree with the record: at most one
    # step that was completed before the kill is trained again.
    assert before - 1 <= record["step"] <= before + 1, (before, record)
    assert record["steps_redone"] is not None and 0 <= record["steps_redone"] <= 1, record
    return record["step"], record["steps_redone"]


def test_losing_the_rank0_node_resumes_from_the_survivors_memory_bitwise(reference, etcd_endpoint, tmp_path):
    _, ref_weights = reference
    job = start(etcd_endpoint, tmp_path, "lose-rank0", "first", "2", ["a", "b"])
    try:
        before, mark, t0, survivor = kill_at_random_step(job, victim_is_rank0=True)
        add_machine(job, tmp_path, "c")  # a replacement machine: its memory is empty
        recovery_s = job.wait_for_training_since(mark, t0, world_size=2)
        step, redone = check_memory_resume(job, before, job.output_since(mark))
        job.finish([survivor, job.nodes[-1]])
        weights = final_weights(job, tmp_path)
        assert weights.keys() == ref_weights.keys()
        assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
        assert memory_dirs(tmp_path, "b") == [] and memory_dirs(tmp_path, "c") == []
        report("hard node loss with the memory tier (rank 0's node)", "survivors resume from node memory",
               round(recovery_s, 1), redone, checkpoints_verified=job.stop_and_verify_checkpoints())
    finally:
        job.cleanup()


def test_losing_the_other_node_resumes_alone_from_memory_with_the_same_samples(reference, etcd_endpoint, tmp_path):
    ref_history, _ = reference
    job = start(etcd_endpoint, tmp_path, "lose-other", "first", "1:2", ["a", "b"])
    try:
        before, mark, t0, survivor = kill_at_random_step(job, victim_is_rank0=False)
        recovery_s = job.wait_for_training_since(mark, t0, world_size=1)
        step, redone = check_memory_resume(job, before, job.output_since(mark))
        job.finish([survivor])
        history = read_ledger(job.run_dir)
        assert list(history) == list(range(1, MAX_STEPS + 1))
        assert [history[s].world_size for s in history] == [2] * step + [1] * (MAX_STEPS - step)
        assert {s: e.all_indices for s, e in history.items() if s != step} == {
            s: e.all_indices for s, e in ref_history.items() if s != step
        }
        # The resumed step: the killed rank may have died after the step's gradient all-reduce (so
        # the survivor completed it, with its samples) but before writing its ledger line; every
        # line on record is the uninterrupted run's, and the survivor's own is there.
        assert 0 in history[step].indices
        assert all(history[step].indices[r] == ref_history[step].indices[r] for r in history[step].indices)
        report("hard node loss with the memory tier (2 -> 1)", "the survivor resumes from its own memory",
               round(recovery_s, 1), redone, checkpoints_verified=job.stop_and_verify_checkpoints())
    finally:
        job.cleanup()


def test_a_node_joining_is_taken_in_from_node_memory_without_a_durable_save_and_with_the_same_samples(
    reference, etcd_endpoint, tmp_path
):
    ref_history, _ = reference
    # The sample order does not depend on the run's length, so the reference's 200 steps compare.
    steps = 6 * MAX_STEPS
    # A node joining a running job registers once its template has imported torch and the library
    # (~6 s here, and several times that on a loaded machine): the first attempt holds at step HOLD
    # until the newcomer asks to join, so that the run cannot end before it is taken in.
    joining = tmp_path / "newcomer-joins"
    job = start(etcd_endpoint, tmp_path, "join", "first", "1:3", ["a", "b"], flags=[*FLAGS, f"--train.max_steps={steps}"],
                extra_env={ENV_FAULT: f"wait@{HOLD}:restart=0:until={joining}"})  # fmt: skip
    try:
        job.wait_for_step(random.randint(15, 40), world_size=2)
        mark, t0 = job.mark(), time.monotonic()
        add_machine(job, tmp_path, "c")  # a new machine: its memory is empty
        newcomer = job.nodes[-1]
        job.wait_until(lambda: "attempts to join the next round" in newcomer.output(), 180, "the new node's join")
        joining.touch()
        recovery_s = job.wait_for_training_since(mark, t0, world_size=3)
        after = job.output_since(mark)
        before = max(s for s, w in job.progress() if w == 2)
        output = job.finish()
    finally:
        job.cleanup()
    assert f"Stopped at step {before} to admit a joining node; its state committed to node memory" in output, after[-4000:]
    records = [r for r in resume_records(job) if r["step"] == before]
    assert [(r["tier"], r["steps_redone"]) for r in records] == [("memory", 0)], resume_records(job)
    # No durable checkpoint of the stop's step: only the periodic ones and the last.
    durable = [c.step for c in list_checkpoints(Storage(str(job.run_dir / "checkpoints")))]
    assert before not in durable and set(durable) <= set(range(DURABLE_EVERY, steps + 1, DURABLE_EVERY)), durable
    history = read_ledger(job.run_dir)
    assert list(history) == list(range(1, steps + 1))
    assert {history[s].world_size for s in history if s > before} == {3}
    assert {s: history[s].all_indices for s in ref_history} == {s: e.all_indices for s, e in ref_history.items()}
    report("a node joins with the memory tier (2 -> 3)", "the stop commits to node memory; all resume from it",
           round(recovery_s, 1), 0, checkpoints_verified=job.stop_and_verify_checkpoints())


def test_losing_every_node_resumes_from_the_durable_tier(etcd_endpoint, tmp_path):
    job = start(etcd_endpoint, tmp_path, "lose-all", "first", "1:2", ["a", "b"])
    try:
        job.wait_for_commit(DURABLE_EVERY, timeout=180)
        for node in job.nodes:
            node.kill()
        durable = list_checkpoints(Storage(str(job.run_dir / "checkpoints")))[-1].step
    finally:
        job.cleanup()
    again = start(etcd_endpoint, tmp_path, "lose-all", "again", "1:2", ["c"])  # new machines, empty memory
    output = again.finish()
    assert resumed_steps(output) == [durable], output[-4000:]
    [record] = resume_records(again)
    assert (record["tier"], record["step"]) == ("durable", durable), record
    assert record["steps_redone"] is not None and record["steps_redone"] >= 0


# --- on by default -------------------------------------------------------------------------------


def interval_steps(run_dir: Path) -> list[float]:
    """The memory tier's save interval as TensorBoard shows it (memory/interval_steps)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return [e.value for e in events.Scalars("memory/interval_steps")]


def redone_steps(run_dir: Path) -> list[int]:
    """The steps a rank's ledger shows completed (their loss recorded) and then started again."""
    again: set[int] = set()
    for path in (run_dir / "ledger").glob("rank-*.jsonl"):
        completed: set[int] = set()
        for record in map(json.loads, path.read_text(encoding="utf-8").splitlines()):
            if "loss" in record:
                completed.add(record["step"])
            elif "indices" in record and record["step"] in completed:
                again.add(record["step"])
    return sorted(again)


def test_with_no_memory_flags_the_survivor_of_rank0s_node_resumes_from_its_own_memory(etcd_endpoint, tmp_path):
    # Two machines: two agents in directories of their own (the default memory dir is one per working
    # directory), the language-model recipe with no memory-tier flag at all.
    job = Job(etcd_endpoint, tmp_path, nnodes="1:2",
              flags=["--train.max_steps=100000", "--checkpoint.every_steps=50", "--data.ledger=true"])  # fmt: skip
    try:
        for machine in ("a", "b"):
            (tmp_path / machine).mkdir()
            job.add_node(cwd=tmp_path / machine)
        job.wait_for_step(30, world_size=2)
        victim = rank0_node(job)
        survivor = next(n for n in job.nodes if n is not victim)
        mark, t0 = job.mark(), time.monotonic()
        victim.kill()
        recovery_s = job.wait_for_training_since(mark, t0, world_size=1)
        survivor.terminate()
        survivor.wait(timeout=120)
    finally:
        job.cleanup()
    [record] = resume_records(job)
    assert record["tier"] == "memory", record
    # The survivor may complete the step in flight after the kill and keep it, so what was redone is read
    # from the ledger after the fact: the steps completed and then started again.
    redone = redone_steps(job.run_dir)
    interval = max(interval_steps(job.run_dir))
    print(f"resumed from node memory at step {record['step']}: {len(redone)} step(s) redone, "
          f"save interval {interval:.0f}, recovery {recovery_s:.1f} s")  # fmt: skip
    # The newest state is at most one interval old, or two when the kill caught its write in flight.
    assert len(redone) <= 2 * interval and 0 <= record["steps_redone"] <= 2 * interval, (redone, record, interval)
    assert record["step"] > 0 and record["step"] % 50, "resumed from a durable checkpoint's step, not from memory"


@pytest.mark.parametrize("lost", ["node", "worker"])
def test_a_failed_step_costs_no_step_at_the_default_interval_the_survivors_keep_the_last_one(lost, etcd_endpoint, tmp_path):
    # Three machines, the language-model recipe with no memory-tier flag: saves are steps apart (the
    # budget), so what the restart redoes is what the survivors kept when the step after failed.
    job = Job(etcd_endpoint, tmp_path, nnodes="1:3",
              flags=["--train.max_steps=100000", "--checkpoint.every_steps=1000", "--data.ledger=true"])  # fmt: skip
    try:
        for machine in ("a", "b", "c"):
            (tmp_path / machine).mkdir()
            job.add_node(cwd=tmp_path / machine)
        job.wait_for_step(random.randint(60, 90), world_size=3)
        victim = job.nodes[random.randrange(3)]
        mark, t0 = job.mark(), time.monotonic()
        if lost == "node":
            victim.kill()
        else:
            [worker] = worker_pids(victim.pid)
            os.kill(worker, signal.SIGKILL)  # its agent restarts the group, at the same world size
        recovery_s = job.wait_for_training_since(mark, t0, world_size=2 if lost == "node" else 3)
        after = job.output_since(mark)
        job.wait_for_step(job.last_step() + 5)
        for node in job.nodes:
            node.terminate()
        for node in job.nodes:
            node.wait(timeout=120)
    finally:
        job.cleanup()
    [record] = resume_records(job)
    assert record["tier"] == "memory", record
    interval = max(interval_steps(job.run_dir))
    assert interval > 2, f"saves every {interval} steps: this test needs them further apart"
    assert "is in this node's memory for the restart" in after, after[-4000:]
    redone = redone_steps(job.run_dir)
    print(f"lost a {lost} of 3; resumed from node memory at step {record['step']}; redone {redone}; save interval "
          f"{interval:.0f}; recovery {recovery_s:.1f} s")  # fmt: skip
    assert len(redone) <= 1 and record["steps_redone"] <= 1, (redone, record)
    history = read_ledger(job.run_dir)
    assert list(history) == list(range(1, max(history) + 1))


def test_a_tmpfs_too_small_for_the_tier_turns_it_off_in_one_line_and_training_goes_on(tmp_path):
    # /dev/shm of 1 MiB, as a container without --shm-size has 64 MiB: a mount namespace of this job only.
    import subprocess
    import sys

    from tests.helpers.job import RECIPE, TINY, env

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(RECIPE),
                f"--run.root={tmp_path}", "--run.name=small-shm", "--train.max_steps=6", *TINY]  # fmt: skip
    command = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"', "sh", *torchrun]
    done = subprocess.run(command, env=env(), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    lines = [line for line in output.splitlines() if "memory tier is off" in line and "WARNING" in line]
    assert len(lines) == 1, output[-6000:]
    assert "only 1.00 MiB" in lines[0] or "is free there" in lines[0], lines[0]
    assert "--shm-size" in lines[0] and "step=6/6" in output
