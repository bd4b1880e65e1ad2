"""FailureReport counts attempts, not ranks: the ranks of one worker group failing together at one
step are one failure, however their agents' restart counts differ; the same failure in another
attempt is a recurrence, and on the last restart torchrun allows it ends the job with one error."""

from __future__ import annotations

import json
import logging

import pytest

from elastic_ddp.worker.distributed import (
    ENV_GROUP_WORLD_SIZE,
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ENV_RDZV_ROUND,
    ENV_RESTART_COUNT,
)
from elastic_ddp.worker.failures import FAILURES_FILE, FailureReport, RecurringFailureError

MAX_RESTARTS = 3
ERROR = "RuntimeError: Connection closed by peer [10.0.0.2]:41234"


def fail(run_dir, monkeypatch, *, round_: int, rank: int, restarts: int, step: int = 5, error: str = ERROR) -> None:
    """A worker of rendezvous round ``round_`` (a group over three nodes) raises in step ``step``;
    its agent has restarted ``restarts`` times."""
    env = {ENV_MASTER_ADDR: "10.0.0.1", ENV_MASTER_PORT: str(29400 + round_), ENV_RDZV_ROUND: str(round_),
           ENV_RESTART_COUNT: str(restarts), ENV_GROUP_WORLD_SIZE: "3"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    kind, _, message = error.partition(": ")
    with FailureReport(run_dir, rank=rank, restart_count=restarts, max_restarts=MAX_RESTARTS) as report:
        report.step = step - 1
        raise {"RuntimeError": RuntimeError, "ValueError": ValueError}[kind](message)


def test_ranks_of_one_attempt_failing_at_the_same_step_are_one_failure_not_a_recurrence(tmp_path, monkeypatch, caplog):
    # One worker SIGKILLed: the other two ranks fail 3 ms apart with the same error. Their agents'
    # restart counts differ (a node that joined later), and one agent has none left.
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        fail(tmp_path, monkeypatch, round_=7, rank=0, restarts=0)
    with caplog.at_level(logging.ERROR, logger="elastic_ddp"), pytest.raises(RuntimeError) as raised:
        fail(tmp_path, monkeypatch, round_=7, rank=2, restarts=MAX_RESTARTS)
    assert type(raised.value) is RuntimeError  # not RecurringFailureError: the job goes on
    assert "failed again" not in caplog.text
    records = [json.loads(line) for line in (tmp_path / FAILURES_FILE).read_text().splitlines()]
    assert [(r["rank"], r["restart"], r["step"]) for r in records] == [(0, 0, 5), (2, MAX_RESTARTS, 5)]
    assert records[0]["attempt"] == records[1]["attempt"] == "10.0.0.1:29407/round-7"


def test_the_same_failure_in_other_attempts_counts_each_attempt_once(tmp_path, monkeypatch, caplog):
    # Every rank fails, every agent counts a failure; the node of rank 1 had counted one more.
    for rank, restarts in enumerate((0, 1, 0)):
        with pytest.raises(RuntimeError):
            fail(tmp_path, monkeypatch, round_=7, rank=rank, restarts=restarts)
    with caplog.at_level(logging.ERROR, logger="elastic_ddp"):
        for rank, restarts in enumerate((1, 2, 1)):  # the next attempt: the same step, the same error
            with pytest.raises(RuntimeError):
                fail(tmp_path, monkeypatch, round_=8, rank=rank, restarts=restarts)
    assert caplog.text.count("Step 5 failed again with the same error as in 1 earlier attempt(s)") == 3
    # The third, on the node whose agent has no restart left: one clear final error.
    with pytest.raises(RecurringFailureError) as raised:
        fail(tmp_path, monkeypatch, round_=9, rank=1, restarts=MAX_RESTARTS)
    assert str(raised.value).startswith(f"Step 5 failed in all 3 attempts with the same error: {ERROR}. Giving up")
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_another_error_or_another_step_is_not_a_recurrence(tmp_path, monkeypatch, caplog):
    with pytest.raises(RuntimeError):
        fail(tmp_path, monkeypatch, round_=7, rank=0, restarts=0)
    with caplog.at_level(logging.ERROR, logger="elastic_ddp"):
        with pytest.raises(ValueError):
            fail(tmp_path, monkeypatch, round_=8, rank=0, restarts=MAX_RESTARTS, error="ValueError: bad sample")
        with pytest.raises(RuntimeError):
            fail(tmp_path, monkeypatch, round_=9, rank=0, restarts=MAX_RESTARTS, step=6)
    assert "failed again" not in caplog.text
