"""A memory-tier save's stall against the number of tensors in the state, inside one process.

    python benchmarks/memory_save_stall.py                    # 16, 32 and 80 blocks
    PYTHONPATH=/path/to/other/checkout python benchmarks/memory_save_stall.py --label other

A save's stall on the host grows with the number of tensors, not their bytes: taking the state
dicts, flattening them, and one copy per tensor. The model here has 9 small parameter tensors per
block (4 attention and 3 MLP projections, 2 norms; 16 wide, so bytes do not count) and AdamW, so
16 blocks have a 1B-parameter transformer's 144 parameter tensors (1,152 tensors with the
optimizer state). One thread, saves into a tmpfs directory, each save's background write waited
for outside the stall; prints the median stall per block count. Run it against two checkouts
(PYTHONPATH) to compare them.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the checkout on PYTHONPATH wins, else this one
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from elastic_ddp.memory.tier import MemoryTier  # noqa: E402
from elastic_ddp.state import ModelState, OptimizerState  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(width, width, bias=False) for _ in range(4))
        self.up, self.gate, self.down = (torch.nn.Linear(width, width, bias=False) for _ in range(3))
        self.norm1, self.norm2 = torch.nn.LayerNorm(width, bias=False), torch.nn.LayerNorm(width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = (self.q, self.k, self.v, self.o, self.up, self.gate, self.down, self.norm1, self.norm2)
        return sum(module(x) for module in parts)


def stall_ms(blocks: int, saves: int, directory: str) -> float:
    model = torch.nn.Sequential(*[Block() for _ in range(blocks)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    optimizer.step()
    state = {"model": ModelState(model), "optim": OptimizerState(model, optimizer)}
    memory_dir = tempfile.mkdtemp(prefix="memory-save-stall-", dir=directory)
    tier = MemoryTier(
        memory_dir=memory_dir, overhead=0.02, every_steps=1, timeout_s=30, run_name="stall",
        identity_digest="0" * 16, rank=0, local_rank=0, local_world_size=1, node=0, device=torch.device("cpu"),
        control_group=None,
    )  # fmt: skip
    try:
        tier.survey(state, fresh=True)
        stalls = []
        for step in range(saves):
            stalls.append(tier.save(step, state))
            tier._wait_writer()
        tier.close()
    finally:
        shutil.rmtree(memory_dir, ignore_errors=True)
    return statistics.median(stalls[3:]) * 1e3  # the first saves plan the layout and take the buffer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 80])
    parser.add_argument("--saves", type=int, default=25)
    parser.add_argument("--dir", default="/dev/shm", help="tmpfs to put the tier's directory in")
    parser.add_argument("--label", default="this checkout")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [f"{9 * blocks} parameter tensors: {stall_ms(blocks, args.saves, args.dir):.1f} ms" for blocks in args.blocks]
    print(f"{args.label}: save stall (median) " + "; ".join(results))


if __name__ == "__main__":
    main()
