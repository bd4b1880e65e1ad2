"""The public API: one object that owns the elastic protocol around a user's own training step.

A training script keeps what is its own -- model, data, optimizer, loss, the step -- and hands the
rest to a :class:`Run`::

    import elastic_ddp as edp

    def train(run: edp.Run) -> None:
        model = Net().to(run.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp_model = run.setup(model, optimizer)               # DDP, registered state, resume
        for step in run.steps(MyDataset()):                   # exactly-once data, saves, metrics, stop
            for x, y in step:                                 # this rank's micro-batches, on run.device
                step.backward(F.cross_entropy(ddp_model(x), y))
            optimizer.step()
            optimizer.zero_grad()

    if __name__ == "__main__":
        edp.launch(train)                                      # config, process group, exit status

What the run does, in the order the protocol needs (the script cannot get it wrong because the
order is not the script's):

1. :func:`~elastic_ddp.worker.launch.launch`: settings from ``--config FILE`` and ``--section.field=value`` (a bad one stops
   the job before anything starts); SIGTERM becomes a stop request (before the first step an
   immediate exit: there is nothing to save yet); the worker exits by itself if its torchrun agent
   dies; the process group and this rank's device; every random generator seeded from
   ``train.seed`` (the same initial weights on every rank).
2. :meth:`Run.setup`: wraps the model in DDP; registers the model, optimizer, scheduler and any
   other stateful objects; proves that every node sees the same checkpoint storage; picks the
   newest state anywhere -- a surviving node's memory tier (``checkpoint.memory_dir``, see
   docs/memory-tier.md) or the newest committed, verified checkpoint, refused if it belongs to a
   run with other identity settings -- and loads it (every object, and the data position); a run
   that resumes nothing starts from ``checkpoint.init_from`` when set (pretrained weights, read once
   and broadcast); opens the metrics.
3. :meth:`Run.steps`: each iteration is one optimizer step over this rank's share of the next
   ``train.global_batch_size`` samples of a world-size-independent order. Around the script's step
   the run agrees with all ranks on stopping, keeps the state in node memory at the interval its
   stall budget allows (``checkpoint.memory_overhead``), saves at ``checkpoint.every_steps`` (in
   the background), logs metrics, and ends with a blocking save at ``train.max_steps``,
   ``train.exit_at_step`` or a stop request -- into node memory only when the stop just admits a
   joining node (every node of the round stays and holds it there).
4. Teardown: waits for a save in flight, closes the metrics and the process group, and exits 0,
   or with :data:`~elastic_ddp.contract.EXIT_STOPPED` after a stop (a survivor of a membership change
   first waits for its agent to restart it; a rank stopped from outside, a preemption, first tells
   its agent that the node leaves, so that the others need not wait for its exit), skipping the
   interpreter's module teardown (0.7 s of every restart with torch imported; threads, ``atexit``
   handlers and open files are still seen to: :mod:`elastic_ddp.worker.exiting`). A failure that must not
   pass silently -- a final save that failed, ``checkpoint.max_failed_saves`` failed saves in a
   row, storage not shared by all nodes, a resume that would mix runs -- ends the job with one
   clear message and a non-zero status.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from elastic_ddp.checkpoint import CheckpointInfo, CheckpointManager
from elastic_ddp.checkpoint.compiled import CompiledArtifacts
from elastic_ddp.checkpoint.manifest import identity_digest, signing_key
from elastic_ddp.config import Config, ConfigError
from elastic_ddp.data import (
    ORDER_VERSION, ElasticSampler, Shards, StepBatches, StepLedger, check_dataset, check_same_dataset,
    dataset_fingerprint, derive_seed,
)  # fmt: skip
from elastic_ddp.faults import at_step
from elastic_ddp.logs import configure_logging
from elastic_ddp.memory.tier import REPORT_SIZE, MemoryTier
from elastic_ddp.state import ModelState, OptimizerState, Stateful, as_stateful, is_compiled
from elastic_ddp.worker.ddp_buckets import stabilize_buckets
from elastic_ddp.worker.distributed import ENV_MAX_RESTARTS, init_distributed, new_gloo_group, shutdown_distributed
from elastic_ddp.worker.exiting import exit_on_settings_error, prepare_exit
from elastic_ddp.worker.failures import FailureReport
from elastic_ddp.worker.lifecycle import (
    ENDED_EXIT_AT_STEP, ENDED_FINISHED, ENDED_STOPPED, RunError, check_ended, end_ended, exit_status, frees_memory,
    loop_end, stop_ended, stop_event, stopped,
)  # fmt: skip
from elastic_ddp.worker.metrics import Metrics, create_metrics
from elastic_ddp.worker.resume import Resumed, init_from, record_lost_history, record_resume, resume
from elastic_ddp.worker.seeding import StepSeeder, seed_everything
from elastic_ddp.worker.step import DataState, Step
from elastic_ddp.worker.step_guard import StepGuard
from elastic_ddp.worker.step_metrics import StepMetrics, timed
from elastic_ddp.worker.stop import StopAgreement, StopSignal, report_leaving

__all__ = ["Run", "RunError", "Step"]

log = logging.getLogger(__name__)

# Names the run gives the objects it registers itself; a script's own objects take other names.
MODEL, OPTIMIZER, SCHEDULER, DATA = "model", "optimizer", "scheduler", "data"


def _registered(name: str, obj: object) -> Stateful:
    """``obj`` as checkpointable state (see :func:`elastic_ddp.state.as_stateful`), or a RunError naming it."""
    try:
        return as_stateful(name, obj)
    except (TypeError, ValueError) as exc:
        raise RunError(f"run.setup(): {exc}") from None


def _report_skipped(skipped: list[dict[str, Any]], ledger: StepLedger, metrics: Any) -> None:
    """Every bad record a sharded source leaves out (``on_bad_record="skip"``), where the user looks: one
    warning with the first few, the ledger (all of them), a TensorBoard event."""
    shown = "; ".join(item["reason"] for item in skipped[:3])
    text = (
        f"The sharded source skips {len(skipped)} bad record(s) or shard end(s) (on_bad_record='skip'), never "
        f"trained on: {shown}{' ...' if len(skipped) > 3 else ''}"
    )
    log.warning("%s", text)
    ledger.skipped(skipped)
    metrics.event(text)


def _lockstep(objects: Mapping[str, Stateful]) -> frozenset[str]:
    """The registered objects that change alike on every rank by construction: the data position (the
    run sets it), and a scheduler that follows the optimizer's steps (not ReduceLROnPlateau, which
    follows a metric that may be a rank's own)."""
    scheduler = objects.get(SCHEDULER)
    follows_steps = isinstance(scheduler, LRScheduler) and not isinstance(scheduler, ReduceLROnPlateau)
    return frozenset({DATA, SCHEDULER} if follows_steps else {DATA})


@dataclass
class _Session:
    """What :meth:`Run.setup` built, together: the objects the loop and the teardown work with."""

    ddp: DistributedDataParallel
    optimizer: torch.optim.Optimizer
    state: dict[str, Stateful]  # every registered object, by name
    checkpoints: CheckpointManager
    memory: MemoryTier | None  # None: the memory tier is off
    metrics: Metrics
    resumed: Resumed
    guard: StepGuard | None  # with the memory tier: what a failed step changed (see Run._keep_failed_step)
    compiled: CompiledArtifacts | None  # a compiled model's artifacts, for nodes that join (None: eager)
    memory_off: str | None = None  # why the memory tier stopped during the loop (reported once)


class Run:
    """One worker's part of an elastic job (see the module docstring). Made by :func:`launch`.

    Attributes: ``cfg`` (the settings), ``rank``, ``world_size``, ``local_rank``, ``device``,
    ``is_main``, ``step`` (optimizer steps completed), ``resumed_from`` (the durable checkpoint this
    attempt started from, or None), ``resumed_tier`` (``"memory"``, ``"durable"`` or None: where this
    attempt's state came from), ``ended`` (how the loop ended, an ``ENDED_*`` value of
    :mod:`elastic_ddp.worker.lifecycle`; None until it did).
    """

    def __init__(self, cfg: Config, stop_signal: StopSignal) -> None:
        self.cfg = cfg
        self._stop_signal = stop_signal
        self._ctx = init_distributed(cfg.dist)
        configure_logging(f"rank {self._ctx.rank}")
        self._control = new_gloo_group(cfg.dist.timeout_s)
        seed_everything(cfg.train.seed)  # the same initial weights on every rank
        self._step_seeder = StepSeeder()  # after the device is chosen: the families this process can use
        self.failures = FailureReport(
            cfg.run.dir, rank=self.rank, restart_count=self._ctx.restart_count,
            max_restarts=int(os.environ.get(ENV_MAX_RESTARTS, "0")),
        )  # fmt: skip
        self.step = 0
        self._data = DataState()
        self._session: _Session | None = None  # set by setup()
        self._events: list[str] = []  # events before the metrics exist; recorded once they do
        self._in_step: int | None = None  # the step the loop is in; None until run.steps() is called
        self.ended: str | None = None

    # ------------------------------------------------------------------------------ where we are

    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    @property
    def local_rank(self) -> int:
        return self._ctx.local_rank

    @property
    def device(self) -> torch.device:
        """This rank's device: ``cuda:N`` with nccl, else the CPU. Put the model there before setup()."""
        return self._ctx.device

    @property
    def is_main(self) -> bool:
        return self._ctx.rank == 0

    @property
    def resumed_from(self) -> CheckpointInfo | None:
        """The durable checkpoint this attempt started from, or None."""
        return self._session.resumed.checkpoint if self._session is not None else None

    @property
    def resumed_tier(self) -> str | None:
        """Where this attempt's state came from: ``"memory"``, ``"durable"`` or None."""
        return self._session.resumed.tier if self._session is not None else None

    # ------------------------------------------------------------------------------------- setup

    def setup(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Stateful | None = None,
        *,
        ddp_kwargs: Mapping[str, Any] | None = None,
        **state: Stateful,
    ) -> DistributedDataParallel:
        """Wrap ``model`` in DDP, register what a checkpoint must hold, and resume; returns the DDP model.

        ``model`` must already be on :attr:`device`; it may be compiled (``torch.compile(model)``): DDP
        wraps it as it is, and checkpoints name its state by the plain module's names, as an eager
        run's (see docs/your-model.md, "Compiled models"). ``scheduler`` and every keyword object -- anything
        with ``state_dict()`` and ``load_state_dict()``, as is: an EMA ``AveragedModel`` or a teacher
        (any ``nn.Module``), another optimizer, a ``torch.amp.GradScaler``, the script's own counters --
        are saved in every checkpoint and restored on resume, as are the model, the optimizer and the
        data position. What differs across ranks (BatchNorm statistics, an EMA of them, a per-rank
        counter) is found at each save and kept per rank (see docs/your-model.md). When nothing is resumed,
        the model's weights come from ``checkpoint.init_from`` if set (a resume always wins). ``ddp_kwargs`` go to
        ``DistributedDataParallel`` (e.g. ``find_unused_parameters=True``). Collective; call once.
        """
        if self._session is not None:
            raise RunError("run.setup() was already called; call it once, after building model and optimizer.")
        where = {p.device for p in model.parameters()}
        if where and where != {self.device}:
            raise RunError(
                f"The model's parameters are on {sorted(str(d) for d in where)}, but this rank trains on "
                f"{self.device}: call model.to(run.device) before run.setup()."
            )
        objects = self._register(model, optimizer, scheduler, state)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, **dict(ddp_kwargs or {}))
        if self.cfg.dist.stable_buckets:
            stabilize_buckets(ddp)  # bitwise same-size resume at 3+ ranks: one reduction layout
        # The shared-storage proof runs here, once, on every rank (at any world size) before anything
        # reads or writes checkpoints: the manager's own check at construction is left to this call.
        checkpoints = CheckpointManager(
            self.cfg.checkpoint, identity=self.cfg.identity(), rdzv_round=self._ctx.rdzv_round, check_storage=False
        )
        checkpoints.check_shared_storage()
        compiled = self._compiled_artifacts(model, checkpoints)
        memory = self._memory_tier(checkpoints.url)
        fresh_optimizer = not optimizer.state
        resumed = resume(self.cfg, checkpoints, memory, objects, rank=self.rank)
        self.step = resumed.step
        if memory is not None and memory.disabled:
            self._events.append(memory.disabled)  # off for this attempt's saves (resume() closed it)
            memory = None
        try:
            checkpoints.init_from, init_event = init_from(
                self.cfg, resumed, objects, objects[MODEL], rank=self.rank, world_size=self.world_size,
                device=self.device, control_group=self._control,
            )  # fmt: skip
        except ConfigError as exc:
            exit_on_settings_error(exc)
        if init_event:
            self._events.append(init_event)
        if resumed.tier is None and fresh_optimizer:
            # Sizing the state (the memory tier's survey, a load's templates) makes torch allocate an
            # unstepped optimizer's state with a zero-gradient step; kept, it would count as a step
            # (Adam's bias correction) and this run would differ from one that never asked.
            optimizer.state.clear()
        metrics = create_metrics(
            self.cfg.logging, rank=self.rank, run_dir=self.cfg.run.dir,
            resume_step=self.step if resumed.tier is not None else None,
            world_size=self.world_size, restart_count=self._ctx.restart_count, max_steps=self.cfg.train.max_steps,
            storage_options=self.cfg.checkpoint.storage_options,
        )  # fmt: skip
        metrics.log_config(self.cfg.to_yaml())
        for text in self._events:
            metrics.event(text)
        self._events.clear()
        if resumed.tier is not None:
            resumed = record_resume(resumed, metrics, self.failures, is_main=self.is_main, world_size=self.world_size)
        elif self.cfg.checkpoint.resume == "auto":
            record_lost_history(metrics, self.failures, is_main=self.is_main, world_size=self.world_size)
        guard = None
        if memory is not None:
            guard = StepGuard(model, {name: obj for name, obj in objects.items() if name not in (MODEL, OPTIMIZER, DATA)})
        self._session = _Session(ddp, optimizer, objects, checkpoints, memory, metrics, resumed, guard, compiled)
        return ddp

    def _compiled_artifacts(self, model: torch.nn.Module, checkpoints: CheckpointManager) -> CompiledArtifacts | None:
        """For a compiled model: what the job's nodes compiled, loaded into this node's caches before
        any rank compiles (checkpoint/compiled.py); None for an eager one."""
        if not is_compiled(model):
            return None
        artifacts = CompiledArtifacts(
            checkpoints.storage, share=self.cfg.checkpoint.share_compiled, key=signing_key(), device=self.device,
            rank=self.rank,
        )  # fmt: skip
        loaded = artifacts.load()
        if loaded:
            log.info("[%d/%d] %s", self.rank, self.step, loaded)
        elif artifacts.why_off and self.is_main:
            log.info("[%d/%d] torch.compile's artifacts are not shared between nodes (%s): a node that joins compiles "
                     "from scratch.", self.rank, self.step, artifacts.why_off)  # fmt: skip
        return artifacts

    def _register(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Stateful | None,
        state: Mapping[str, Stateful],
    ) -> dict[str, Stateful]:  # fmt: skip
        """Everything a checkpoint holds, by name: the run's own objects and the script's."""
        # DDP keeps the model's trainable parameters and the optimizer's state the same on every rank:
        # a save need not compare those across ranks (everything else it does).
        objects: dict[str, Stateful] = {
            MODEL: ModelState(model, replicated=True), OPTIMIZER: OptimizerState(model, optimizer, replicated=True),
        }  # fmt: skip
        if scheduler is not None:
            objects[SCHEDULER] = _registered(SCHEDULER, scheduler)
        for name, obj in state.items():
            if name in (MODEL, OPTIMIZER, SCHEDULER, DATA):
                raise RunError(f"The state name {name!r} is the run's own; give the object another name.")
            objects[name] = _registered(name, obj)
        objects[DATA] = self._data
        return objects

    def _memory_tier(self, checkpoint_url: str) -> MemoryTier | None:
        cfg = self.cfg.checkpoint
        if cfg.memory_overhead <= 0:
            return None
        return MemoryTier(
            memory_dir=cfg.memory_path, overhead=cfg.memory_overhead, every_steps=cfg.memory_every_steps,
            required=cfg.memory_asked,
            timeout_s=cfg.timeout_s, run_name=self.cfg.run.name,
            # Named from the identity *and* the durable location: two runs of one name elsewhere never meet.
            identity_digest=identity_digest({**self.cfg.identity(), "checkpoint.url": checkpoint_url}),
            rank=self.rank, local_rank=self.local_rank, local_world_size=self._ctx.local_world_size,
            node=self._ctx.node_rank, device=self.device, control_group=self._control, world_size=self.world_size,
            write_threads=cfg.memory_write_threads, read_threads=cfg.memory_read_threads,
            direct_cost=cfg.memory_direct_cost,
        )  # fmt: skip

    # -------------------------------------------------------------------------------------- loop

    def steps(
        self, dataset: Any, *, collate_fn: Callable[[list[Any]], Any] | None = None, fingerprint: str = ""
    ) -> Iterator[Step]:
        """The training loop's steps over ``dataset`` (a map-style dataset: ``__len__``, ``__getitem__``;
        or a sharded source, :class:`~elastic_ddp.data.Shards`, in its own order of shards and windows).

        Each step holds this rank's share of the next ``train.global_batch_size`` samples, split into
        micro-batches of at most ``train.micro_batch_size`` and batched by ``collate_fn`` (default
        ``torch.utils.data.default_collate``). ``fingerprint`` (optional) names the dataset's contents;
        without it, a dataset's own ``_fingerprint`` does (a Hugging Face ``datasets.Dataset``'s, see
        :func:`~elastic_ddp.data.dataset_fingerprint`). A resume over a dataset with another fingerprint
        or size is refused (``data.on_change=next_epoch``: continued at the start of the next epoch), and
        so is a start where the ranks' datasets differ. The loop ends by itself at
        ``train.max_steps``, ``train.exit_at_step`` or a stop request, after a blocking checkpoint; leaving
        it early (``break``) is an error, since the steps since the last checkpoint would be lost.
        """
        if self._session is None:
            raise RunError("Call run.setup(model, optimizer, ...) before run.steps(): the loop starts where the checkpoint ends.")
        if self._in_step is not None:
            raise RunError("run.steps() can run once per worker; the run's end is the process's end.")
        self._in_step = 0
        where = self._session.resumed.source or "(none)"
        order = ORDER_VERSION
        if isinstance(dataset, Shards):
            dataset.prepare(self._control)  # the shard index: read or built by rank 0, once
            order = dataset.order_version
        num_samples, fingerprint = check_dataset(dataset), dataset_fingerprint(dataset, fingerprint)
        check_same_dataset(num_samples, fingerprint, self._control)
        changed = self._data.bind(num_samples, fingerprint, where, order, self.cfg.data.on_change)
        if changed and self.is_main:  # every rank moved its cursor alike; one line says so
            log.warning("[%d/%d] %s", self.rank, self.step, changed)
        return self._loop(dataset, collate_fn)

    def _loop(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None) -> Iterator[Step]:
        # From here a stop has a step boundary to reach and a checkpoint to save; before, it exits.
        self._stop_signal.steps_started()
        session, train, data = self._session, self.cfg.train, self.cfg.data
        end = loop_end(self.step, train.max_steps, train.exit_at_step)
        if isinstance(dataset, Shards):  # a sharded source orders its records by shards and windows
            sampler = dataset.order(train.global_batch_size, train.seed)
        else:
            sampler = ElasticSampler(self._data.num_samples, train.global_batch_size, train.seed)
        batches = StepBatches(
            dataset, sampler, self._data.cursor, rank=self.rank, world_size=self.world_size,
            num_steps=max(end - self.step, 0), start_step=self.step, micro_batch_size=train.micro_batch_size,
            num_workers=data.num_workers, prefetch_batches=data.prefetch_batches, collate_fn=collate_fn,
        )  # fmt: skip
        ledger = StepLedger(self.cfg.run.dir, rank=self.rank, world_size=self.world_size, resume_step=self.step,
                            enabled=data.ledger)  # fmt: skip
        memory, metrics, every, guard = session.memory, session.metrics, self.cfg.checkpoint.every_steps, session.guard
        if isinstance(dataset, Shards) and dataset.skipped and self.rank == 0:
            _report_skipped(dataset.skipped, ledger, metrics)
        agreement = StopAgreement(self._stop_signal, self._control, values=REPORT_SIZE, period_s=self.cfg.dist.stop_check_s)
        if self.step >= end:
            log.info("[%d/%d] Nothing to train: the run is at step %d of %d.", self.rank, self.step, self.step, end)
            self.ended = ENDED_FINISHED
            ledger.close()
            return
        session.ddp.train()
        collector = StepMetrics(
            metrics, step=self.step, checkpoints=session.checkpoints, memory=memory, optimizer=session.optimizer,
            global_batch_size=train.global_batch_size, steps_redone=session.resumed.steps_redone,
        )  # fmt: skip
        first_step = self.step + 1
        try:
            for batch in timed(batches, collector.timing, self._seed_step):
                at_step(batch.step, self.rank)  # fault-injection tests only; one dict lookup otherwise
                step = Step(batch, session.ddp, self.device)
                self._in_step = batch.step
                ledger.started(batch.step, batch.rank_indices)
                if guard is not None:
                    guard.begin()
                yield step
                step._check_complete()
                self.step, self._data.cursor = batch.step, batch.cursor_after
                if guard is not None:
                    guard.end()
                self.failures.step = self.step
                stop = agreement.after_step(memory.report if memory is not None else None)
                exiting = self.step == end
                # The loss is all-reduced (a host sync) only where it is recorded: every step for the ledger,
                # else at the logged steps; metrics follow their own cadence either way.
                logged = metrics.should_log(self.step)
                loss = self._global_loss(step) if data.ledger or logged else None
                ledger.finished(self.step, loss if loss is not None else float("nan"))
                if session.compiled is not None and self.step == first_step:
                    # Once an attempt's first step compiled (or loaded) the model: for nodes that join.
                    published = session.compiled.publish()
                    if published:
                        log.info("[%d/%d] %s", self.rank, self.step, published)
                if memory is not None:
                    # After the ledger line: a state in node memory is a step this rank has on record.
                    memory.after_step(self.step, session.state, agreement.agreed)
                    if memory.failed and session.memory_off is None:
                        session.memory_off = f"The memory tier stopped on rank {self.rank}: {memory.failed}"
                        metrics.event(session.memory_off)
                # A stop only to admit a joining node: every node of this round stays, with the
                # state in its memory (see elastic_ddp.worker.stop), so storage is not needed.
                in_memory = stop and not exiting and not agreement.durable and self._commit_to_memory()
                if not in_memory and (stop or exiting or (every and self.step % every == 0)):
                    self._save(blocking=stop or exiting)
                if logged:
                    collector.log(self.step, loss, step.scalars)
                if stop:
                    self.ended = stop_ended(self._stop_signal.requested)
                    metrics.event(stop_event(self.step, in_memory))
                    return
                if exiting:
                    self.ended = end_ended(self.step, train.max_steps)
                    if self.ended == ENDED_EXIT_AT_STEP:
                        metrics.event(f"Exiting after step {self.step} (train.exit_at_step); checkpoint committed")
                    return
        finally:
            agreement.close()
            ledger.close()

    def _commit_to_memory(self) -> bool:
        """Collective: the current step committed to every node's memory tier; False (commit it to
        the durable tier instead) when the tier is off or the commit failed on any rank."""
        memory = self._session.memory
        if memory is None or not memory.enabled or memory.failed:
            return False
        if memory.commit(self.step, self._session.state):
            return True
        log.warning("[%d/%d] The stop's state could not be committed to node memory on every rank; committing it "
                    "to the durable tier instead.", self.rank, self.step)  # fmt: skip
        return False

    def _keep_failed_step(self) -> None:
        """After an exception in the loop (a peer died in a collective, the script's own error): keep the
        state after the last completed step in this node's memory, so that the restart redoes no step.

        Between steps the state is that step's as it is; within one, when the failed step changed
        nothing but the model's buffers, which are put back first (:class:`StepGuard`). No collective.
        """
        session = self._session
        if session is None or session.guard is None or session.memory is None or not self._in_step:
            return
        why = session.guard.changed()
        if why is None:
            session.guard.restore()
            try:
                why = session.memory.keep(self.step, session.state, _lockstep(session.state))
            except (OSError, RuntimeError, ValueError) as exc:
                # tmpfs full or gone, a part the node's memory refused, a state no longer cut as planned:
                # the failure to report stays the step's; this one only costs the restart its steps.
                why = f"{type(exc).__name__}: {exc}"
        if why is None:
            log.info("[%d/%d] The loop failed; the state after step %d is in this node's memory for the restart.",
                     self.rank, self.step, self.step)  # fmt: skip
        else:
            log.info("[%d/%d] The loop failed; the state after step %d is not kept in node memory (%s).",
                     self.rank, self.step, self.step, why)  # fmt: skip

    def _seed_step(self, step: int) -> None:
        # Every random generator of this process starts each step from a seed derived from the run's
        # seed, this rank and the step: what a step draws is a function of (seed, rank, step), so a
        # resume from any checkpoint at the same world size draws exactly what the uninterrupted run
        # drew -- plain nn.Dropout included -- with no generator state to store or lose with a node.
        self._step_seeder(derive_seed("step", self.cfg.train.seed, self.rank, step))

    def _global_loss(self, step: Step) -> float:
        totals = step._loss_and_samples()
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(totals)
        loss_sum, samples = totals.tolist()
        return loss_sum / max(samples, 1.0)

    def _save(self, *, blocking: bool) -> None:
        checkpoints = self._session.checkpoints
        ok = checkpoints.save(self.step, self._session.state, blocking=blocking)
        if blocking and not ok:
            raise RunError(
                f"The checkpoint of step {self.step} could not be saved, so this run's work since its last "
                f"checkpoint would be lost: {checkpoints.last_error}"
            )
        limit = self.cfg.checkpoint.max_failed_saves
        if checkpoints.consecutive_failed_saves >= limit:
            raise RunError(
                f"{checkpoints.consecutive_failed_saves} checkpoint saves in a row failed "
                f"(checkpoint.max_failed_saves={limit}); training on would risk everything since the last "
                f"good one. The last error: {checkpoints.last_error}"
            )

    def event(self, text: str) -> None:
        """Record a notable happening in TensorBoard's events and on the console (rank 0); before
        run.setup() it is kept until the metrics exist."""
        if self._session is None:
            self._events.append(text)
        else:
            self._session.metrics.event(text)

    # ---------------------------------------------------------------------------------- teardown

    def finish(self) -> int:
        """Ordered teardown after the script returned; the process's exit status (see the module docstring)."""
        check_ended(self.ended, max(self._in_step or 0, self.step), self.cfg.train.max_steps)
        session = self._session
        if not session.checkpoints.close():
            raise RunError(f"The last checkpoint save failed: {session.checkpoints.last_error}")
        if self.ended == ENDED_STOPPED and self._stop_signal.for_join is None:
            # Stopped from outside (a preemption): the node leaves, and every rank waits for its agent to
            # leave the rendezvous -- which it may do now, its stop checkpoint committed.
            report_leaving(f"rank {self.rank} stopped at step {self.step}")
        if session.memory is not None:
            session.memory.close()
            if frees_memory(self.ended):
                # The run is over, so node memory is freed -- once every local rank stopped writing.
                if self._control is not None:
                    dist.barrier(group=self._control)
                session.memory.remove()
        if stopped(self.ended):
            self._stop_signal.stopped()
        session.metrics.summary(self.ended)
        session.metrics.close(self.ended)
        shutdown_distributed()
        # The script has returned: the exit's search for open files is done now, not after the SIGTERM
        # that a survivor of a membership change waits for (on the path of the restart).
        prepare_exit()
        return exit_status(self.ended, self._stop_signal, self.cfg.dist.restart_wait_s)
