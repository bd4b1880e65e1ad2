"""The scalars of a logged step, gathered in one place from every part of the run that has numbers.

:class:`StepMetrics` assembles the dictionary :meth:`elastic_ddp.worker.metrics.Metrics.log_step` records:
the loss and learning rate, the step time and data wait (:class:`Timing`, averaged between logged
steps), the script's own ``step.log`` scalars, the checkpoint manager's ``ckpt/*`` numbers, the
memory tier's ``memory/*`` numbers while it is on, and at this attempt's first logged step how many
completed steps it trains again (``elastic/steps_redone``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.data import StepBatch, StepBatches
from elastic_ddp.memory.tier import MemoryTier
from elastic_ddp.worker.metrics import Metrics

__all__ = ["StepMetrics", "Timing", "timed"]


class Timing:
    """Wall time and data wait per step, averaged between logged steps (a sync happens at each)."""

    def __init__(self, step: int) -> None:
        self._since_step, self._since = step, time.perf_counter()
        self._wait = 0.0

    def add_wait(self, seconds: float) -> None:
        self._wait += seconds

    def per_step(self, step: int) -> tuple[float, float]:
        now, steps = time.perf_counter(), max(step - self._since_step, 1)
        out = ((now - self._since) / steps, self._wait / steps)
        self._since_step, self._since, self._wait = step, now, 0.0
        return out


def timed(batches: StepBatches, timing: Timing, before_step: Callable[[int], None]) -> Iterator[StepBatch]:
    """The batches, each fetched after ``before_step(step)`` (so a dataset drawing random numbers in
    the training process draws them from that step's seeds), with the time spent waiting for it."""
    iterator = iter(batches)
    step = batches.start_step
    while True:
        step += 1
        before_step(step)
        started = time.perf_counter()
        batch = next(iterator, None)
        if batch is None:
            return
        timing.add_wait(time.perf_counter() - started)
        yield batch


class StepMetrics:
    """Collects and logs the scalars of each logged step of one loop that starts after ``step``.

    ``steps_redone``: the completed steps this attempt trains again (None: unknown), logged once, at
    the attempt's first logged step.
    """

    def __init__(
        self, metrics: Metrics, *, step: int, checkpoints: CheckpointManager, memory: MemoryTier | None,
        optimizer: torch.optim.Optimizer, global_batch_size: int, steps_redone: int | None,
    ) -> None:  # fmt: skip
        self.metrics = metrics
        self.timing = Timing(step)
        self._checkpoints = checkpoints
        self._memory = memory
        self._optimizer = optimizer
        self._samples = global_batch_size
        self._steps_redone = steps_redone

    def collect(self, step: int, loss: float, scalars: Mapping[str, Any]) -> dict[str, float]:
        """The scalars of ``step`` (tag -> value); ``scalars``: the script's own (``step.log``)."""
        step_time_s, data_wait_s = self.timing.per_step(step)
        out = {
            "train/loss": loss,
            "train/lr": float(self._optimizer.param_groups[0]["lr"]),
            "perf/step_time_s": step_time_s,
            "perf/data_wait_s": data_wait_s,
            "perf/samples_per_s": self._samples / step_time_s if step_time_s > 0 else 0.0,
            **{name: float(value) for name, value in scalars.items()},
            **self._checkpoints.metrics(),
        }
        memory = self._memory
        if memory is not None and memory.enabled:
            out["memory/interval_steps"] = float(memory.interval)
            out["memory/stall_s"] = memory.stall_s
            out["memory/save_cost_s"] = memory.cost_s
            out["memory/write_s"] = memory.write_s
            out["memory/saves"] = float(memory.saves)
        if self._steps_redone is not None and step == self.metrics.start_step:
            out["elastic/steps_redone"] = float(self._steps_redone)
        return out

    def log(self, step: int, loss: float, scalars: Mapping[str, Any]) -> None:
        """Record the scalars of ``step`` (see :meth:`collect`)."""
        self.metrics.log_step(step, self.collect(step, loss, scalars))
