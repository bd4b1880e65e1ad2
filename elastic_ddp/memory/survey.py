"""The memory tier at a start: what every node's memory holds, and a restore from the node that holds it.

Collective, before training: :meth:`Resume.survey` all-gathers what each node's memory holds (newest
complete step, the last step the node completed) and checks that every node has room; the run picks
the newest state anywhere (:func:`elastic_ddp.memory.policy.choose_resume`); :meth:`Resume.restore`
has the holding node's ranks read its parts, verifying each as it is read, agrees that all verified,
and broadcasts the bytes over the default process group (NCCL on GPUs) straight into every rank's
registered tensors, placed as a durable restore places them
(:func:`elastic_ddp.checkpoint.sharded.place`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint.sharded import place, restore_rank_values
from elastic_ddp.checkpoint.staging import byte_view
from elastic_ddp.checkpoint.tree import TensorSpec, TreeError, flatten_named, path_text, unflatten
from elastic_ddp.config import DEFAULT_MEMORY_BASE
from elastic_ddp.memory.base import MemoryTierError, Ranks
from elastic_ddp.memory.policy import Candidate
from elastic_ddp.memory.saver import state_dicts
from elastic_ddp.memory.store import MemoryFormatError, NodeMemory, PartRecord

__all__ = ["BROADCAST_BYTES", "SPACE_MARGIN", "NodeOffer", "Resume", "Survey", "all_ok"]

log = logging.getLogger(__name__)

# Bytes per broadcast at a restore. An NCCL broadcast is a pipelined ring whose fill costs about
# one hop per rank, so a state goes in as few broadcasts as the devices' free memory allows: 16 for
# a 16 GB state, not the 256 of 64 MiB slices (docs/memory-tier.md, "Costs at scale"). The buffer
# lives only during the restore, before training allocates anything.
BROADCAST_BYTES = 1 << 30
MIN_BROADCAST_BYTES = 64 << 20
# Room left free beside the two slots (commit records, the index, tmpfs rounding).
SPACE_MARGIN = 16 << 20


@dataclass(frozen=True)
class NodeOffer:
    """What one rank reported at the survey (see :meth:`Resume.survey`).

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


def all_gather(group: Any, row: list[int]) -> list[list[int]]:
    """Collective on ``group`` (None: one process): every rank's ``row``, by rank."""
    mine = torch.tensor(row, dtype=torch.int64)
    if group is None:
        return [row]
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [t.tolist() for t in out]


def all_min(group: Any, value: int) -> int:
    """Collective: the smallest ``value`` of any rank."""
    if group is None:
        return value
    agreed = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return int(agreed.item())


def all_ok(group: Any, ok: bool) -> bool:
    """Collective: whether ``ok`` on every rank."""
    return bool(all_min(group, int(ok)))


def broadcast_bytes(group: Any, data: bytes | None, src: int) -> bytes:
    if group is None:
        return data or b""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size.item()), dtype=torch.uint8)
    if buffer.numel():
        dist.broadcast(buffer, src=src, group=group)
    return buffer.numpy().tobytes()


class Resume:
    """One rank's part of a start from node memory: the survey (:meth:`survey`) and the restore
    (:meth:`restore`), collectives on the tier's ``group`` (None: one process) and, for the restore's
    bytes, the default group. ``read_threads``: threads a part's checksum may use while it is read."""

    def __init__(self, store: NodeMemory, ranks: Ranks, *, memory_dir: str, group: Any, device: torch.device,
                 read_threads: int) -> None:  # fmt: skip
        self.store = store
        self.ranks = ranks
        self.memory_dir = memory_dir
        self.group = group
        self.device = device
        self.read_threads = read_threads

    # ------------------------------------------------------------------------------------ survey

    def survey(self, state: Mapping[str, Any], *, fresh: bool, required: bool) -> tuple[Survey, str | None]:
        """Collective: every rank's offer, and why the tier must turn itself off for this attempt (None:
        it need not; see :meth:`check`). ``fresh``: this start must not resume node memory, so the
        node's states are forgotten first."""
        r = self.ranks
        _, tensors, _ = flatten_named(state_dicts(state))
        need = 2 * sum(t.numel() * t.element_size() for t in tensors) + SPACE_MARGIN
        states, own, last, free = [], [], None, 0
        problem = ""
        try:
            if r.local_rank == 0:
                os.makedirs(self.memory_dir, exist_ok=True)
                for path in self.store.remove_stale_runs(siblings=self.store.root.parent == Path(DEFAULT_MEMORY_BASE)):
                    log.info("[%d/-] Removed the memory tier of an ended run: %s", r.rank, path)
            self.store.open()
            if r.local_rank == 0:
                if fresh:
                    self.store.clear()
                states, last = self.store.states(), self.store.last_step()
            own = sorted(self.store.own_parts(r.rank, r.world_size))[-2:]
            free = self.store.free_bytes()
        except OSError as exc:
            problem = f"{exc}"
        by_slot = {found.slot: found for found in states}
        row = [r.node, r.local_rank, _place_key(self.memory_dir)]
        for slot in range(2):
            found = by_slot.get(slot)
            row += [found.step, int(bool(_per_rank_of(found)))] if found is not None else [-1, 0]
        row += (own + [-1, -1])[:2] + [-1 if last is None else last, need, -1 if problem else free]
        survey = Survey(tuple(NodeOffer.from_row(i, row) for i, row in enumerate(all_gather(self.group, row))))
        return survey, self.check(survey, problem, required=required)

    def check(self, survey: Survey, problem: str, *, required: bool) -> str | None:
        """Why the tier turns itself off for this attempt (every rank sees the same survey, so every rank
        alike), or None: two nodes share one directory, or -- unless ``required`` (then it raises
        :class:`MemoryTierError`) -- a node lacks room or cannot use its directory (``problem``: why
        this rank cannot)."""
        places: dict[int, int] = {}
        for offer in survey.offers:
            other = places.setdefault(offer.place, offer.node)
            if other != offer.node:
                # Not an error: two agents on one host (a test, a dense dev box) lose only the memory
                # tier, and durable checkpoints protect them as before; the event says how to get it back.
                return (
                    f"Nodes {other} and {offer.node} use the same checkpoint.memory_dir ({self.memory_dir!r}) on "
                    "one host, so the memory tier is off for this attempt (durable checkpoints go on); give each "
                    "agent its own --checkpoint.memory_dir to have it."
                )
        short = [o for o in survey.offers if o.free < 0 or (o.local_rank == 0 and o.free < o.need)]
        if not short:
            return None
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
        if required:
            raise MemoryTierError(
                f"{where}{room}, or turn the tier off with --checkpoint.memory_overhead=0 (durable checkpoints "
                "still work)."
            )
        return (
            f"{where}So the memory tier is off for this attempt: a hard node loss costs the steps since the last "
            f"durable checkpoint. {room}; --checkpoint.memory_overhead=0 turns it off without this message."
        )

    def slice_bytes(self) -> int:
        """Collective: bytes per restore broadcast, the same on every rank (they must issue the same
        broadcasts): :data:`BROADCAST_BYTES`, or a quarter of the least free device memory of any rank."""
        limit = BROADCAST_BYTES
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            limit = min(limit, max(MIN_BROADCAST_BYTES, free // 4))
        return all_min(self.group, limit)

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
        if self.ranks.rank in ranks:
            try:
                found = self.store.complete(slot)
                if found is None or found.step != step:
                    raise MemoryFormatError(f"The state of step {step} in {self.store.slot_path(slot)} is no longer complete.")
                mine = [i for i in range(len(found.records)) if ranks[i % len(ranks)] == self.ranks.rank]
                for part in mine:
                    held[part] = self.store.read(found, part, self.read_threads)
                if self.ranks.rank == ranks[0]:
                    first = found.records[0]
                    header = json.dumps({"index": found.index, "own": first.own, "rank": first.rank}).encode()
            except MemoryFormatError as exc:
                problem = str(exc)
                log.warning("[%d/%d] %s", self.ranks.rank, step, problem)
        if not all_ok(self.group, not problem):
            log.warning("[%d/%d] The memory tier of node %d failed verification; choosing again without it.",
                        self.ranks.rank, step, node)  # fmt: skip
            return False
        own: tuple[PartRecord, torch.Tensor] | None = None
        if has_per_rank and survey.exact(step):
            own = self._own_part(step)
        exact = has_per_rank and all_ok(self.group, own is not None)
        saved = json.loads(broadcast_bytes(self.group, header, ranks[0]))
        index = saved["index"]
        try:
            specs = [TensorSpec.from_json(s, "the memory tier's index") for s in index["tensors"]]
            pieces = [[tuple(p) for p in part] for part in index["pieces"]]
            per_rank = [int(t) for t in index.get("per_rank", [])]
            templates = state_dicts(state)
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
                received = broadcast_bytes(self.group, first, ranks[0])
                section = torch.frombuffer(bytearray(received), dtype=torch.uint8) if received else torch.empty(0, dtype=torch.uint8)
                own_objects = saved["own"]
                if self.ranks.rank == 0:
                    log.warning(
                        "[%d/%d] Not every rank holds its own part of step %d in node memory (another world size, or a "
                        "lost part): what differs across ranks is restored from rank %d's values on every rank, so it "
                        "is not per-rank exact.", self.ranks.rank, step, step, saved["rank"],
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
        log.info("[%d/%d] Restored from node %d's memory in %.2f s%s.", self.ranks.rank, step, node,
                 time.perf_counter() - started, "" if not has_per_rank else
                 (", each rank its own per-rank values" if exact else ", per-rank values from one rank"))  # fmt: skip
        return True

    def _own_part(self, step: int) -> tuple[PartRecord, torch.Tensor] | None:
        """This rank's own part of ``step`` in its node's memory, verified, or None."""
        found = self.store.own_parts(self.ranks.rank, self.ranks.world_size).get(step)
        if found is None:
            return None
        slot, record = found
        try:
            return record, self.store.read_record(slot, record, self.read_threads)
        except MemoryFormatError as exc:
            log.warning("[%d/%d] This rank's own part cannot be used: %s", self.ranks.rank, step, exc)
            return None

    def _receive(
        self, pieces: list[list[tuple[int, int, int]]], specs: list[TensorSpec], ranks: list[int],
        held: Mapping[int, torch.Tensor], dests: Mapping[int, torch.Tensor],
    ) -> None:  # fmt: skip
        """Broadcast every part from the rank that read it, in slices, into the destination tensors."""
        distributed = self.group is not None
        step = self.slice_bytes()
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
                if self.ranks.rank == holder:
                    chunk.copy_(held[part][lo:hi])
                if distributed:
                    dist.broadcast(chunk, src=holder)
                for a, b, t, start in spans:
                    if b <= lo or a >= hi:
                        continue
                    x, y = max(a, lo), min(b, hi)
                    itemsize = specs[t].itemsize
                    whole = byte_view(dests[t], 0, dests[t].numel())
                    whole[start * itemsize + (x - a) : start * itemsize + (y - a)].copy_(chunk[x - lo : y - lo])


def _destinations(
    encoded: Mapping[str, Any], specs: list[TensorSpec], templates: Mapping[str, Any]
) -> tuple[dict[int, torch.Tensor], Any]:
    """Where each saved tensor goes (:func:`elastic_ddp.checkpoint.sharded.place`: the template's own
    tensor at its path, filled in place, or a new CPU tensor); and a ``finish()`` that copies into
    non-contiguous templates."""
    paths: dict[int, tuple] = {}
    missing = sorted(set(templates) - set(encoded))
    if missing:
        raise TreeError(f"it holds no state named {', '.join(repr(m) for m in missing)}")

    def note(i: int, path: tuple) -> None:
        if not 0 <= i < len(specs) or i in paths:
            raise TreeError(f"the index refers to tensor {i} at {path_text(path)!r}, which it does not hold once")
        paths[i] = path

    for name in templates:
        unflatten(encoded[name], note, (name,), where="the memory tier's index")
    return place(paths, specs, templates, where="in node memory", end="")


def _pieces_bytes(pieces: list[tuple[int, int, int]], specs: list[TensorSpec]) -> int:
    return sum((b - a) * specs[t].itemsize for t, a, b in pieces)


def _per_rank_of(found: Any) -> bool:
    """Whether a complete state in node memory holds per-rank values."""
    index = found.records[0].index or {}
    return bool(index.get("per_rank")) or found.records[0].own is not None
