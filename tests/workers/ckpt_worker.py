"""A tiny DDP job for the checkpoint tests, run under torchrun (gloo, CPU).

save: train ``--steps`` steps, async-saving at each step in ``--save-at`` while training goes on
      (mutating the tensors right after each save() returns); rank 0 dumps the values of the last
      saved step to ``--dump`` for the loader to compare. ``--fault POINT:RANK`` arms the manager's
      fault point for the save of step ``--fault-step`` only.
load: resolve ``--resume`` (default auto), load into a fresh model and optimizer, compare with
      ``--dump`` (model, optimizer state, extra), then train one more step to show it works.

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/workers/ckpt_worker.py \
        save --url /tmp/ck --steps 3 --save-at 3 --dump /tmp/ck.pt
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_ddp.checkpoint import ENV_FAULT_POINT, CheckpointManager
from elastic_ddp.config import CheckpointConfig
from elastic_ddp.state import ModelState, OptimizerState

IDENTITY = {"worker": "ckpt_worker"}


class Progress:
    """The step and world size a checkpoint was saved at (a user's own stateful object)."""

    def __init__(self, step: int = -1, world: int = -1) -> None:
        self.step, self.world = step, world

    def state_dict(self) -> dict:
        return {"step": self.step, "world": self.world}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.world = state["step"], state["world"]


def objects(model: torch.nn.Module, opt: torch.optim.Optimizer, progress: Progress) -> dict:
    return {"model": ModelState(model), "optim": OptimizerState(model, opt), "progress": progress}


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(ddp: DDP, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=gen)
    opt.zero_grad()
    ddp(x).pow(2).mean().backward()
    opt.step()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": {
            i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
            for i, s in enumerate(opt.state_dict()["state"].values())
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save-at", type=int, nargs="*", default=[])
    parser.add_argument("--dump", default="")
    parser.add_argument("--resume", default="auto")
    parser.add_argument("--fault", default="")
    parser.add_argument("--fault-step", type=int, default=-1)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build()
    ddp = DDP(model)
    mgr = CheckpointManager(CheckpointConfig(url=args.url, keep_last=10), identity=IDENTITY)

    if args.mode == "save":
        expected = None
        for step in range(1, args.steps + 1):
            train_step(ddp, opt, step, rank)
            if step in args.save_at:
                if step == args.fault_step:
                    os.environ[ENV_FAULT_POINT] = args.fault
                mgr.save(step, objects(model, opt, Progress(step, world)), blocking=False)
                expected = snapshot(model, opt)
                # Keep changing the tensors while the background write runs.
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(-3.0).add_(1.0)
        ok = mgr.close()
        if rank == 0 and args.dump and expected is not None:
            torch.save(expected, args.dump)
        shutdown(ddp)
        return 0 if ok else 3

    info = mgr.resolve(args.resume)
    if info is None:
        print("no checkpoint", file=sys.stderr)
        return 4
    progress = Progress()
    mgr.load(info, objects(model, opt, progress))
    expected = torch.load(args.dump, weights_only=True)
    got = snapshot(model, opt)
    for key, value in expected["model"].items():
        if not torch.equal(got["model"][key], value):
            raise SystemExit(f"rank {rank}: model tensor {key} differs after load")
    for index, state in expected["optim"].items():
        for key, value in state.items():
            if not torch.equal(torch.as_tensor(got["optim"][index][key]), torch.as_tensor(value)):
                raise SystemExit(f"rank {rank}: optimizer state {index}.{key} differs after load")
    if (progress.step, progress.world) != (info.step, info.world_size):
        raise SystemExit(f"rank {rank}: progress {progress.state_dict()} does not match step {info.step}")
    train_step(ddp, opt, info.step + 1, rank)
    mgr.close()
    print(f"rank {rank}/{world}: resumed step {info.step} saved at world size {info.world_size}: OK", flush=True)
    shutdown(ddp)
    return 0


def shutdown(ddp: DDP) -> None:
    # Destroying the groups right after DDP's last allreduce deadlocked ~1 run in 6 here (torch 2.13):
    # the gloo group's destructor joins a worker thread that waits for the GIL to drop a finished
    # work. A barrier first, and a moment with the GIL released, avoid that.
    dist.barrier()
    time.sleep(0.2)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
