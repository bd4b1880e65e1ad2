"""Training-loop glue the recipe calls: stop signals, the per-step agreement, the LR schedule.

Stopping is cooperative. SIGTERM (what Kubernetes, Slurm and torchrun send on preemption or
before restarting a worker group) only sets a flag. Once per optimizer step every rank adds its
flag to the one small all-reduce that also sums the loss for logging, so all ranks learn of a
stop at the same step boundary and can commit a checkpoint of that same step before exiting.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastic_ddp.config import TrainConfig

log = logging.getLogger(__name__)

# Exit status of a worker whose agent vanished (the node was lost): it must not train on as a
# ghost of the old group, so it leaves on its own.
EXIT_ORPHANED = 70


class StopSignal:
    """Records SIGTERM/SIGINT instead of dying, so the loop can stop at a step boundary.

    A second signal of the same kind while stopping restores the default action, so an operator
    can still force an exit.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.received: int | None = None
        self.received_at: float | None = None
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


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``cfg.lr``, then cosine decay to ``cfg.min_lr`` at ``cfg.max_steps``.

    A pure function of the step, so a resumed run follows exactly the curve of an uninterrupted one.
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.max_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


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
