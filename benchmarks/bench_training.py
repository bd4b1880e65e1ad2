"""Training overhead: each recipe against a plain DDP loop on the same model and data (3 ranks).

For each model (the language-model recipe's ByteGPT, the classifier recipe's Net), alternated:

* ``plain``: a hand-written DDP loop (benchmarks/workers/protected_ddp.py with no protection: torch's
  DistributedSampler and DataLoader, the model, the optimizer, the loss, a progress line).
* ``recipe``: the recipe with every default but the memory tier (off) and durable saves (none in the
  window: ``checkpoint.every_steps=0`` saves only at the end, after it). What the step path costs:
  the stop agreement, the re-seeding, the data order, the metrics, the stable-bucket hook.
* ``defaults``: the recipe as a user who changes nothing runs it -- the memory tier at its budget and
  durable saves every ``checkpoint.every_steps``, whose amortised cost this row includes.

The windows are long (300 steps of the LM, 1,000 of the classifier) and hold whole save intervals,
so that one repeat's ratio moves by about 1 % rather than 5 %. Three ranks share two cores here:
every background thread (a save's writer, a collective's) competes with the steps, which a GPU
node's spare host cores do not, and how the scheduler places three ranks on two cores moves a
repeat by more than the library's cost. So a full eager run also times the classifier, whose 1.5 ms
steps show a per-step cost the most, at one rank (no sharing of cores, no collective waits): its
``one rank`` rows are the library's CPU cost per step, the precise measure beside the 3-rank targets. ``python -m benchmarks.bench_training --compile --out DIR`` runs
the same with every model compiled (``torch.compile``: minutes of compilation a launch) into
``DIR/training_compiled.json``, which ``run.py --update-from DIR`` puts into RESULTS.md.
"""

from __future__ import annotations

from dataclasses import replace

from benchmarks.bench_protections import BACKEND, RANKS, Model, models, recipe_variant, worker_variant
from benchmarks.common import Context, Result, Target, alternate, ratios, row, run_alone
from elastic_ddp.config import CheckpointConfig

NAME = "training"
TITLE = "Training overhead: each recipe against a plain DDP loop, 3 ranks"

SAVE_EVERY = CheckpointConfig().every_steps
MEMORY_BUDGET = CheckpointConfig().memory_overhead
# The recipe without the memory tier and without a durable save inside the window.
NO_CHECKPOINTS = {"checkpoint.every_steps": 0, "checkpoint.memory_overhead": 0}
REPEATS = 5  # run.py's default for this comparison
# Full runs: windows of whole save intervals (saves at 50, 100, ... inside them).
WINDOWS = {"lm": (20, 320), "classifier": (50, 1050)}
# Full runs: the model also timed at one rank (the classifier: the shortest steps).
ONE_RANK = "classifier"


def windowed(smoke: bool) -> list[Model]:
    return [model if smoke else replace(model, first=WINDOWS[model.name][0], last=WINDOWS[model.name][1])
            for model in models(smoke)]  # fmt: skip


def model_rows(model: Model, samples: dict[str, dict[str, list[float]]], ranks: int = RANKS) -> list[dict]:
    rate = {name: s["steps_per_s"] for name, s in samples.items()}
    prefix = "" if model.name == "lm" else f"{model.name}: "
    if ranks == 1:
        prefix = f"{model.name}, one rank: "
        return [
            row(f"{prefix}plain DDP loop", rate["plain"], "steps/s"),
            row(f"{prefix}recipe / plain (no checkpoints)", ratios(rate["recipe"], rate["plain"]), "ratio",
                note="the step path's CPU cost, without contention for cores"),
            row(f"{prefix}recipe, defaults / plain", ratios(rate["defaults"], rate["plain"]), "ratio",
                note="with both checkpoint tiers, whose writer threads share the rank's core"),
        ]  # fmt: skip
    return [
        row(f"{prefix}plain DDP loop ({model.label})", rate["plain"], "steps/s"),
        row(f"{prefix}recipe, no checkpoint in window", rate["recipe"], "steps/s"),
        row(f"{prefix}recipe, every default", rate["defaults"], "steps/s"),
        row(f"{prefix}recipe / plain (no checkpoints)", ratios(rate["recipe"], rate["plain"]), "ratio",
            Target(">=", 0.99), note="memory tier off, no durable save in the window"),
        row(f"{prefix}recipe, defaults / plain", ratios(rate["defaults"], rate["plain"]), "ratio", Target(">=", 0.975),
            note=f"memory tier at {MEMORY_BUDGET:g}, durable saves every {SAVE_EVERY} steps"),
        row(f"{prefix}recipe, defaults / recipe", ratios(rate["defaults"], rate["recipe"]), "ratio",
            note="the two checkpoint tiers alone"),
    ]  # fmt: skip


def run(ctx: Context, compiled: bool = False) -> Result:
    samples: dict[str, dict[str, list[float]]] = {}
    rows: list[dict] = []
    chosen = windowed(ctx.smoke)
    runs = [(model, RANKS) for model in chosen]
    if not ctx.smoke and not compiled and RANKS > 1:  # compiled: minutes of compilation a launch
        runs += [(model, 1) for model in chosen if model.name == ONE_RANK]
    for model, ranks in runs:
        tag = f"-{ranks}rank" if ranks != RANKS else ""
        measured = alternate(
            {
                "plain": worker_variant(ctx, model, f"plain{tag}", "", compiled, ranks),
                "recipe": recipe_variant(ctx, model, f"recipe{tag}", NO_CHECKPOINTS, compiled, ranks),
                "defaults": recipe_variant(ctx, model, f"defaults{tag}", {}, compiled, ranks),
            },
            ctx.repeats,
        )
        samples.update({f"{model.name}{tag}/{name}": values for name, values in measured.items()})
        rows += model_rows(model, measured, ranks)
    return Result(
        NAME + ("_compiled" if compiled else ""), TITLE + (", compiled" if compiled else ""),
        params={"ranks": RANKS, "backend": BACKEND, "repeats": ctx.repeats, "compiled": compiled,
                "windows": {m.name: [m.first, m.last] for m in chosen}, "save_every": SAVE_EVERY,
                "memory_overhead": MEMORY_BUDGET, "one_rank": ONE_RANK if len(runs) > len(chosen) else None},  # fmt: skip
        samples=samples,
        rows=rows,
        notes=["3 ranks on 2 cores, one thread each: a background thread takes a core from a rank, which a GPU "
               "node's spare host cores would not, and the ranks' placement on the cores moves a repeat by several %.",
               "The one-rank rows time the same runs at one rank: the step path's CPU cost per step, without "
               "contention (the classifier's steps take 1.5 ms at one rank; the LM's 50 ms at three)."],  # fmt: skip
    )


def main() -> int:
    return run_alone(NAME, run, REPEATS)


if __name__ == "__main__":
    raise SystemExit(main())
