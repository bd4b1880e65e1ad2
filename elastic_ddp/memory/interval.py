"""The memory tier's interval controller: one rank's measurements, and the interval all ranks agree on.

Each rank measures its steps (without a save's stall), the cost of its saves and its background
writes (:class:`IntervalController`), and reports the medians of the recent ones (:class:`Report`).
The reports ride on the stop agreement (:class:`elastic_ddp.worker.stop.StopAgreement`: an
all-reduce with ``MAX`` that runs every ``dist.stop_check_s`` seconds of steps anyway), so every
rank gets the largest of each at the same step and computes the same interval from it
(:func:`elastic_ddp.memory.policy.interval`): every rank saves the same steps without a collective of
its own. The controller only measures and decides; the caller carries its report to the agreement
and the agreed numbers back, so it works -- and is tested -- without a process group.

A save's cost is its stall plus what its background work takes from the steps it overlaps
(:func:`save_cost`): measured directly -- on the CPU the write's CPU time (the ranks share the
cores with it), on a GPU the device-to-host copies' time on the training stream (the write runs on
host cores the step does not use) -- or, where larger, from the step times themselves: the steps a
write overlaps against the steps between saves that it does not
(:func:`elastic_ddp.memory.policy.background_cost`), which also counts what no direct measure sees
(caches and memory bandwidth shared with the step, a rank waiting for a slower one).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from elastic_ddp.memory.policy import background_cost, interval

__all__ = ["PHASE_HISTORY", "REPORT_SIZE", "SAVE_WINDOW", "STEP_WINDOW", "IntervalController", "Report", "StepTimes",
           "save_cost"]  # fmt: skip

# The interval follows the medians of the last few measurements, not the last one: one step's
# time varies by tens of percent on a busy host (a noisy neighbour, a data-loader hiccup, a
# collective that waited), and an interval that follows each step swings widely at a steady
# budget (docs/memory-tier.md, "Measured here") -- and, since a save's share of the step goes as
# 1 / interval, costs more on average than a steady interval of the same mean. A step is a fraction
# of a second, a save a few steps: 32 steps and 8 saves still follow a real change (a longer
# sequence, a new world size) within seconds.
STEP_WINDOW = 32
SAVE_WINDOW = 8
# Steps kept, with their phase (steps since the last save), for what a save's background work
# takes from the steps it overlaps (policy.background_cost): ~100 saves at a save every 5 steps,
# enough for a phase's median to hold still.
PHASE_HISTORY = 512


class Report(NamedTuple):
    """One rank's numbers on the stop agreement, and (the maximum over the ranks) what was agreed.

    ``cost_s``, ``step_s``, ``write_s``: the medians of the recent save costs, step times without a
    save's stall, and background writes (zeros before the first of each); ``untold``: 1.0 while the
    step times cannot yet tell what a save's background work costs, else 0.0; ``failed``: 1.0 once a
    save of this rank failed, else 0.0.
    """

    cost_s: float
    step_s: float
    write_s: float
    untold: float
    failed: float

    @classmethod
    def of(cls, agreed: Sequence[float]) -> Report:
        """The agreed numbers (the first ``REPORT_SIZE`` of what the agreement carried) by name."""
        return cls(*agreed[: len(cls._fields)])


# The numbers each rank puts on the stop agreement.
REPORT_SIZE = len(Report._fields)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def save_cost(stall_s: float, direct_s: float, background_s: float | None) -> float:
    """What a save costs the training loop: its ``stall_s``, plus what its background work takes from
    the steps it overlaps -- ``direct_s`` as measured directly (on the CPU the write's CPU time, on a
    GPU the copies' time on the training stream) or, where larger, ``background_s`` from the steps'
    times (:func:`~elastic_ddp.memory.policy.background_cost`; None: not told yet)."""
    return stall_s + max(direct_s, background_s or 0.0)


class StepTimes:
    """One rank's step times, each without the stall of a save made in it, and their phase (steps
    since the last save). ``clock``: seconds, monotonic (tests move it)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._tick: tuple[float, float] | None = None  # (when the last step ended, stall to leave out since)
        self._since_save: int | None = None
        self.last_s = 0.0
        self.recent: deque[float] = deque(maxlen=STEP_WINDOW)
        self.phases: deque[tuple[int, float]] = deque(maxlen=PHASE_HISTORY)  # (steps since a save, step time)

    def ended(self) -> None:
        """A step ended now."""
        now = self._clock()
        if self._tick is not None:
            last, stall = self._tick
            self.last_s = max(now - last - stall, 0.0)
            self.recent.append(self.last_s)
            if self._since_save is not None:
                self._since_save += 1
                self.phases.append((self._since_save, self.last_s))
        self._tick = (now, 0.0)

    def saved(self, stall_s: float) -> None:
        """A save ran after the step that just ended: its ``stall_s`` is left out of the next step's time
        (the interval weighs the stall against a step without it), and the phases start again."""
        if self._tick is not None:
            self._tick = (self._tick[0], stall_s)
        self._since_save = 0


class IntervalController:
    """One rank's measurements, and the interval from what the ranks agreed (every rank the same).

    ``budget``: the stall budget as a fraction of step time (``checkpoint.memory_overhead``);
    ``every_steps``: a fixed interval instead (0: from the budget); ``clock``: seconds, monotonic.
    """

    def __init__(self, *, budget: float, every_steps: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget, self.every_steps = budget, every_steps
        self.steps = StepTimes(clock)
        self._costs: deque[float] = deque(maxlen=SAVE_WINDOW)  # save costs, once each save's write is done
        self._writes: deque[float] = deque(maxlen=SAVE_WINDOW)  # background writes' wall times
        self.interval, self.why = 1, "not measured yet"
        self.background_s: float | None = None  # background_cost() at the last save; None: not told yet
        self._next_due = 0

    def step_ended(self, step: int, agreed: Report | Sequence[float] | None) -> bool:
        """After each step: note its time, adopt the interval from ``agreed`` (the maxima over the ranks
        of their :meth:`report`, None when not agreed at this step); True when a save is due."""
        self.steps.ended()
        if self.every_steps:
            self.interval, self.why = self.every_steps, f"checkpoint.memory_every_steps={self.every_steps}"
        elif agreed is not None:
            cost_s, step_s, write_s, untold, _ = Report.of(agreed)
            # Not told while any rank's step times cannot tell the background cost: ~64 steps, and
            # again when the last steps between saves have left the history (every ~500 steps).
            self.interval, self.why = interval(cost_s, step_s, self.budget, write_s, told=untold == 0)
        return step >= self._next_due

    def saved(self, step: int, stall_s: float) -> None:
        """A save of ``step`` was made, stalling the loop ``stall_s`` (its one-off waits included)."""
        self.steps.saved(stall_s)
        self._next_due = step + self.interval
        # Here, not in the save: its time falls in the next step, which it then measures.
        touched = math.ceil(_median(self._writes) / max(_median(self.steps.recent), 1e-9))
        self.background_s = background_cost(self.steps.phases, touched)

    def save_done(self, cost_s: float, write_s: float) -> None:
        """A save's write is complete: its cost (:func:`save_cost`) and its write's wall time."""
        self._costs.append(cost_s)
        self._writes.append(write_s)

    def report(self, failed: bool) -> Report:
        """This rank's share of the agreement (see :class:`Report`); ``failed``: a save of this rank failed."""
        return Report(
            _median(self._costs), _median(self.steps.recent), _median(self._writes),
            1.0 if self.background_s is None else 0.0, 1.0 if failed else 0.0,
        )  # fmt: skip
