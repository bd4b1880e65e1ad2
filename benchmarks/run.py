"""Run the side-by-side comparisons and write JSON plus a regenerated RESULTS.md.

    python benchmarks/run.py --out /tmp/bench                 # everything, ~35 min; rewrites benchmarks/RESULTS.md
    python benchmarks/run.py --only rendezvous --out /tmp/b   # one comparison (repeatable flag)
    python benchmarks/run.py --smoke --out /tmp/b             # tiny sizes, < 2 min; RESULTS.md goes into --out
    python benchmarks/run.py --render-from /tmp/b1 /tmp/b2    # RESULTS.md from earlier runs' JSON (later wins)
    python benchmarks/run.py --update-from /tmp/b              # only those comparisons' sections of RESULTS.md

Every comparison alternates its variants over several repeats and reports medians, ranges and
per-repeat ratios (see benchmarks/common.py). Writes ``<out>/<name>.json`` per comparison and
``<out>/results.json`` with all of them and the machine description. A comparison that fails is
recorded with its error (and the exit code is 1); the others still run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `elastic_ddp` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Context, machine_info  # noqa: E402
from benchmarks.report import EXTRAPOLATED_FROM, merge, render  # noqa: E402

# In the order they run (the cheap, independent ones first).
COMPARISONS = {
    "contention": "benchmarks.bench_contention",
    "rendezvous": "benchmarks.bench_rendezvous",
    "rdzv_join": "benchmarks.bench_rdzv_join",
    "rdzv_idle": "benchmarks.bench_rdzv_idle",
    "checkpoint": "benchmarks.bench_checkpoint",
    "divergence": "benchmarks.bench_divergence",
    "resume": "benchmarks.bench_resume",
    "sampler": "benchmarks.bench_sampler",
    "shards": "benchmarks.bench_shards",
    "training": "benchmarks.bench_training",
    "protections": "benchmarks.bench_protections",
    "metrics": "benchmarks.bench_metrics",
    "recovery": "benchmarks.bench_recovery",
    "soak": "benchmarks.bench_soak",
    "grace": "benchmarks.bench_grace",
    "memory_tier": "benchmarks.bench_memory_tier",
    "memory_io": "benchmarks.bench_memory_io",
    "export": "benchmarks.bench_export",
}
# RESULTS.md's sections in order: each comparison, then its compiled rows where a comparison writes
# them (python -m benchmarks.bench_training --compile --out DIR: DIR/training_compiled.json).
SECTIONS = [section for name in COMPARISONS for section in (name, f"{name}_compiled")]
RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for the JSON results (created)")
    parser.add_argument(
        "--render-from", nargs="+", metavar="DIR", default=[],
        help="run nothing: write RESULTS.md from the <name>.json files of earlier runs (a later DIR wins); "
        "every comparison must be present",
    )  # fmt: skip
    parser.add_argument(
        "--update-from", nargs="+", metavar="DIR", default=[],
        help="run nothing: rewrite the sections of RESULTS.md for the comparisons whose full-run JSON is in "
        "DIRs (``--only`` runs), keep the others, count the summary again",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: checks that everything runs")
    parser.add_argument("--only", action="append", choices=sorted(COMPARISONS), help="run only this comparison")
    parser.add_argument(
        "--repeats", type=int, default=0, help="repeats per comparison (default: 1 smoke; full: 3 or the comparison's REPEATS)"
    )
    parser.add_argument("--work-dir", default="", help="scratch directory on the disk to test (default: a temp dir)")
    args = parser.parse_args(argv)
    if not args.out and not args.render_from and not args.update_from:
        parser.error("--out DIR is required (or --render-from DIR ... or --update-from DIR ...)")
    return args


def _load(dirs: list[str]) -> tuple[dict[str, dict], list[dict]] | None:
    """The per-comparison JSON of earlier full runs (a later DIR wins) and their machines; None (and
    why, on stderr) when one is from a smoke run."""
    found: dict[str, dict] = {}
    machines = []
    for directory in map(Path, dirs):
        results = directory / "results.json"
        if results.exists():
            machines.append(json.loads(results.read_text())["machine"])
        for name in SECTIONS:
            path = directory / f"{name}.json"
            if path.exists():
                data = json.loads(path.read_text())
                if data.get("smoke"):
                    print(f"error: {path} is from a smoke run; only full runs go into RESULTS.md", file=sys.stderr)
                    return None
                found[name] = data
    return found, machines


def _machine(machines: list[dict]) -> dict:
    """The newest run's description, where it knew a value: a run started without the virtualenv's
    scripts on PATH sees no etcd binary, though its benchmarks started the bundled one."""
    machine: dict = {}
    for each in machines:
        machine.update({key: value for key, value in each.items() if value != "not installed" or key not in machine})
    return machine


def render_from(dirs: list[str]) -> int:
    """RESULTS.md from the per-comparison JSON of earlier full runs (``--only`` runs included)."""
    loaded = _load(dirs)
    if loaded is None:
        return 2
    found, machines = loaded
    missing = [name for name in COMPARISONS if name not in found]
    if missing or not machines:
        print(f"error: no results for {', '.join(missing) or 'the machine'} in {', '.join(dirs)}", file=sys.stderr)
        return 2
    machine = _machine(machines)
    dates = sorted({m["date"] for m in machines})
    if len(dates) > 1:
        machine["date"] = f"{dates[0]} to {dates[-1]} (comparisons from {len(dates)} runs on this machine)"
    RESULTS_MD.write_text(render(machine, [found[name] for name in SECTIONS if name in found]))
    print(f"Wrote {RESULTS_MD} from {len(found)} comparisons", flush=True)
    return 1 if any("error" in data for data in found.values()) else 0


def update_from(dirs: list[str]) -> int:
    """RESULTS.md with the sections of the comparisons found in ``dirs`` rendered anew."""
    loaded = _load(dirs)
    if loaded is None:
        return 2
    found, machines = loaded
    if not found or not machines:
        print(f"error: no full-run results in {', '.join(dirs)}", file=sys.stderr)
        return 2
    # The extrapolation section draws on all of them at once: those are rendered together or not at all.
    if set(found) & set(EXTRAPOLATED_FROM) and not set(EXTRAPOLATED_FROM) <= set(found):
        print(f"error: {', '.join(EXTRAPOLATED_FROM)} go into RESULTS.md together (their extrapolation uses all)",
              file=sys.stderr)  # fmt: skip
        return 2
    machine = {**_machine(machines), "date": max(m["date"] for m in machines)}
    runs = len({m["date"] for m in machines})
    RESULTS_MD.write_text(merge(RESULTS_MD.read_text(), machine, list(found.values()), SECTIONS, runs))
    print(f"Updated {', '.join(found)} in {RESULTS_MD}", flush=True)
    return 1 if any("error" in data for data in found.values()) else 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.render_from:
        return render_from(args.render_from)
    if args.update_from:
        return update_from(args.update_from)
    # dcp.save/load in one process without a process group (checkpoint, resume) says so every call.
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(COMPARISONS)
    work = Path(tempfile.mkdtemp(prefix="elastic-ddp-bench-", dir=args.work_dir or None))
    machine = machine_info()
    results, failed = [], False
    try:
        for name in names:
            module = importlib.import_module(COMPARISONS[name])
            # A comparison may ask for more repeats than 3 (REPEATS): a ratio that must show 1 % needs them.
            repeats = args.repeats or (1 if args.smoke else getattr(module, "REPEATS", 3))
            ctx = Context(smoke=args.smoke, work_dir=work / name, repeats=repeats)
            ctx.work_dir.mkdir(parents=True, exist_ok=True)
            print(f"== {name}: {module.TITLE}", flush=True)
            start = time.monotonic()
            try:
                data = module.run(ctx).to_json()
            except Exception as exc:  # one broken comparison must not hide the others' numbers
                failed = True
                data = {"name": name, "title": module.TITLE, "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc(), "rows": []}
                print(data["traceback"], file=sys.stderr, flush=True)
            data["wall_s"] = round(time.monotonic() - start, 1)
            data["smoke"] = args.smoke
            for line in _summary_lines(data):
                print(line, flush=True)
            (out / f"{name}.json").write_text(json.dumps(data, indent=2))
            results.append(data)
            shutil.rmtree(ctx.work_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    (out / "results.json").write_text(json.dumps({"machine": machine, "smoke": args.smoke, "comparisons": results}, indent=2))
    # A smoke run or a partial run must not replace the repository's full results.
    target = RESULTS_MD if not args.smoke and not args.only else out / "RESULTS.md"
    target.write_text(render(machine, results, smoke=args.smoke))
    print(f"Wrote {out}/results.json and {target}", flush=True)
    return 1 if failed else 0


def _summary_lines(data: dict) -> list[str]:
    if "error" in data:
        return [f"   FAILED: {data['error'].splitlines()[0]}"]
    lines = []
    for r in data["rows"]:
        median = "-" if r["median"] is None else f"{r['median']:.4g}"
        mark = {True: "pass", False: "MISS", None: ""}[r["pass"]]
        lines.append(f"   {r['label']}: {median} {r['unit']} {r['target']} {mark}".rstrip())
    lines.append(f"   ({data['wall_s']} s)")
    return lines


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
