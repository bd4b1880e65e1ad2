"""Training overhead: the recipe's loop vs a plain hand-written DDP loop (2 ranks, gloo, --standalone).

Variants, alternated: ``plain`` (benchmarks/workers/plain_ddp.py), ``recipe`` (no checkpoint
during the window: ``--checkpoint.every_steps=0`` saves only at the end, after the window) and
``recipe_ckpt`` (async checkpoints every N steps, so the window pays N-step-amortised staging and
background writing). Same model, corpus, global batch and logging interval in all three.
"""

from __future__ import annotations

from benchmarks.common import Context, Result, Target, alternate, ratios, row
from benchmarks.loops import DEFAULT, TINY, plain_rate, recipe_rate

NAME = "training"
TITLE = "Training overhead: recipe vs plain DDP loop"


def run(ctx: Context) -> Result:
    work = TINY if ctx.smoke else DEFAULT
    log_every = 10 if ctx.smoke else 20
    first, last = log_every, (3 if ctx.smoke else 8) * log_every
    ckpt_every = 10 if ctx.smoke else 20

    def plain(i: int) -> dict[str, float]:
        return {"steps_per_s": plain_rate(work, ctx.scratch(f"{NAME}/plain{i}"), first, last, log_every)}

    def recipe(i: int) -> dict[str, float]:
        return {"steps_per_s": recipe_rate(work, ctx.scratch(f"{NAME}/recipe{i}"), first, last, log_every)}

    def recipe_ckpt(i: int) -> dict[str, float]:
        rate = recipe_rate(work, ctx.scratch(f"{NAME}/ckpt{i}"), first, last, log_every, ckpt_every)
        return {"steps_per_s": rate}

    samples = alternate({"plain": plain, "recipe": recipe, "recipe_ckpt": recipe_ckpt}, ctx.repeats)
    rate = {name: s["steps_per_s"] for name, s in samples.items()}
    result = Result(
        NAME,
        TITLE,
        params={**work.__dict__, "window_steps": [first, last], "log_every": log_every,
                "ckpt_every": ckpt_every, "ranks": 2, "backend": "gloo", "repeats": ctx.repeats},
        samples=samples,
    )
    result.rows = [
        row("plain DDP loop", rate["plain"], "steps/s"),
        row("recipe, no checkpoint in window", rate["recipe"], "steps/s"),
        row(f"recipe, async checkpoint every {ckpt_every} steps", rate["recipe_ckpt"], "steps/s"),
        row("recipe / plain (no checkpoints)", ratios(rate["recipe"], rate["plain"]), "ratio", Target(">=", 0.99)),
        row(f"recipe+ckpt/{ckpt_every} / plain", ratios(rate["recipe_ckpt"], rate["plain"]), "ratio", Target(">=", 0.965)),
        row(f"recipe+ckpt/{ckpt_every} / recipe", ratios(rate["recipe_ckpt"], rate["recipe"]), "ratio",
            note="amortised checkpoint cost alone"),
    ]
    return result
