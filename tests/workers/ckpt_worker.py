"""A tiny DDP job for the checkpoint tests, run under torchrun (gloo, CPU).

save: train ``--steps`` steps, async-saving at each step in ``--save-at`` while training goes on
      (mutating the tensors right after each save() returns); rank 0 dumps the values of every
      saved step to ``--dump`` for the loader to compare. ``--fault FAULT`` (``ELASTIC_DDP_FAULT``'s
      grammar, e.g. ``kill@mid_write:rank=1``) arms the fault for the save of step ``--fault-step`` only. Each rank prints how many bytes of the
      replicated state it staged: ``rank R staged S of T replicated bytes``. ``--hang RANK:STEP``
      makes that rank sleep where it would save that step (a rank that hangs, not one that dies).
load: resolve ``--resume`` (default auto), load into a fresh model and optimizer, compare with the
      dump of the resumed step (model, optimizer state, progress) and check that each rank got its
      own per-rank object back at the saving world size, rank 0's at another; print the bytes of the
      checkpoint this rank read from storage; then train one more step to show it works.

Both modes register an object whose values differ per rank (a tensor and the rank) beside the
replicated state, as any other: the manager finds that it differs and stores it per rank. A manager
that cannot be built (checkpoint.url not shared by all nodes) ends the worker with exit status 5.

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/workers/ckpt_worker.py \
        save --url /tmp/ck --steps 3 --save-at 3 --dump /tmp/ck.pt
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_ddp.checkpoint import CheckpointError, CheckpointManager
from elastic_ddp.config import CheckpointConfig
from elastic_ddp.faults import ENV_FAULT
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


class Mine:
    """Per-rank state: the rank that saved it and a tensor only that rank has."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.values = torch.full((5,), float(rank))

    def state_dict(self) -> dict:
        return {"rank": self.rank, "values": self.values}

    def load_state_dict(self, state: dict) -> None:
        self.rank, self.values = state["rank"], state["values"].clone()


def own_value(rank: int, step: int) -> float:
    """What rank ``rank``'s per-rank tensor holds when step ``step`` is saved."""
    return float(10 * rank + step)


def objects(model: torch.nn.Module, opt: torch.optim.Optimizer, progress: Progress, mine: Mine | None = None) -> dict:
    out = {"model": ModelState(model), "optim": OptimizerState(model, opt), "progress": progress}
    return out if mine is None else {**out, "mine": mine}


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


def replicated_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    tensors = list(model.state_dict().values())
    tensors += [v for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


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
    # RANK:STEP: that rank stops making progress (sleeps) where it would save that step.
    parser.add_argument("--hang", default="")
    parser.add_argument("--dist-timeout-s", type=float, default=60.0)
    # 0: every rank writes files even for this tiny model (the layout is what the tests check).
    parser.add_argument("--min-file-mb", type=float, default=0.0)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.dist_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build()
    ddp = DDP(model)
    cfg = CheckpointConfig(url=args.url, keep_last=10, min_file_mb=args.min_file_mb)
    try:
        mgr = CheckpointManager(cfg, identity=IDENTITY)
    except CheckpointError as exc:  # e.g. checkpoint.url is not shared by all nodes
        print(f"rank {rank}: CheckpointError: {exc}", flush=True)
        dist.destroy_process_group()
        return 5
    mine = Mine(rank)

    if args.mode == "save":
        expected = {}
        for step in range(1, args.steps + 1):
            train_step(ddp, opt, step, rank)
            if step in args.save_at:
                if args.hang == f"{rank}:{step}":
                    time.sleep(3600)
                if step == args.fault_step:
                    os.environ[ENV_FAULT] = args.fault
                mine.values.fill_(own_value(rank, step))
                mgr.save(step, objects(model, opt, Progress(step, world), mine), blocking=False)
                expected[step] = snapshot(model, opt)
                # Keep changing the tensors while the background write runs.
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(-3.0).add_(1.0)
                    mine.values.add_(1000.0)
        ok = mgr.close()
        if ok and mgr.last_save is not None:
            own = mine.values.numel() * mine.values.element_size()
            print(f"rank {rank} staged {mgr.last_save.staged_bytes - own} of {replicated_bytes(model, opt)} "
                  "replicated bytes", flush=True)  # fmt: skip
        if rank == 0 and args.dump and expected:
            torch.save(expected, args.dump)
        shutdown(ddp)
        return 0 if ok else 3

    info = mgr.resolve(args.resume)
    if info is None:
        print("no checkpoint", file=sys.stderr)
        return 4
    progress = Progress()
    restored = mgr.load(info, objects(model, opt, progress, mine))
    read = mgr.last_load.bytes_read
    expected = torch.load(args.dump, weights_only=True)[info.step]
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
    if restored != (info.world_size == world):
        raise SystemExit(f"rank {rank}: per-rank state restored={restored} at world size {world}")
    owner = rank if restored else 0  # at another world size every rank gets rank 0's
    if mine.rank != owner or not torch.equal(mine.values, torch.full((5,), own_value(owner, info.step))):
        raise SystemExit(f"rank {rank}: got the per-rank state of rank {mine.rank}, expected rank {owner}'s")
    train_step(ddp, opt, info.step + 1, rank)
    mgr.close()
    print(f"rank {rank}/{world}: resumed step {info.step} saved at world size {info.world_size}: OK "
          f"(own state restored: {restored}; read {read} bytes)", flush=True)  # fmt: skip
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
