"""The memory tier's interval controller alone: measurements in, the agreed interval out.

No process group, no node memory and no saves: a clock the test moves, and the numbers the
stop agreement would carry handed in directly (tests/unit/test_memory_tier.py drives the same
controller through a real tier).
"""

from __future__ import annotations

import pytest

from elastic_ddp.memory.interval import (
    PHASE_HISTORY, REPORT_SIZE, SAVE_WINDOW, STEP_WINDOW, IntervalController, Report, save_cost,
)  # fmt: skip
from elastic_ddp.memory.policy import MIN_SAVES, MIN_UNTOUCHED


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def controller(clock: Clock, *, budget: float = 0.02, every_steps: int = 0) -> IntervalController:
    return IntervalController(budget=budget, every_steps=every_steps, clock=clock)


def test_the_report_is_what_rides_on_the_stop_agreement():
    # Five numbers, a plain tuple to the agreement, and read back by name from what it agreed.
    assert REPORT_SIZE == 5 == len(Report(0.0, 0.0, 0.0, 0.0, 0.0))
    agreed = tuple(float(v) for v in Report(0.008, 0.1, 0.25, 0.0, 1.0))
    assert Report.of(agreed).failed == 1.0 and Report.of(agreed + (7.0,)).write_s == 0.25
    fresh = controller(Clock()).report(failed=False)
    assert fresh == (0.0, 0.0, 0.0, 1.0, 0.0)  # nothing measured; the background cost not told yet
    assert controller(Clock()).report(failed=True).failed == 1.0


def test_step_times_leave_out_a_saves_stall_and_the_first_step_is_not_timed():
    clock = Clock()
    c = controller(clock)
    assert c.step_ended(1, None)  # due at once: nothing measured, nothing saved
    assert c.steps.last_s == 0.0 and list(c.steps.recent) == []
    c.saved(1, 0.030)
    clock.now += 0.130  # a 100 ms step, and the 30 ms the save stalled the loop
    c.step_ended(2, None)
    assert c.steps.last_s == pytest.approx(0.100)
    clock.now += 0.100
    c.step_ended(3, None)
    assert c.steps.last_s == pytest.approx(0.100)
    # Phases count the steps since the last save.
    assert [phase for phase, _ in c.steps.phases] == [1, 2]


def test_the_interval_follows_what_was_agreed_and_saves_fall_on_due_steps():
    clock = Clock()
    c = controller(clock)
    assert c.step_ended(1, None) and (c.interval, c.why) == (1, "not measured yet")
    c.saved(1, 0.0)
    clock.now += 0.1
    # 8 ms a save, 100 ms steps, 2 % aimed at 80 %: 1.6 ms a step -> every 5 steps.
    assert c.step_ended(2, (0.008, 0.100, 0.0, 0.0, 0.0))
    assert c.interval == 5 and "every 5 steps" in c.why
    c.saved(2, 0.0)
    due = []
    for step in range(3, 13):
        clock.now += 0.1
        if c.step_ended(step, (0.008, 0.100, 0.0, 0.0, 0.0)):
            due.append(step)
            c.saved(step, 0.0)
    assert due == [7, 12]
    # While the step times cannot tell the background cost (untold), every 2nd step, not every step.
    c.step_ended(13, (0.001, 0.100, 0.0, 1.0, 0.0))
    assert c.interval == 2
    c.step_ended(14, (0.001, 0.100, 0.0, 0.0, 0.0))
    assert c.interval == 1


def test_a_fixed_interval_ignores_the_measurements():
    clock = Clock()
    c = controller(clock, every_steps=3)
    c.step_ended(1, (10.0, 0.001, 0.0, 0.0, 0.0))
    assert (c.interval, c.why) == (3, "checkpoint.memory_every_steps=3")


def test_the_report_carries_recent_medians_not_one_slow_step_or_save():
    clock = Clock()
    c = controller(clock)
    for step in range(1, STEP_WINDOW + 10):
        clock.now += 2.0 if step == 20 else 0.1
        c.step_ended(step, None)
    for cost in [0.001] * 5 + [3.0] + [0.001] * 3:
        c.save_done(cost, 0.050)
    report = c.report(failed=False)
    assert report.cost_s == pytest.approx(0.001) and report.step_s == pytest.approx(0.1)
    assert report.write_s == pytest.approx(0.050)
    assert len(c.steps.recent) == STEP_WINDOW and len(c._costs) == SAVE_WINDOW


def test_the_background_cost_is_told_from_the_steps_a_write_overlaps():
    clock = Clock()
    c = controller(clock, every_steps=5)
    saved_before = False
    for step in range(1, 5 * (MIN_SAVES + 2) + MIN_UNTOUCHED):
        clock.now += 0.100 + (0.020 if saved_before else 0.0)  # the step after a save is 20 ms slower
        saved_before = c.step_ended(step, None)
        if saved_before:
            c.saved(step, 0.0)
            c.save_done(0.0, 0.010)  # a 10 ms write: it overlaps one step
    assert c.background_s == pytest.approx(0.020)
    assert c.report(failed=False).untold == 0.0
    assert len(c.steps.phases) <= PHASE_HISTORY


def test_a_saves_cost_is_its_stall_plus_the_larger_measure_of_its_background_work():
    assert save_cost(0.002, 0.003, None) == pytest.approx(0.005)
    assert save_cost(0.002, 0.003, 0.010) == pytest.approx(0.012)
    assert save_cost(0.002, 0.010, 0.003) == pytest.approx(0.012)
