"""A memory-tier save on one rank: stage its part of the state, write it in the background.

Every rank, no collective but the split check's: after a step that is due, each rank takes the
registered state's tensors in traversal order, cuts that byte stream into ``LOCAL_WORLD_SIZE``
equal parts (:func:`elastic_ddp.checkpoint.layout.plan`, a pure function of the shapes, so every
rank knows every part without talking), copies *its* part to a host buffer (:class:`Staging`) -- on a
GPU parameters and optimizer state on a side stream that the next ``optimizer.step()`` waits for
(:mod:`elastic_ddp.memory.copies`) -- and a background thread writes it into the node's tmpfs with
its checksum and commits it (:class:`BackgroundWriter`, :mod:`elastic_ddp.memory.store`), into the
slot that does not hold the node's newest complete state (:class:`Slots`).
"""

from __future__ import annotations

import concurrent.futures
import enum
import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint.divergence import Plan, Split, all_max_over, classify, plan_of, split_as, stale, values
from elastic_ddp.checkpoint.layout import plan
from elastic_ddp.checkpoint.staging import byte_view
from elastic_ddp.checkpoint.tree import TensorSpec, path_text
from elastic_ddp.memory.base import MemoryTierError, Ranks
from elastic_ddp.memory.copies import DeviceCopies
from elastic_ddp.memory.store import NodeMemory, PartRecord
from elastic_ddp.state import OptimizerState, synced_paths

__all__ = ["BackgroundWriter", "Outcome", "SaveTimes", "Saver", "Slots", "SplitCheck", "Staging", "state_dicts"]

log = logging.getLogger(__name__)


def state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    return {name: obj.state_dict() for name, obj in state.items()}


@dataclass
class SaveTimes:
    """What the last saves took, in seconds (see :class:`Saver`)."""

    stall_s: float = 0.0  # the last save's stall, without its one-off waits (set by the caller)
    waited_s: float = 0.0  # the last save's wait for the previous write and buffer allocation
    write_cpu_s: float = 0.0  # CPU time of the last finished background write (its thread's)
    write_s: float = 0.0  # wall time of the last finished background write, start to commit
    copies_s: float = 0.0  # on a GPU: what the last measured copies cost the training stream


class Outcome(enum.Enum):
    """How the save in flight ended (:meth:`Saver.wait`)."""

    NONE = "none"  # no save was in flight
    DONE = "done"  # written and committed
    SKIPPED = "skipped"  # no rank wrote it: the ranks' values no longer split as planned
    FAILED = "failed"  # this rank's write failed
    RUNNING = "running"  # still in flight when the wait gave up (its comparison waits for a peer that is gone)


class Slots:
    """The node's two slots as this rank's saves use them: the next save goes to :attr:`slot`, and may
    overwrite it once the node's ranks finished :attr:`previous` ((slot, step) of the last save)."""

    def __init__(self) -> None:
        self.slot = 0
        self.previous: tuple[int, int] | None = None
        self._before: tuple[int, tuple[int, int] | None] = (0, None)

    def start(self, newest: int) -> None:
        """At the survey: the node's newest complete state is in slot ``newest`` (-1: none)."""
        self.slot = 1 - newest if newest >= 0 else 0

    def advance(self, step: int) -> None:
        """A save of ``step`` went to :attr:`slot`; the next goes to the other one."""
        self.previous, self.slot = (self.slot, step), 1 - self.slot

    def remember(self) -> None:
        self._before = (self.slot, self.previous)

    def undo(self) -> None:
        """The last save was skipped on every rank: the slots stay as they were before it."""
        self.slot, self.previous = self._before


class SplitCheck:
    """What differs across ranks, so that each rank keeps its own values of those in its part instead of
    a share of them (elastic_ddp/checkpoint/divergence.py: Plan): decided at the first save and checked
    at every later one; a save the check finds stale is skipped.

    Collective, on every rank alike (a rank whose last write failed too, until the stop agreement
    turns the tier off everywhere): decided once, blocking, then checked at each save by one
    all-reduce that the save does not wait for -- its write does (see :meth:`_start_check`).
    """

    def __init__(self, group: Any, device: torch.device) -> None:
        self._group = group
        self._device = device
        self._check_device = device if device.type == "cuda" else torch.device("cpu")
        self.plan: Plan | None = None
        # This rank's side (elastic_ddp.checkpoint.divergence.values) of the last comparison that found
        # the plan holding on every rank, on the host; None until one did.
        self.verified: torch.Tensor | None = None

    def split(self, trees: dict[str, Any], state: Mapping[str, Any]) -> tuple[Split | None, Callable[[], str | None] | None]:
        """The split of ``trees``, and the wait for the check's verdict (None at a decision)."""
        synced = synced_paths(state)
        if self.plan is None or self._group is None:
            # On the default group (NCCL on GPUs), where the vector lives on this rank's device.
            all_max = all_max_over(None, self._device) if self._group is not None else None
            split = classify(trees, synced=synced, all_max=all_max)
            if self._group is not None:
                self.plan = plan_of(split, trees, synced)
                # The decision compared every rank's values: they are the verified ones.
                self.verified = values(self.plan, trees, split, self._check_device).cpu()
            return split, None
        split = split_as(self.plan, trees, synced)
        return split, self._start_check(values(self.plan, trees, split, self._check_device))

    def _start_check(self, mine: torch.Tensor) -> Callable[[], str | None]:
        """Start the all-reduce that checks the current split plan (``mine``: this rank's
        :func:`~elastic_ddp.checkpoint.divergence.values`); returns the wait for its verdict (why the
        plan no longer holds, or None), for the background write.

        On a GPU it runs on the default (NCCL) group, the result copied to pinned host memory behind
        it on the stream: the training loop never waits. On CPUs on the tier's gloo group.
        """
        plan, count = self.plan, mine.numel()
        both = torch.cat([mine, ~mine])
        if both.is_cuda:
            dist.all_reduce(both, op=dist.ReduceOp.MAX, async_op=True).wait()  # the stream waits, not the host
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            ready: Callable[[], Any] = done.synchronize
        else:
            ready = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self._group, async_op=True).wait
            host = both

        def verdict() -> str | None:
            ready()
            result = host.tolist()
            why = stale(plan, result[:count], [~v for v in result[count:]])
            if why is None:
                self.verified = mine.cpu()
            return why

        return verdict

    def unchanged(self, trees: dict[str, Any], split: Split | None, lockstep: frozenset[str]) -> str | None:
        """No collective: None when this rank's values of what the plan stores once are those of the last
        comparison that held on every rank, else which one changed. What a rank keeps per rank may
        change; so may the objects in ``lockstep``, which change alike on every rank by construction
        (the run's data position; a scheduler that follows the optimizer's steps). Anything else
        stored once that changed since may have started to differ across ranks, which this rank
        alone cannot tell."""
        plan = self.plan
        if plan is None or self.verified is None or split is None:
            return "no comparison of the ranks' values has held yet"
        now = values(plan, trees, split, self._check_device).cpu().tolist()
        then = self.verified.tolist()
        if now[0] != then[0]:
            return "the state's structure changed"
        for k, name in enumerate(plan.compared, start=1):
            if now[k] != then[k] and name not in plan.own and name not in lockstep:
                return f"the plain values of {name!r}, stored once for every rank, changed"
        base = 1 + len(plan.compared)
        for k, i in enumerate(plan.checked):
            a = base + 2 * k
            owner = split.paths[i][0]
            if now[a : a + 2] != then[a : a + 2] and i not in plan.per_rank and owner not in lockstep:
                return f"a tensor of {owner!r} ({path_text(split.paths[i])}), stored once for every rank, changed"
        return None


@dataclass
class Staged:
    """This rank's part of one save, in host memory (or on its way there: ``copies``)."""

    record: PartRecord  # without size and checksum: the write adds them
    buffer: torch.Tensor
    copies: Any  # the device-to-host copies' round to wait for, or None
    allocated_s: float  # time spent allocating the host buffer (a one-off)


class Staging:
    """Which bytes of the state are this rank's part, and the host buffer they are copied into (kept
    from save to save, with the plan and the views of the pieces, while the state's shape holds)."""

    def __init__(self, ranks: Ranks, device: torch.device) -> None:
        self._ranks = ranks
        self._device = device
        # (key, each local rank's pieces, state digest, the specs as the index lists them, this rank's pieces).
        self._plan: tuple[Any, list[list[tuple[int, int, int]]], str, list[Any], list[tuple[int, int, int]]] | None = None
        self._buffer: torch.Tensor | None = None
        self._views: tuple[torch.Tensor, list[tuple[int, torch.Tensor, torch.Tensor]]] | None = None  # see _pieces
        self.copies: DeviceCopies | None = None  # the device-to-host copies of saves on a GPU

    def stage(self, step: int, split: Split, state: Mapping[str, Any], clock: Callable[[], float]) -> Staged:
        """Copy this rank's part of ``split`` (of ``state``, after ``step``) into the host buffer."""
        ranks = self._ranks
        encoded, tensors, paths = split.shared, list(split.tensors), split.paths
        per_rank = tuple(sorted(split.per_rank))
        specs = split.specs
        own_specs = tuple(TensorSpec.of(t) for t in split.own_tensors)
        key = (specs, per_rank, own_specs)
        if self._plan is None or self._plan[0] != key:
            workers = list(range(ranks.local_world_size))
            layout = plan(specs, workers, files_per_writer=1, min_file_bytes=0, skip=per_rank)
            # (tensor, first element, end element) of each local rank's part, in byte-stream order.
            parts = [[(p.tensor, p.start, p.stop) for f in layout.files_of(w) for p in f.pieces] for w in workers]
            digest = hashlib.sha256(
                json.dumps([[[path_text(p), s.to_json()] for p, s in zip(paths, specs)], per_rank, sorted(split.own)]).encode()
            ).hexdigest()[:16]
            # After its share: this rank's own values of the per-rank tensors, then its per-rank objects.
            own = [(t, 0, specs[t].numel) for t in per_rank]
            own += [(len(specs) + j, 0, spec.numel) for j, spec in enumerate(own_specs)]
            self._plan = (key, parts, digest, [spec.to_json() for spec in specs], parts[ranks.local_rank] + own)
            self._views = None  # the pieces are others now
        _, parts, digest, specs_json, mine = self._plan
        tensors += split.own_tensors
        specs += own_specs
        nbytes = sum((b - a) * specs[t].itemsize for t, a, b in mine)
        on_gpu = any(tensors[t].is_cuda for t, _, _ in mine)
        allocated_s = 0.0
        if self._buffer is None or self._buffer.numel() != nbytes or self._buffer.is_pinned() != on_gpu:
            allocating = clock()
            self._buffer = None  # the old one goes before the new one is taken
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
            allocated_s = clock() - allocating
        pieces = self._pieces(mine, tensors, specs)
        copies = None
        if on_gpu:
            # Parameters and optimizer state are copied while the next step computes (see
            # elastic_ddp/memory/copies.py); what the copies cost the training stream, measured on the
            # GPU at the previous save, is added to the stall this rank reports.
            if self.copies is None:
                self.copies = DeviceCopies(self._device)
            optimizers = [obj.optimizer for obj in state.values() if isinstance(obj, OptimizerState)]
            copies = self.copies.copy(pieces, optimizers)
        else:
            torch._foreach_copy_([target for _, target in pieces], [source for source, _ in pieces])
        index = None
        if ranks.local_rank == 0:
            index = {"state": encoded, "tensors": specs_json, "pieces": parts, "per_rank": list(per_rank)}
        own_objects = {"state": split.own, "tensors": [spec.to_json() for spec in own_specs]} if split.own else None
        record = PartRecord(step, ranks.local_rank, ranks.local_world_size, nbytes, "", digest, index, ranks.rank,
                            ranks.world_size, own_objects)  # fmt: skip
        return Staged(record, self._buffer, copies, allocated_s)

    def _pieces(
        self, mine: list[tuple[int, int, int]], tensors: list[torch.Tensor], specs: tuple[TensorSpec, ...]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source bytes, buffer bytes) of each piece of this rank's part.

        Kept from save to save: the state's tensors are mostly the same storages every time (live
        parameters and optimizer state), and making two views per tensor costs microseconds each, which
        adds up to milliseconds a save at a model's thousand-odd tensors (docs/memory-tier.md,
        "Measured here"). A kept view is reused only for a contiguous tensor at the same address: the
        view holds the old storage alive, so no other tensor can be at that address.
        """
        buffer = self._buffer
        kept = None
        if self._views is not None and self._views[0] is buffer and len(self._views[1]) == len(mine):
            kept = self._views[1]  # the same buffer and plan: each piece's target is where it was
        views: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        pos = 0
        for i, (t, a, b) in enumerate(mine):
            tensor = tensors[t]
            size = (b - a) * specs[t].itemsize
            address = tensor.data_ptr() if tensor.is_contiguous() else -1
            if kept is not None and address >= 0 and kept[i][0] == address:
                views.append(kept[i])
            else:
                views.append((address, byte_view(tensor, a, b), buffer[pos : pos + size]))
            pos += size
        self._views = (buffer, views)
        return [(source, target) for _, source, target in views]

    def close(self) -> None:
        if self.copies is not None:
            self.copies.close()
            self.copies = None
        self._views = None  # they hold the state's storages


class BackgroundWriter:
    """Writes staged parts into the node's memory on one background thread, one save at a time.

    ``timeout_s``: how long a write waits for the node's other ranks to finish the previous save;
    ``threads``: threads a part's checksum may use; ``times``: where each write's times go.
    """

    def __init__(
        self, store: NodeMemory, *, timeout_s: float, threads: int, times: SaveTimes, clock: Callable[[], float]
    ) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.threads = threads
        self._times, self._clock = times, clock
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.pending: concurrent.futures.Future | None = None
        self.skipped: str | None = None  # why the save in flight was skipped on every rank

    def submit(self, slot: int, previous: tuple[int, int] | None, staged: Staged | None,
               check: Callable[[], str | None] | None) -> None:  # fmt: skip
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="memory-tier")
        self.pending = self.pool.submit(self._write, slot, previous, staged, check)

    def _write(self, slot: int, previous: tuple[int, int] | None, staged: Staged | None,
               check: Callable[[], str | None] | None) -> None:  # fmt: skip
        started, started_cpu = self._clock(), time.thread_time()
        try:
            if staged is not None and staged.copies is not None:
                staged.copies.wait()
            why = check() if check is not None else None
            if why is not None:
                # The split the part was staged with no longer holds: every rank sees the same verdict
                # and skips this save; the next one decides anew.
                self.skipped = why
                return
            if staged is None:
                return  # this rank could not stage (its last write failed): the agreement stops the tier
            self._write_part(slot, previous, staged.record, staged.buffer)
        finally:
            self._times.write_cpu_s = time.thread_time() - started_cpu
            self._times.write_s = self._clock() - started

    def _write_part(self, slot: int, previous: tuple[int, int] | None, record: PartRecord, buffer: torch.Tensor) -> None:
        # Overwrite this slot only once the other slot holds the previous state complete: every
        # local rank finished it. Until then this slot's older state is the node's only complete one.
        if previous is not None and not self.store.wait_complete(*previous, timeout_s=self.timeout_s):
            raise MemoryTierError(
                f"The node's other ranks did not finish the memory-tier save of step {previous[1]} within "
                f"{self.timeout_s:.0f} s (checkpoint.timeout_s)."
            )
        self.commit_part(slot, record, buffer)

    def commit_part(self, slot: int, record: PartRecord, buffer: torch.Tensor, threads: int | None = None) -> None:
        """Write this rank's part into ``slot`` and commit it; the node's other slot must hold its newest
        complete state (until the commit, this slot's part is uncommitted: never half of two states)."""
        self.store.uncommit(slot, record.part)
        data = [memoryview(buffer.numpy()).cast("B")]
        size, checksum = self.store.write(slot, record.part, data, threads or self.threads)
        self.store.commit(slot, replace(record, size=size, checksum=checksum))

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the write in flight (if any), at most ``timeout_s`` (None: until it ends); raises what
        it raised. False when it is still running after ``timeout_s``: it stays the write in flight."""
        pending = self.pending
        if pending is None:
            return True
        done, _ = concurrent.futures.wait([pending], timeout=timeout_s)
        if not done:
            return False
        self.pending = None
        pending.result()
        return True

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


class Saver:
    """One rank's memory-tier saves: staging (:class:`Staging`), the background write
    (:class:`BackgroundWriter`), the slots and the split check; :attr:`times` what they took."""

    def __init__(self, store: NodeMemory, ranks: Ranks, *, device: torch.device, group: Any, timeout_s: float,
                 write_threads: int, clock: Callable[[], float]) -> None:  # fmt: skip
        self.times = SaveTimes()
        self.slots = Slots()
        self.writer = BackgroundWriter(store, timeout_s=timeout_s, threads=write_threads, times=self.times, clock=clock)
        self._staging, self._split = Staging(ranks, device), SplitCheck(group, device)
        self._ranks, self._clock = ranks, clock
        self.saves, self.skipped_saves = 0, 0
        self.local_failure: str | None = None  # this rank's failed save, until the agreement stops the tier

    def save(self, step: int, state: Mapping[str, Any], *, started: float, waited_s: float, ok: bool) -> float:
        """Stage this rank's part of the state after ``step`` and write it in the background; the stall (s)
        since ``started``, less :attr:`SaveTimes.waited_s`. ``waited_s``: the wait since ``started`` for
        the previous save (:meth:`wait`); ``ok``: that save did not fail."""
        self.times.waited_s = waited_s
        trees = state_dicts(state)
        split, check = self._split.split(trees, state)
        self.slots.remember()
        if not ok or self.local_failure or split is None:
            if check is not None:
                # The check's verdict is everyone's: consumed in the background like a write's. With
                # another structure here it says so, and every rank skips this save (see wait).
                self.writer.submit(self.slots.slot, None, None, check)
                self.slots.advance(step)
            return 0.0
        staged = self._staging.stage(step, split, state, self._clock)
        self.times.waited_s += staged.allocated_s
        self.writer.submit(self.slots.slot, self.slots.previous, staged, check)
        self.slots.advance(step)
        self.saves += 1
        # On GPUs what the device-to-host copies cost the training stream, timed at the previous save.
        self.times.copies_s = self._staging.copies.cost_s if staged.copies is not None else 0.0
        return self._clock() - started - self.times.waited_s

    def keep(self, step: int, state: Mapping[str, Any], *, lockstep: frozenset[str], wait_s: float,
             threads: int) -> str | None:  # fmt: skip
        """No collective, after a failed step: write this rank's part of the state after ``step`` into the
        node's memory and commit it, now; None when committed, else why not.

        The part is cut as the last save's plan says and written to the slot the next save would use,
        once the other slot holds the previous save complete (waited for up to ``wait_s``: the node's
        other ranks may still be writing it). Only when this rank's values of what the plan stores once
        are unchanged since the last comparison that held on every rank: the node then holds step
        ``step`` complete if all its ranks keep it, and nothing of it is one rank's value standing for
        another's.
        """
        plan = self._split.plan
        if self.local_failure or plan is None:
            return self.local_failure or "no save of this attempt has split the state yet"
        trees = state_dicts(state)
        split = split_as(plan, trees, synced_paths(state))
        why = self._split.unchanged(trees, split, lockstep)
        if why is not None:
            return why
        previous = self.slots.previous
        if previous is not None and not self.writer.store.wait_complete(*previous, timeout_s=wait_s):
            return f"the node's save of step {previous[1]} is not complete"
        staged = self._staging.stage(step, split, state, self._clock)
        if staged.copies is not None:
            staged.copies.wait()
        self.writer.commit_part(self.slots.slot, staged.record, staged.buffer, threads)
        self.slots.advance(step)
        return None

    def retract(self) -> None:
        """After the save in flight failed (:meth:`wait`), before anything else: it committed nothing, so the
        slots are as before it and this rank may save again."""
        self.slots.undo()
        self.local_failure = None

    def wait(self, timeout_s: float | None = None) -> Outcome:
        """Wait for the save in flight, at most ``timeout_s`` (None: until it ends); :attr:`local_failure`
        says why when it failed. :attr:`Outcome.RUNNING` when it is still running after ``timeout_s``."""
        if self.writer.pending is None:
            return Outcome.NONE
        try:
            if not self.writer.wait(timeout_s):
                return Outcome.RUNNING
        except Exception as exc:  # noqa: BLE001 - a failed memory save must not stop training: durable still works
            self.local_failure = f"{type(exc).__name__}: {exc}"
            log.error("[%d/-] A memory-tier save failed on this rank (%s); the tier stops on every rank at the next "
                      "agreed step, durable checkpoints go on.", self._ranks.rank, self.local_failure)  # fmt: skip
            return Outcome.FAILED
        if self.writer.skipped is not None:
            # No rank wrote that save: the slots stay as they were, and the next save splits afresh.
            log.info("[%d/-] A memory-tier save was skipped on every rank: %s; the next one compares the ranks "
                     "again.", self._ranks.rank, self.writer.skipped)  # fmt: skip
            self.slots.undo()
            self.writer.skipped, self._split.plan = None, None
            self.skipped_saves += 1
            return Outcome.SKIPPED
        return Outcome.DONE

    def close(self) -> None:
        """Wait for nothing more: shut the writer's thread down (after :meth:`wait`) and drop the views."""
        self.writer.close()
        self._staging.close()
