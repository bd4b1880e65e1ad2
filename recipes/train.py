"""Train a byte-level transformer language model with elastic, fault-tolerant DDP.

One machine, two processes (no etcd needed)::

    torchrun --standalone --nproc-per-node=2 recipes/train.py --train.max_steps=200

Several machines, 1 to 4 of them, joined through etcd (run the same line on every machine)::

    torchrun --nnodes=1:4 --nproc-per-node=8 --max-restarts=3 \
        --rdzv-backend=etcd --rdzv-endpoint=etcd-0:2379,etcd-1:2379,etcd-2:2379 --rdzv-id=my-run \
        recipes/train.py --config recipes/configs/default.yaml --checkpoint.url=s3://bucket/my-run

The local demo (a bundled etcd and 2 agents on this machine)::

    make demo

Nodes may leave (preemption, failure) and join while the job runs: torchrun restarts the workers
at the new world size and this script resumes from the newest committed, verified checkpoint,
consuming exactly the samples the uninterrupted run would have consumed. Settings: see
``elastic_ddp/config.py`` (every field has a description), ``--config FILE`` and
``--section.field=value``.
"""

import os
import sys
import time
from contextlib import nullcontext

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_ddp.chaos import maybe_inject
from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.config import ConfigError, load_config
from elastic_ddp.data import (
    ByteWindows, DataCursor, ElasticSampler, StepBatches, StepLedger, corpus_fingerprint, load_corpus,
)  # fmt: skip
from elastic_ddp.distributed import ENV_MAX_RESTARTS, init_distributed, shutdown_distributed
from elastic_ddp.failures import FailureReport
from elastic_ddp.logs import configure_logging
from elastic_ddp.loop import StepAgreement, StopSignal, exit_when_orphaned, lr_at, run_worker, wait_for_restart
from elastic_ddp.metrics import create_metrics
from elastic_ddp.model import ByteGPT, per_sample_loss


@record  # torchrun prints this worker's exception as the root cause when it gives up
def main(argv: list[str]) -> int:
    # Every setting is checked before any process group exists: a typo costs nothing.
    try:
        cfg = load_config(argv)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    # SIGTERM now means "checkpoint at the next step boundary, then exit", within grace_s.
    stop_signal = StopSignal(grace_s=cfg.checkpoint.grace_s)
    exit_when_orphaned()  # if our torchrun agent dies, do not train on as a ghost
    configure_logging("worker")
    ctx = init_distributed(cfg.dist)
    configure_logging(f"rank {ctx.rank}")

    # The same seed on every rank gives the same initial weights (DDP also broadcasts them).
    torch.manual_seed(cfg.train.seed)
    model = ByteGPT(cfg.model).to(ctx.device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, betas=(0.9, 0.95)
    )
    ddp_model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)

    corpus = load_corpus(cfg.data)
    windows = ByteWindows(corpus, cfg.model.block_size)
    sampler = ElasticSampler(len(windows), cfg.train.global_batch_size, cfg.train.seed)

    # Resume from the newest committed, verified checkpoint, whatever world size wrote it.
    # The rendezvous round fences commits: a group the job re-formed without cannot commit any more.
    checkpoints = CheckpointManager(
        cfg.checkpoint, config_digest=cfg.model_digest(), model_config=cfg.model.model_dump(),
        rdzv_round=ctx.rdzv_round,
    )  # fmt: skip
    step, cursor = 0, DataCursor(epoch=0, consumed=0)
    resumed = checkpoints.resolve(cfg.checkpoint.resume)
    fingerprint = corpus_fingerprint(corpus)
    if resumed is not None:
        extra = checkpoints.load(resumed, model=model, optimizer=optimizer)
        step, cursor = resumed.step, DataCursor.from_state_dict(extra["data"])
        # The cursor counts positions in a permutation of this corpus's samples: other bytes would
        # make "exactly the samples the uninterrupted run consumed" silently false.
        if extra.get("corpus", fingerprint) != fingerprint:
            raise RuntimeError(
                f"{resumed.url} was written for a corpus with fingerprint {extra['corpus']}, but data.path "
                f"({cfg.data.path or 'the standard library'}, data.max_bytes={cfg.data.max_bytes}) now reads "
                f"{fingerprint}. Use the same data, or start a new run (checkpoint.resume=never)."
            )
    metrics = create_metrics(
        cfg.logging,
        rank=ctx.rank,
        run_dir=cfg.run.dir,
        resume_step=step if resumed is not None else None,
        world_size=ctx.world_size,
        restart_count=ctx.restart_count,
        max_steps=cfg.train.max_steps,
        storage_options=cfg.checkpoint.storage_options,
    )
    metrics.log_config(cfg.to_yaml())
    if resumed is not None:
        metrics.event(f"Resumed from {resumed.url} (step {resumed.step})")

    batches = StepBatches(
        windows, sampler, cursor, rank=ctx.rank, world_size=ctx.world_size,
        num_steps=cfg.train.max_steps - step, start_step=step,
        micro_batch_size=cfg.train.micro_batch_size,
        num_workers=cfg.data.num_workers, prefetch_batches=cfg.data.prefetch_batches,
    )
    ledger = StepLedger(cfg.run.dir, rank=ctx.rank, world_size=ctx.world_size, resume_step=step, enabled=cfg.data.ledger)
    failures = FailureReport(
        cfg.run.dir, rank=ctx.rank, restart_count=ctx.restart_count,
        max_restarts=int(os.environ.get(ENV_MAX_RESTARTS, "0")),
    )  # fmt: skip
    agreement = StepAgreement(ctx.device, stop_signal)
    tokens_per_sample = cfg.model.block_size
    stopped = False
    ddp_model.train()
    step_started = time.perf_counter()
    with failures:  # a crash that recurs at the same step ends with one clear error
        for batch in batches:
            maybe_inject(step + 1, ctx.rank)  # chaos tests only; a no-op unless ELASTIC_DDP_FAULT is set
            data_wait_s = time.perf_counter() - step_started
            lr = lr_at(step, cfg.train)
            for group in optimizer.param_groups:
                group["lr"] = lr

            # Gradient accumulation: DDP all-reduces gradients only on the last micro-batch. Each
            # sample's loss carries a weight that makes the all-reduced gradient the global-batch
            # mean, whatever the world size and however the batch was split.
            loss_sum = 0.0
            for index, micro in enumerate(batch.micro_batches):
                last = index == len(batch.micro_batches) - 1
                x, y = micro.x.to(ctx.device, non_blocking=True), micro.y.to(ctx.device, non_blocking=True)
                with nullcontext() if last else ddp_model.no_sync():
                    losses = per_sample_loss(ddp_model(x, micro.seeds.to(ctx.device)), y)
                    (losses * micro.weight.to(ctx.device)).sum().backward()
                if not micro.dummy:
                    loss_sum += losses.detach().sum().item()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
            )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step, cursor = step + 1, batch.cursor_after
            failures.step = step

            # One small all-reduce: the global-batch loss for logging and whether any rank must stop.
            outcome = agreement.agree(loss_sum, len(batch.rank_indices))
            ledger.record(step, batch.rank_indices, outcome.loss)
            stopped = outcome.stop
            # Every rank reaches the same step, so ending here needs no agreement.
            exiting = step in (cfg.train.max_steps, cfg.train.exit_at_step)
            if stopped or exiting or (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0):
                checkpoints.save(
                    step, model=model, optimizer=optimizer,
                    extra={"data": cursor.state_dict(), "corpus": fingerprint, "world_size": ctx.world_size},
                    blocking=stopped or exiting,
                )  # fmt: skip
            step_time_s = time.perf_counter() - step_started
            if metrics.should_log(step) or stopped or exiting:
                samples = cfg.train.global_batch_size
                metrics.log_step(step, {
                    "train/loss": outcome.loss,
                    "train/lr": lr,
                    "train/grad_norm": float(grad_norm),
                    "perf/step_time_s": step_time_s,
                    "perf/data_wait_s": data_wait_s,
                    "perf/samples_per_s": samples / step_time_s,
                    "perf/tokens_per_s": samples * tokens_per_sample / step_time_s,
                    **checkpoints.metrics(),
                })  # fmt: skip
            if stopped:
                metrics.event(f"Stopped at step {step} on request; checkpoint committed")
                break
            if step == cfg.train.exit_at_step:
                metrics.event(f"Exiting after step {step} (train.exit_at_step); checkpoint committed")
                break
            step_started = time.perf_counter()

    checkpoints.close()  # waits for an async save still in flight
    ledger.close()
    metrics.summary()
    metrics.close()
    shutdown_distributed()
    if stopped:
        # Preempted ranks leave now; survivors wait for their agent to restart them at the new
        # membership, so the stop costs neither steps nor one of torchrun's --max-restarts.
        return wait_for_restart(stop_signal, cfg.dist.restart_wait_s)
    return 0


if __name__ == "__main__":
    run_worker(main, sys.argv[1:])  # after an exception: report, then leave without cleanup
