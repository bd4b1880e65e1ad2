"""What each of the library's protections costs, one at a time, against a plain DDP loop (3 ranks; NCCL on GPUs).

How to read the table. Every row is a ratio of steps per second, taken per repeat between runs of the
same repeat (see benchmarks/common.py) and summarised as median and range: 1.0 costs nothing, 0.97
means 3 % fewer steps per second. A range that straddles 1.0 says the cost is below this machine's noise.
For each model (the language-model recipe's ByteGPT, the classifier recipe's Net):

* ``+ X / plain``: benchmarks/workers/protected_ddp.py with only protection X switched on
  (``--protect=X``), over the same loop without it. The worker calls the library's own components
  where ``Run._loop`` calls them: the stop agreement, the per-step re-seeding, the step guard, the
  ledger, the metrics at their default cadence, the stable-bucket hook, and the cross-rank comparison
  a save runs (at the default save interval; its time per save is also shown, and its share of the
  step time once spread over that interval: SaveStats reports it only inside a save's stall).
* ``recipe ... / recipe off``: the recipe itself (recipes/train.py, recipes/train_classifier.py) with
  every optional protection off (no durable save in the window, memory tier, ledger and stable buckets
  off), against the same plus durable saves at the default interval, or plus the memory tier at its
  default budget: these two need the checkpoint manager and the memory tier wired to the run's state.
* ``recipe, every optional protection off / plain`` is what remains when nothing optional is on (the
  stop agreement, the re-seeding, the metrics, the run's Step and data loading); ``recipe, every default
  on / plain`` is what a user who changes nothing pays over their own loop.

Steps per second are measured between two rank-0 progress lines during the run (benchmarks/loops.py), so
start-up and the final save are outside the window; the window holds a whole number of save intervals.
The global batch is 30 (the recipes' 32 rounded down to a multiple of 3), so the plain loop's
DistributedSampler and the recipe give every rank the same 10 samples. Three ranks share two cores here:
every collective competes with the compute, so a per-step collective costs more than on a GPU node.

A full run (3 repeats, 12 variants per model) takes about 18 minutes on 2 cores; ``--smoke`` about one.
Compiled models (torch.compile, in the worker and in the recipes) add minutes of compilation per launch
and are not part of run.py's run: ``python -m benchmarks.bench_protections --compile --out DIR`` writes
``DIR/protections_compiled.json`` (``run.py --update-from DIR`` puts it into RESULTS.md).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from benchmarks.common import (
    WORKERS, Context, Result, TimedProcess, alternate, child_env, ratios, row, run_alone, step_stamps, steps_per_s,
)  # fmt: skip
from benchmarks.loops import DEFAULT, TINY, standalone
from elastic_ddp.config import CheckpointConfig, LoggingConfig

NAME = "protections"
TITLE = "What each protection costs: a plain DDP loop plus one protection at a time, 3 ranks"

# Three ranks (a sum's order matters from three on); on a GPU machine one per GPU, up to three.
RANKS = min(3, torch.cuda.device_count()) if torch.cuda.is_available() else 3
BACKEND = "nccl" if torch.cuda.is_available() else "gloo"
GLOBAL_BATCH = 30
WORKER = WORKERS / "protected_ddp.py"
RECIPES = WORKERS.parents[1] / "recipes"
SAVE_EVERY = CheckpointConfig().every_steps
MEMORY_BUDGET = CheckpointConfig().memory_overhead
LOG_EVERY = LoggingConfig().every_steps
COMPARISON_LINE = re.compile(r"\[rank0\] comparison at step \d+: ([0-9.]+) s")

# Per protection of the worker: its row's label and what it buys.
PROTECTIONS = {
    "stop": ("stop agreement (async all-reduce every dist.stop_check_s, own gloo group)",
             "every rank stops at the same step boundary with a checkpoint of it, within 2 s and two steps of a signal"),
    "seed": ("re-seeding every generator each step",
             "a resumed step draws exactly what the uninterrupted run drew, with no generator state to save"),
    "guard": ("step guard around each step",
              "after a failed step, whether the state is still the last completed step's, for the memory tier"),
    "ledger": ("ledger, with its global-loss all-reduce each step",
               "an audit of every step's samples per rank: exactly-once across restarts"),
    "metrics": (f"metrics every {LOG_EVERY} steps (TensorBoard, loss all-reduce at logged steps)",
                "curves that read as one run across restarts, recovery time, progress line"),
    "buckets": ("stable-bucket communication hook",
                "bitwise-identical same-size resume at 3+ ranks (one bucket layout)"),
    "compare": (f"cross-rank comparison at each save (every {SAVE_EVERY} steps)",
                "no checkpoint splices tensors that differ across ranks"),
}  # fmt: skip
EVERY_PROTECTION = ",".join(PROTECTIONS)

# The recipe's optional protections: all off, then one of the two that need the run's wiring on.
RECIPE_OFF = {"checkpoint.every_steps": 0, "checkpoint.memory_overhead": 0, "data.ledger": "false",
              "dist.stable_buckets": "false"}  # fmt: skip
RECIPE_VARIANTS = {
    "recipe_off": RECIPE_OFF,
    "recipe_saves": {**RECIPE_OFF, "checkpoint.every_steps": SAVE_EVERY},
    "recipe_tier": {**RECIPE_OFF, "checkpoint.memory_overhead": MEMORY_BUDGET},
    "recipe_defaults": {},
}


@dataclass(frozen=True)
class Model:
    """One model as the worker and its recipe train it, and the window its steps are timed over."""

    name: str
    label: str
    worker_flags: tuple[str, ...]
    recipe: Path
    recipe_flags: tuple[str, ...]
    first: int  # the window: from the progress line of step `first` to that of step `last`
    last: int


def models(smoke: bool) -> list[Model]:
    lm = replace(TINY if smoke else DEFAULT, global_batch_size=GLOBAL_BATCH)
    # Full: the windows hold whole save intervals (the saves at 50 and 100, or 100 to 450).
    lm_window, classifier_window = ((10, 60), (10, 60)) if smoke else ((20, 120), (50, 450))
    return [
        Model("lm", "LM (ByteGPT)", ("--model=lm", *lm.plain_flags()), RECIPES / "train.py",
              tuple(lm.recipe_flags()), *lm_window),
        Model("classifier", "classifier (Net)", ("--model=classifier", f"--global-batch-size={GLOBAL_BATCH}"),
              RECIPES / "train_classifier.py", (f"--train.global_batch_size={GLOBAL_BATCH}",), *classifier_window),
    ]  # fmt: skip


def timed_run(cmd: list[str], model: Model, log_path: Path) -> dict[str, float]:
    """Run ``cmd`` to completion: steps/s over the model's window, and the median time of the comparisons
    the worker printed (if it ran any)."""
    with TimedProcess(cmd, child_env(), log_path) as proc:
        proc.check(600)
        lines = proc.lines()
    out = {"steps_per_s": steps_per_s(step_stamps(lines), model.first, model.last)}
    comparisons = [float(m[1]) for _, line in lines if (m := COMPARISON_LINE.search(line))]
    if comparisons:
        out["comparison_s"] = statistics.median(comparisons)
    return out


def worker_variant(
    ctx: Context, model: Model, name: str, protect: str, compiled: bool, ranks: int = RANKS
) -> Callable[[int], dict[str, float]]:
    """A run of the plain loop with the protections ``protect`` (comma-separated; "" for none) over the
    model's window, one step more so that a final save would fall after it, at ``ranks`` ranks."""

    def run(i: int) -> dict[str, float]:
        root = ctx.scratch(f"{model.name}/{name}{i}")
        args = [*model.worker_flags, f"--protect={protect}", f"--run-dir={root}", f"--steps={model.last + 1}",
                f"--log-every={LOG_EVERY}", *(["--compile"] if compiled else [])]  # fmt: skip
        return timed_run(standalone(WORKER, args, ranks), model, root / "worker.log")

    return run


def recipe_variant(
    ctx: Context, model: Model, name: str, settings: dict[str, object], compiled: bool, ranks: int = RANKS
) -> Callable[[int], dict[str, float]]:
    """A run of the model's recipe with ``settings`` over the model's window (one step more, as above)."""

    def run(i: int) -> dict[str, float]:
        root = ctx.scratch(f"{model.name}/{name}{i}")
        args = [*model.recipe_flags, f"--run.root={root}", "--run.name=bench", f"--checkpoint.url={root}/ckpt",
                "--checkpoint.resume=never", f"--train.max_steps={model.last + 1}", f"--logging.every_steps={LOG_EVERY}",
                *(f"--{key}={value}" for key, value in settings.items()),
                *(["--train.compile=true"] if compiled else [])]  # fmt: skip
        return timed_run(standalone(model.recipe, args, ranks), model, root / "recipe.log")

    return run


def variants(ctx: Context, model: Model, compiled: bool) -> dict[str, Callable[[int], dict[str, float]]]:
    """The runs to alternate for ``model``: the plain loop, each protection on it (in a smoke run all of
    them in one run), and the recipe variants (in a smoke run only all off and all defaults)."""
    runs = {"plain": worker_variant(ctx, model, "plain", "", compiled)}
    if ctx.smoke:
        runs["all"] = worker_variant(ctx, model, "all", EVERY_PROTECTION, compiled)
        recipes = {name: RECIPE_VARIANTS[name] for name in ("recipe_off", "recipe_defaults")}
    else:
        runs.update({name: worker_variant(ctx, model, name, name, compiled) for name in PROTECTIONS})
        recipes = RECIPE_VARIANTS
    runs.update({name: recipe_variant(ctx, model, name, settings, compiled) for name, settings in recipes.items()})
    return runs


def model_rows(model: Model, samples: dict[str, dict[str, list[float]]]) -> list[dict]:
    rate = {name: s["steps_per_s"] for name, s in samples.items()}
    plain = rate["plain"]
    label = model.label
    rows = [row(f"{label}: plain DDP loop", plain, "steps/s")]
    for name, (what, buys) in PROTECTIONS.items():
        if name in rate:
            rows.append(row(f"{label}: + {what} / plain", ratios(rate[name], plain), "ratio", note=buys))
    if "all" in rate:
        rows.append(row(f"{label}: + every per-step protection at once / plain", ratios(rate["all"], plain), "ratio"))
    with_comparison = next((s for s in samples.values() if "comparison_s" in s), None)
    if with_comparison is not None:
        seconds = with_comparison["comparison_s"]
        # Spread over the save interval: its seconds against the interval's steps at the plain loop's rate.
        shares = [s * r / SAVE_EVERY for s, r in zip(seconds, plain)]
        rows += [
            row(f"{label}: cross-rank comparison, time per save (rank 0)", seconds, "s",
                note="snapshot() as a save runs it; SaveStats has it only inside ckpt/stall_s"),
            row(f"{label}: cross-rank comparison over {SAVE_EVERY} steps, share of step time", shares, "fraction",
                note="the comparison's amortised cost per step"),
        ]  # fmt: skip
    off = rate["recipe_off"]
    rows.append(row(f"{label}: recipe, every optional protection off / plain", ratios(off, plain), "ratio",
                    note="no durable save in the window; memory tier, ledger, stable buckets off"))  # fmt: skip
    if "recipe_saves" in rate:
        rows += [
            row(f"{label}: recipe off + durable saves every {SAVE_EVERY} steps / recipe off",
                ratios(rate["recipe_saves"], off), "ratio",
                note="a committed, verified checkpoint to resume from after any failure; async"),
            row(f"{label}: recipe off + memory tier (budget {MEMORY_BUDGET:g}) / recipe off",
                ratios(rate["recipe_tier"], off), "ratio",
                note="the state in node memory: a failure redoes at most the steps since its last save"),
        ]  # fmt: skip
    rows.append(row(f"{label}: recipe, every default on / plain", ratios(rate["recipe_defaults"], plain), "ratio"))
    return rows


def run(ctx: Context, compiled: bool = False) -> Result:
    samples: dict[str, dict[str, list[float]]] = {}
    rows: list[dict] = []
    chosen = models(ctx.smoke)
    for model in chosen:
        measured = alternate(variants(ctx, model, compiled), ctx.repeats)
        samples.update({f"{model.name}/{name}": values for name, values in measured.items()})
        rows += model_rows(model, measured)
    return Result(
        NAME + ("_compiled" if compiled else ""), TITLE + (", compiled" if compiled else ""),
        params={
            "ranks": RANKS, "backend": BACKEND, "repeats": ctx.repeats, "global_batch_size": GLOBAL_BATCH,
            "windows": {m.name: [m.first, m.last] for m in chosen}, "log_every": LOG_EVERY,
            "save_every": SAVE_EVERY, "memory_overhead": MEMORY_BUDGET, "compiled": compiled,
            "lm_model": {key: value for key, value in (TINY if ctx.smoke else DEFAULT).__dict__.items()
                         if key != "global_batch_size"},
            "full_run": "3 repeats x 12 variants x 2 models, about 18 min on 2 cores",
        },  # fmt: skip
        samples=samples,
        rows=rows,
        notes=[
            "Protections 1-6 and the comparison at a save are priced on a plain loop "
            "(benchmarks/workers/protected_ddp.py); durable saves and the memory tier on the recipe, with the "
            "recipe's other optional protections off.",
            "3 ranks on 2 cores, one thread each (OMP_NUM_THREADS=1): collectives wait for a core, so their "
            "cost is larger than on a node with a core per rank.",
        ],
    )


def main() -> int:
    return run_alone(NAME, run, 3)


if __name__ == "__main__":
    raise SystemExit(main())
