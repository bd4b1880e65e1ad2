"""The memory tier: the state after a step kept in node memory, and a resume from any node that has it.

Saving (every rank, no collective): after a step that is due, each rank takes the registered
state's tensors in traversal order, cuts that byte stream into ``LOCAL_WORLD_SIZE`` equal parts
(:func:`elastic_ddp.checkpoint.layout.plan`, a pure function of the shapes, so every rank knows
every part without talking), copies *its* part to a host buffer -- on a GPU parameters and
optimizer state on a side stream that the next ``optimizer.step()`` waits for
(:mod:`elastic_ddp.memory.copies`) -- and a background thread writes it into the node's tmpfs
with its checksum and commits it (:mod:`elastic_ddp.memory.store`). How often:
:func:`elastic_ddp.memory.policy.interval` from the largest over the ranks of the recent median cost
of a save, step time and write time, which ride on the per-step stop agreement, so every rank
saves the same steps without another collective. A save's cost is its stall plus what its
background work takes from the steps it overlaps: measured directly -- on the CPU the write's CPU
time (the ranks share the cores with it), on a GPU the device-to-host copies' time on the training
stream (the write runs on host cores the step does not use) -- or, where larger, from the step
times themselves: the steps a write overlaps against the steps between saves that it does not
(:func:`elastic_ddp.memory.policy.background_cost`), which also counts what no direct measure sees
(caches and memory bandwidth shared with the step, a rank waiting for a slower one).

Resuming (collective, before training): :meth:`MemoryTier.survey` all-gathers what each node's
memory holds (newest complete step, the last step the node completed) and checks that every
node has room; the run picks the newest state anywhere
(:func:`elastic_ddp.memory.policy.choose_resume`); :meth:`MemoryTier.restore` has the holding
node's ranks read its parts, verifying each as it is read, agrees that all verified, and
broadcasts the bytes over the default process group (NCCL on GPUs) straight into every rank's
registered tensors.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import math
import os
import socket
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint.divergence import Plan, all_max_over, classify, plan_of, split_as, stale, values
from elastic_ddp.config import DEFAULT_MEMORY_BASE
from elastic_ddp.checkpoint.layout import plan
from elastic_ddp.checkpoint.sharded import restore_rank_values
from elastic_ddp.checkpoint.tree import TensorSpec, TreeError, flatten_named, leaf, path_text, unflatten
from elastic_ddp.memory.copies import DeviceCopies
from elastic_ddp.memory.policy import Candidate, background_cost, interval
from elastic_ddp.memory.store import MemoryFormatError, NodeMemory, PartRecord
from elastic_ddp.state import OptimizerState, synced_paths

__all__ = ["REPORT_SIZE", "MemoryTier", "MemoryTierError", "NodeOffer", "Survey"]

log = logging.getLogger(__name__)

# Bytes per broadcast at a restore. An NCCL broadcast is a pipelined ring whose fill costs about
# one hop per rank (~15 ms at 8,000 ranks), so a state goes in as few broadcasts as the devices'
# free memory allows: 16 for a 16 GB state, not the 256 of 64 MiB slices (~4 s of fills at 1,000
# nodes). The buffer lives only during the restore, before training allocates anything.
BROADCAST_BYTES = 1 << 30
MIN_BROADCAST_BYTES = 64 << 20
# Room left free beside the two slots (commit records, the index, tmpfs rounding).
SPACE_MARGIN = 16 << 20
# The interval follows the medians of the last few measurements, not the last one: one step's
# time varies by tens of percent on a busy host (a noisy neighbour, a data-loader hiccup, a
# collective that waited), and an interval that follows each step swings 1 to 12 at a steady
# 2 % budget -- and, since a save's share of the step goes as 1 / interval, more overhead on
# average than a steady interval of the same mean. A step is a fraction of a second, a save a few
# steps: 32 steps and 8 saves still follow a real change (a longer sequence, a new world size)
# within seconds.
STEP_WINDOW = 32
SAVE_WINDOW = 8
# Steps kept, with their phase (steps since the last save), for what a save's background work
# takes from the steps it overlaps (elastic_ddp/memory/policy.py: background_cost): ~100 saves at
# a save every 5 steps, enough for a phase's median to hold still.
PHASE_HISTORY = 512
# The numbers each rank's report() puts on the per-step agreement (see report()).
REPORT_SIZE = 5


class MemoryTierError(RuntimeError):
    """The memory tier cannot work as configured; the message says why and what to do."""


@dataclass(frozen=True)
class NodeOffer:
    """What one rank reported at the survey (see :meth:`MemoryTier.survey`).

    ``steps[s]``/``per_rank[s]``: the step of the complete state in its node's slot ``s`` (-1: none)
    and whether that state holds per-rank values (1) -- reported by the node's local rank 0, -1 and 0
    by the others; ``own``: the steps of the parts this rank itself saved at this world size
    (-1: none), whose per-rank values are its own.
    """

    rank: int
    node: int
    local_rank: int
    place: int  # a hash of (host, memory dir): two nodes must not share one directory
    steps: tuple[int, int]
    per_rank: tuple[int, int]
    own: tuple[int, int]
    last_step: int  # the last step its node completed before this start, -1: unknown
    need: int
    free: int

    @classmethod
    def from_row(cls, rank: int, row: list[int]) -> NodeOffer:
        node, local_rank, place, s0, p0, s1, p1, o0, o1, last, need, free = row
        return cls(rank, node, local_rank, place, (s0, s1), (p0, p1), (o0, o1), last, need, free)

    @property
    def newest_slot(self) -> int:
        """The slot of the newest complete state, -1 when none."""
        best = max(range(len(self.steps)), key=lambda s: self.steps[s])
        return best if self.steps[best] >= 0 else -1


@dataclass(frozen=True)
class Survey:
    """Every rank's offer, the same on every rank."""

    offers: tuple[NodeOffer, ...]

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks of ``node``, by local rank."""
        return [o.rank for o in sorted((o for o in self.offers if o.node == node), key=lambda o: o.local_rank)]

    def leader(self, node: int) -> NodeOffer:
        return min((o for o in self.offers if o.node == node), key=lambda o: o.local_rank)

    def candidates(self, excluded: set[int] = frozenset()) -> list[Candidate]:
        """Every complete state on every node but ``excluded`` (both slots), newest first."""
        out = []
        for node in sorted({o.node for o in self.offers} - set(excluded)):
            leader = self.leader(node)
            for step, per_rank in zip(leader.steps, leader.per_rank):
                if step >= 0:
                    out.append(Candidate(node, step, exact=not per_rank or self.exact(step)))
        return sorted(out, key=lambda c: (-c.step, c.node))

    def exact(self, step: int) -> bool:
        """Whether every rank holds its own part of ``step`` (saved by the same rank at this world size)."""
        return all(step in o.own for o in self.offers)

    def slot(self, node: int, step: int) -> int:
        """The slot of ``node`` that holds the complete state of ``step``."""
        return self.leader(node).steps.index(step)

    def last_step(self) -> int | None:
        """The last step any node completed before this start (None when no node knows)."""
        best = max(o.last_step for o in self.offers)
        return best if best >= 0 else None


def _size(nbytes: int) -> str:
    unit = "GiB" if nbytes >= 2**30 else "MiB"
    return f"{nbytes / (2**30 if unit == 'GiB' else 2**20):.2f} {unit} ({nbytes:,} bytes)"


def _place_key(memory_dir: str) -> int:
    text = f"{socket.gethostname()}\0{os.path.realpath(memory_dir)}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _median(values: deque[float]) -> float:
    return statistics.median(values) if values else 0.0


def _cores_per_rank(local_world_size: int) -> int:
    """The CPU cores this process may use divided among the node's ranks (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


def _state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    return {name: obj.state_dict() for name, obj in state.items()}


def _byte_range(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of a contiguous ``tensor`` as uint8 (a view)."""
    return tensor.detach().reshape(-1)[start:stop].view(torch.uint8)


class MemoryTier:
    """One rank's part of the memory tier. Off (every method a no-op) when ``overhead`` is 0.

    ``memory_dir``: the node's tmpfs directory; ``overhead``: the stall budget as a fraction of
    step time; ``every_steps``: a fixed interval instead (0: from the budget); ``timeout_s``: how
    long a save waits for the node's other ranks to finish the previous one. ``required``: the
    user asked for the tier, so a node without room for it is an error; otherwise (the tier is on
    by default) the tier turns itself off for the attempt and :attr:`disabled` says why.
    """

    def __init__(
        self, *, memory_dir: str, overhead: float, every_steps: int, timeout_s: float, run_name: str,
        identity_digest: str, rank: int, local_rank: int, local_world_size: int, node: int, device: torch.device,
        control_group: Any, world_size: int = 1, required: bool = True,
    ) -> None:  # fmt: skip
        self.enabled = overhead > 0
        self.memory_dir = memory_dir
        self.overhead = overhead
        self.every_steps = every_steps
        self.timeout_s = timeout_s
        self.rank = rank
        self.world_size = world_size
        self.required = required
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.node = node
        self.device = device
        self._group = control_group
        self.store = NodeMemory(memory_dir, run_name, identity_digest)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        # (specs, each local rank's pieces, state digest, the specs as the index lists them), per layout.
        self._plan: tuple[tuple[TensorSpec, ...], list[list[tuple[int, int, int]]], str, list[Any]] | None = None
        self._buffer: torch.Tensor | None = None
        self._views: tuple[torch.Tensor, list[tuple[int, torch.Tensor, torch.Tensor]]] | None = None  # see _pieces
        self._slot = 0
        self._previous: tuple[int, int] | None = None  # (slot, step) of this rank's last save
        self._next_due = 0
        self.interval = 1
        self.interval_why = "not measured yet"
        self.stall_s = 0.0  # the last save's stall, without its one-off waits (below)
        self.waited_s = 0.0  # the last save's wait for the previous write and buffer allocation
        self.write_cpu_s = 0.0  # CPU time of the last finished background write (its thread's)
        self.write_s = 0.0  # wall time of the last finished background write, start to commit
        self.step_s = 0.0
        # The recent measurements behind report(): step times without a save's stall, save costs, writes.
        self._recent_steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._recent_costs: deque[float] = deque(maxlen=SAVE_WINDOW)
        self._recent_writes: deque[float] = deque(maxlen=SAVE_WINDOW)
        self._phases: deque[tuple[int, float]] = deque(maxlen=PHASE_HISTORY)  # (steps since a save, step time)
        self._since_save: int | None = None
        self.copies_s = 0.0  # on a GPU: what the last measured copies cost the training stream
        self.background_s: float | None = None  # background_cost() at the last save; None: not told yet
        self._last_tick: float | None = None
        self._stall_since_tick = 0.0
        self.saves = 0
        self._copies: DeviceCopies | None = None  # the device-to-host copies of saves on a GPU
        # Threads a part's checksum may use (elastic_ddp/memory/store.py): at a restore nothing else
        # runs, so the rank's whole share of the cores. While training on a GPU, half of it -- the
        # rest is the training process's own (its loop, data loading, NCCL's threads), and a save
        # then writes about as fast as the bytes go into tmpfs instead of write + hash. On the CPU
        # the cores belong to the training step: one thread, and its CPU time counts as a save's cost.
        cores = _cores_per_rank(local_world_size)
        self.read_threads = cores
        self.write_threads = 1 if device.type == "cpu" else max(1, min(4, cores // 2))
        # What differs across ranks, decided at the first save and checked at every later one
        # (elastic_ddp/checkpoint/divergence.py: Plan); a save the check finds stale is skipped.
        self._split_plan: Plan | None = None
        self._check_device = device if device.type == "cuda" else torch.device("cpu")
        self._skipped: str | None = None
        self._before: tuple[int, tuple[int, int] | None] = (0, None)
        self.skipped_saves = 0
        self.failed: str | None = None  # why the tier stopped: set on every rank at the same step
        self._local_failure: str | None = None  # this rank's failed save, until the agreement stops the tier
        self.disabled: str | None = None  # why the tier turned itself off at the survey

    # ------------------------------------------------------------------------------------ start

    def survey(self, state: Mapping[str, Any], *, fresh: bool) -> Survey | None:
        """Collective: every rank's offer; raises :class:`MemoryTierError` (on every rank alike) when a
        node's memory dir lacks room for two states or cannot be used. When two nodes share one
        directory the tier turns itself off instead (:attr:`disabled` says why).

        ``fresh``: this start must not resume node memory (``checkpoint.resume`` is not ``auto``), so
        the node's states are forgotten first. None when the tier is off.
        """
        if not self.enabled:
            return None
        _, tensors, _ = flatten_named(_state_dicts(state))
        need = 2 * sum(t.numel() * t.element_size() for t in tensors) + SPACE_MARGIN
        states, own, last, free = [], [], None, 0
        problem = ""
        try:
            if self.local_rank == 0:
                os.makedirs(self.memory_dir, exist_ok=True)
                for path in self.store.remove_stale_runs(siblings=self.store.root.parent == Path(DEFAULT_MEMORY_BASE)):
                    log.info("[%d/-] Removed the memory tier of an ended run: %s", self.rank, path)
            self.store.open()
            if self.local_rank == 0:
                if fresh:
                    self.store.clear()
                states, last = self.store.states(), self.store.last_step()
            own = sorted(self.store.own_parts(self.rank, self.world_size))[-2:]
            free = self.store.free_bytes()
        except OSError as exc:
            problem = f"{exc}"
        by_slot = {found.slot: found for found in states}
        row = [self.node, self.local_rank, _place_key(self.memory_dir)]
        for slot in range(2):
            found = by_slot.get(slot)
            row += [found.step, int(bool(_per_rank_of(found)))] if found is not None else [-1, 0]
        row += (own + [-1, -1])[:2] + [-1 if last is None else last, need, -1 if problem else free]
        survey = Survey(tuple(NodeOffer.from_row(r, row) for r, row in enumerate(self._all_gather(row))))
        survey = self._check(survey, problem)
        newest = survey.leader(self.node).newest_slot
        self._slot = 1 - newest if newest >= 0 else 0
        return survey

    def _check(self, survey: Survey, problem: str) -> Survey:
        places: dict[int, int] = {}
        for offer in survey.offers:
            other = places.setdefault(offer.place, offer.node)
            if other != offer.node:
                # Every rank sees the same survey, so every rank turns the tier off alike. Not an
                # error: two agents on one host (a test, a dense dev box) lose only the memory tier,
                # and durable checkpoints protect them as before; the event says how to get it back.
                self.disabled = (
                    f"Nodes {other} and {offer.node} use the same checkpoint.memory_dir ({self.memory_dir!r}) on "
                    "one host, so the memory tier is off for this attempt (durable checkpoints go on); give each "
                    "agent its own --checkpoint.memory_dir to have it."
                )
                return self._turn_off(survey)
        short = [o for o in survey.offers if o.free < 0 or (o.local_rank == 0 and o.free < o.need)]
        if short:
            worst = short[0]
            unreadable = worst.free < 0
            where = (
                f"The memory tier needs {_size(worst.need)} (two copies of the {_size((worst.need - SPACE_MARGIN) // 2)} "
                f"state, and {_size(SPACE_MARGIN)} for its records) in checkpoint.memory_dir ({self.memory_dir!r}) on "
                f"node{'s' if len(short) > 1 else ''} {', '.join(str(o.node) for o in short)}, but "
                + (f"the directory cannot be used there ({problem or 'an OS error on that node'}). "
                   if unreadable else f"only {_size(worst.free)} is free there. ")
            )  # fmt: skip
            room = (
                "Give it room (Docker: --shm-size; Kubernetes: an emptyDir with medium: Memory and a sizeLimit "
                "mounted at /dev/shm; or point --checkpoint.memory_dir at a larger tmpfs)"
            )
            if self.required:
                raise MemoryTierError(
                    f"{where}{room}, or turn the tier off with --checkpoint.memory_overhead=0 (durable checkpoints "
                    "still work)."
                )
            self.disabled = (
                f"{where}So the memory tier is off for this attempt: a hard node loss costs the steps since the last "
                f"durable checkpoint. {room}; --checkpoint.memory_overhead=0 turns it off without this message."
            )
            return self._turn_off(survey)
        return survey

    def _turn_off(self, survey: Survey) -> Survey:
        """Every rank sees the same survey, so every rank turns the tier off alike (:attr:`disabled` says
        why): no saves in this attempt. The states the nodes hold are still offered for the resume --
        each is complete and checksummed, and reading one mixes nothing -- so a joining node without
        room does not cost the steps a join's stop committed to the others' memory."""
        if self.rank == 0:
            log.warning("[%d/-] %s", self.rank, self.disabled)
        self.enabled = False
        return survey

    def _all_gather(self, row: list[int]) -> list[list[int]]:
        mine = torch.tensor(row, dtype=torch.int64)
        if self._group is None:
            return [row]
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(out, mine, group=self._group)
        return [t.tolist() for t in out]

    def _all_min(self, value: int) -> int:
        """Collective: the smallest ``value`` of any rank."""
        if self._group is None:
            return value
        agreed = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self._group)
        return int(agreed.item())

    def _all_ok(self, ok: bool) -> bool:
        return bool(self._all_min(int(ok)))

    def _slice_bytes(self) -> int:
        """Collective: bytes per restore broadcast, the same on every rank (they must issue the same
        broadcasts): :data:`BROADCAST_BYTES`, or a quarter of the least free device memory of any rank."""
        limit = BROADCAST_BYTES
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            limit = min(limit, max(MIN_BROADCAST_BYTES, free // 4))
        return self._all_min(limit)

    def _broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        if self._group is None:
            return data or b""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=src, group=self._group)
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size.item()), dtype=torch.uint8)
        if buffer.numel():
            dist.broadcast(buffer, src=src, group=self._group)
        return buffer.numpy().tobytes()

    # ---------------------------------------------------------------------------------- restore

    def restore(self, survey: Survey, node: int, step: int, state: Mapping[str, Any]) -> bool:
        """Collective: load the state of ``step`` from ``node``'s memory into ``state`` on every rank.

        The node's ranks read its parts, verifying each as it is read; if any part fails, every
        rank returns False (nothing was loaded) and the caller chooses again without this node.
        What differs across ranks: when every rank holds its own part of ``step``
        (:meth:`Survey.exact`), each restores its own values from it; otherwise every rank gets the
        values of the rank that saved the node's first part, and one line says so. Raises
        :class:`MemoryTierError` when the saved state does not fit the registered objects.
        """
        ranks = survey.node_ranks(node)
        slot = survey.slot(node, step)
        has_per_rank = bool(survey.leader(node).per_rank[slot])
        held: dict[int, torch.Tensor] = {}
        problem = ""
        header: bytes | None = None
        if self.rank in ranks:
            try:
                found = self.store.complete(slot)
                if found is None or found.step != step:
                    raise MemoryFormatError(f"The state of step {step} in {self.store.slot_path(slot)} is no longer complete.")
                mine = [i for i in range(len(found.records)) if ranks[i % len(ranks)] == self.rank]
                for part in mine:
                    held[part] = self.store.read(found, part, self.read_threads)
                if self.rank == ranks[0]:
                    first = found.records[0]
                    header = json.dumps({"index": found.index, "own": first.own, "rank": first.rank}).encode()
            except MemoryFormatError as exc:
                problem = str(exc)
                log.warning("[%d/%d] %s", self.rank, step, problem)
        if not self._all_ok(not problem):
            log.warning("[%d/%d] The memory tier of node %d failed verification; choosing again without it.",
                        self.rank, step, node)  # fmt: skip
            return False
        own: tuple[PartRecord, torch.Tensor] | None = None
        if has_per_rank and survey.exact(step):
            own = self._own_part(step)
        exact = has_per_rank and self._all_ok(own is not None)
        saved = json.loads(self._broadcast_bytes(header, ranks[0]))
        index = saved["index"]
        try:
            specs = [TensorSpec.from_json(s, "the memory tier's index") for s in index["tensors"]]
            pieces = [[tuple(p) for p in part] for part in index["pieces"]]
            per_rank = [int(t) for t in index.get("per_rank", [])]
            templates = _state_dicts(state)
            shared = {name: tree for name, tree in templates.items() if name in index["state"]}
            dests, finish = _destinations(index["state"], specs, shared)
            if set(templates) - set(shared) - set((saved["own"] or {}).get("state", {})):
                raise TreeError(f"it holds no state named {sorted(set(templates) - set(shared))}")
        except (KeyError, TypeError, ValueError) as exc:
            raise MemoryTierError(
                f"The state of step {step} in node {node}'s memory tier does not fit this run's registered "
                f"objects: {exc}. Its directory is named after this run's identity, so this means the script "
                "registers other state than the run that saved it; start with --checkpoint.memory_overhead=0 "
                "once to resume from the durable tier."
            ) from exc
        started = time.perf_counter()
        self._receive(pieces, specs, ranks, held, dests)
        trees: dict[str, Any] = {}
        if has_per_rank:
            if exact:
                # This rank's own values: in the part it saved itself, read from its own node's memory.
                record, data = own
                section, own_objects = data[_pieces_bytes(pieces[record.part], specs) :], record.own
            else:
                # The values of the rank that saved the holding node's first part, for every rank.
                first = held[0][_pieces_bytes(pieces[0], specs) :].numpy().tobytes() if 0 in held else None
                received = self._broadcast_bytes(first, ranks[0])
                section = torch.frombuffer(bytearray(received), dtype=torch.uint8) if received else torch.empty(0, dtype=torch.uint8)
                own_objects = saved["own"]
                if self.rank == 0:
                    log.warning(
                        "[%d/%d] Not every rank holds its own part of step %d in node memory (another world size, or a "
                        "lost part): what differs across ranks is restored from rank %d's values on every rank, so it "
                        "is not per-rank exact.", self.rank, step, step, saved["rank"],
                    )  # fmt: skip
            own_specs = [TensorSpec.from_json(x, "the memory tier's per-rank objects") for x in (own_objects or {}).get("tensors", [])]
            trees = restore_rank_values(section, per_rank, specs, dests, (own_objects or {}).get("state", {}), own_specs,
                                        templates, "the memory tier")  # fmt: skip
        finish()
        trees.update({name: unflatten(index["state"][name], lambda i, _: dests[i], (name,), where="the memory tier")
                      for name in shared})  # fmt: skip
        for name, obj in state.items():
            try:
                obj.load_state_dict(trees[name])
            except Exception as exc:  # the object's own check (keys, shapes) failed: name it
                raise MemoryTierError(
                    f"Loading {name!r} from node {node}'s memory tier (step {step}) failed: {type(exc).__name__}: "
                    f"{exc}. The state there does not fit this run's registered objects; start with "
                    "--checkpoint.memory_overhead=0 once to resume from the durable tier."
                ) from exc
        log.info("[%d/%d] Restored from node %d's memory in %.2f s%s.", self.rank, step, node,
                 time.perf_counter() - started, "" if not has_per_rank else
                 (", each rank its own per-rank values" if exact else ", per-rank values from one rank"))  # fmt: skip
        return True

    def _own_part(self, step: int) -> tuple[PartRecord, torch.Tensor] | None:
        """This rank's own part of ``step`` in its node's memory, verified, or None."""
        found = self.store.own_parts(self.rank, self.world_size).get(step)
        if found is None:
            return None
        slot, record = found
        try:
            return record, self.store.read_record(slot, record, self.read_threads)
        except MemoryFormatError as exc:
            log.warning("[%d/%d] This rank's own part cannot be used: %s", self.rank, step, exc)
            return None

    def _receive(
        self, pieces: list[list[tuple[int, int, int]]], specs: list[TensorSpec], ranks: list[int],
        held: Mapping[int, torch.Tensor], dests: Mapping[int, torch.Tensor],
    ) -> None:  # fmt: skip
        """Broadcast every part from the rank that read it, in slices, into the destination tensors."""
        distributed = self._group is not None
        step = self._slice_bytes()
        buffer: torch.Tensor | None = None
        for part, part_pieces in enumerate(pieces):
            holder = ranks[part % len(ranks)]
            spans, pos = [], 0
            for t, start, stop in part_pieces:
                size = (stop - start) * specs[t].itemsize
                spans.append((pos, pos + size, t, start))
                pos += size
            for lo in range(0, pos, step):
                hi = min(pos, lo + step)
                if buffer is None or buffer.numel() < hi - lo:
                    buffer = None  # the smaller one goes before the larger one is taken
                    buffer = torch.empty(min(pos, step), dtype=torch.uint8, device=self.device)
                chunk = buffer[: hi - lo]
                if self.rank == holder:
                    chunk.copy_(held[part][lo:hi])
                if distributed:
                    dist.broadcast(chunk, src=holder)
                for a, b, t, start in spans:
                    if b <= lo or a >= hi:
                        continue
                    x, y = max(a, lo), min(b, hi)
                    itemsize = specs[t].itemsize
                    whole = _byte_range(dests[t], 0, dests[t].numel())
                    whole[start * itemsize + (x - a) : start * itemsize + (y - a)].copy_(chunk[x - lo : y - lo])

    # ------------------------------------------------------------------------------------- save

    def after_step(self, step: int, state: Mapping[str, Any], agreed: tuple[float, ...] | None) -> None:
        """Called by every rank after each step: note it, adopt the agreed interval, save when due."""
        if not self.enabled or self.failed:
            return
        if agreed is not None and agreed[4] > 0:
            # Some rank's save failed: every rank stops the tier at this same step (its saves are
            # collective), and durable checkpoints go on.
            self.failed = self._local_failure or "a memory-tier save failed on another rank"
            log.error("[%d/%d] The memory tier stops after a failed save (%s); durable checkpoints go on.",
                      self.rank, step, self.failed)  # fmt: skip
            return
        now = time.perf_counter()
        if self._last_tick is not None:
            self.step_s = max(now - self._last_tick - self._stall_since_tick, 0.0)
            self._recent_steps.append(self.step_s)
            if self._since_save is not None:
                self._since_save += 1
                self._phases.append((self._since_save, self.step_s))
        self._last_tick, self._stall_since_tick = now, 0.0
        if self.local_rank == 0:
            self.store.note_step(step)
        if self.every_steps:
            self.interval, self.interval_why = self.every_steps, f"checkpoint.memory_every_steps={self.every_steps}"
        elif agreed is not None:
            # Not told while any rank's step times cannot tell the background cost: ~64 steps, and
            # again when the last steps between saves have left the history (every ~500 steps).
            self.interval, self.interval_why = interval(agreed[0], agreed[1], self.overhead, agreed[2], told=agreed[3] == 0)
        if step >= self._next_due:
            # Subtracted from the next step's time: the interval weighs the stall against a step without it.
            self.stall_s = self.save(step, state)
            self._stall_since_tick = self.stall_s + self.waited_s
            self._next_due = step + self.interval
            self._since_save = 0
            # Here, not in the save: its time (~0.1 ms) falls in the next step, which it then measures.
            touched = math.ceil(_median(self._recent_writes) / max(_median(self._recent_steps), 1e-9))
            self.background_s = background_cost(self._phases, touched)

    def commit(self, step: int, state: Mapping[str, Any]) -> bool:
        """Collective: the state after ``step`` complete in every node's memory now, for a stop that
        needs no durable checkpoint; True on every rank when every rank's part of it is committed.

        The save :meth:`after_step` started for ``step`` is waited for; without one, this saves it.
        False (nothing is lost: the caller then commits the step to the durable tier) when the tier
        is off, stopped, or any rank's part did not commit.
        """
        if not self.enabled or self.failed:
            return False
        if self._previous is None or self._previous[1] != step:
            self.save(step, state)
        self._wait_writer()
        # What the node's memory holds, not what was asked: a save may be skipped (the ranks'
        # values no longer split as planned) or fail.
        ok = self._local_failure is None and step in self.store.own_parts(self.rank, self.world_size)
        return self._all_ok(ok)

    @property
    def cost_s(self) -> float:
        """What a save costs the training loop: its stall, plus what its background work takes from the
        steps it overlaps -- measured directly (on the CPU the write's CPU time, on a GPU the copies'
        time on the training stream) or, where larger, from the steps' times
        (:func:`elastic_ddp.memory.policy.background_cost`; see the module docstring)."""
        direct = self.write_cpu_s if self.device.type == "cpu" else self.copies_s
        return self.stall_s + max(direct, self.background_s or 0.0)

    def report(self) -> tuple[float, float, float, float, float]:
        """This rank's share of the agreement (``REPORT_SIZE`` numbers): the medians of the recent save
        costs, step times without a save's stall, and background writes (see ``STEP_WINDOW``; zeros
        before the first of each); 1.0 while the step times cannot yet tell what a save's
        background work costs (:attr:`background_s` is None), else 0.0; 1.0 once a save of this
        rank failed, else 0.0."""
        untold = 1.0 if self.background_s is None else 0.0
        failed = 1.0 if self._local_failure else 0.0
        return _median(self._recent_costs), _median(self._recent_steps), _median(self._recent_writes), untold, failed

    def save(self, step: int, state: Mapping[str, Any]) -> float:
        """Stage this rank's part of the state after ``step`` and write it in the background; the stall (s).

        Not in the stall, in :attr:`waited_s` instead: waiting for the previous write and allocating the
        host buffer. Both are one-offs -- the interval keeps saves further apart than a write takes
        (:func:`elastic_ddp.memory.policy.interval`), and the buffer is kept -- so counting them as the
        cost of every save would space saves out for good after the first ones.
        """
        started = time.perf_counter()
        ok = self._wait_writer()
        self.waited_s = time.perf_counter() - started
        trees = _state_dicts(state)
        # What differs across ranks, so that each rank keeps its own values of those in its part
        # instead of a share of them. Collective, on every rank alike (a rank whose last write failed
        # too, until the per-step agreement turns the tier off everywhere): decided once, blocking,
        # then checked at each save by one all-reduce that the save does not wait for -- its write
        # does (see _start_check).
        synced = synced_paths(state)
        check = None
        if self._split_plan is None or self._group is None:
            # On the default group (NCCL on GPUs), where the vector lives on this rank's device.
            all_max = all_max_over(None, self.device) if self._group is not None else None
            split = classify(trees, synced=synced, all_max=all_max)
            if self._group is not None:
                self._split_plan = plan_of(split, trees, synced)
        else:
            split = split_as(self._split_plan, trees, synced)
            check = self._start_check(values(self._split_plan, trees, split, self._check_device))
        self._before = (self._slot, self._previous)
        if not ok or self._local_failure or split is None:
            if check is not None:
                # The check's verdict is everyone's: consumed in the background like a write's. With
                # another structure here it says so, and every rank skips this save (see _write).
                self._pending = self._executor().submit(self._write, self._slot, None, None, None, None, check)
                self._previous, self._slot = (self._slot, step), 1 - self._slot
            return 0.0
        encoded, tensors, paths = split.shared, list(split.tensors), split.paths
        per_rank = tuple(sorted(split.per_rank))
        specs = split.specs
        own_specs = tuple(TensorSpec.of(t) for t in split.own_tensors)
        key = (specs, per_rank, own_specs)
        if self._plan is None or self._plan[0] != key:
            layout = plan(specs, list(range(self.local_world_size)), files_per_writer=1, min_file_bytes=0, skip=per_rank)
            # (tensor, first element, end element) of each local rank's part, in byte-stream order.
            parts = [[(p.tensor, p.start, p.stop) for f in layout.files_of(w) for p in f.pieces] for w in range(self.local_world_size)]
            digest = hashlib.sha256(
                json.dumps([[[path_text(p), s.to_json()] for p, s in zip(paths, specs)], per_rank, sorted(split.own)]).encode()
            ).hexdigest()[:16]
            # After its share: this rank's own values of the per-rank tensors, then its per-rank objects.
            own = [(t, 0, specs[t].numel) for t in per_rank]
            own += [(len(specs) + j, 0, spec.numel) for j, spec in enumerate(own_specs)]
            self._plan = (key, parts, digest, [spec.to_json() for spec in specs], parts[self.local_rank] + own)
            self._views = None  # the pieces are others now
        _, parts, digest, specs_json, mine = self._plan
        tensors += split.own_tensors
        specs += own_specs
        nbytes = sum((b - a) * specs[t].itemsize for t, a, b in mine)
        on_gpu = any(tensors[t].is_cuda for t, _, _ in mine)
        if self._buffer is None or self._buffer.numel() != nbytes or self._buffer.is_pinned() != on_gpu:
            allocating = time.perf_counter()
            self._buffer = None  # the old one goes before the new one is taken
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_gpu)
            self.waited_s += time.perf_counter() - allocating
        pieces = self._pieces(mine, tensors, specs)
        copies = None
        if on_gpu:
            # Parameters and optimizer state are copied while the next step computes (see
            # elastic_ddp/memory/copies.py); what the copies cost the training stream, measured on the
            # GPU at the previous save, is added to the stall this rank reports.
            if self._copies is None:
                self._copies = DeviceCopies(self.device)
            optimizers = [obj.optimizer for obj in state.values() if isinstance(obj, OptimizerState)]
            copies = self._copies.copy(pieces, optimizers)
        else:
            torch._foreach_copy_([target for _, target in pieces], [source for source, _ in pieces])
        index = None
        if self.local_rank == 0:
            index = {"state": encoded, "tensors": specs_json, "pieces": parts, "per_rank": list(per_rank)}
        slot, previous = self._slot, self._previous
        own_objects = {"state": split.own, "tensors": [spec.to_json() for spec in own_specs]} if split.own else None
        record = PartRecord(step, self.local_rank, self.local_world_size, nbytes, "", digest, index, self.rank,
                            self.world_size, own_objects)  # fmt: skip
        self._pending = self._executor().submit(self._write, slot, previous, record, self._buffer, copies, check)
        self._previous, self._slot = (slot, step), 1 - slot
        self.saves += 1
        # On GPUs what the device-to-host copies cost the training stream, timed at the previous save.
        self.copies_s = self._copies.cost_s if on_gpu else 0.0
        return time.perf_counter() - started - self.waited_s

    def _pieces(
        self, mine: list[tuple[int, int, int]], tensors: list[torch.Tensor], specs: tuple[TensorSpec, ...]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source bytes, buffer bytes) of each piece of this rank's part.

        Kept from save to save: the state's tensors are mostly the same storages every time (live
        parameters and optimizer state), and making two views per tensor costs ~10 us each -- 11 ms
        a save at 1,152 tensors. A kept view is reused only for a contiguous tensor at the same
        address: the view holds the old storage alive, so no other tensor can be at that address.
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
                views.append((address, _byte_range(tensor, a, b), buffer[pos : pos + size]))
            pos += size
        self._views = (buffer, views)
        return [(source, target) for _, source, target in views]

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="memory-tier")
        return self._pool

    def _start_check(self, mine: torch.Tensor) -> Callable[[], str | None]:
        """Start the all-reduce that checks the current split plan (``mine``: this rank's
        :func:`~elastic_ddp.checkpoint.divergence.values`); returns the wait for its verdict (why the
        plan no longer holds, or None), for the background write.

        On a GPU it runs on the default (NCCL) group, the result copied to pinned host memory behind
        it on the stream: the training loop never waits. On CPUs on the tier's gloo group.
        """
        plan, count = self._split_plan, mine.numel()
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
            return stale(plan, result[:count], [~v for v in result[count:]])

        return verdict

    def _write(self, slot: int, previous: tuple[int, int] | None, record: PartRecord | None,
               buffer: torch.Tensor | None, copies: Any, check: Callable[[], str | None] | None) -> None:  # fmt: skip
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            if copies is not None:
                copies.wait()
            why = check() if check is not None else None
            if why is not None:
                # The split the part was staged with no longer holds: every rank sees the same verdict
                # and skips this save; the next one decides anew.
                self._skipped = why
                return
            if record is None:
                return  # this rank could not stage (its last write failed): the agreement stops the tier
            self._write_part(slot, previous, record, buffer)
        finally:
            self.write_cpu_s = time.thread_time() - started_cpu
            self.write_s = time.perf_counter() - started

    def _write_part(self, slot: int, previous: tuple[int, int] | None, record: PartRecord, buffer: torch.Tensor) -> None:
        # Overwrite this slot only once the other slot holds the previous state complete: every
        # local rank finished it. Until then this slot's older state is the node's only complete one.
        if previous is not None and not self.store.wait_complete(*previous, timeout_s=self.timeout_s):
            raise MemoryTierError(
                f"The node's other ranks did not finish the memory-tier save of step {previous[1]} within "
                f"{self.timeout_s:.0f} s (checkpoint.timeout_s)."
            )
        self.store.uncommit(slot, record.part)
        size, checksum = self.store.write(slot, record.part, [memoryview(buffer.numpy()).cast("B")], self.write_threads)
        self.store.commit(slot, replace(record, size=size, checksum=checksum))

    def _wait_writer(self) -> bool:
        """Wait for the save in flight; False (the tier then stops on this rank) if it failed."""
        if self._pending is None:
            return True
        pending, self._pending = self._pending, None
        try:
            pending.result()
        except Exception as exc:  # noqa: BLE001 - a failed memory save must not stop training: durable still works
            self._local_failure = f"{type(exc).__name__}: {exc}"
            log.error("[%d/-] A memory-tier save failed on this rank (%s); the tier stops on every rank at the next "
                      "agreed step, durable checkpoints go on.", self.rank, self._local_failure)  # fmt: skip
            return False
        if self._skipped is not None:
            # No rank wrote that save: the slots stay as they were, and the next save splits afresh.
            log.info("[%d/-] A memory-tier save was skipped on every rank: %s; the next one compares the ranks "
                     "again.", self.rank, self._skipped)  # fmt: skip
            self._slot, self._previous = self._before
            self._skipped, self._split_plan = None, None
            self.skipped_saves += 1
            return True
        # The save is complete: its stall (not yet replaced by the next save's) and its write's times.
        self._recent_costs.append(self.cost_s)
        self._recent_writes.append(self.write_s)
        return True

    # --------------------------------------------------------------------------------- teardown

    def close(self) -> None:
        """Wait for the save in flight and release the directory (its states stay for a restart)."""
        if not self.enabled:
            self.store.close()  # a tier turned off at the survey holds the directory until here
            return
        self._wait_writer()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._copies is not None:
            self._copies.close()
            self._copies = None
        self._views = None  # they hold the state's storages
        self.store.close()

    def remove(self) -> None:
        """After a normal end, once every local rank has closed: local rank 0 deletes the run's directory."""
        if self.enabled and self.local_rank == 0:
            self.store.remove()


def _destinations(
    encoded: Mapping[str, Any], specs: list[TensorSpec], templates: Mapping[str, Any]
) -> tuple[dict[int, torch.Tensor], Any]:
    """Where each saved tensor goes: the template's own tensor at its path (filled in place) or a new
    CPU tensor; and a ``finish()`` that copies into non-contiguous templates."""
    dests: dict[int, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    missing = sorted(set(templates) - set(encoded))
    if missing:
        raise TreeError(f"it holds no state named {', '.join(repr(m) for m in missing)}")

    def place(i: int, path: tuple) -> None:
        if not 0 <= i < len(specs) or i in dests:
            raise TreeError(f"the index refers to tensor {i} at {path_text(path)!r}, which it does not hold once")
        spec = specs[i]
        target = leaf(templates[path[0]], path[1:])
        if not isinstance(target, torch.Tensor):
            dests[i] = torch.empty(spec.shape, dtype=spec.dtype)
            return
        if target.dtype != spec.dtype or tuple(target.shape) != spec.shape:
            raise TreeError(
                f"{path_text(path)!r} is {spec.dtype} of shape {list(spec.shape)} in node memory but {target.dtype} "
                f"of shape {list(target.shape)} here"
            )
        if target.is_contiguous():
            dests[i] = target.detach()
        else:
            dests[i] = torch.empty_like(target, memory_format=torch.contiguous_format)
            copies.append((dests[i], target))

    for name in templates:
        unflatten(encoded[name], place, (name,), where="the memory tier's index")

    def finish() -> None:
        with torch.no_grad():
            for filled, target in copies:
                target.copy_(filled)

    return dests, finish


def _pieces_bytes(pieces: list[tuple[int, int, int]], specs: list[TensorSpec]) -> int:
    return sum((b - a) * specs[t].itemsize for t, a, b in pieces)


def _per_rank_of(found: Any) -> bool:
    """Whether a complete state in node memory holds per-rank values."""
    index = found.records[0].index or {}
    return bool(index.get("per_rank")) or found.records[0].own is not None
