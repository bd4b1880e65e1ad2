"""benchmarks/run.py --smoke runs every comparison at tiny sizes and records numbers for each (two
halves of the comparisons side by side, each its own run.py --only ...). ``make bench`` runs it; it
is not part of ``make test`` (about four minutes of both cores).

No timing assertions: the machine is shared and noisy; the full run's numbers go to
benchmarks/RESULTS.md, which a smoke run must leave alone.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.run import COMPARISONS, RESULTS_MD  # noqa: E402
from tests.helpers.nodes import descendants  # noqa: E402


# Seconds each comparison's smoke run took on a 2-core host: only to split them into two halves of
# about equal length, which run side by side (a smoke run checks that everything runs, not how fast).
SMOKE_S = {
    "soak": 65, "protections": 65, "memory_tier": 45, "training": 41, "rdzv_idle": 26, "rdzv_join": 20, "grace": 19,
    "recovery": 18,
}  # fmt: skip


def halves() -> tuple[list[str], list[str]]:
    """Every comparison in one of two halves, the longest first into the shorter half."""
    split: tuple[list[str], list[str]] = ([], [])
    for name in sorted(COMPARISONS, key=lambda n: -SMOKE_S.get(n, 15)):
        min(split, key=lambda half: sum(SMOKE_S.get(n, 15) for n in half)).append(name)
    return split


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smoke_run_records_numbers_for_every_comparison_and_leaves_results_md_alone(tmp_path):
    before = RESULTS_MD.read_bytes() if RESULTS_MD.exists() else None
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    outs = [tmp_path / "first-half", tmp_path / "second-half"]
    logs = [tmp_path / "first-half.log", tmp_path / "second-half.log"]
    files = [log.open("w") for log in logs]
    runs = [
        subprocess.Popen(
            [sys.executable, str(REPO / "benchmarks" / "run.py"), "--smoke", "--out", str(out),
             *(f"--only={name}" for name in half)],
            cwd=tmp_path, env=env, stdout=file, stderr=subprocess.STDOUT,
        )
        for out, file, half in zip(outs, files, halves())
    ]  # fmt: skip
    try:
        for run in runs:
            run.wait(timeout=580)
    finally:
        for run, file in zip(runs, files):
            for pid in descendants(run.pid):  # torchrun's workers run in sessions of their own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            run.kill()
            run.wait()
            file.close()
    for run, log in zip(runs, logs):
        assert run.returncode == 0, log.read_text()[-6000:]

    by_name, where = {}, {}
    for out in outs:
        data = json.loads((out / "results.json").read_text())
        assert data["smoke"] is True
        for comparison in data["comparisons"]:
            by_name[comparison["name"]], where[comparison["name"]] = comparison, out
        assert (out / "RESULTS.md").read_text().startswith("# Benchmark results")
    assert set(by_name) == set(COMPARISONS)
    for name, comparison in by_name.items():
        assert "error" not in comparison, (name, comparison.get("traceback"))
        assert comparison["rows"], name
        for r in comparison["rows"]:
            assert r["n"] >= 1 and math.isfinite(r["median"]), (name, r)
        assert json.loads((where[name] / f"{name}.json").read_text())["name"] == name

    after = RESULTS_MD.read_bytes() if RESULTS_MD.exists() else None
    assert after == before, "a smoke run must not overwrite benchmarks/RESULTS.md"
