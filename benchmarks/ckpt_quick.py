"""Quick side-by-side numbers for the checkpoint manager at 1 rank on local disk.

    python benchmarks/ckpt_quick.py --dir /tmp/ckpt-bench --mb 300 --rounds 3

Per round, alternating: an async save (training stall = time until save() returns), a sync save
(stall = the whole save), and torch.save of the same state dict to the same disk (with fsync).
Reports medians; the disk here is noisy, so compare within a round and across rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch

from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.config import CheckpointConfig
from elastic_ddp.state import ModelState, OptimizerState


def build(total_mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # AdamW keeps two moments per parameter: the state is ~3x the parameters.
    n_params = total_mb * (1 << 20) // 4 // 3
    width = 2048
    layers = max(1, n_params // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def torch_save(state: dict, path: str) -> float:
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def checksum_s_per_gb(mb: int = 512) -> float:
    data = os.urandom(mb << 20)
    view = memoryview(data)
    start = time.perf_counter()
    h = mf.new_hasher()
    for i in range(0, len(data), 8 << 20):
        h.update(view[i : i + (8 << 20)])
    return (time.perf_counter() - start) / (mb / 1024)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/ckpt-bench")
    parser.add_argument("--mb", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    model, opt = build(args.mb)
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    print(f"state: {state_bytes / 1e6:.0f} MB ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params + AdamW)")
    mgr = CheckpointManager(CheckpointConfig(url=f"{args.dir}/ck", keep_last=1), identity={"benchmark": "ckpt_quick"})
    objects = {"model": ModelState(model), "optim": OptimizerState(model, opt)}
    rows: dict[str, list[float]] = {k: [] for k in ("async_stall", "async_save", "sync_stall", "sync_tput", "torch_tput")}
    step = 0
    for _ in range(args.rounds):
        step += 1
        mgr.save(step, objects, blocking=False)
        assert mgr.wait(), mgr.last_error
        rows["async_stall"].append(mgr.last_save.stall_s)
        rows["async_save"].append(mgr.last_save.save_s)
        step += 1
        assert mgr.save(step, objects, blocking=True), mgr.last_error
        rows["sync_stall"].append(mgr.last_save.stall_s)
        rows["sync_tput"].append(mgr.last_save.throughput_bytes_per_s / 1e6)
        path = f"{args.dir}/plain.pt"
        seconds = torch_save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
        rows["torch_tput"].append(os.path.getsize(path) / seconds / 1e6)
        os.unlink(path)
    mgr.close()
    for key, values in rows.items():
        unit = "MB/s" if key.endswith("tput") else "s"
        print(f"{key:12s} median {statistics.median(values):8.3f} {unit}   all {[round(v, 3) for v in values]}")
    print(f"{mf.CHECKSUM_ALGORITHM:12s} {checksum_s_per_gb():.3f} s/GB (one core, in memory)")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
