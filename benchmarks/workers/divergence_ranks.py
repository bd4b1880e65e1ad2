"""The cross-rank check of a save against the save it guards, at N ranks under torchrun (bench_divergence).

Every rank builds the same training state -- ByteGPT + AdamW after one step, ``--mb`` MiB, registered
as the run registers it (the DDP model's parameters and the optimizer's state declared replicated)
-- plus, with ``--ema``, an ``AveragedModel(use_buffers=True)`` of it whose buffers are then made to
differ per rank (as BatchNorm statistics do): a copy of the parameters that must be hashed at every
save. Alternating every repeat, between barriers, timed on every rank and reported as the slowest:

check -- what ``classify`` takes beyond encoding the state dicts (which every save does): the
         checksums, the digests and the two all-reduces a save runs before it stages
save  -- ``CheckpointManager.save(blocking=False)``'s stall (which includes the check)

Rank 0 writes ``--out`` (JSON): per repeat ``check_s``, ``stall_s``, and the bytes hashed.

    torchrun --standalone --nproc-per-node=2 benchmarks/workers/divergence_ranks.py --mb 64 --ema --root /tmp/d --out /tmp/d.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run by torchrun as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.optim.swa_utils import AveragedModel  # noqa: E402

from benchmarks.common import alternate  # noqa: E402
from benchmarks.state import build_state  # noqa: E402
from elastic_ddp.checkpoint import CheckpointManager  # noqa: E402
from elastic_ddp.checkpoint.divergence import classify  # noqa: E402
from elastic_ddp.checkpoint.tree import flatten_named  # noqa: E402
from elastic_ddp.config import CheckpointConfig  # noqa: E402
from elastic_ddp.state import ModelState, OptimizerState, synced_paths  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, required=True, help="model + AdamW state in MiB")
    parser.add_argument("--ema", action="store_true", help="also register an EMA of the model (hashed at each save)")
    parser.add_argument("--root", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    timing = dist.new_group(backend="gloo")
    state = build_state(args.mb, device=device)
    objects = {
        "model": ModelState(state.model, replicated=True),
        "optimizer": OptimizerState(state.model, state.optimizer, replicated=True),
    }
    if args.ema:
        ema = AveragedModel(state.model, use_buffers=True)
        with torch.no_grad():
            for buffer in ema.buffers():
                if buffer.is_floating_point():
                    buffer.add_(rank)  # per-rank values, as BatchNorm statistics would have
        objects["ema"] = ModelState(ema)
    manager = CheckpointManager(CheckpointConfig(url=f"{args.root}/ckpt", keep_last=1), check_storage=False)

    def slowest(seconds: float) -> float:
        box = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=timing)
        return float(box.item())

    def all_max(values: torch.Tensor) -> torch.Tensor:
        box = values.to(device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return box.cpu()

    hashed = {"bytes": 0}

    def check(_: int) -> dict[str, float]:
        # The state dicts and their encoding are what any save takes (untimed here, measured below);
        # the check's own cost is classify() beyond flatten_named(), on the same trees.
        trees = {name: obj.state_dict() for name, obj in objects.items()}
        synced = synced_paths(objects)
        dist.barrier(group=timing)
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        flatten_named(trees)
        flat = time.perf_counter() - started
        started = time.perf_counter()
        split = classify(trees, synced=synced, all_max=all_max)
        took = time.perf_counter() - started
        hashed["bytes"] = sum(t.numel() * t.element_size() for t, p in zip(split.tensors, split.paths) if not synced(p))
        return {"check_s": slowest(max(took - flat, 0.0)), "per_rank_tensors": len(split.per_rank)}

    step = {"n": 0}

    def save(_: int) -> dict[str, float]:
        dist.barrier(group=timing)
        step["n"] += 1
        manager.save(step["n"], objects, blocking=False)
        manager.wait()  # the stall is the manager's own measure: until save() returned
        return {"stall_s": slowest(manager.last_save.stall_s)}

    results = alternate({"check": check, "save": save}, args.repeats)
    manager.close()
    if rank == 0:
        total = sum(t.numel() * t.element_size() for o in objects.values() for t in _tensors(o.state_dict()))
        Path(args.out).write_text(json.dumps({
            **results["check"], **results["save"], "state_bytes": total, "hashed_bytes": hashed["bytes"],
            "world_size": dist.get_world_size(), "device": str(device),
        }))  # fmt: skip
    dist.barrier(group=timing)
    dist.destroy_process_group()
    return 0


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


if __name__ == "__main__":
    sys.exit(main())
