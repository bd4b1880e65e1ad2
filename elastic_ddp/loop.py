"""Training-loop glue the recipe calls: stop signals, the per-step agreement, the LR schedule.

Stopping is cooperative. SIGTERM (what Kubernetes, Slurm and torchrun send on preemption or
before restarting a worker group) only sets a flag. Once per optimizer step every rank adds its
flag to the one small all-reduce that also sums the loss for logging, so all ranks learn of a
stop at the same step boundary and can commit a checkpoint of that same step before exiting.

After that checkpoint a rank that received the signal itself exits (:data:`EXIT_STOPPED`). A rank
that did not -- a survivor of a preemption elsewhere -- waits (:func:`wait_for_restart`) until its
own agent, noticing the membership change, restarts it at the new world size: no step is lost and
no restart of ``--max-restarts`` is spent.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import NoReturn
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic_ddp.config import TrainConfig

log = logging.getLogger(__name__)

# Exit status of a worker whose agent vanished (the node was lost): it must not train on as a
# ghost of the old group, so it leaves on its own.
EXIT_ORPHANED = 70
# Exit status after a stop on request with the checkpoint committed (EX_TEMPFAIL: run again to
# resume). Non-zero on purpose: a worker stopped by someone other than its agent is restarted.
EXIT_STOPPED = 75
# The stop did not reach a step boundary (and its checkpoint) within checkpoint.grace_s.
EXIT_STOP_TIMEOUT = 76
# A survivor waited dist.restart_wait_s after a stop checkpoint without being restarted.
EXIT_NOT_RESTARTED = 77


class StopSignal:
    """Records SIGTERM/SIGINT instead of dying, so the loop can stop at a step boundary.

    A second signal of the same kind while stopping restores the default action, so an operator
    can still force an exit. ``grace_s`` bounds the cooperative stop: a rank stuck where it cannot
    reach a step boundary (a hung collective, a peer that froze) exits with
    :data:`EXIT_STOP_TIMEOUT` that long after the signal instead of waiting for SIGKILL.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT), grace_s: float | None = None) -> None:
        self.received: int | None = None
        self.received_at: float | None = None
        self._grace_s = grace_s
        self._woken = threading.Event()
        self._previous = {}
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum
        self.received_at = time.monotonic()
        self._woken.set()
        if self._grace_s is not None:
            timer = threading.Timer(self._grace_s, self._grace_expired)
            timer.daemon = True
            timer.start()

    def _grace_expired(self) -> None:
        log.error(
            "Signal %s was received %.0f s ago and this rank has not stopped at a step boundary; exiting.",
            signal.Signals(self.received).name, self._grace_s,
        )  # fmt: skip
        logging.shutdown()
        os._exit(EXIT_STOP_TIMEOUT)

    def wait(self, timeout: float) -> bool:
        """Block until a signal is received (True) or ``timeout`` s pass (False)."""
        return self._woken.wait(timeout)

    @property
    def requested(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        """Put back the handlers that were there before."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


@dataclass(frozen=True)
class StepOutcome:
    """What all ranks agreed on after one optimizer step."""

    loss: float  # mean per-sample loss over the whole global batch
    stop: bool  # some rank was asked to stop: every rank saves this step and leaves the loop
    stop_here: bool  # this rank itself received the signal


class StepAgreement:
    """One all-reduce per step carrying [loss sum, sample count, stop flag].

    The loss is needed for logging anyway; adding the stop flag to the same tiny tensor
    makes the stop decision free and identical on every rank.
    """

    def __init__(self, device: torch.device, stop_signal: StopSignal) -> None:
        self._buffer = torch.zeros(3, dtype=torch.float64, device=device)
        self._stop_signal = stop_signal

    def agree(self, loss_sum: float, samples: int) -> StepOutcome:
        stop_here = self._stop_signal.requested
        self._buffer[0] = loss_sum
        self._buffer[1] = samples
        self._buffer[2] = 1.0 if stop_here else 0.0
        if dist.is_initialized():
            dist.all_reduce(self._buffer)
        total_loss, total_samples, stops = self._buffer.tolist()
        return StepOutcome(
            loss=total_loss / max(total_samples, 1.0),
            stop=stops > 0,
            stop_here=stop_here,
        )


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


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``cfg.lr``, then cosine decay to ``cfg.min_lr`` at ``cfg.max_steps``.

    A pure function of the step, so a resumed run follows exactly the curve of an uninterrupted one.
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.max_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def run_worker(main: Callable[[list[str]], int], argv: list[str]) -> NoReturn:
    """Run a worker's ``main(argv)`` and exit with its status.

    After an exception the traceback is printed and the process leaves at once (``os._exit``),
    skipping interpreter cleanup: destroying a process group whose peer hangs can block forever
    (gloo waits on the frozen peer's socket), and a failed worker must be gone for its agent to
    restart the group.
    """
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - every failure ends the same way: reported, then gone
        traceback.print_exc()
        code = 1
        _flush_and_exit(code)
    sys.exit(code)


def _flush_and_exit(code: int) -> NoReturn:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


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
