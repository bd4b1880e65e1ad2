"""What a memory-tier save costs a training step, measured inside one process.

    python benchmarks/memory_tier_quick.py --every 9 --blocks 15

One process trains the recipe's default ByteGPT on the CPU (one thread) and alternates blocks of
steps without the tier and with it saving every ``--every`` steps into a tmpfs directory, so the
machine's load changes hit both alike. Prints the median step time of each, the overhead per step
and per save, and the cost per save the tier itself measured (stall + background write CPU): the
in-process check of the budget that bench_memory_tier.py measures end to end, where the noise of a
shared machine is larger than a 2 % budget.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))  # the LM recipe's recipes/lm/, as `lm`
from lm import ByteGPT, ByteGPTConfig  # noqa: E402
from elastic_ddp.memory.tier import MemoryTier
from elastic_ddp.state import ModelState, OptimizerState


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=9, help="save every N steps in the blocks with the tier")
    parser.add_argument("--blocks", type=int, default=15, help="pairs of blocks (without, with), 6 saves each")
    parser.add_argument("--dir", default="/dev/shm", help="tmpfs to put the tier's directory in")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ByteGPT(ByteGPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"model": ModelState(model), "optim": OptimizerState(model, optimizer)}
    batch = torch.randint(0, 256, (16, 64))

    def train_step() -> None:
        loss = F.cross_entropy(model(batch).flatten(0, 1), batch.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    memory_dir = tempfile.mkdtemp(prefix="memory-tier-quick-", dir=args.dir)
    tier = MemoryTier(
        memory_dir=memory_dir, overhead=0.02, every_steps=args.every, timeout_s=30, run_name="quick",
        identity_digest="0" * 16, rank=0, local_rank=0, local_world_size=1, node=0, device=torch.device("cpu"),
        control_group=None,
    )  # fmt: skip
    try:
        tier.survey(state, fresh=True)
        for _ in range(20):  # warm-up: allocator, caches, the optimizer's moments
            train_step()
        steps_per_block = 6 * args.every
        times: dict[str, list[float]] = {"without": [], "with": []}
        costs: list[float] = []
        step = 0
        for _ in range(args.blocks):
            for mode in ("without", "with"):
                start = time.perf_counter()
                for _ in range(steps_per_block):
                    train_step()
                    step += 1
                    if mode == "with":
                        saves = tier.saves
                        tier.after_step(step, state, None)
                        if tier.saves > saves and saves:
                            costs.append(tier.cost_s)  # the previous save's, now that its write is done
                times[mode].append((time.perf_counter() - start) / steps_per_block)
        tier.close()
    finally:
        shutil.rmtree(memory_dir, ignore_errors=True)
    without, with_tier = statistics.median(times["without"]), statistics.median(times["with"])
    per_step = with_tier - without
    print(f"step without the tier {without * 1e3:.2f} ms, with a save every {args.every}: {with_tier * 1e3:.2f} ms")
    print(f"overhead {per_step * 1e3:.2f} ms per step = {per_step * args.every * 1e3:.1f} ms per save; "
          f"step-rate ratio {without / with_tier:.3f}")  # fmt: skip
    print(f"cost per save as the tier measures it (median): {statistics.median(costs) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
