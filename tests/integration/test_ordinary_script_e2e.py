"""What the library takes over of a worker's process -- its exit, its start as a fork of the node's
warm template -- behaves for an ordinary script as plain Python and a fresh process do
(tests/workers/ordinary_habits.py: an environment variable set before ``import torch``, a thread
pool left alive, ``atexit``, a logging handler, ``tqdm``, DataLoader workers), at 3 ranks through
the etcd rendezvous, across a restart."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.helpers.job import REPO, one_node_job, steps
from tests.helpers.nodes import wait_for

pytestmark = pytest.mark.slow

HABITS = REPO / "tests" / "workers" / "ordinary_habits.py"
RANKS, STEPS = 3, 24
FRESH_START = "This worker starts without its node's template: the script sets TORCHINDUCTOR_MAX_AUTOTUNE"


@pytest.fixture(scope="module")
def habits_run(etcd_server, tmp_path_factory):
    """One job of the script at 3 ranks, a worker killed at step 8 of its first attempt; the node's
    output, the run directory, and how long torchrun took to exit after the last step line."""
    root = tmp_path_factory.mktemp("habits")
    job = one_node_job(
        etcd_server.endpoint, root, "habits", nproc=RANKS, attempt="a", recipe=HABITS,
        flags=[f"--train.max_steps={STEPS}", "--train.global_batch_size=12", "--checkpoint.every_steps=6",
               "--logging.every_steps=1", "--data.num_workers=1"],
        extra_env={"ELASTIC_DDP_FAULT": f"kill@8:rank={RANKS - 1}:restart=0"},
    )  # fmt: skip
    node = job.nodes[0]
    try:
        last = wait_for(lambda: steps(node.output())[-1:] == [(STEPS, RANKS)] and time.monotonic(), 300,
                        what=f"the step line of step {STEPS}")  # fmt: skip
        code = node.wait(timeout=90)
        exit_s = time.monotonic() - last
    finally:
        job.cleanup()
    return node.output(), job.run_dir, code, exit_s


def test_a_script_with_a_live_thread_pool_and_atexit_ends_and_every_ranks_handler_runs(habits_run):
    output, run_dir, code, exit_s = habits_run
    assert code == 0, output[-6000:]
    assert exit_s < 60, f"torchrun exited {exit_s:.0f} s after the last step line\n{output[-4000:]}"
    for rank in range(RANKS):
        assert (run_dir / f"atexit-rank{rank}.txt").read_text() == f"atexit ran after step {STEPS}"
        # The script's own FileHandler, never closed by it: flushed by logging's atexit handler.
        assert f"finished at step {STEPS}" in (run_dir / f"habits-rank{rank}.log").read_text()
    assert "keep it alive" not in output


def _attempts(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"attempts-rank{rank}.jsonl").read_text().splitlines()]


def test_a_variable_set_before_import_torch_holds_in_the_first_attempt_and_after_a_restart(habits_run):
    output, run_dir, code, _ = habits_run
    assert code == 0, output[-6000:]
    for rank in range(RANKS):
        attempts = _attempts(run_dir, rank)
        assert [a["restart"] for a in attempts] == [0, 1], attempts
        assert all(a["max_autotune"] is True for a in attempts), (rank, attempts)
        assert all(a["mode"] == "test" for a in attempts), (rank, attempts)
    # The restarted workers were forks of a template with torch._inductor.config imported: each
    # left for a fresh start, and said why in one line.
    assert output.count(FRESH_START) >= RANKS, output[-6000:]
