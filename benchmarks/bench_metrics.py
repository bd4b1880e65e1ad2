"""Metrics overhead: the recipe logging every step vs every 1000 steps (TensorBoard + console on rank 0).

With ``--logging.every_steps=1000`` rank 0 prints only the first step of the attempt and the last
step, so both variants are timed between those two lines: from step 1 to step ``max_steps``. The
last step includes the final blocking checkpoint (the same small save in both variants).
"""

from __future__ import annotations

from benchmarks.common import RECIPE, Context, Result, Target, alternate, ratios, row
from benchmarks.loops import DEFAULT, TINY, measure_rate, recipe_flags, standalone

NAME = "metrics"
TITLE = "Metrics overhead: logging every step vs every 1000 steps"


def run(ctx: Context) -> Result:
    work = TINY if ctx.smoke else DEFAULT
    max_steps = 30 if ctx.smoke else 160

    def variant(log_every: int):
        def once(i: int) -> dict[str, float]:
            root = ctx.scratch(f"{NAME}/every{log_every}-{i}")
            cmd = standalone(RECIPE, recipe_flags(work, root, max_steps, log_every))
            return {"steps_per_s": measure_rate(cmd, 1, max_steps, root / "recipe.log")}

        return once

    samples = alternate({"log_every_1": variant(1), "log_every_1000": variant(1000)}, ctx.repeats)
    every1, every1000 = samples["log_every_1"]["steps_per_s"], samples["log_every_1000"]["steps_per_s"]
    return Result(
        NAME,
        TITLE,
        params={**work.__dict__, "window_steps": [1, max_steps], "ranks": 2, "repeats": ctx.repeats},
        samples=samples,
        rows=[
            row("recipe, log every step", every1, "steps/s"),
            row("recipe, log every 1000 steps", every1000, "steps/s"),
            row("every 1 / every 1000", ratios(every1, every1000), "ratio", Target(">=", 0.99, "≥ 0.99 (< 1% cost)")),
        ],
    )
