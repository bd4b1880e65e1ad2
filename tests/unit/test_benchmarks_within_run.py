"""The memory-tier benchmark's within-run yardstick (benchmarks/bench_memory_tier.py: within_run).

Pure function on logged step times: checked here on synthetic runs whose answer is known, and on
the windows where it must say nothing rather than fail (the smoke run's short window can hold no
save at all).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_memory_tier import MIN_SAVES, within_run  # noqa: E402


def run_log(steps: int, every: int, extra_ms: dict[int, float], noise_ms: float = 0.0, seed: int = 0):
    """Step times (s) and the saves counter of a run saving every ``every`` steps; ``extra_ms[k]`` is
    added to the k-th step after a save (0: the save's own step)."""
    rng = random.Random(seed)
    step_s, saves, count = {}, {0: 0.0}, 0
    for s in range(1, steps + 1):
        phase = (s - 1) % every
        count += phase == 0
        saves[s] = float(count)
        step_s[s] = (10.0 + extra_ms.get(phase, 0.0) + rng.uniform(-noise_ms, noise_ms)) / 1000
    return step_s, saves


def test_known_excess_gives_the_overhead_per_step():
    # 3 ms on the save's step, 2 ms on the next (the write, 8 ms < one 10 ms step), a save every 5
    # steps: 5 ms every 50 ms of clean steps -> overhead 10 %.
    step_s, saves = run_log(400, 5, {0: 3.0, 1: 2.0}, noise_ms=0.5)
    got = within_run(step_s, saves, write_s=0.008, first=0, last=400)
    assert got["excess_ms"] == pytest.approx(5.0, abs=0.5)
    assert got["within_ratio"] == pytest.approx(1 / 1.1, abs=0.01)


def test_a_window_without_a_save_says_nothing():
    step_s, saves = run_log(40, 100, {0: 3.0})
    saves = {s: 0.0 for s in saves}  # the interval outgrew the window: no save in it
    assert within_run(step_s, saves, write_s=0.008, first=10, last=30) == {}


def test_too_few_saves_or_no_untouched_step_says_nothing():
    step_s, saves = run_log(5 * (MIN_SAVES - 1), 5, {0: 3.0})
    assert within_run(step_s, saves, write_s=0.008, first=0, last=5 * (MIN_SAVES - 1)) == {}
    step_s, saves = run_log(400, 1, {0: 3.0})  # a save every step: nothing to compare against
    assert within_run(step_s, saves, write_s=0.008, first=0, last=400) == {}
