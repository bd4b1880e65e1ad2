"""The GPU node's shape, run on CPUs: every value the library derives from the node is forced to what a
GPU node derives (docs/memory-tier.md, "Derived from the node"), so the paths only GPU nodes take run
here too -- each memory save's part hashed beside its write on a helper thread
(``--checkpoint.memory_write_threads=4``), a restore's and a kept step's checksums with several
threads (``--checkpoint.memory_read_threads=2``, a kept part then hashed beside its write too), and
a save's cost without the write's CPU time (``--checkpoint.memory_direct_cost=copies``).

Each script -- the language-model recipe, the classifier recipe and the BatchNorm + EMA script of
tests/workers/ordinary_model.py -- runs once, as one job of 4 nodes (one rank each, a memory
directory each, as four machines) through every event of a run's life:

1. the start, with saves to node memory and durable checkpoints every ``DURABLE_EVERY`` steps;
2. rank 1's worker SIGKILLed at step ``KILL_AT``: the job restarts at 4 ranks and resumes from the
   memory tier;
3. a node (not rank 0's) killed with all its processes: the other three resume at 3 ranks from the
   state a survivor kept in its node memory;
4. another node preempted (SIGTERM to its agent) once a durable checkpoint after that is committed:
   the stop is committed, the node leaves, the other two resume at 2 ranks;
5. the finish at ``MAX_STEPS``, its final checkpoint verified, the survivors' node memory freed;
6. the exit: the preempted node's torchrun within ``EXIT_S`` of the survivors' resume, the others'
   with status 0 within ``EXIT_S`` of the last step's line. A worker that outlives its run (a live
   thread pool at its exit) fails the test saying so, not by hanging it.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest

from elastic_ddp.checkpoint.manager import list_checkpoints, verify_checkpoint
from elastic_ddp.checkpoint.storage import Storage
from tests.helpers.job import CLASSIFIER, RECIPE, REPO, Job, resumed_steps, steps

pytestmark = pytest.mark.slow

ORDINARY = REPO / "tests" / "workers" / "ordinary_model.py"
MAX_STEPS, DURABLE_EVERY, KILL_AT = 44, 8, 10
MACHINES = "abcd"
# What a GPU node derives (elastic_ddp/memory/tier.py: node_shape), forced on this CPU host.
GPU_SHAPE = [
    "--checkpoint.memory_write_threads=4", "--checkpoint.memory_read_threads=2", "--checkpoint.memory_direct_cost=copies",
    # A GPU node's steps take about a second, so its stop check (every dist.stop_check_s, 1 s) comes every
    # step or two; these steps take milliseconds, and the period is scaled alike so that the preemption
    # stops the run within a few steps, before its 44 steps are done.
    "--dist.stop_check_s=0.01",
]  # fmt: skip
# From the last step's line to every agent's exit: the final checkpoint, the tier's close, the teardown.
EXIT_S = 45.0

SCRIPTS = {
    # The recipe's saves follow the budget, its cost measured as on a GPU (no write CPU time):
    # a generous budget keeps them every step or two on these millisecond steps.
    "lm": (RECIPE, ["--checkpoint.memory_overhead=0.5"]),
    "classifier": (CLASSIFIER, ["--checkpoint.memory_every_steps=1"]),
    "ordinary": (ORDINARY, ["--checkpoint.memory_every_steps=1"]),
}


def resume_records(job: Job) -> list[dict]:
    """The run's resumes on record (``failures.jsonl``), oldest first."""
    try:
        lines = (job.run_dir / "failures.jsonl").read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}") and '"kind": "resume"' in line]


def rank0_node(job: Job):
    hosts = [node for node in job.nodes if "[rank0]" in node.output()]
    assert len(hosts) == 1, job.output()[-4000:]
    return hosts[0]


def wait_for_exit(job: Job, nodes: list, what: str) -> list[int]:
    """Every agent's exit status, each within ``EXIT_S`` of now; a clear failure naming the hang otherwise."""
    deadline = time.monotonic() + EXIT_S
    codes = []
    for node in nodes:
        try:
            codes.append(node.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            alive = [n.log_path.name for n in nodes if n.returncode is None]
            pytest.fail(
                f"{what}, but torchrun did not exit within {EXIT_S:.0f} s: a worker hangs at its exit ({alive} "
                f"still running; a thread or pool alive after run.finish()?)\n--- job output ---\n{job.output()[-6000:]}"
            )
    return codes


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_a_run_in_the_gpu_nodes_shape_survives_a_kill_and_a_preemption_and_exits_promptly(script, etcd_endpoint, tmp_path):
    recipe, flags = SCRIPTS[script]
    started = time.monotonic()
    job = Job(
        etcd_endpoint, tmp_path, nnodes=f"2:{len(MACHINES)}", run_id=f"gpu-shape-{script}", rdzv_id=f"gpu-shape-{script}-{uuid.uuid4().hex[:6]}",
        recipe=recipe, extra_env={"ELASTIC_DDP_FAULT": f"kill@{KILL_AT}:rank=1:restart=0"},
        flags=[f"--train.max_steps={MAX_STEPS}", f"--checkpoint.every_steps={DURABLE_EVERY}", "--checkpoint.keep_last=10",
               "--data.ledger=true", *GPU_SHAPE, *flags],
    )  # fmt: skip
    try:
        for machine in MACHINES:
            job.add_node(flags=[f"--checkpoint.memory_dir={tmp_path / f'shm-{machine}'}"])
        # 1-2. Rank 1 dies at step KILL_AT; the restart at 4 ranks resumes from node memory.
        [record] = job.wait_until(lambda: resume_records(job), 240, "a resume after rank 1's kill")
        # Node memory -- or a durable checkpoint of the same step, which a loaded host may commit first.
        assert record["tier"] in ("memory", "durable") and KILL_AT - 3 <= record["step"] < KILL_AT, record
        # 3. A node dies with its processes; the other three resume from a survivor's node memory.
        job.wait_for_step(record["step"] + 4, world_size=4)
        host = rank0_node(job)
        killed = next(node for node in job.nodes if node is not host)
        mark = job.mark()
        killed.kill()
        job.wait_for_training_since(mark, time.monotonic(), world_size=3)
        after_node_kill = job.wait_until(lambda: resume_records(job)[1:], 60, "the resume after the node kill")[0]
        assert after_node_kill["tier"] in ("memory", "durable") and after_node_kill["steps_redone"] <= 3, after_node_kill
        # 4. A node leaves (preempted) once a durable checkpoint after the node kill is committed.
        committed = (after_node_kill["step"] // DURABLE_EVERY + 1) * DURABLE_EVERY
        job.wait_for_commit(committed, timeout=180)
        job.wait_for_step(committed + 2, world_size=3)
        host = rank0_node(job)
        preempted = next(node for node in job.nodes if node is not host and node is not killed)
        survivors = [node for node in job.nodes if node is not preempted and node is not killed]
        mark = job.mark()
        preempted.terminate()
        job.wait_for_training_since(mark, time.monotonic(), world_size=2)
        last_at_3 = max(s for s, w in steps(job.output()) if w == 3)
        # The stop committed the last step trained at 3 ranks (to the durable tier, and node memory when a
        # save of that step was due: memory wins a tie).
        assert resumed_steps(job.output_since(mark))[-1] == last_at_3, job.output_since(mark)[-4000:]
        # Its agent leaves as torchrun does on a SIGTERM (status 1, a SignalException), and promptly.
        wait_for_exit(job, [preempted], "the preempted node's stop checkpoint was committed")
        # 4-5. The finish, then every survivor's exit, promptly.
        job.wait_for_step(MAX_STEPS, timeout=240)
        assert wait_for_exit(job, survivors, f"the run finished (step {MAX_STEPS} logged)") == [0, 0], job.output()[-6000:]
    finally:
        job.cleanup()
    # Both tiers saved: the durable checkpoints verify, and node memory was used (the resume) and freed.
    storage = Storage(str(job.run_dir / "checkpoints"))
    infos = list_checkpoints(storage)
    assert MAX_STEPS in [info.step for info in infos] and all(verify_checkpoint(storage, info).ok for info in infos)
    records = resume_records(job)
    assert len(records) == 3 and "memory" in [r["tier"] for r in records[:2]], records
    # The finish freed the survivors' node memory; the preempted machine's stop kept its own (a stop may be
    # resumed), and the killed machine's stays as it was left.
    held = {machine: bool(list((tmp_path / f"shm-{machine}").glob("*/run.json"))) for machine in MACHINES}
    assert held == {machine: node in (preempted, killed) for machine, node in zip(MACHINES, job.nodes)}, held
    print(f"{script}: worker kill, node kill, preemption, finish and exit in the GPU node's shape in "
          f"{time.monotonic() - started:.0f} s")


def test_the_classifier_on_one_node_of_3_ranks_with_4_write_threads_ends_and_exits_promptly(etcd_endpoint, tmp_path):
    # Each local rank hashes its memory-tier parts beside the write on a thread pool of its own (the
    # GPU node's path); at the run's end that pool must not keep a worker, and so torchrun, alive.
    job = Job(
        etcd_endpoint, tmp_path, nnodes="1", run_id="write-threads", recipe=CLASSIFIER,
        torchrun_flags=["--nproc-per-node=3"],
        flags=["--train.max_steps=16", "--checkpoint.every_steps=8", *GPU_SHAPE, "--checkpoint.memory_every_steps=2"],
    )  # fmt: skip
    try:
        job.add_node()
        job.wait_for_step(16, timeout=240, world_size=3)
        assert wait_for_exit(job, job.nodes, "the run finished (step 16 logged)") == [0], job.output()[-6000:]
    finally:
        job.cleanup()
    assert "keep it alive" not in job.output()
