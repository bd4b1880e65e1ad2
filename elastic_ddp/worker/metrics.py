"""TensorBoard metrics and console progress that tell the story of an elastic run.

Only global rank 0 writes. :func:`create_metrics` returns a :class:`TensorBoardMetrics` there and
a :class:`Metrics` (the no-op twin, same interface) on every other rank, so the training loop calls
the same methods everywhere and never tests the rank itself.

One TensorBoard directory serves the whole job, across every torchrun restart:

* Each attempt opens a new event file with ``purge_step = (resume_step or 0) + 1``. TensorBoard's
  readers then drop the points an earlier attempt logged at or after that step (the work a failed
  attempt did after its last checkpoint is redone, so its points are stale). Every tag therefore
  reads back with unique, increasing steps: the curves of a run with restarts look like those of
  a run without.
* A tiny progress record (``progress.json`` in the run directory; any fsspec URL) remembers the
  last logged step, its wall time, the world size and torchrun's restart count. A new attempt
  reads it to log ``elastic/recovery_s`` and the events "World size changed from A to B" and
  "Failure recovered after X s".

Writing never stalls training: a logged step's scalars go into one event (one summary of every
tag), which ``SummaryWriter`` queues for a background thread (the queue is sized so that queueing
never waits for it), and the progress record is written by a background thread of its own, which
keeps only the newest record and rewrites it at most every :data:`PROGRESS_MIN_INTERVAL_S`.
"""

from __future__ import annotations

import atexit
import datetime
import glob
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from elastic_ddp.checkpoint.storage import Storage, join
from elastic_ddp.config import ConfigError, LoggingConfig
from elastic_ddp.worker.lifecycle import (  # noqa: F401 - the end states are also importable from here
    ENDED_EXIT_AT_STEP, ENDED_FINISHED, ENDED_MEMBERSHIP, ENDED_STOPPED, ended_text,
)  # fmt: skip

log = logging.getLogger(__name__)

# torchrun sets this in every worker: how many times the agent has restarted the worker group.
ENV_TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"

PROGRESS_FILE = "progress.json"
# The progress record is rewritten at most this often. On local disk a rewrite is two fsyncs, and a
# fast loop logs tens of steps a second, whose writes would take host cores from the ranks. A process
# killed outright (SIGKILL, a lost node) leaves a record up to this much older than its last logged
# step, which the next attempt's elastic/recovery_s then includes; every other end writes the last one.
PROGRESS_MIN_INTERVAL_S = 1.0

# Text tags. add_text stores a tag T as "T/text_summary"; readers find them under that name.
TAG_CONFIG = "config"
TAG_EVENTS = "events"

# SummaryWriter's default queue holds 10 events; past it, queueing waits for the writer thread's
# file writes. A large queue keeps queueing a put into memory: even a few thousand logged steps'
# events are a few megabytes.
_MAX_QUEUE = 10_000

# Event files are named events.out.tfevents.<unix seconds>.<host>.<pid>.<n> and TensorBoard reads
# them in name order; a purge only hides points of files read before the purging one.
_EVENT_FILE_TIME = re.compile(r"events\.out\.tfevents\.(\d+)\.")
# Waiting for the next second is cheap; waiting out a skewed clock of another machine is not.
_MAX_NAME_ORDER_WAIT_S = 2.0


def restart_count_from_env() -> int:
    """torchrun's restart count of this worker group (0 outside torchrun)."""
    return int(os.environ.get(ENV_TORCHELASTIC_RESTART_COUNT, "0") or 0)


def _format_duration(seconds: float) -> str:
    """``H:MM:SS`` (``D days, H:MM:SS`` beyond a day); ``-`` for an unknown duration."""
    if not math.isfinite(seconds) or seconds < 0:
        return "-"
    return str(datetime.timedelta(seconds=round(seconds)))


def console_line(
    *,
    rank: int,
    step: int,
    max_steps: int,
    scalars: Mapping[str, float],
    world_size: int,
    rate_origin: tuple[int, float] | None,
    now: float,
) -> str:
    """The compact progress line, as a pure function (``now`` is passed in).

    ``rate_origin`` is ``(step, time)`` of the first step logged by this attempt: the ETA is the
    remaining steps at this attempt's mean step rate since then (steps of earlier attempts ran at
    other world sizes, so they are no guide). Without a usable origin, ``perf/step_time_s`` is
    used, else the ETA is ``-``. Every field is ``key=value`` so the lines grep well under
    torchrun's per-worker prefixes, e.g.::

        [rank0] step=30/300 loss=2.3456 samples_per_s=1234.5 world_size=4 eta=0:05:12
    """
    remaining = max(max_steps - step, 0)
    eta = float("nan")
    if rate_origin is not None and step > rate_origin[0] and now > rate_origin[1]:
        eta = (now - rate_origin[1]) / (step - rate_origin[0]) * remaining
    elif "perf/step_time_s" in scalars:
        eta = float(scalars["perf/step_time_s"]) * remaining
    parts = [f"[rank{rank}] step={step}/{max_steps}"]
    if "train/loss" in scalars:
        parts.append(f"loss={float(scalars['train/loss']):.4f}")
    if "perf/samples_per_s" in scalars:
        parts.append(f"samples_per_s={float(scalars['perf/samples_per_s']):.1f}")
    parts.append(f"world_size={world_size}")
    parts.append(f"eta={_format_duration(eta)}")
    return " ".join(parts)


def summary_line(
    *,
    rank: int,
    step: int | None,
    max_steps: int,
    final_loss: float | None,
    wall_s: float,
    attempt_wall_s: float,
    restarts: int,
    ended: str = ENDED_FINISHED,
) -> str:
    """The one line printed at the end of an attempt, as a pure function.

    ``wall_s`` spans the whole job (from the first attempt's start), ``attempt_wall_s`` this
    process only; ``restarts`` counts the attempts before this one; ``ended`` says why it ended
    (one of the ``ENDED_*`` values).
    """
    loss = "-" if final_loss is None else f"{final_loss:.4f}"
    steps = "-" if step is None else str(step)
    return (
        f"[rank{rank}] {ended_text(ended)}: steps={steps}/{max_steps} final_loss={loss} "
        f"wall={_format_duration(wall_s)} attempt_wall={_format_duration(attempt_wall_s)} "
        f"restarts={restarts}"
    )


class Metrics:
    """The metrics interface; this base class is the no-op twin every rank but 0 gets.

    Every method is safe to call in any order, any number of times, and returns quickly.
    """

    def __init__(self, cfg: LoggingConfig, *, max_steps: int, start_step: int = 1) -> None:
        self.cfg = cfg
        self.max_steps = max_steps
        self.start_step = start_step

    def should_log(self, step: int) -> bool:
        """Whether the loop should gather scalars and call :meth:`log_step` at ``step``.

        The same answer on every rank (the loop all-reduces the loss there): every
        ``logging.every_steps`` steps, the last step, and the first step of this attempt (which
        keeps ``elastic/recovery_s`` exact).
        """
        return step % self.cfg.every_steps == 0 or step >= self.max_steps or step == self.start_step

    def log_step(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record ``scalars`` (tag -> value) at global optimizer step ``step``."""

    def event(self, text: str) -> None:
        """Record a notable happening (e.g. "Resumed from <checkpoint> (step N)") as text."""

    def log_config(self, yaml_text: str) -> None:
        """Record the run's whole configuration (YAML, secrets already redacted) as text."""

    def previous_step(self) -> int | None:
        """The last step an earlier attempt of the run logged (None: unknown here, or none logged)."""
        return None

    def summary(self, ended: str = ENDED_FINISHED) -> str:
        """Print and return the one-line summary of this attempt (empty on the no-op twin)."""
        return ""

    def close(self, ended: str | None = None) -> None:
        """Flush and release everything; ``ended`` (an ``ENDED_*`` value) tells the next attempt how
        this one ended (None: it did not end cleanly). Idempotent."""

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _ProgressRecord:
    """The run's progress record: read once at start, rewritten by a background thread.

    The record is ``{"step", "time", "world_size", "restart_count", "start_time", "attempts"}``
    as JSON, written with :meth:`~elastic_ddp.checkpoint.storage.Storage.write_bytes_atomic`, so a
    reader (the next attempt, perhaps on another machine) never sees half a file. Only the newest
    pending record is kept: a slow store (S3) delays the record, never the training loop.
    """

    def __init__(
        self, run_dir: str, storage_options: Mapping[str, Any] | None, min_interval_s: float = PROGRESS_MIN_INTERVAL_S
    ) -> None:
        self._storage = Storage(run_dir, dict(storage_options or {}))
        self.path = join(self._storage.url, PROGRESS_FILE)
        self._min_interval_s = min_interval_s
        self._pending: dict[str, Any] | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="metrics-progress", daemon=True)
        self._thread.start()

    def read(self) -> dict[str, Any] | None:
        """The stored record, or None when there is none or it cannot be read (logged)."""
        try:
            record = json.loads(self._storage.read_bytes(self.path))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("Ignoring the unreadable progress record %s: %s", self.path, exc)
            return None
        if not isinstance(record, dict):
            log.warning("Ignoring the progress record %s: not a JSON object.", self.path)
            return None
        return record

    def put(self, record: dict[str, Any]) -> None:
        """Queue ``record`` for writing; it replaces any record not yet written."""
        with self._cond:
            # With a record pending, the thread is writing or waiting out its interval, and takes the
            # newest when it is done: only an empty slot can have it waiting for a record.
            if self._pending is None:
                self._cond.notify()
            self._pending = dict(record)

    def close(self) -> None:
        """Write the last pending record, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        next_write = 0.0  # time.monotonic() from which the next record may be written
        while True:
            with self._cond:
                while not self._closed:
                    if self._pending is None:
                        self._cond.wait()
                        continue
                    delay = next_write - time.monotonic()
                    if delay <= 0:
                        break
                    self._cond.wait(delay)  # a newer record may replace the pending one meanwhile
                record, self._pending = self._pending, None
                closed = self._closed
            if record is not None:
                self._write(record)
                next_write = time.monotonic() + self._min_interval_s
            if closed:
                return

    def _write(self, record: dict[str, Any]) -> None:
        try:
            self._storage.makedirs(self._storage.url)
            self._storage.write_bytes_atomic(self.path, json.dumps(record).encode())
        except OSError as exc:
            # The record only feeds recovery_s and the world-size event of the next attempt;
            # losing one write must not stop training, and the next log retries.
            log.warning("Could not write the progress record %s: %s", self.path, exc)


def _wait_for_later_event_file_name(log_dir: str) -> None:
    """Make sure the event file opened next sorts after every event file already in ``log_dir``.

    TensorBoard reads event files in name order and the name starts with the creation time in
    whole seconds, so a new file opened in the same second as an old one (restarts in tests,
    fast local restarts) could sort first, and then its purge would hide nothing.
    """
    newest = -1
    for name in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        match = _EVENT_FILE_TIME.match(os.path.basename(name))
        if match:
            newest = max(newest, int(match.group(1)))
    if newest < 0:
        return
    wait_s = newest + 1 - time.time()
    if wait_s <= 0:
        return
    if wait_s > _MAX_NAME_ORDER_WAIT_S:
        log.warning(
            "An event file in %s is dated %.0f s in the future (clock skew between machines?); "
            "TensorBoard may still show the points a failed attempt logged after its last checkpoint.",
            log_dir,
            wait_s,
        )
        return
    time.sleep(wait_s)


class TensorBoardMetrics(Metrics):
    """Rank 0's metrics: TensorBoard events, the progress record and console lines.

    Use :func:`create_metrics` rather than constructing this directly.
    """

    def __init__(
        self,
        cfg: LoggingConfig,
        *,
        run_dir: str,
        resume_step: int | None,
        world_size: int,
        restart_count: int,
        max_steps: int,
        storage_options: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # Imported here so ranks other than 0 never pay for importing TensorBoard.
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter

        self._summary = Summary

        super().__init__(cfg, max_steps=max_steps, start_step=(resume_step or 0) + 1)
        self.rank = 0
        self.world_size = world_size
        self.restart_count = restart_count
        self._clock = clock
        self._start_time = clock()
        self._last_step: int | None = None
        self._last_time = 0.0
        self._last_loss: float | None = None
        self._rate_origin: tuple[int, float] | None = None
        self._pending_events: list[str] = []
        self._last_events_step = -1
        self._write_failed = False
        self._closed = False

        self._progress = _ProgressRecord(run_dir, storage_options)
        self._previous = self._progress.read()
        previous = self._previous or {}
        self._job_start_time = float(previous.get("start_time", self._start_time))
        self._attempts = int(previous.get("attempts", 0)) + 1
        # How this attempt relates to the last one that logged: recovering from a failure (no clean
        # end recorded), resuming after a stop, or continuing a run that had ended (e.g. a longer
        # train.max_steps) -- which is not a recovery at all.
        self._recovering = self._previous is not None and "time" in previous
        self._previous_end = previous.get("ended")
        if self._previous is not None and previous.get("world_size") not in (None, world_size):
            self.event(f"World size changed from {previous['world_size']} to {world_size}")

        os.makedirs(cfg.tensorboard_dir, exist_ok=True)
        _wait_for_later_event_file_name(cfg.tensorboard_dir)
        # SummaryWriter opens its event file and writes the purge marker (a session START at
        # purge_step) in its constructor, before any point of this attempt.
        # Always purge, also on a fresh start: an earlier attempt that never checkpointed left
        # points from step 1 on. And TensorBoard's own server (--load_fast=false) ignores the
        # first session START of a run, so a purge only works if every attempt wrote one.
        self._writer = SummaryWriter(
            log_dir=cfg.tensorboard_dir,
            purge_step=self.start_step,
            max_queue=_MAX_QUEUE,
            flush_secs=cfg.flush_s,
        )
        atexit.register(self.close)

    def previous_step(self) -> int | None:
        step = (self._previous or {}).get("step")
        return step if isinstance(step, int) else None

    def log_step(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._closed:
            return
        now = self._clock()
        values = {tag: float(value) for tag, value in scalars.items()}
        values["elastic/world_size"] = float(self.world_size)
        values["elastic/restart_count"] = float(self.restart_count)
        if self._recovering:
            self._recovering = False
            self._event_for_previous_attempt(step, now, values)
        try:
            # One event holding every tag's value (what add_scalar writes for one tag): one
            # serialization and one queued write a logged step instead of one per tag.
            summary = self._summary(value=[self._summary.Value(tag=t, simple_value=v) for t, v in values.items()])
            self._writer._get_file_writer().add_summary(summary, step, now)
            self._write_pending_events(step, now)
        except OSError as exc:
            # The writer thread failed (disk full, directory gone) and re-raises here. Curves
            # are not worth a lost training run: warn once, keep the console and the record.
            if not self._write_failed:
                self._write_failed = True
                log.warning("TensorBoard events can no longer be written to %s: %s",
                            self.cfg.tensorboard_dir, exc)

        self._last_step = step
        self._last_time = now
        if "train/loss" in values:
            self._last_loss = values["train/loss"]
        if self._rate_origin is None:
            self._rate_origin = (step, now)
        self._progress.put(self._record(step, now))
        if self.cfg.console and (self.should_log(step) or self._rate_origin[0] == step):
            line = console_line(
                rank=self.rank,
                step=step,
                max_steps=self.max_steps,
                scalars=values,
                world_size=self.world_size,
                rate_origin=self._rate_origin,
                now=now,
            )
            # print, not logging: this line is the product's output and must show whatever the
            # application configured for logging (the root logger drops INFO by default);
            # flush because torchrun pipes worker stdout, which is block-buffered otherwise.
            print(line, flush=True)

    def _event_for_previous_attempt(self, step: int, now: float, values: dict[str, float]) -> None:
        previous = self._previous or {}
        gap_s = max(now - float(previous["time"]), 0.0)
        before = previous.get("step")
        if self._previous_end in (ENDED_FINISHED, ENDED_EXIT_AT_STEP):
            self.event(f"Continuing the run, which ended at step {before}; first step now: {step}")
            return
        values["elastic/recovery_s"] = gap_s
        if self._previous_end in (ENDED_STOPPED, ENDED_MEMBERSHIP):
            self.event(f"Resumed {gap_s:.1f} s after the stop at step {before}; first step now: {step}")
        else:
            self.event(
                f"Failure recovered after {gap_s:.1f} s (last step logged before: {before}, first step "
                f"logged now: {step})"
            )

    def event(self, text: str) -> None:
        # Shown at once on the console; written to TensorBoard with the next logged step, so
        # the events tag holds one entry per step even when several events happen together.
        if self._closed:
            return
        if self.cfg.console:
            print(f"[rank{self.rank}] event: {text}", flush=True)
        else:
            log.info("[rank%d] event: %s", self.rank, text)
        self._pending_events.append(text)

    def log_config(self, yaml_text: str) -> None:
        if self._closed:
            return
        # The text plugin renders Markdown; a fenced block keeps YAML's indentation.
        self._writer.add_text(TAG_CONFIG, f"```yaml\n{yaml_text}\n```", global_step=self.start_step)

    def summary(self, ended: str = ENDED_FINISHED) -> str:
        if self._closed and self._last_step is None:
            return ""
        now = self._clock()
        line = summary_line(
            rank=self.rank,
            step=self._last_step,
            max_steps=self.max_steps,
            final_loss=self._last_loss,
            wall_s=now - self._job_start_time,
            attempt_wall_s=now - self._start_time,
            # Attempts that failed before creating their metrics left no trace in the progress
            # record, but torchrun counted them; a resubmitted job restarts torchrun's count at 0.
            restarts=max(self._attempts - 1, self.restart_count),
            ended=ended,
        )
        if self.cfg.console:
            print(line, flush=True)
        return line

    def close(self, ended: str | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            if self._pending_events:
                self._write_pending_events(self._last_step or self.start_step, self._clock())
            self._writer.close()
        except OSError as exc:
            log.warning("Closing the TensorBoard writer of %s failed: %s", self.cfg.tensorboard_dir, exc)
        if self._last_step is None:
            # Nothing logged: keep the record of the last step logged (recovery of the next
            # attempt is measured from there) but count this attempt.
            previous = dict(self._previous or {})
            previous.update(attempts=self._attempts, start_time=self._job_start_time)
            if ended is not None:
                previous["ended"] = ended
            if "time" in previous:
                self._progress.put(previous)
        elif ended is not None:
            self._progress.put({**self._record(self._last_step, self._last_time), "ended": ended})
        self._progress.close()

    def _record(self, step: int, now: float) -> dict[str, Any]:
        return {
            "step": step,
            "time": now,
            "world_size": self.world_size,
            "restart_count": self.restart_count,
            "start_time": self._job_start_time,
            "attempts": self._attempts,
        }

    def _write_pending_events(self, step: int, now: float) -> None:
        if not self._pending_events:
            return
        # One entry per step keeps the events tag's steps unique.
        step = max(step, self._last_events_step + 1)
        text = "\n".join(f"* {item}" for item in self._pending_events)
        self._pending_events.clear()
        self._writer.add_text(TAG_EVENTS, text, global_step=step, walltime=now)
        self._last_events_step = step


def create_metrics(
    cfg: LoggingConfig,
    *,
    rank: int,
    run_dir: str,
    resume_step: int | None,
    world_size: int,
    restart_count: int,
    max_steps: int,
    storage_options: Mapping[str, Any] | None = None,
    clock: Callable[[], float] = time.time,
) -> Metrics:
    """The metrics of this process: a :class:`TensorBoardMetrics` on global rank 0, else the no-op
    :class:`Metrics`.

    ``run_dir`` (a path or fsspec URL, with ``storage_options``) holds the progress record;
    ``cfg.tensorboard_dir`` must be a local path (or ``file://`` URL) because ``SummaryWriter``
    writes local files: a URL there raises :class:`ConfigError` on every rank. ``resume_step`` is
    the step of the checkpoint this attempt resumed from (None: a fresh start): points logged
    after it by earlier attempts are purged. ``restart_count`` is torchrun's
    (:func:`restart_count_from_env`). ``clock`` returns wall-clock seconds (tests move it).
    """
    tensorboard_dir = cfg.tensorboard_dir
    if tensorboard_dir.startswith("file://"):
        tensorboard_dir = tensorboard_dir.removeprefix("file://")
    elif "://" in tensorboard_dir:
        raise ConfigError(
            f"logging.tensorboard_dir ({cfg.tensorboard_dir!r}) must be a local directory: "
            "TensorBoard event files are written with local file I/O. Point it at a local or "
            "shared-filesystem path (and copy it to object storage separately if needed)."
        )
    if not tensorboard_dir:
        raise ConfigError("logging.tensorboard_dir is empty; it must name a local directory.")
    if resume_step is not None and resume_step < 0:
        raise ValueError(f"The resume step ({resume_step}) must not be negative.")
    if rank != 0:
        return Metrics(cfg, max_steps=max_steps, start_step=(resume_step or 0) + 1)
    if tensorboard_dir != cfg.tensorboard_dir:
        cfg = cfg.model_copy(update={"tensorboard_dir": tensorboard_dir})
    return TensorBoardMetrics(
        cfg,
        run_dir=run_dir,
        resume_step=resume_step,
        world_size=world_size,
        restart_count=restart_count,
        max_steps=max_steps,
        storage_options=storage_options,
        clock=clock,
    )
