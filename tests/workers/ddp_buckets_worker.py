"""Worker of tests/integration/test_ddp_buckets.py, under ``torchrun --standalone`` (gloo, CPU).

For each case named on the command line: STEPS steps in one DDP instance (uninterrupted), and
STEPS/2 steps, then a new model and optimizer loaded from their state dicts, a new DDP over them and
STEPS/2 more (resumed). Every rank prints one line per case::

    CASE {"rank": ..., "case": ..., "equal": <uninterrupted == resumed, bitwise>, "status": [...], ...}

with each DDP instance's StableBuckets status, the post-accumulate-grad hooks left on the
parameters afterwards, and the NOT_BITWISE warnings the rank logged. Cases that do not resume
(``resume=False``) compare one run with plain DDP instead (``close_to_plain``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic_ddp.worker import ddp_buckets


class Reordered(nn.Module):
    """Registers its layers in another order than its forward uses them, and a parameter used last
    registered first: gradients become ready in neither registration order nor its reverse."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(10))
        self.mid = nn.Linear(256, 256)
        self.out = nn.Linear(256, 10)
        self.inp = nn.Linear(32, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x))))) * self.scale


class Mixed(nn.Module):
    """float32 and float64 parameters: DDP's initial layout has a bucket per dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 256).double()
        self.c = nn.Linear(256, 10).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)).double()))).float()


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
        nn.Linear(512, 10),
    )  # fmt: skip


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Dropout(0.3), nn.Linear(256, 10),
    )  # fmt: skip


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16, sparse=True)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x).mean(1))


@dataclass
class Case:
    build: Callable[[], nn.Module]
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    shape: tuple[int, ...] = (8, 64)  # one micro-batch's input
    micro_batches: int = 1
    stable: bool = True  # register the hook (False: plain DDP)
    env: dict[str, str] = field(default_factory=dict)
    resume: bool = True  # False: one uninterrupted run only (compared with plain DDP instead)
    mispredict: bool = False  # make the prediction wrong: the check must catch it


CASES: dict[str, Case] = {
    "mlp": Case(mlp, {"bucket_cap_mb": 1}),
    "cnn": Case(cnn, {"bucket_cap_mb": 0.005}, shape=(8, 3, 12, 12)),
    "accumulation": Case(mlp, micro_batches=3),  # default caps: a 1 MiB bucket, then 25 MiB
    "reordered": Case(Reordered, {"bucket_cap_mb": 0.25}, shape=(8, 32)),
    "cap_list": Case(mlp, {"bucket_cap_mb_list": [1, 2]}),
    "static_graph": Case(mlp, {"bucket_cap_mb": 1, "static_graph": True}),
    "last_bucket_cap": Case(mlp, env={ddp_buckets.ENV_LAST_BUCKET_CAP: "1"}),
    "mixed_dtypes": Case(Mixed, {"bucket_cap_mb": 0.5}),
    "bucket_view": Case(mlp, {"bucket_cap_mb": 1, "gradient_as_bucket_view": True}),
    "find_unused": Case(mlp, {"bucket_cap_mb": 1, "find_unused_parameters": True}),
    "plain_mlp": Case(mlp, {"bucket_cap_mb": 1}, stable=False),
    "mispredicted": Case(mlp, {"bucket_cap_mb": 1}, resume=False, mispredict=True),
    "sparse": Case(Sparse, shape=(8, 5), resume=False),
}


class Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(ddp_buckets.NOT_BITWISE):
            self.count += 1
            sys.stdout.write(f"rank {dist.get_rank()}: {record.getMessage()}\n")
            sys.stdout.flush()


def batch(case: Case, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_000 * step + 100 * dist.get_rank() + micro)
    if case.build is Sparse:
        x = torch.randint(0, 100, case.shape, generator=g)
    else:
        x = torch.randn(case.shape, generator=g)
    return x, torch.randint(0, 10, (case.shape[0],), generator=g)


def make(case: Case, state: dict | None = None) -> tuple[nn.Module, DistributedDataParallel, Any, Any]:
    """A model, its DDP (with the stable-bucket hook unless ``case.stable`` is False) and optimizer,
    loaded from ``state`` if given."""
    torch.manual_seed(0)
    model = case.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    ddp = DistributedDataParallel(model, **case.ddp_kwargs)
    stable = ddp_buckets.stabilize_buckets(ddp) if case.stable else None
    return model, ddp, optimizer, stable


def train(case: Case, model, ddp, optimizer, steps: range) -> None:
    for step in steps:
        for micro in range(case.micro_batches):
            x, y = batch(case, step, micro)
            torch.manual_seed(7 * step + 1000 * dist.get_rank() + micro)  # dropout masks, per step and rank
            last = micro == case.micro_batches - 1
            with nullcontext() if last else ddp.no_sync():
                loss = nn.functional.cross_entropy(ddp(x), y) / case.micro_batches
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def hooks_left(model: nn.Module) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def run_case(name: str, steps: int, counter: Counter) -> dict[str, Any]:
    case = CASES[name]
    saved_env = {k: os.environ.get(k) for k in case.env}
    os.environ.update(case.env)
    real_private = ddp_buckets._torch_private
    if case.mispredict:

        def wrong(ddp, count):  # tiny caps: the prediction has many more buckets than DDP's rebuild
            plan = real_private(ddp, count)
            return ddp_buckets._Rebuild(plan.assign, (4096,), plan.reverse, plan.initial_iterations)

        ddp_buckets._torch_private = wrong
    counter.count = 0
    try:
        full, ddp, optimizer, stable_full = make(case)
        train(case, full, ddp, optimizer, range(1, steps + 1))
        stables = [stable_full]
        result: dict[str, Any] = {"case": name}
        if case.resume:
            half, ddp, optimizer, stable_half = make(case)
            train(case, half, ddp, optimizer, range(1, steps // 2 + 1))
            state = {"model": half.state_dict(), "optimizer": optimizer.state_dict()}
            resumed, ddp, optimizer, stable_resumed = make(case, state)
            train(case, resumed, ddp, optimizer, range(steps // 2 + 1, steps + 1))
            stables += [stable_half, stable_resumed]
            pairs = zip(full.state_dict().values(), resumed.state_dict().values())
            result["equal"] = all(torch.equal(a, b) for a, b in pairs)
            left = hooks_left(full) + hooks_left(half) + hooks_left(resumed)
        else:
            plain_case = Case(case.build, case.ddp_kwargs, case.shape, case.micro_batches, stable=False)
            plain, ddp, optimizer, _ = make(plain_case)
            train(plain_case, plain, ddp, optimizer, range(1, steps + 1))
            pairs = zip(full.state_dict().values(), plain.state_dict().values())
            result["close_to_plain"] = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in pairs)
            left = hooks_left(full)
        if stable_full is not None and stable_full.layout is not None:
            result["buckets"] = len(stable_full.layout)
        result["status"] = [s.status if s is not None else None for s in stables]
        result["hooks_left"] = left
        result["warnings"] = counter.count
        return result
    finally:
        ddp_buckets._torch_private = real_private
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    counter = Counter()
    logging.getLogger("elastic_ddp").addHandler(counter)
    try:
        for name in args.cases.split(","):
            result = run_case(name, args.steps, counter)
            # One write per line: the ranks share the log (and PYTHONUNBUFFERED splits a print in two).
            sys.stdout.write("CASE " + json.dumps({"rank": dist.get_rank(), **result}) + "\n")
            sys.stdout.flush()
    finally:
        dist.barrier()
        dist.destroy_process_group()
        # Gloo's threads release a finished collective's tensors, and one that Python has seen needs
        # the GIL for that: a process that finalizes Python in the meantime aborts ("terminate called
        # without an active exception"). Sleeping hands them the GIL first.
        time.sleep(0.2)


if __name__ == "__main__":
    main()
