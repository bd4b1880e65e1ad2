"""The memory tier: what it costs per step, and what it saves per hard loss (2 ranks, gloo, --standalone).

Step time, alternated: the recipe with the memory tier off (``--checkpoint.memory_overhead=0``), at
the default budget (0.02: the interval comes from the measured stall), and forced to save every
step (``--checkpoint.memory_every_steps=1``). No durable checkpoint during the window. Memory goes
to the default ``/dev/shm`` directory, a tmpfs, as in production.

Steps redone per hard loss: a worker is SIGKILLed as step K starts (``ELASTIC_DDP_FAULT=kill@K``)
and torchrun restarts the group, which resumes from the newest state it can find; steps redone
are ``K - 1`` minus the resume step of the ``failures.jsonl`` resume record. Durable-only
(tier off, a durable checkpoint every ``DURABLE_EVERY`` steps, as today) vs the tier at its
default budget. The killed process's node memory survives as a node's does for the survivors of
a node loss (tests/test_memory_tier_e2e.py covers real node losses).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import RECIPE, Context, Result, Target, TimedProcess, alternate, child_env, ratios, row
from benchmarks.loops import DEFAULT, TINY, recipe_flags, recipe_rate, standalone

ON = "--checkpoint.memory_overhead=0.02"  # the budget the deploy manifests set
NAME = "memory_tier"
TITLE = "Memory tier: step-time cost and steps redone per hard loss"
DURABLE_EVERY = 25


def steps_redone(work, root: Path, kill_at: int, *extra: str) -> float:
    """Run to ``kill_at + 10`` with a worker killed at the start of step ``kill_at``; steps redone."""
    # The restarted attempt must resume, so not the fresh start the throughput runs ask for.
    flags = [f for f in recipe_flags(work, root, kill_at + 10, 10, DURABLE_EVERY, *extra) if f != "--checkpoint.resume=never"]
    cmd = standalone(RECIPE, flags)
    cmd.insert(cmd.index("--standalone") + 1, "--max-restarts=1")
    env = child_env(ELASTIC_DDP_FAULT=f"kill@{kill_at}:rank=1:restart=0")
    with TimedProcess(cmd, env, root / "kill.log") as proc:
        proc.check(600)
    lines = (root / "bench" / "failures.jsonl").read_text(encoding="utf-8").splitlines()
    [record] = [r for r in map(json.loads, lines) if r.get("kind") == "resume"]
    # The fault kills rank 1 as step kill_at starts, so step kill_at - 1 was the last completed.
    return float(kill_at - 1 - record["step"])


def run(ctx: Context) -> Result:
    work = TINY if ctx.smoke else DEFAULT
    log_every = 10 if ctx.smoke else 20
    # ~25 s per measured window: the budget is 2 % of step time and this machine's noise is more.
    first, last = log_every, (3 if ctx.smoke else 20) * log_every
    kill_at = 38

    def rate(name: str, *extra: str):
        def measure(i: int) -> dict[str, float]:
            return {"steps_per_s": recipe_rate(work, ctx.scratch(f"{NAME}/{name}{i}"), first, last, log_every, 0, *extra)}

        return measure

    samples = alternate(
        {
            "off": rate("off", "--checkpoint.memory_overhead=0"),
            "budget": rate("budget", ON),
            "every_step": rate("every", ON, "--checkpoint.memory_every_steps=1"),
        },
        ctx.repeats,
    )
    lost = alternate(
        {
            "durable_only": lambda i: {"redone": steps_redone(work, ctx.scratch(f"{NAME}/kd{i}"), kill_at,
                                                              "--checkpoint.memory_overhead=0")},
            "memory_tier": lambda i: {"redone": steps_redone(work, ctx.scratch(f"{NAME}/km{i}"), kill_at, ON)},
        },
        ctx.repeats,
    )  # fmt: skip
    samples.update(lost)
    speed = {name: samples[name]["steps_per_s"] for name in ("off", "budget", "every_step")}
    result = Result(
        NAME,
        TITLE,
        params={**work.__dict__, "window_steps": [first, last], "ranks": 2, "backend": "gloo",
                "kill_at_step": kill_at, "durable_every": DURABLE_EVERY, "repeats": ctx.repeats},  # fmt: skip
        samples=samples,
    )
    result.rows = [
        row("memory tier off", speed["off"], "steps/s"),
        row("memory tier, default budget (0.02)", speed["budget"], "steps/s"),
        row("memory tier, every step", speed["every_step"], "steps/s"),
        row("default budget / off", ratios(speed["budget"], speed["off"]), "ratio", Target(">=", 0.98)),
        row("every step / off", ratios(speed["every_step"], speed["off"]), "ratio",
            note="the cost of saving every step whatever the budget"),
        row(f"steps redone per hard loss, durable only (every {DURABLE_EVERY})", lost["durable_only"]["redone"], "steps"),
        row("steps redone per hard loss, memory tier (default budget)", lost["memory_tier"]["redone"], "steps"),
    ]
    return result
