"""How a worker stops: on request at an agreed step, when its agent is gone, or with a clear status.

Before the training loop starts there is nothing to save, so SIGTERM or SIGINT ends the worker at
once with :data:`EXIT_STOPPED` -- also while it waits in C++ for its peers in process-group set-up
(:class:`StopSignal`). From the loop's start, stopping is cooperative. SIGTERM (what Kubernetes,
Slurm and torchrun send on preemption or before restarting a worker group) only sets a flag. Every
rank adds its flag to a tiny all-reduce on a gloo group of its own (:class:`StopAgreement`), started
every ``dist.stop_check_s`` seconds of steps and read at the next of those, so it never waits on
the GPU or on the network: all ranks learn of a stop at the same step boundary -- at most two
such periods (and two steps) after the signal -- and commit a checkpoint of that same step.

After that checkpoint a rank that received the signal itself exits (:data:`EXIT_STOPPED`). A rank
that did not -- a survivor of a preemption elsewhere -- waits (:func:`wait_for_restart`) until its
own agent, noticing the membership change, restarts it at the new world size: no step is lost and
no restart of ``--max-restarts`` is spent.

When the agent stops its workers because nodes of their round are gone (a node died), no step
boundary can be agreed with the dead: it says so first (:func:`report_members_gone`), and a rank
that does not leave within :data:`MEMBERS_GONE_GRACE_S` of the signal -- one waiting in a collective
on a dead peer -- leaves then, instead of after ``checkpoint.grace_s`` or torchrun's SIGKILL.

When the agent stops its workers only to admit a joining node, it says that first too
(:func:`report_nodes_joining`). Every node of the old round stays, and each holds the agreed step's
state in its memory tier, so that is all the stop needs to commit. When every signalled rank's stop
is of that kind, the agreement says no durable checkpoint is needed (:attr:`StopAgreement.durable`).
A stop that any rank received from outside, a preemption say, is committed to the durable tier as
before; once it is, the node's workers tell their agent (:func:`report_leaving`), which leaves the
rendezvous then instead of once they are gone, so the others' restart starts sooner.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from elastic_ddp.agent_marks import (
    clear_restart_marks, members_gone, nodes_joining, read_settings_error, report_leaving, report_members_gone,
    report_nodes_joining, report_settings_error,
)  # fmt: skip
from elastic_ddp.contract import (
    ENV_AGENT_PID, ENV_SETTINGS_ERROR_DIR, EXIT_CONFIG, EXIT_FAILED, EXIT_NOT_RESTARTED, EXIT_ORPHANED, EXIT_STOP_TIMEOUT,
    EXIT_STOPPED, LEAVING_SOCKET, MAX_LEAVING_MESSAGE,
)  # fmt: skip

__all__ = [
    "ENV_AGENT_PID", "ENV_SETTINGS_ERROR_DIR", "LEAVING_SOCKET", "MAX_LEAVING_MESSAGE", "EXIT_CONFIG",
    "EXIT_FAILED", "EXIT_NOT_RESTARTED", "EXIT_ORPHANED", "EXIT_STOPPED", "EXIT_STOP_TIMEOUT",
    "MAX_STEPS_BETWEEN_AGREEMENTS", "StopAgreement", "StopSignal", "clear_restart_marks", "exit_when_orphaned",
    "flush_and_exit", "members_gone", "nodes_joining", "read_settings_error", "report_leaving",
    "report_members_gone", "report_nodes_joining", "report_settings_error", "steps_between", "wait_for_restart",
]  # fmt: skip

log = logging.getLogger(__name__)


class StopSignal:
    """SIGTERM/SIGINT: until :meth:`steps_started`, exit at once; from then on, a request to stop at
    a step boundary.

    Before the first step there is nothing to save: a signal ends the worker within moments with
    :data:`EXIT_STOPPED` (what a stopped worker exits with; torch's agent does not read the status
    of workers it stops itself, and for anyone else it means "run again to resume"). The signal may
    come while the main thread waits in C++ -- ``init_process_group`` waiting for its peers, a store
    wait -- where a Python signal handler does not run until the call returns (torchrun waited 30 s,
    then sent SIGKILL). So a watcher thread takes the exit, woken through
    :func:`signal.set_wakeup_fd`: Python's C-level handler writes the signal's number to a pipe the
    moment the signal arrives, whatever the main thread is doing. The pipe replaces any other wakeup
    fd of the process (an asyncio loop's) until :meth:`restore`; a forked child keeps neither it nor
    the handlers.

    From :meth:`steps_started` on, a signal only sets a flag, so the loop can stop at a step
    boundary. Further signals while stopping are logged and otherwise ignored: on Slurm a preemption
    signals every process of the step, torchrun forwards its own SIGTERM, and a batch script may
    forward once more -- none of them may kill the stop checkpoint. ``grace_s`` bounds the
    cooperative stop: a rank stuck where it cannot reach a step boundary (a hung collective, a peer
    that froze) exits with :data:`EXIT_STOP_TIMEOUT` that long after the first signal instead of
    waiting for SIGKILL -- :data:`MEMBERS_GONE_GRACE_S` when the agent reported that nodes of the
    round are gone (:func:`members_gone`), since no boundary can be agreed with them. The watcher
    thread starts that clock when the signal arrives, even while the main thread waits in C++.

    Create it in the main thread (Python's signal API requires it).
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT), grace_s: float | None = None) -> None:
        self.received: int | None = None
        self.received_at: float | None = None
        # Why the agent stopped the workers when the signal came only to admit a joining node
        # (report_nodes_joining); None for any other signal, a preemption's included.
        self.for_join: str | None = None
        self.repeats = 0
        self._signals = frozenset(signals)
        self._grace_s = grace_s
        self._timer: threading.Timer | None = None
        self._timer_lock = threading.Lock()
        self._woken = threading.Event()
        self._stepping = False
        self._restored = False
        self._previous = {}
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._wakeup_read, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_write, False)  # required by set_wakeup_fd: a signal never blocks
        self._previous_wakeup = signal.set_wakeup_fd(self._wakeup_write, warn_on_full_buffer=False)
        _ACTIVE.append(self)
        self._watcher = threading.Thread(target=self._watch, name="stop-signal-watch", daemon=True)
        self._watcher.start()

    def steps_started(self) -> None:
        """The training loop starts: from now on a signal is a request to stop at a step boundary."""
        self._stepping = True

    def _watch(self) -> None:
        """The watcher thread: exit on the first of our signals that arrives before the loop starts;
        once it has started, start the stop's grace clock."""
        while True:
            try:
                numbers = os.read(self._wakeup_read, 64)
            except OSError:
                return
            if self._restored:
                return
            # Any signal with a Python handler writes its number (SIGCHLD, say, if someone handles it).
            mine = [n for n in numbers if n in self._signals]
            if mine and not self._stepping:
                log.warning("Signal %s received before training started: nothing to save yet; exiting with status %d.",
                            signal.Signals(mine[0]).name, EXIT_STOPPED)  # fmt: skip
                flush_and_exit(EXIT_STOPPED)
            if mine:
                self._start_grace(mine[0])

    def _start_grace(self, signum: int) -> None:
        with self._timer_lock:
            if self._timer is not None:
                return
            gone = members_gone(os.environ.get(ENV_SETTINGS_ERROR_DIR, ""))
            grace = self._grace_s if gone is None else min(self._grace_s or MEMBERS_GONE_GRACE_S, MEMBERS_GONE_GRACE_S)
            if grace is None:
                return
            self._timer = threading.Timer(grace, self._grace_expired, args=(signum, grace, gone))
            self._timer.daemon = True
            self._timer.start()

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            self.repeats += 1
            # Safe in a handler: logging from the main thread between bytecodes; the record is short.
            log.warning("Signal %s received again while stopping; the stop checkpoint goes on.", signal.Signals(signum).name)
            self._woken.set()
            return
        self.received = signum
        self.received_at = time.monotonic()
        self.for_join = nodes_joining(os.environ.get(ENV_SETTINGS_ERROR_DIR, ""))
        self._woken.set()
        self._start_grace(signum)  # the watcher thread usually has, the moment the signal arrived

    def _grace_expired(self, signum: int, grace: float, gone: str | None) -> None:
        if gone is not None:
            log.warning("Signal %s: the agent restarts the workers because %s; this rank waits on a peer that is gone "
                        "(no step boundary can be agreed with it) and leaves now. The run resumes from the newest "
                        "state in node memory or storage.", signal.Signals(signum).name, gone)  # fmt: skip
            flush_and_exit(EXIT_STOPPED)
        log.error(
            "Signal %s was received %.0f s ago and this rank has not finished its stop at a step boundary; exiting. "
            "Where each of its threads was (the main thread's frame is where the stop waited):",
            signal.Signals(signum).name, grace,
        )  # fmt: skip
        # What a user needs to tell a stuck collective from a slow save, and the one chance to see it.
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        flush_and_exit(EXIT_STOP_TIMEOUT)

    def stopped(self) -> None:
        """The stop reached its step boundary and its checkpoint: the grace timer has nothing left to bound."""
        if self._timer is not None:
            self._timer.cancel()

    def wait(self, timeout: float) -> bool:
        """Block until a signal is received (True) or ``timeout`` s pass (False)."""
        return self._woken.wait(timeout)

    @property
    def requested(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        """Put back the handlers and wakeup fd that were there before, and end the watcher thread."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_wakeup)
        _ACTIVE.remove(self)
        self._restored = True
        # A byte, not end-of-file, wakes the watcher: a forked child (a DataLoader worker) may still
        # hold the pipe's write end.
        os.write(self._wakeup_write, b"\0")
        self._watcher.join()
        os.close(self._wakeup_write)
        os.close(self._wakeup_read)


# This process's StopSignals not yet restored, oldest first (see _signals_as_before_in_child).
_ACTIVE: list[StopSignal] = []


def _signals_as_before_in_child() -> None:
    """In a child made by ``fork`` (a ``multiprocessing`` pool, a DataLoader worker): the signal
    handlers and wakeup fd as they were before any StopSignal. The child is not the training process:
    with the inherited wakeup fd its signals would reach the parent's watcher through the shared pipe
    (the SIGTERM that ``Pool.terminate()`` sends its workers would end the parent), and with the
    inherited handler a SIGTERM would not end it (``Pool.terminate()`` would wait for it forever)."""
    if not _ACTIVE:
        return
    # The forking thread is the child's main thread, which may set handlers. Newest first, so that
    # the oldest StopSignal's predecessors are what remains; a handler set since is left alone.
    for stop in reversed(_ACTIVE):
        for signum, previous in stop._previous.items():
            if signal.getsignal(signum) == stop._handle:
                signal.signal(signum, previous)
    fd = signal.set_wakeup_fd(-1)
    if fd not in {stop._wakeup_write for stop in _ACTIVE}:
        signal.set_wakeup_fd(fd)  # not ours: leave it
    _ACTIVE.clear()


os.register_at_fork(after_in_child=_signals_as_before_in_child)


def flush_and_exit(status: int) -> NoReturn:
    """Leave now with ``status``, from any thread, after flushing the logs and standard streams.

    ``os._exit``: the main thread may be stuck in C++ (or in a collective whose peer is gone), where
    ``sys.exit`` and interpreter teardown would wait for it.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


class StopAgreement:
    """Whether any rank was asked to stop, agreed by all ranks at the same step, off the critical path.

    :meth:`after_step` is called by every rank once per step. Every ``period_s`` seconds of steps
    (``dist.stop_check_s``) it reads the result of the tiny all-reduce it started at the previous
    agreement and starts the next one with this rank's flag. The all-reduce thus has a whole period
    to complete: a few bytes over gloo, while the GPU computes steps -- and, at thousands of ranks,
    the hops of a ring, which take longer than a step but not than a period. So all ranks see the
    same value at the same step, and a signal stops the job at most two periods (and two steps)
    after it arrived. The flag is a CPU tensor on a gloo group of its own: no GPU synchronisation,
    no interleaving with the gradient all-reduces or the checkpoint's collectives. Without a
    process group (one rank) the flag is read directly, every step.

    Why a period and not every step: each all-reduce wakes a gloo thread on every rank and a round
    of messages between them, which a fast step (a few ms on a CPU, or a small model) pays as
    several percent. The steps between two agreements are counted, not timed, so that every rank
    starts the next one at the same step: each agreement also carries this rank's mean step time
    since the previous one, and every rank derives the same count from the agreed maximum
    (:func:`steps_between`). ``period_s=0`` agrees after every step.

    With the stop, whether it needs the durable tier (:attr:`durable`): True unless every rank that
    was signalled by then was stopped by its agent only to admit a joining node
    (:attr:`StopSignal.for_join`); a rank not signalled yet has no say.

    ``values`` more numbers ride on the same all-reduce (the maximum over ranks is agreed): at each
    agreement :meth:`after_step` asks the caller for this rank's (``report``), and :attr:`agreed`
    holds the maxima at the next agreement -- the same tuple on every rank at the same step, None at
    steps where nothing new was agreed -- for decisions all ranks must take alike (the memory tier's
    save interval) without a collective of their own.
    """

    def __init__(
        self,
        stop_signal: StopSignal,
        group: Any = None,
        values: int = 0,
        period_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._signal = stop_signal
        self._group = group
        self._values = values
        self._period_s = period_s
        self._clock = clock
        # [stop, stop from outside (the durable tier needed), mean step time since the last start, values...]
        self._buffer = torch.zeros(3 + values, dtype=torch.float64)
        self._pending: Any = None
        self._until_next = 1  # calls until the next agreement, this one included
        self._every = 1  # steps from the last agreement to the next
        self._started_at: float | None = None  # when the last all-reduce started
        self.agreed: tuple[float, ...] | None = None
        self.durable = True

    def after_step(self, report: Callable[[], Sequence[float]] | None = None) -> bool:
        """True when every rank must stop after the step just completed. ``report``: this rank's
        ``values`` numbers, called only when an all-reduce starts (zeros without it)."""
        if self._group is None:
            values = self._own_values(report)
            self.agreed = values if self._values else None
            self.durable = self._from_outside()
            return self._signal.requested
        self.agreed = None
        self._until_next -= 1
        if self._until_next > 0:
            return False
        agreed_step_s = 0.0
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            result = self._buffer.tolist()
            self.agreed = tuple(result[3:]) if self._values else None
            if result[0] > 0:
                self.durable = result[1] > 0
                return True
            agreed_step_s = result[2]
        values = self._own_values(report)
        now = self._clock()
        self._buffer[0] = 1.0 if self._signal.requested else 0.0
        self._buffer[1] = 1.0 if self._from_outside() else 0.0
        self._buffer[2] = (now - self._started_at) / self._every if self._started_at is not None else 0.0
        for i, value in enumerate(values, start=3):
            self._buffer[i] = float(value)
        self._started_at = now
        # From the agreed maximum: the same count on every rank.
        self._every = self._until_next = steps_between(self._period_s, agreed_step_s)
        # MAX: the flag is set if any rank's is, and each number is the largest any rank reported.
        self._pending = dist.all_reduce(self._buffer, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return False

    def _own_values(self, report: Callable[[], Sequence[float]] | None) -> tuple[float, ...]:
        values = tuple(float(v) for v in report()) if report is not None else (0.0,) * self._values
        if len(values) != self._values:
            raise ValueError(f"StopAgreement was made for {self._values} value(s) per agreement, got {len(values)}.")
        return values

    def _from_outside(self) -> bool:
        return self._signal.requested and self._signal.for_join is None

    def close(self) -> None:
        """Wait for an all-reduce still in flight (every rank started it, so it completes)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None


# Most steps between two stop agreements, however short a step: a bound on a stop's delay in steps
# when the clock says little (steps of microseconds).
MAX_STEPS_BETWEEN_AGREEMENTS = 1000


def steps_between(period_s: float, step_s: float) -> int:
    """Steps from one stop agreement's start to the next: ``period_s`` worth of steps of ``step_s``
    (the agreed mean step time; 0: not measured yet), at least 1, at most
    :data:`MAX_STEPS_BETWEEN_AGREEMENTS`. Every rank computes it from the same agreed numbers."""
    if period_s <= 0 or step_s <= 0:
        return 1
    return max(1, min(MAX_STEPS_BETWEEN_AGREEMENTS, int(period_s / step_s)))


def wait_for_restart(stop_signal: StopSignal, timeout_s: float) -> int:
    """After a stop checkpoint: the exit status to leave with, once this rank may leave.

    A rank that received the stop signal itself leaves now. Any other rank waits for its agent's
    SIGTERM, which comes when the agent restarts the workers at the new membership, and then
    leaves; should it not come within ``timeout_s``, the rank leaves with an error so that the agent
    restarts it anyway (the checkpoint is committed, so nothing is lost either way).
    """
    if not stop_signal.requested:
        log.info("Stop checkpoint committed; waiting for the agent to restart this rank at the new membership.")
        if not stop_signal.wait(timeout_s):
            log.error("No restart within %.0f s of the stop checkpoint; exiting so the agent restarts this rank.", timeout_s)
            return EXIT_NOT_RESTARTED
    return EXIT_STOPPED


def exit_when_orphaned(poll_s: float = 1.0) -> threading.Thread:
    """Exit this worker within ``poll_s`` seconds of its parent (the torchrun agent) dying.

    torchrun starts workers in a session of their own, so they survive a SIGKILL of their agent
    and would keep training with the old group. A lost parent shows as a changed ``getppid()``.
    """
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                log.error("The torchrun agent (pid %d) is gone; exiting this orphaned worker.", parent)
                os._exit(EXIT_ORPHANED)

    thread = threading.Thread(target=watch, name="orphan-watch", daemon=True)
    thread.start()
    return thread


# How long a rank signalled while nodes of its round are gone may take to leave by itself (a rank
# waiting for its restart, or between steps, leaves at once; one in a collective with the dead never).
MEMBERS_GONE_GRACE_S = 1.0
