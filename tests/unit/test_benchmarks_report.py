"""benchmarks/report.py: RESULTS.md with some comparisons' sections rendered anew (run.py --update-from)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.report import merge, render  # noqa: E402

MACHINE = {"date": "2026-12-01 10:00:00 UTC", "cores": 2, "mem_gib": 23.5, "cpu": "cpu", "platform": "linux",
           "python": "3.11", "torch": "2.13", "etcd": "3.5"}  # fmt: skip


def comparison(name: str, value: float, passed: bool) -> dict:
    row = {"label": f"{name} time", "median": value, "min": value, "max": value, "n": 1, "unit": "s",
           "target": "≤ 1", "pass": passed}  # fmt: skip
    return {"name": name, "title": f"The {name} comparison", "rows": [row], "params": {"size": 1}, "wall_s": 1.0}


def test_an_update_renders_only_the_new_sections_keeps_the_rest_and_counts_the_summary_again():
    order = ["first", "second", "third"]
    existing = render(MACHINE, [comparison("first", 2.0, False), comparison("second", 3.0, False),
                                comparison("third", 0.5, True)])  # fmt: skip
    assert "**Summary:** 1 targets met, 2 missed" in existing
    newer = {**MACHINE, "date": "2026-12-06 06:00:00 UTC"}
    updated = merge(existing, newer, [comparison("second", 0.25, True)], order)
    assert "**Summary:** 2 targets met, 1 missed" in updated
    assert "- date: 2026-12-01 10:00:00 UTC to 2026-12-06 06:00:00 UTC (comparisons from 2 runs on this machine)" in updated
    assert "| second time | 0.250 |" in updated and "| second time | 3" not in updated
    assert "| first time | 2" in updated and "| third time | 0.500 |" in updated
    assert updated.index("`first`") < updated.index("`second`") < updated.index("`third`")
    # A second update counts one more run and keeps the first date.
    again = merge(updated, {**MACHINE, "date": "2026-12-07 06:00:00 UTC"}, [comparison("first", 0.5, True)], order)
    assert "- date: 2026-12-01 10:00:00 UTC to 2026-12-07 06:00:00 UTC (comparisons from 3 runs" in again
    assert "**Summary:** 3 targets met, 0 missed" in again
