"""An audit trail of what every optimizer step consumed: each rank's sample indices and the loss.

With ``data.ledger`` on, each rank appends one JSON line per optimizer step to
``<run dir>/ledger/rank-<R>.jsonl``. Every worker start first writes a header naming its attempt
(the worker group's store address and torchrun's restart count, shared by all ranks of one group),
the step it resumed from and the world size. Lines are flushed as they are written, so a node
killed with SIGKILL leaves every step it completed on record.

Records (one JSON object a line; docs/data.md has the details):

==============  =========  =================================================================
header field    type       meaning
==============  =========  =================================================================
``attempt``     str        ``"MASTER_ADDR:MASTER_PORT/TORCHELASTIC_RESTART_COUNT"`` (``local``,
                           ``0``, ``0`` where unset); equal strings are one attempt
``resume_step`` int        steps completed by the state the attempt started from (0: fresh)
``world_size``  int        the attempt's world size
``rank``        int        this worker's rank in the attempt
``time``        float      ``time.time()`` when the header was written
==============  =========  =================================================================

==============  =========  =================================================================
step field      type       meaning
==============  =========  =================================================================
``step``        int        the optimizer step just completed (1-based)
``indices``     list[int]  this rank's sample indices of the step, in training order
``loss``        float      the step's global loss (all ranks' samples; float64, as computed)
==============  =========  =================================================================

:func:`read_ledger` replays the attempts in the order they started. An attempt that resumed from
step ``s`` supersedes whatever earlier attempts recorded after ``s`` (those steps were redone), so
the result is the history of the job as its checkpoints tell it: for every step, which samples
each rank of that moment consumed. Tests use it to check that no sample was consumed twice or
skipped across restarts and world-size changes; operators can use it to audit a real run.

Cost: one line of ``global_batch_size / world_size`` integers per rank and step.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

__all__ = ["LedgerStep", "StepLedger", "read_ledger"]

LEDGER_DIR = "ledger"


def _attempt_id() -> str:
    # MASTER_ADDR:MASTER_PORT is the store of this worker group (a fresh one per rendezvous
    # round); with torchrun's restart count it names one attempt on every rank alike.
    return "{}:{}/{}".format(
        os.environ.get("MASTER_ADDR", "local"),
        os.environ.get("MASTER_PORT", "0"),
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
    )


class StepLedger:
    """Appends this rank's per-step records; a no-op when ``enabled`` is false."""

    def __init__(self, run_dir: str | os.PathLike, *, rank: int, world_size: int, resume_step: int, enabled: bool) -> None:
        self._file: IO[str] | None = None
        if not enabled:
            return
        directory = Path(run_dir) / LEDGER_DIR
        directory.mkdir(parents=True, exist_ok=True)
        self._file = open(directory / f"rank-{rank}.jsonl", "a", encoding="utf-8")
        self._write({
            "attempt": _attempt_id(), "resume_step": resume_step, "world_size": world_size,
            "rank": rank, "time": time.time(),
        })  # fmt: skip

    def record(self, step: int, indices: list[int], loss: float) -> None:
        """Step ``step`` (counted after the optimizer step) consumed ``indices`` on this rank."""
        if self._file is not None:
            self._write({"step": step, "indices": indices, "loss": loss})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, record: dict) -> None:
        assert self._file is not None
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()


@dataclass
class LedgerStep:
    """One optimizer step of the job's history."""

    step: int
    world_size: int
    loss: float
    indices: dict[int, list[int]] = field(default_factory=dict)  # rank -> sample indices

    @property
    def all_indices(self) -> list[int]:
        """Every rank's samples, in rank order."""
        return [i for rank in sorted(self.indices) for i in self.indices[rank]]


@dataclass
class _Attempt:
    started: float
    resume_step: int
    world_size: int
    steps: dict[int, LedgerStep] = field(default_factory=dict)


def read_ledger(run_dir: str | os.PathLike) -> dict[int, LedgerStep]:
    """The job's step history from every rank's ledger file (see the module docstring).

    Raises:
        FileNotFoundError: ``run_dir`` has no ledger (``data.ledger`` was off).
        ValueError: a line that is not a ledger record, naming the file and line.
    """
    directory = Path(run_dir) / LEDGER_DIR
    files = sorted(directory.glob("rank-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"No ledger files in {directory} (was data.ledger enabled?)")
    attempts: dict[str, _Attempt] = {}
    for path in files:
        current: _Attempt | None = None
        rank = -1
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if "attempt" in record:
                    rank = int(record["rank"])
                    current = attempts.setdefault(
                        record["attempt"],
                        _Attempt(record["time"], int(record["resume_step"]), int(record["world_size"])),
                    )
                    current.started = min(current.started, record["time"])
                    continue
                step = int(record["step"])
                indices = [int(i) for i in record["indices"]]
                loss = float(record["loss"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a ledger record ({exc})") from None
            if current is None:
                raise ValueError(f"{path}:{number}: a step record before any attempt header")
            entry = current.steps.setdefault(step, LedgerStep(step, current.world_size, loss))
            entry.indices[rank] = indices
    history: dict[int, LedgerStep] = {}
    for attempt in sorted(attempts.values(), key=lambda a: a.started):
        for step in [s for s in history if s > attempt.resume_step]:
            del history[step]
        history.update(attempt.steps)
    return dict(sorted(history.items()))
