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

On a machine with CUDA it runs one rank per GPU (nccl) and a larger model (``GPU``, ~57 M
parameters, ~0.9 GB of model and AdamW state per rank), where a save's device-to-host copy is
part of the stall and the background write has cores of its own, as on a GPU node.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from benchmarks.common import RECIPE, Context, Result, Target, TimedProcess, alternate, child_env, ratios, row
from benchmarks.loops import DEFAULT, TINY, Workload, recipe_flags, recipe_rate, standalone

ON = "--checkpoint.memory_overhead=0.02"  # the budget the deploy manifests set
NAME = "memory_tier"
TITLE = "Memory tier: step-time cost and steps redone per hard loss"
DURABLE_EVERY = 25
GPU = Workload(n_layer=8, n_head=12, n_embd=768, block_size=256, global_batch_size=32)


def steps_redone(work, root: Path, kill_at: int, *extra: str, nproc: int = 2) -> float:
    """Run to ``kill_at + 10`` with a worker killed at the start of step ``kill_at``; steps redone."""
    # The restarted attempt must resume, so not the fresh start the throughput runs ask for.
    flags = [f for f in recipe_flags(work, root, kill_at + 10, 10, DURABLE_EVERY, *extra) if f != "--checkpoint.resume=never"]
    cmd = standalone(RECIPE, flags, nproc)
    cmd.insert(cmd.index("--standalone") + 1, "--max-restarts=1")
    env = child_env(ELASTIC_DDP_FAULT=f"kill@{kill_at}:rank={nproc - 1}:restart=0")
    with TimedProcess(cmd, env, root / "kill.log") as proc:
        proc.check(600)
    lines = (root / "bench" / "failures.jsonl").read_text(encoding="utf-8").splitlines()
    [record] = [r for r in map(json.loads, lines) if r.get("kind") == "resume"]
    # The fault kills the last rank as step kill_at starts, so step kill_at - 1 was the last completed.
    return float(kill_at - 1 - record["step"])


def tier_choice(tensorboard: Path) -> dict[str, float]:
    """The interval the tier chose last and the median cost per save it measured (TensorBoard), if on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    if "memory/interval_steps" not in tags:
        return {}
    cost_s = statistics.median(e.value for e in events.Scalars("memory/save_cost_s"))
    return {"interval": events.Scalars("memory/interval_steps")[-1].value, "save_cost_ms": 1000 * cost_s}


def run(ctx: Context) -> Result:
    gpus = torch.cuda.device_count()
    ranks, backend = (min(gpus, 8), "nccl") if gpus else (2, "gloo")
    work = TINY if ctx.smoke else GPU if gpus else DEFAULT
    log_every = 10 if ctx.smoke else 20
    # ~25 s per measured window on CPUs: the budget is 2 % of step time and a shared machine's
    # noise is more. GPU steps vary far less, and device time is scarce: half the window.
    first, last = log_every, (3 if ctx.smoke else 10 if gpus else 20) * log_every
    kill_at = 38

    def rate(name: str, *extra: str):
        def measure(i: int) -> dict[str, float]:
            root = ctx.scratch(f"{NAME}/{name}{i}")
            steps_per_s = recipe_rate(work, root, first, last, log_every, 0, *extra, nproc=ranks)
            return {"steps_per_s": steps_per_s, **tier_choice(root / "bench" / "tensorboard")}

        return measure

    variants = {"off": rate("off", "--checkpoint.memory_overhead=0"), "budget": rate("budget", ON)}
    if not gpus:
        # On a GPU a save of ~0.9 GB every step is bound by the write, whatever the budget: minutes
        # of device time to show what the CPU run already shows.
        variants["every_step"] = rate("every", ON, "--checkpoint.memory_every_steps=1")
    samples = alternate(variants, ctx.repeats)
    lost = alternate(
        {
            "durable_only": lambda i: {"redone": steps_redone(work, ctx.scratch(f"{NAME}/kd{i}"), kill_at,
                                                              "--checkpoint.memory_overhead=0", nproc=ranks)},
            "memory_tier": lambda i: {"redone": steps_redone(work, ctx.scratch(f"{NAME}/km{i}"), kill_at, ON,
                                                             nproc=ranks)},
        },
        ctx.repeats,
    )  # fmt: skip
    samples.update(lost)
    speed = {name: samples[name]["steps_per_s"] for name in variants}
    result = Result(
        NAME,
        TITLE,
        params={**work.__dict__, "window_steps": [first, last], "ranks": ranks, "backend": backend,
                "kill_at_step": kill_at, "durable_every": DURABLE_EVERY, "repeats": ctx.repeats},  # fmt: skip
        samples=samples,
    )
    every = "every_step" in speed
    result.rows = [
        row("memory tier off", speed["off"], "steps/s"),
        row("memory tier, default budget (0.02)", speed["budget"], "steps/s"),
        *([row("memory tier, every step", speed["every_step"], "steps/s")] if every else []),
        row("default budget / off", ratios(speed["budget"], speed["off"]), "ratio", Target(">=", 0.98)),
        row("interval the tier chose at the default budget", samples["budget"]["interval"], "steps"),
        row("cost per save the tier measured (median)", samples["budget"]["save_cost_ms"], "ms",
            note="its stall; on CPUs also the background write's CPU time"),
        *([row("every step / off", ratios(speed["every_step"], speed["off"]), "ratio",
               note="the cost of saving every step whatever the budget")] if every else []),
        row(f"steps redone per hard loss, durable only (every {DURABLE_EVERY})", lost["durable_only"]["redone"], "steps"),
        row("steps redone per hard loss, memory tier (default budget)", lost["memory_tier"]["redone"], "steps"),
    ]  # fmt: skip
    return result
