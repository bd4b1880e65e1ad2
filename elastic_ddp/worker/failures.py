"""One clear final error for a crash that keeps coming back at the same step.

torchrun restarts a failed worker group up to ``--max-restarts`` times. A node lost to the
cluster is worth those restarts; a bug or a bad sample that crashes the same step every time is
not, and a user reading the logs of attempt four wants to know that attempts one to three died
the same way. :class:`FailureReport` writes every rank's failure (step, error, attempt) to
``<run dir>/failures.jsonl`` -- beside one ``"kind": "resume"`` line per resume saying which tier
(node memory or durable) it came from and how many steps were redone -- and, when a step fails
again as it did in an earlier attempt, says so; on the last attempt torchrun allows, it raises one
error that names the step, the error and the attempts. With the recipe's ``@record``, that error
is the "root cause" torchrun prints when it gives up.

Attempts are counted, not ranks: when one rank dies, the others of its worker group often fail at
the same step with the same error a few milliseconds later, and those records share one attempt id
(:func:`elastic_ddp.worker.distributed.attempt_id`, the step ledger's too), so they count once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from types import TracebackType

from elastic_ddp.worker.distributed import attempt_id

__all__ = ["FAILURES_FILE", "FailureReport", "RecurringFailureError"]

log = logging.getLogger(__name__)

FAILURES_FILE = "failures.jsonl"


class RecurringFailureError(RuntimeError):
    """The same step failed the same way in every attempt torchrun allowed."""


class FailureReport:
    """Context manager around the training loop; set :attr:`step` as steps complete.

    ``restart_count`` and ``max_restarts`` are torchrun's (``TORCHELASTIC_RESTART_COUNT``,
    ``TORCHELASTIC_MAX_RESTARTS``): this node's agent gives up when the count reaches the maximum.
    The attempt is named by :func:`~elastic_ddp.worker.distributed.attempt_id` from the environment at
    construction. Only exceptions are handled; a SIGKILL leaves no record.
    """

    def __init__(self, run_dir: str | os.PathLike, *, rank: int, restart_count: int, max_restarts: int) -> None:
        self.path = Path(run_dir) / FAILURES_FILE
        self.rank = rank
        self.restart_count = restart_count
        self.max_restarts = max_restarts
        self.attempt = attempt_id()
        self.step = 0

    def __enter__(self) -> FailureReport:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None or not isinstance(exc, Exception):
            return
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        earlier = self._earlier_attempts(error)
        self._write({"attempt": self.attempt, "restart": self.restart_count, "rank": self.rank,
                     "step": self.step + 1, "error": error, "time": time.time()})  # fmt: skip
        if not earlier:
            return
        attempts = len(earlier) + 1
        if self.restart_count >= self.max_restarts:
            raise RecurringFailureError(
                f"Step {self.step + 1} failed in all {attempts} attempts with the same error: {error}. "
                f"Giving up: torchrun's --max-restarts={self.max_restarts} is spent. A failure that "
                "recurs at the same step is a bug or bad data, not a lost node; see "
                f"{self.path} for every attempt."
            ) from exc
        log.error(
            "Step %d failed again with the same error as in %d earlier attempt(s): %s", self.step + 1,
            len(earlier), error,
        )  # fmt: skip

    def record_resume(self, *, tier: str, step: int, source: str, steps_redone: int | None, world_size: int) -> None:
        """Record where an attempt resumed from: ``tier`` (``"memory"`` or ``"durable"``), the ``step``, the
        ``source`` (a node's memory or a checkpoint URL) and how many completed steps it trains again."""
        self._write({"attempt": self.attempt, "restart": self.restart_count, "rank": self.rank, "kind": "resume",
                     "tier": tier, "step": step, "source": source, "steps_redone": steps_redone,
                     "world_size": world_size, "time": time.time()})  # fmt: skip

    def _earlier_attempts(self, error: str) -> set[str]:
        """The other attempts on record whose failure was ``error`` at the step failing now."""
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except OSError:
            return set()
        found = set()
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("kind") == "resume":
                continue
            if record.get("step") == self.step + 1 and record.get("error") == error and record.get("attempt") != self.attempt:
                found.add(record.get("attempt"))
        return found

    def _write(self, record: dict) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as file:
                file.write(json.dumps(record) + "\n")
        except OSError as exc:  # the original error matters more than its record
            log.warning("Could not record the failure in %s: %s", self.path, exc)
