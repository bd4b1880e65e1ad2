"""An audit trail of what every optimizer step consumed: each rank's sample indices and the loss.

With ``data.ledger`` on, each rank appends two JSON lines per optimizer step to
``<run dir>/ledger/rank-<R>.jsonl``: the samples as the step starts, the loss once it completed.
Every worker start first writes a header naming its attempt (:func:`elastic_ddp.worker.distributed.attempt_id`:
the same on every rank of one worker group, whichever node it runs on), the step it resumed from
and the world size. Lines are flushed as they are written, so a node killed with SIGKILL leaves
every step it started on record -- also one whose update the others completed without it (it died
after its gradients went into the all-reduce), which the job's state then holds.

Records (one JSON object a line; docs/data.md has the details):

==============  =========  =================================================================
header field    type       meaning
==============  =========  =================================================================
``attempt``     str        the worker group's id: ``"MASTER_ADDR:MASTER_PORT/round-N"`` under
                           this package's etcd rendezvous, ``"MASTER_ADDR:MASTER_PORT"`` under
                           another one over several nodes, ``".../TORCHELASTIC_RESTART_COUNT"``
                           on one node (and on every node in ledgers written before the round
                           was used)
``resume_step`` int        steps completed by the state the attempt started from (0: fresh)
``world_size``  int        the attempt's world size
``rank``        int        this worker's rank in the attempt
``restart``     int        torchrun's restart count of this worker's agent
                           (``TORCHELASTIC_RESTART_COUNT``; 0 outside torchrun): a failure
                           counts on its own node, a membership change counts nowhere
``time``        float      ``time.time()`` when the header was written
==============  =========  =================================================================

==============  =========  =================================================================
step field      type       meaning
==============  =========  =================================================================
``step``        int        the optimizer step (1-based): starting (with ``indices``) or
                           completed (with ``loss``); a line may carry both
``indices``     list[int]  this rank's sample indices of the step, in training order
``loss``        float      the step's global loss (all ranks' samples; float64, as computed)
==============  =========  =================================================================

Rank 0 also records, after its header, the bad records a sharded source skips (``on_bad_record="skip"``)
as ``{"skipped": [{"shard", "record", "reason", "rest"?}, ...]}`` (:func:`read_skipped`).

:func:`read_ledger` groups the headers of all files into attempts, orders the attempts as they ran
and follows the job's state back from the last one: an attempt that resumed from step ``s``
continues the latest earlier attempt that completed ``s``, so steps that others recorded after ``s``
were redone or belong to a state no later attempt started from; a step is complete where some rank
recorded its loss, or where a later attempt resumed from it (its loss is then NaN: the step's
update was kept when a peer died in the collectives after it). The result is the history of the
job as its checkpoints tell it: for every step, which samples each rank of that moment consumed.
Tests use it to check that no sample was consumed twice or skipped across restarts, node losses
and world-size changes; operators can use it to audit a real run.

Cost: one line of ``global_batch_size / world_size`` integers and one of the loss per rank and step.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from elastic_ddp.worker.distributed import ENV_RESTART_COUNT, attempt_id

__all__ = ["LedgerStep", "StepLedger", "exactly_once_problems", "read_ledger", "read_skipped"]

LEDGER_DIR = "ledger"


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
            "attempt": attempt_id(), "resume_step": resume_step, "world_size": world_size,
            "rank": rank, "restart": int(os.environ.get(ENV_RESTART_COUNT, "0") or 0), "time": time.time(),
        })  # fmt: skip

    def started(self, step: int, indices: list[int]) -> None:
        """Step ``step`` (counted after its optimizer step) starts, consuming ``indices`` on this rank."""
        if self._file is not None:
            self._write({"step": step, "indices": indices})

    def skipped(self, records: list[dict]) -> None:
        """The bad records the source leaves out (shard, record, reason), for :func:`read_skipped`."""
        if self._file is not None:
            self._write({"skipped": records})

    def finished(self, step: int, loss: float) -> None:
        """Step ``step`` completed with the global ``loss``."""
        if self._file is not None:
            self._write({"step": step, "loss": loss})

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
    loss: float  # NaN where no rank recorded it (see the module docstring)
    indices: dict[int, list[int]] = field(default_factory=dict)  # rank -> sample indices

    @property
    def all_indices(self) -> list[int]:
        """Every rank's samples, in rank order."""
        return [i for rank in sorted(self.indices) for i in self.indices[rank]]


# An attempt as read_ledger groups headers: (attempt id, resume_step, world_size, occurrence).
_Key = tuple[str, int, int, int]


@dataclass
class _Attempt:
    started: float  # the earliest of its headers' times
    resume_step: int
    world_size: int
    steps: dict[int, LedgerStep] = field(default_factory=dict)  # started (and maybe completed)
    done: set[int] = field(default_factory=set)  # steps some rank recorded as completed

    @property
    def reach(self) -> int:
        """The last step this attempt's state is known to have completed."""
        return max(self.done, default=self.resume_step)


def read_ledger(run_dir: str | os.PathLike) -> dict[int, LedgerStep]:
    """The job's step history from every rank's ledger file (see the module docstring).

    Headers with the same attempt id, resume step and world size are one attempt, pairing each
    file's first such header with the other files' first, its second with their second: a worker
    writes one header per attempt, and an id can come back (a port handed out again, a job
    launched again on one node with its restart count back at 0). Attempts run in the order every
    file lists them (one worker appends to a file at a time), so clocks of different hosts decide
    only between attempts that share no file; there, the earliest header goes first. From the last
    attempt back, each attempt continues the latest earlier one that reached its resume step (or,
    where none did, the latest that resumed no later), which supplies the steps up to it.

    Raises:
        FileNotFoundError: ``run_dir`` has no ledger (``data.ledger`` was off).
        ValueError: a line that is not a ledger record, naming the file and line.
    """
    directory = Path(run_dir) / LEDGER_DIR
    files = sorted(directory.glob("rank-*.jsonl"))
    if not files:
        raise FileNotFoundError(f"No ledger files in {directory} (was data.ledger enabled?)")
    attempts: dict[_Key, _Attempt] = {}
    sequences: list[list[_Key]] = []  # each file's attempts, in the file's order
    for path in files:
        sequence: list[_Key] = []
        seen: Counter[tuple[str, int, int]] = Counter()
        current: _Attempt | None = None
        rank = -1
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if "attempt" in record:
                    rank = int(record["rank"])
                    same = (str(record["attempt"]), int(record["resume_step"]), int(record["world_size"]))
                    started = float(record["time"])
                    key = (*same, seen[same])
                    seen[same] += 1
                    sequence.append(key)
                    current = attempts.setdefault(key, _Attempt(started, same[1], same[2]))
                    current.started = min(current.started, started)
                    continue
                if "skipped" in record:  # the source's bad records: read_skipped()
                    continue
                step = int(record["step"])
                indices = [int(i) for i in record["indices"]] if "indices" in record else None
                loss = float(record["loss"]) if "loss" in record else None
                if indices is None and loss is None:
                    raise KeyError("indices or loss")
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a ledger record ({exc})") from None
            if current is None:
                raise ValueError(f"{path}:{number}: a step record before any attempt header")
            entry = current.steps.setdefault(step, LedgerStep(step, current.world_size, math.nan))
            if indices is not None:
                entry.indices[rank] = indices
            if loss is not None and step not in current.done:
                entry.loss = loss
                current.done.add(step)
        sequences.append(sequence)
    return _lineage(_in_order(attempts, sequences))


def _in_order(attempts: dict[_Key, _Attempt], sequences: list[list[_Key]]) -> list[_Attempt]:
    """The attempts in an order that keeps every file's order, the earliest-started first where
    that leaves a choice (a topological sort of the files' orders)."""
    after: dict[_Key, list[_Key]] = {key: [] for key in attempts}
    pending = dict.fromkeys(attempts, 0)  # per unplaced attempt: unplaced ones a file lists just before it
    for sequence in sequences:
        for first, then in zip(sequence, sequence[1:]):
            after[first].append(then)
            pending[then] += 1
    ready = [(attempts[key].started, key) for key, count in pending.items() if count == 0]
    heapq.heapify(ready)
    order: list[_Attempt] = []
    while pending:
        if ready:
            key = heapq.heappop(ready)[1]
        else:
            # The files disagree: an id came back in a way the pairing could not tell apart (a
            # worker that died before its header, in an attempt whose id, resume step and world
            # size a later one repeated). The headers' times decide.
            key = min(pending, key=lambda k: attempts[k].started)
        del pending[key]
        order.append(attempts[key])
        for then in after[key]:
            if then in pending:
                pending[then] -= 1
                if pending[then] == 0:
                    heapq.heappush(ready, (attempts[then].started, then))
    return order


def _lineage(order: list[_Attempt]) -> dict[int, LedgerStep]:
    """The steps that led to the last attempt's state: its own, then, up to the step it resumed
    from, those of the attempt it continued, and so on back to a fresh start."""
    history: dict[int, LedgerStep] = {}
    index = len(order) - 1
    limit = order[index].reach if order else 0  # the last attempt: up to its last completed step
    while index >= 0 and limit > 0:
        attempt = order[index]
        history.update((step, entry) for step, entry in attempt.steps.items() if step <= limit)
        limit = attempt.resume_step
        earlier = [i for i in range(index) if order[i].resume_step <= limit]
        # The latest state at step `limit` is the one a resume from it loaded. Where no attempt on
        # record reached it (an earlier run without the ledger), the latest one that resumed no
        # later holds the steps before it, and the steps between are missing from the history.
        reached = [i for i in earlier if order[i].reach >= limit]
        index = (reached or earlier or [-1])[-1]
    return dict(sorted(history.items()))


def read_skipped(run_dir: str | os.PathLike) -> list[dict]:
    """The bad records a sharded source left out, as each attempt recorded them (the last record wins)."""
    found: list[dict] = []
    for path in sorted((Path(run_dir) / LEDGER_DIR).glob("rank-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if '"skipped"' in line:  # parsed only where it may be one: a ledger holds a line per step and rank
                found = json.loads(line).get("skipped", found)
    return found


def exactly_once_problems(history: dict[int, LedgerStep], samples_per_epoch: int) -> list[str]:
    """What is wrong with a job's history (:func:`read_ledger`) against "every step once, every
    sample once per epoch"; empty when nothing is.

    Steps must run 1, 2, ... without a gap; the samples the steps consumed, in order, cut into
    epochs of ``samples_per_epoch``, must repeat none within an epoch and leave none out of a
    complete one (the data order takes each epoch's samples in turn, a global batch crossing into
    the next epoch where one ends).
    """
    problems = []
    steps = list(history)
    if steps != list(range(1, len(steps) + 1)):
        seen = set(steps)
        missing = [s for s in range(1, max(steps, default=0) + 1) if s not in seen]
        problems.append(f"the steps do not run 1..{len(steps)} once each (missing: {missing[:10]})")
    consumed = [i for entry in history.values() for i in entry.all_indices]
    for start in range(0, len(consumed), samples_per_epoch):
        epoch, number = consumed[start : start + samples_per_epoch], start // samples_per_epoch
        if len(set(epoch)) != len(epoch):
            problems.append(f"epoch {number} consumed a sample more than once")
        elif len(epoch) == samples_per_epoch and sorted(epoch) != list(range(samples_per_epoch)):
            problems.append(f"epoch {number} left samples out")
    return problems
