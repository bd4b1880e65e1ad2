"""A plain hand-written DDP loop with the library's per-step protections switched on by name (bench_protections).

With no ``--protect`` it is the loop a user writes without the library, as benchmarks/workers/plain_ddp.py
(torch's DistributedSampler and DataLoader, the model, the optimizer, the loss, a progress line every
``logging.every_steps`` steps). Each name in ``--protect=a,b,c`` adds one protection, called where and as
``Run._loop`` (elastic_ddp/worker/run.py) calls it, so that a comparison prices the library's own code:

stop     -- the stop agreement: a StopAgreement on a gloo group of its own, carrying the memory tier's
            report (REPORT_SIZE numbers), one async all-reduce every dist.stop_check_s seconds of steps
seed     -- every generator re-seeded from (seed, rank, step) before each step's batch is fetched (StepSeeder)
guard    -- StepGuard.begin() before and .end() after each step, over the model and the scheduler
ledger   -- StepLedger enabled: each step's sample indices, then the global loss (one all-reduce and one
            host sync a step)
metrics  -- TensorBoard metrics through StepMetrics at the default cadence (the loss all-reduced at logged
            steps); the metrics' console line replaces the loop's own
buckets  -- stabilize_buckets(ddp): the stable-bucket communication hook
compare  -- the cross-rank comparison a save runs before it stages (snapshot(): the state dicts encoded and
            compared across ranks, checkpoint/divergence.py; after the first, a check of the last decision in
            one all-reduce, as a CheckpointManager's Classifier does) at every checkpoint.every_steps, over the
            state as the run registers it; rank 0 prints its time, which a save reports only inside its stall

Two models: ``--model=lm``, the language-model recipe's ByteGPT with AdamW as plain_ddp.py trains it, and
``--model=classifier``, recipes/train_classifier.py's own Net, Digits, SGD with momentum and StepLR
(imported from it), with the recipe's float16 autocast and GradScaler where it has them (on CUDA). Where CUDA is
available, a rank per GPU with NCCL and pinned batches, as the recipes run; else gloo on the CPU.

    torchrun --standalone --nproc-per-node=3 benchmarks/workers/protected_ddp.py --model=classifier --protect=stop,seed
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))  # recipes/lm as `lm`, the classifier recipe
from lm import ByteGPT, ByteGPTConfig, ByteWindows, CorpusConfig, load_corpus  # noqa: E402
from train_classifier import Digits, ModelSettings, Net, OptimSettings  # noqa: E402

from elastic_ddp.checkpoint.divergence import Classifier, all_max_over  # noqa: E402
from elastic_ddp.checkpoint.group import state_dicts  # noqa: E402
from elastic_ddp.checkpoint.sharded import snapshot  # noqa: E402
from elastic_ddp.config import CheckpointConfig, DistConfig, LoggingConfig, TrainConfig  # noqa: E402
from elastic_ddp.data import StepLedger, derive_seed  # noqa: E402
from elastic_ddp.memory.tier import REPORT_SIZE  # noqa: E402
from elastic_ddp.state import ModelState, OptimizerState, as_stateful, synced_paths  # noqa: E402
from elastic_ddp.worker.ddp_buckets import stabilize_buckets  # noqa: E402
from elastic_ddp.worker.distributed import new_gloo_group, shutdown_distributed  # noqa: E402
from elastic_ddp.worker.metrics import create_metrics  # noqa: E402
from elastic_ddp.worker.seeding import StepSeeder  # noqa: E402
from elastic_ddp.worker.step import DataState  # noqa: E402
from elastic_ddp.worker.step_guard import StepGuard  # noqa: E402
from elastic_ddp.worker.step_metrics import StepMetrics, timed  # noqa: E402
from elastic_ddp.worker.stop import StopAgreement, StopSignal  # noqa: E402

PROTECTIONS = ("stop", "seed", "guard", "ledger", "metrics", "buckets", "compare")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("lm", "classifier"), required=True)
    parser.add_argument("--protect", default="", help=f"comma-separated protections to add: {', '.join(PROTECTIONS)}")
    parser.add_argument("--run-dir", required=True, help="where the ledger and the metrics write")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-every", type=int, default=LoggingConfig().every_steps)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model before DDP wraps it")
    parser.add_argument("--global-batch-size", type=int, default=TrainConfig().global_batch_size)
    parser.add_argument("--seed", type=int, default=TrainConfig().seed)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--max-bytes", type=int, default=8_000_000)
    args = parser.parse_args()
    args.protect = {name for name in args.protect.split(",") if name}
    unknown = args.protect - set(PROTECTIONS)
    if unknown:
        parser.error(f"unknown protection(s) {sorted(unknown)}; known: {', '.join(PROTECTIONS)}")
    return args


class Training:
    """One model's data, module, optimizer and step, as a plain DDP script has them."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        self.device = device
        self.scheduler: Any = None
        if args.model == "lm":
            self.dataset: Dataset = ByteWindows(load_corpus(CorpusConfig(max_bytes=args.max_bytes)), args.block_size)
            self.model: torch.nn.Module = ByteGPT(ByteGPTConfig(
                block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
            ))  # fmt: skip
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95)
            )
        else:
            self.dataset = Digits()
            self.model = Net(ModelSettings())
            optim = OptimSettings()
            self.optimizer = torch.optim.SGD(
                self.model.parameters(), lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay
            )
            self.scheduler = torch.optim.lr_scheduler.StepLR(
                self.optimizer, step_size=optim.step_size, gamma=optim.gamma
            )
        self.lm = args.model == "lm"
        self.model.to(device)  # before the optimizer's first step creates its state, as the recipes do
        # The classifier recipe's float16 autocast and gradient scaler on CUDA (both off on the CPU).
        self.amp = not self.lm and device.type == "cuda"
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp)
        if args.compile:
            self.model = torch.compile(self.model)  # before DDP, as the recipes compile

    def step(self, ddp_model: DDP, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One optimizer step: the batch's mean loss and the step's own scalars (still on the device)."""
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if self.lm:
            logits = ddp_model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
        else:
            with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.amp):
                loss = F.cross_entropy(ddp_model(x), y)
            self.scaler.scale(loss).backward()
        scalars = {}
        if self.lm:
            scalars["train/grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, scalars


class Batches:
    """This rank's batches, epoch after epoch, with their sample indices (what the ledger records).

    ``start_step`` and iteration are what :func:`elastic_ddp.worker.step_metrics.timed` reads of the
    run's StepBatches.
    """

    start_step = 0

    def __init__(self, dataset: Dataset, batch_size: int, rank: int, world: int, seed: int, pin: bool) -> None:
        self.sampler = DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, drop_last=True, pin_memory=pin)
        self.batch_size = batch_size
        self.epoch_indices: list[int] = []
        self.position = 0  # the next sample of epoch_indices

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = 0
        while True:
            self.sampler.set_epoch(epoch)
            self.position = 0
            for batch in self.loader:
                yield batch
                self.position += self.batch_size
            epoch += 1

    def indices(self) -> list[int]:
        """The sample indices of the batch last yielded (the sampler's order is a function of the epoch)."""
        if self.position == 0:
            self.epoch_indices = list(self.sampler)
        return self.epoch_indices[self.position : self.position + self.batch_size]


class NoSaveYet:
    """What StepMetrics reads of the checkpoint manager, as a manager that has not saved reports it: this loop
    has none (durable saves are priced on the recipe, with the manager wired to the run's state)."""

    def metrics(self) -> dict[str, float]:
        return {"ckpt/failed_saves": 0.0}


def global_loss(loss: torch.Tensor, samples: int) -> float:
    """The loss over every rank's samples, as Run._global_loss computes it from Step's sums."""
    totals = torch.zeros(2, dtype=torch.float64, device=loss.device)  # on the training group's device
    totals[0] = (loss.detach().float() * samples).double()
    totals[1] = float(samples)
    dist.all_reduce(totals)
    loss_sum, count = totals.tolist()
    return loss_sum / max(count, 1.0)


def numbered(batches: Batches, before_step: Callable[[int], None]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches, each fetched after ``before_step(step)``: what ``timed`` does without its clock."""
    iterator = iter(batches)
    step = batches.start_step
    while True:
        step += 1
        before_step(step)
        yield next(iterator)


def main() -> None:
    args = parse_args()
    protect = args.protect
    # A rank per GPU with NCCL where CUDA is available, as the recipes run (elastic_ddp.worker.distributed).
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    control = new_gloo_group(DistConfig().timeout_s) if protect & {"stop", "compare"} else None
    training = Training(args, device)
    model, optimizer = training.model, training.optimizer
    ddp_model = DDP(model, device_ids=[device.index] if cuda else None)
    if "buckets" in protect:
        stabilize_buckets(ddp_model)
    per_rank = args.global_batch_size // world
    batches = Batches(training.dataset, per_rank, rank, world, args.seed, pin=cuda)

    # The run's registered state (model, optimizer, scheduler, data position), for the guard and the comparison.
    scheduler = {"scheduler": as_stateful("scheduler", training.scheduler)} if training.scheduler is not None else {}
    agreement = None
    if "stop" in protect:
        stop_signal = StopSignal(grace_s=CheckpointConfig().grace_s)  # as launch() makes it
        stop_signal.steps_started()
        agreement = StopAgreement(stop_signal, control, values=REPORT_SIZE, period_s=DistConfig().stop_check_s)
    guard = StepGuard(model, scheduler) if "guard" in protect else None
    state = {
        "model": ModelState(model, replicated=True), "optimizer": OptimizerState(model, optimizer, replicated=True),
        **scheduler, "data": DataState(),
    }  # fmt: skip
    save_every = CheckpointConfig().every_steps if "compare" in protect else 0
    classifier = Classifier()  # the saves' decision of what differs, kept between them as a manager keeps it
    ledger = StepLedger(args.run_dir, rank=rank, world_size=world, resume_step=0, enabled="ledger" in protect)
    metrics = collector = None
    if "metrics" in protect:
        metrics = create_metrics(
            LoggingConfig(every_steps=args.log_every, tensorboard_dir=f"{args.run_dir}/tensorboard"), rank=rank,
            run_dir=args.run_dir, resume_step=None, world_size=world, restart_count=0, max_steps=args.steps,
        )  # fmt: skip
        collector = StepMetrics(
            metrics, step=0, checkpoints=NoSaveYet(), memory=None, optimizer=optimizer,
            global_batch_size=args.global_batch_size, steps_redone=None,
        )  # fmt: skip

    seeder = StepSeeder()

    def reseed(step: int) -> None:
        seeder(derive_seed("step", args.seed, rank, step))

    before_step = reseed if "seed" in protect else (lambda step: None)
    source = timed(batches, collector.timing, before_step) if collector is not None else numbered(batches, before_step)
    ddp_model.train()
    for step, (x, y) in enumerate(source, start=1):
        if "ledger" in protect:  # the plain loop does not gather the indices it never records
            ledger.started(step, batches.indices())
        if guard is not None:
            guard.begin()
        loss, scalars = training.step(ddp_model, x, y)
        if guard is not None:
            guard.end()
        if agreement is not None:
            agreement.after_step()  # the memory tier's report: zeros while it is off
        global_mean = None
        if "ledger" in protect or (metrics is not None and metrics.should_log(step)):
            global_mean = global_loss(loss, per_rank)
        ledger.finished(step, global_mean if global_mean is not None else float("nan"))
        if save_every and step % save_every == 0:
            started = time.perf_counter()
            snapshot(state_dicts(state), synced=synced_paths(state), all_max=all_max_over(control, torch.device("cpu")),
                     classifier=classifier)
            if rank == 0:
                print(f"[rank0] comparison at step {step}: {time.perf_counter() - started:.6f} s", flush=True)
        if collector is not None and global_mean is not None:
            collector.log(step, global_mean, scalars)
        elif metrics is None and rank == 0 and (step % args.log_every == 0 or step == 1 or step == args.steps):
            print(f"[rank0] step={step}/{args.steps} loss={loss.item():.4f} world_size={world}", flush=True)
        if step == args.steps:
            break
    if agreement is not None:
        agreement.close()
    ledger.close()
    if metrics is not None:
        metrics.close()
    shutdown_distributed()
    # Leave here, as plain_ddp.py and the recipe's launch() do, with the DDP model still referenced: torch 2.13
    # can deadlock when it is freed (the reducer's gloo group joins its run-loop thread, which waits for the GIL
    # the freeing main thread holds).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
