"""benchmarks/run.py --smoke runs every comparison at tiny sizes and records numbers for each.

No timing assertions: the machine is shared and noisy; the full run's numbers go to
benchmarks/RESULTS.md, which a smoke run must leave alone.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.run import COMPARISONS, RESULTS_MD  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smoke_run_records_numbers_for_every_comparison_and_leaves_results_md_alone(tmp_path):
    before = RESULTS_MD.read_bytes() if RESULTS_MD.exists() else None
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--smoke", "--out", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=580,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    data = json.loads((tmp_path / "results.json").read_text())
    assert data["smoke"] is True
    by_name = {c["name"]: c for c in data["comparisons"]}
    assert set(by_name) == set(COMPARISONS)
    for name, comparison in by_name.items():
        assert "error" not in comparison, (name, comparison.get("traceback"))
        assert comparison["rows"], name
        for r in comparison["rows"]:
            assert r["n"] >= 1 and math.isfinite(r["median"]), (name, r)
        assert json.loads((tmp_path / f"{name}.json").read_text())["name"] == name

    assert (tmp_path / "RESULTS.md").read_text().startswith("# Benchmark results")
    after = RESULTS_MD.read_bytes() if RESULTS_MD.exists() else None
    assert after == before, "a smoke run must not overwrite benchmarks/RESULTS.md"
