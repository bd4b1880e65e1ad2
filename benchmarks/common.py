"""Shared plumbing of the comparisons: alternation, statistics, targets, timed child processes.

This machine is shared and noisy, so every comparison runs its variants *alternately* (A B, B A,
A B, ...) over several repeats and reports medians and ranges; a ratio is taken per repeat
(A_i / B_i of neighbouring runs, which saw the same noise) and then summarised the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_ddp.contract import ENV_PRESTART

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "train.py"
WORKERS = Path(__file__).resolve().parent / "workers"

# The recipe's progress line on rank 0, e.g. "[rank0] step=30/300 loss=2.3456 ... world_size=2 ...".
# The plain loops in benchmarks/workers print the same shape so one parser serves both.
STEP_LINE = re.compile(r"\[rank0\] step=(\d+)/(\d+)")
WORLD_SIZE = re.compile(r"world_size=(\d+)")


# ----------------------------------------------------------------------------------- statistics


def summary(samples: Sequence[float]) -> dict[str, Any]:
    """Median, range and count of ``samples`` (an empty list gives ``None`` values)."""
    values = [float(v) for v in samples if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0, "samples": []}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "samples": values,
    }


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Per-repeat ratios ``a_i / b_i`` (pairs of neighbouring runs); pairs with a zero are skipped."""
    return [a / b for a, b in zip(numerators, denominators) if b]


def alternate(
    variants: Mapping[str, Callable[[int], Mapping[str, float]]], repeats: int
) -> dict[str, dict[str, list[float]]]:
    """Run each variant ``repeats`` times, rotating the order every repeat (AB, BA, AB, ...).

    Each variant is called with the repeat index and returns named measurements; the result maps
    variant -> measurement name -> one value per repeat.
    """
    names = list(variants)
    results: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        order = names[shift:] + names[:shift]
        for name in order:
            for metric, value in variants[name](repeat).items():
                results[name].setdefault(metric, []).append(float(value))
    return results


# -------------------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """A goal for a row's median: ``op`` is ``">="`` or ``"<="``, ``text`` what RESULTS.md shows."""

    op: str
    value: float
    text: str = ""

    def check(self, median: float | None) -> bool | None:
        if median is None:
            return None
        return median >= self.value if self.op == ">=" else median <= self.value

    def describe(self) -> str:
        return self.text or f"{'≥' if self.op == '>=' else '≤'} {self.value:g}"


def row(label: str, samples: Sequence[float], unit: str, target: Target | None = None, note: str = "") -> dict[str, Any]:
    """One line of the results table: the summary of ``samples``, the target and whether it is met."""
    stats = summary(samples)
    return {
        "label": label,
        "unit": unit,
        **stats,
        "target": target.describe() if target else "",
        "pass": target.check(stats["median"]) if target else None,
        "note": note,
    }


@dataclass
class Result:
    """What one comparison hands to run.py: raw per-variant samples, table rows, notes."""

    name: str
    title: str
    params: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    discussion: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "params": self.params,
            "samples": self.samples,
            "rows": self.rows,
            "notes": self.notes,
            "discussion": self.discussion,
        }


@dataclass
class Context:
    """What every comparison gets from run.py."""

    smoke: bool
    work_dir: Path  # scratch space on the disk under test; removed by run.py afterwards
    repeats: int

    def scratch(self, name: str) -> Path:
        path = self.work_dir / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path


# ---------------------------------------------------------------------------- child processes


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every benchmarked process: the repo importable, one thread per rank."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop(ENV_PRESTART, None)  # the default: workers forked warm
    env.update(extra)
    return env


def torchrun(*agent_args: str, script: str | Path, script_args: Sequence[str] = ()) -> list[str]:
    """``python -m torch.distributed.run AGENT_ARGS SCRIPT SCRIPT_ARGS``."""
    return [sys.executable, "-m", "torch.distributed.run", *agent_args, str(script), *script_args]


class TimedProcess:
    """A child whose output lines are read as they come and stamped with the time of arrival.

    Lines are stamped with ``time.monotonic()`` in the parent; workers flush every line, so the
    stamp is within a millisecond or so of the print. :meth:`kill` kills the whole process tree
    (torchrun starts workers in sessions of their own), see :class:`tests.helpers.nodes.Node`.
    """

    def __init__(
        self, cmd: Sequence[str], env: Mapping[str, str] | None = None, log_path: Path | None = None,
        cwd: Path | None = None,
    ) -> None:
        from tests.helpers.nodes import Node

        self.cmd = list(cmd)
        self.started = time.monotonic()
        self.started_wall = time.time()
        self._process = subprocess.Popen(
            self.cmd,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            cwd=cwd,
        )
        self._node = Node(self._process, Path(log_path or os.devnull), None)
        self._log = open(log_path, "w") if log_path else None  # noqa: SIM115 - closed by the reader
        self._lines: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            now = time.monotonic()
            if self._log:
                self._log.write(line)
                self._log.flush()
            with self._cond:
                self._lines.append((now, line.rstrip("\n")))
                self._cond.notify_all()
        if self._log:
            self._log.close()
        with self._cond:
            self._cond.notify_all()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process.poll() is None

    def lines(self) -> list[tuple[float, str]]:
        with self._cond:
            return list(self._lines)

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines())

    def wait_for(self, predicate: Callable[[str], Any], timeout: float, after: float = float("-inf"), what: str = "a line") -> tuple[float, Any]:
        """The first line stamped after ``after`` for which ``predicate`` is truthy: ``(stamp, value)``."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for stamp, line in self._lines[seen:]:
                    if stamp > after:
                        value = predicate(line)
                        if value:
                            return stamp, value
                seen = len(self._lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"Timed out after {timeout:g} s waiting for {what}.\n{self._tail()}")
                if self._process.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(
                        f"The process exited with code {self._process.returncode} before {what}.\n{self._tail()}"
                    )
                self._cond.wait(min(remaining, 0.5))

    def _tail(self, n: int = 25) -> str:
        return "\n".join(line for _, line in self._lines[-n:])

    def wait(self, timeout: float) -> int:
        """The exit code; on timeout the tree is killed and ``TimeoutError`` raised with the output tail."""
        try:
            code = self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"{' '.join(self.cmd[:6])} ... did not finish within {timeout:g} s.\n{self._tail()}") from None
        self._reader.join(5)
        return code

    def check(self, timeout: float) -> None:
        """Wait for exit and raise with the output tail unless the exit code is 0."""
        code = self.wait(timeout)
        if code != 0:
            raise RuntimeError(f"{' '.join(self.cmd[:6])} ... exited with code {code}.\n{self._tail()}")

    def kill(self) -> None:
        """SIGKILL the process and every descendant (a node dying with its workers)."""
        self._node.kill()

    def cleanup(self) -> None:
        self._node.cleanup()

    def __enter__(self) -> TimedProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()


def step_stamps(lines: Sequence[tuple[float, str]], after: float = float("-inf")) -> dict[int, float]:
    """Arrival time of the first rank-0 progress line of each step (lines stamped after ``after``)."""
    stamps: dict[int, float] = {}
    for stamp, line in lines:
        match = STEP_LINE.search(line)
        if match and stamp > after:
            stamps.setdefault(int(match[1]), stamp)
    return stamps


def steps_per_s(stamps: Mapping[int, float], first: int, last: int) -> float:
    """Steps per second between the progress lines of steps ``first`` and ``last``."""
    missing = [s for s in (first, last) if s not in stamps]
    if missing:
        raise RuntimeError(f"No progress line for step(s) {missing}; saw steps {sorted(stamps)[:10]}...")
    return (last - first) / (stamps[last] - stamps[first])


# ---------------------------------------------------------------------------------- environment


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def _etcd_version() -> str:
    binary = shutil.which("etcd")
    if not binary:
        return "not installed"
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    match = re.search(r"etcd Version: (\S+)", out)
    return match[1] if match else out.strip().splitlines()[0] if out.strip() else "unknown"


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cores": os.cpu_count(),
        "mem_gib": _mem_gib(),
        "cpu": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "etcd": _etcd_version(),
    }


def run_alone(name: str, run: Callable[[Context, bool], Result], full_repeats: int) -> int:
    """A comparison's own command line (``python -m benchmarks.bench_X --out DIR [--compile]``): runs it,
    eager or compiled, and writes ``DIR/<name>[_compiled].json`` and a ``results.json`` as run.py does,
    so that ``run.py --update-from DIR`` puts its section into RESULTS.md."""
    parser = argparse.ArgumentParser(description="This comparison alone, optionally with compiled models.")
    parser.add_argument("--out", required=True, help=f"directory for {name}[_compiled].json (created)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model in every variant")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    parser.add_argument("--repeats", type=int, default=0, help=f"default: 1 smoke, {full_repeats} full")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="elastic-ddp-bench-"))
    ctx = Context(smoke=args.smoke, work_dir=work, repeats=args.repeats or (1 if args.smoke else full_repeats))
    start, machine = time.monotonic(), machine_info()
    try:
        data = run(ctx, args.compile).to_json()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data.update(wall_s=round(time.monotonic() - start, 1), smoke=args.smoke)
    path = out / f"{name}{'_compiled' if args.compile else ''}.json"
    path.write_text(json.dumps(data, indent=2))
    (out / "results.json").write_text(json.dumps({"machine": machine, "smoke": args.smoke, "comparisons": [data]}, indent=2))
    for r in data["rows"]:
        print(f"{r['label']}: {r['median']:.4g} {r['unit']} ({r['min']:.4g} - {r['max']:.4g})", flush=True)
    print(f"Wrote {path} ({data['wall_s']} s)", flush=True)
    return 0
