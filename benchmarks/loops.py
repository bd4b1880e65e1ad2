"""Launching the recipe and the plain DDP loop on the same model, data and batch, and timing them.

Steps per second are measured between two progress lines printed by rank 0 *during* the run
(their arrival in the parent is stamped), so interpreter start-up, corpus loading and the final
blocking checkpoint are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import RECIPE, WORKERS, TimedProcess, child_env, step_stamps, steps_per_s, torchrun

PLAIN_LOOP = WORKERS / "plain_ddp.py"


@dataclass(frozen=True)
class Workload:
    """Model, data and batch shared by the recipe and the plain loop."""

    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    global_batch_size: int = 32
    max_bytes: int = 8_000_000

    def recipe_flags(self) -> list[str]:
        return [
            f"--model.n_layer={self.n_layer}", f"--model.n_head={self.n_head}",
            f"--model.n_embd={self.n_embd}", f"--model.block_size={self.block_size}",
            f"--train.global_batch_size={self.global_batch_size}", f"--data.max_bytes={self.max_bytes}",
        ]  # fmt: skip

    def plain_flags(self) -> list[str]:
        return [
            f"--n-layer={self.n_layer}", f"--n-head={self.n_head}", f"--n-embd={self.n_embd}",
            f"--block-size={self.block_size}", f"--global-batch-size={self.global_batch_size}",
            f"--max-bytes={self.max_bytes}",
        ]  # fmt: skip


DEFAULT = Workload()  # the recipe's own defaults
TINY = Workload(n_layer=1, n_head=2, n_embd=32, block_size=32, global_batch_size=8, max_bytes=300_000)


def recipe_flags(work: Workload, root: Path, max_steps: int, log_every: int, ckpt_every: int = 0, *extra: str) -> list[str]:
    """Recipe flags for a fresh run under ``root``: no resume, checkpoints every ``ckpt_every`` (0: final only)."""
    return [
        *work.recipe_flags(),
        f"--run.root={root}", "--run.name=bench", f"--checkpoint.url={root}/ckpt",
        "--checkpoint.resume=never", f"--checkpoint.every_steps={ckpt_every}",
        f"--train.max_steps={max_steps}", f"--logging.every_steps={log_every}",
        "--train.warmup_steps=2", *extra,
    ]  # fmt: skip


def standalone(script: Path, args: list[str], nproc: int = 2) -> list[str]:
    return torchrun("--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.1", script=script, script_args=args)


def measure_rate(cmd: list[str], first: int, last: int, log_path: Path, timeout: float = 600) -> float:
    """Run ``cmd`` to completion; steps/s between the progress lines of steps ``first`` and ``last``."""
    with TimedProcess(cmd, child_env(), log_path) as proc:
        proc.check(timeout)
        return steps_per_s(step_stamps(proc.lines()), first, last)


def recipe_rate(
    work: Workload, root: Path, first: int, last: int, log_every: int, ckpt_every: int = 0, *extra: str, nproc: int = 2
) -> float:
    """The recipe's steps/s from step ``first`` to ``last``; it runs one step more so the final save is outside."""
    flags = recipe_flags(work, root, last + 1, log_every, ckpt_every, *extra)
    return measure_rate(standalone(RECIPE, flags, nproc), first, last, root / "recipe.log")

