"""The memory tier: the state after a step kept in node memory, and a resume from any node that has it.

:class:`MemoryTier` is one rank's front door; the work is done by

* :mod:`elastic_ddp.memory.saver` -- a save: this rank's part staged into a host buffer (on a GPU
  parameters and optimizer state copied on a side stream, :mod:`elastic_ddp.memory.copies`) and
  written into the node's tmpfs by a background thread (:mod:`elastic_ddp.memory.store`);
* :mod:`elastic_ddp.memory.interval` -- how often: the measurements of steps, saves and writes,
  and the interval from what the ranks agreed (:func:`elastic_ddp.memory.policy.interval`);
* :mod:`elastic_ddp.memory.survey` -- at a start: the survey of every node's memory and the
  restore by broadcast from the node that holds the chosen state.

The tier has no collective of its own between saves: each rank's :meth:`MemoryTier.report`
(:class:`~elastic_ddp.memory.interval.Report`, ``REPORT_SIZE`` numbers) rides on the stop agreement
(:class:`elastic_ddp.worker.stop.StopAgreement`, every ``dist.stop_check_s`` seconds of steps), and the
caller hands the agreed maxima back to :meth:`MemoryTier.after_step`, so every rank saves the same
steps without another collective.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from elastic_ddp.memory.base import MemoryTierError, Ranks
from elastic_ddp.memory.interval import REPORT_SIZE, IntervalController, Report, save_cost
from elastic_ddp.memory.saver import Outcome, Saver
from elastic_ddp.memory.store import NodeMemory
from elastic_ddp.memory.survey import NodeOffer, Resume, Survey, all_ok

__all__ = ["REPORT_SIZE", "MemoryTier", "MemoryTierError", "NodeOffer", "NodeShape", "Survey", "node_shape"]

log = logging.getLogger(__name__)

# How long a keep after a failed step waits for the save in flight, and then for the node's other
# ranks to finish it: a save is done at once or never (its check needed a peer that is gone: an
# all-reduce with a peer whose process lives on but left the collective waits up to the group's
# timeout), and the restart waits for this.
KEEP_WAIT_S = 3.0


def _now() -> float:
    """The tier's clock (``time`` is looked up at each call, so a test can move it)."""
    return time.perf_counter()


def _cores_per_rank(local_world_size: int) -> float:
    """The CPU cores this process may use divided among the node's ranks: below 1 where they share cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores / max(1, local_world_size)


@dataclass(frozen=True)
class NodeShape:
    """What the tier derives from the node it runs on (:func:`node_shape`), each forcible by a setting so
    that a GPU node's values run on CPUs (docs/memory-tier.md, "Derived from the node").

    ``write_threads``: threads a save's checksum uses (more than 1: hashed beside the write,
    ``checkpoint.memory_write_threads``); ``read_threads``: threads a restore's or a keep's checksum
    uses (``checkpoint.memory_read_threads``); ``direct_cost``: the direct measure of a save's
    background cost, ``"write_cpu"`` or ``"copies"`` (``checkpoint.memory_direct_cost``);
    ``cpu_weight``: the training time one second of the write's CPU time costs, with ``"write_cpu"``
    -- 1 while each rank has a core, the ranks per core where they share the cores.
    """

    write_threads: int
    read_threads: int
    direct_cost: str
    cpu_weight: float = 1.0


def node_shape(device: torch.device, cores: float, *, write_threads: int = 0, read_threads: int = 0,
               direct_cost: str = "auto") -> NodeShape:  # fmt: skip
    """The tier's :class:`NodeShape` for a rank training on ``device`` with ``cores`` cores of its own
    (its share of the host's, below 1 where ranks share cores); a forced value (not 0 / ``"auto"``)
    wins over the derived one. Pure: a ``torch.device("cuda")`` needs no GPU here.

    At a restore nothing else runs, so it reads with the rank's whole share. While training on a
    GPU a save hashes with half of it, 1 to 4 threads -- the rest is the training process's own (its
    loop, data loading, NCCL's threads) -- and then writes about as fast as the bytes go into tmpfs
    instead of write + hash; the step runs on the device, so what the save costs training directly
    is the copies' time on its stream. On the CPU the cores belong to the training step: one
    thread, and its CPU time counts as a save's cost -- weighted by the ranks per core where they
    share the cores: every core is then busy with steps, every rank writes at the same step and the
    ranks wait for each other at the next all-reduce, so the node's W writes of c CPU seconds on
    C < W cores delay every rank's step by about W * c / C, not c.
    """
    on_cpu = device.type == "cpu"
    whole = max(1, int(cores))
    return NodeShape(
        write_threads=write_threads or (1 if on_cpu else max(1, min(4, whole // 2))),
        read_threads=read_threads or whole,
        direct_cost=direct_cost if direct_cost != "auto" else ("write_cpu" if on_cpu else "copies"),
        cpu_weight=max(1.0, 1.0 / cores) if cores > 0 else 1.0,
    )


class MemoryTier:
    """One rank's part of the memory tier. Off (every method a no-op) when ``overhead`` is 0.

    ``memory_dir``: the node's tmpfs directory; ``overhead``: the stall budget as a fraction of
    step time; ``every_steps``: a fixed interval instead (0: from the budget); ``timeout_s``: how
    long a save waits for the node's other ranks to finish the previous one. ``required``: the
    user asked for the tier, so a node without room for it is an error; otherwise (the tier is on
    by default) the tier turns itself off for the attempt and :attr:`disabled` says why.
    ``write_threads``, ``read_threads``, ``direct_cost``: forced values of :attr:`shape` (0 and
    ``"auto"``: derived from ``device`` and the cores, see :func:`node_shape`).
    """

    def __init__(
        self, *, memory_dir: str, overhead: float, every_steps: int, timeout_s: float, run_name: str,
        identity_digest: str, rank: int, local_rank: int, local_world_size: int, node: int, device: torch.device,
        control_group: Any, world_size: int = 1, required: bool = True, write_threads: int = 0,
        read_threads: int = 0, direct_cost: str = "auto",
    ) -> None:  # fmt: skip
        self.enabled = overhead > 0
        self.required = required
        self.device = device
        self.ranks = Ranks(rank, world_size, local_rank, local_world_size, node)
        self.store = NodeMemory(memory_dir, run_name, identity_digest)
        self.shape = node_shape(device, _cores_per_rank(local_world_size), write_threads=write_threads,
                                read_threads=read_threads, direct_cost=direct_cost)  # fmt: skip
        self._resume = Resume(self.store, self.ranks, memory_dir=memory_dir, group=control_group, device=device,
                              read_threads=self.shape.read_threads)  # fmt: skip
        self._saver = Saver(self.store, self.ranks, device=device, group=control_group, timeout_s=timeout_s,
                            write_threads=self.shape.write_threads, clock=_now)  # fmt: skip
        self._interval = IntervalController(budget=overhead, every_steps=every_steps, clock=_now)
        self.failed: str | None = None  # why the tier stopped: set on every rank at the same step
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
        survey, why = self._resume.survey(state, fresh=fresh, required=self.required)
        if why is not None:
            self._turn_off(why)
        self._saver.slots.start(survey.leader(self.ranks.node).newest_slot)
        return survey

    def _check(self, survey: Survey, problem: str) -> Survey:
        why = self._resume.check(survey, problem, required=self.required)
        if why is not None:
            self._turn_off(why)
        return survey

    def _turn_off(self, why: str) -> None:
        """Every rank sees the same survey, so every rank turns the tier off alike (:attr:`disabled` says
        why): no saves in this attempt. The states the nodes hold are still offered for the resume --
        each is complete and checksummed, and reading one mixes nothing -- so a joining node without
        room does not cost the steps a join's stop committed to the others' memory."""
        self.disabled = why
        if self.ranks.rank == 0:
            log.warning("[%d/-] %s", self.ranks.rank, why)
        self.enabled = False

    def restore(self, survey: Survey, node: int, step: int, state: Mapping[str, Any]) -> bool:
        """Collective: load the state of ``step`` from ``node``'s memory into ``state`` on every rank;
        False on every rank when a part failed verification (see :meth:`.survey.Resume.restore`)."""
        return self._resume.restore(survey, node, step, state)

    # ------------------------------------------------------------------------------------- save

    def after_step(self, step: int, state: Mapping[str, Any], agreed: tuple[float, ...] | None) -> None:
        """Called by every rank after each step with what the stop agreement agreed at this step (the
        maxima of the ranks' :meth:`report`; None at a step where nothing was agreed): note the step,
        adopt the agreed interval, save when due."""
        if not self.enabled or self.failed:
            return
        if agreed is not None and Report.of(agreed).failed > 0:
            # Some rank's save failed: every rank stops the tier at this same step (its saves are
            # collective), and durable checkpoints go on.
            self.failed = self._saver.local_failure or "a memory-tier save failed on another rank"
            log.error("[%d/%d] The memory tier stops after a failed save (%s); durable checkpoints go on.",
                      self.ranks.rank, step, self.failed)  # fmt: skip
            return
        due = self._interval.step_ended(step, agreed)
        if self.ranks.local_rank == 0:
            self.store.note_step(step)
        if due:
            times = self._saver.times
            times.stall_s = self.save(step, state)
            self._interval.saved(step, times.stall_s + times.waited_s)

    def commit(self, step: int, state: Mapping[str, Any]) -> bool:
        """Collective: the state after ``step`` complete in every node's memory now, for a stop that
        needs no durable checkpoint; True on every rank when every rank's part of it is committed.

        The save :meth:`after_step` started for ``step`` is waited for; without one, this saves it.
        False (nothing is lost: the caller then commits the step to the durable tier) when the tier
        is off, stopped, or any rank's part did not commit.
        """
        if not self.enabled or self.failed:
            return False
        previous = self._saver.slots.previous
        if previous is None or previous[1] != step:
            self.save(step, state)
        self._wait_writer()
        # What the node's memory holds, not what was asked: a save may be skipped (the ranks'
        # values no longer split as planned) or fail.
        ok = self._saver.local_failure is None and step in self.store.own_parts(self.ranks.rank, self.ranks.world_size)
        return all_ok(self._resume.group, ok)

    def keep(self, step: int, state: Mapping[str, Any], lockstep: frozenset[str] = frozenset()) -> str | None:
        """No collective, after a failed step: the state after ``step`` (the last completed one) committed to
        this node's memory now, for the restart to resume from; None when this rank's part of it is
        committed (by an earlier save or now), else why not.

        The caller vouches that ``state`` is exactly that after ``step`` (see
        :class:`elastic_ddp.worker.step_guard.StepGuard`) and names the objects that change alike on every
        rank by construction (``lockstep``, see :meth:`.saver.SplitCheck.unchanged`). The node holds the step complete when every local
        rank kept it; a node where one did not keeps its previous states as they were.
        """
        if not self.enabled or self.failed:
            return self.failed or "the memory tier is off"
        if self.ranks.local_rank == 0:
            # The node completed it, kept or not: a failure after a step's update but before its
            # bookkeeping must count the step as done, or the restart would count -1 steps redone.
            self.store.note_step(step)
        outcome = self._saver.wait(timeout_s=KEEP_WAIT_S)
        if outcome is Outcome.RUNNING:
            # Its comparison waits for a peer that is gone, and may yet write its slot: keep nothing,
            # and leave the restart what the node held before it.
            return (f"the save in flight is still running after {KEEP_WAIT_S:g} s (its comparison waits for a "
                    "lost peer)")
        if outcome is Outcome.FAILED:
            # Most often the comparison that the save in flight waits for, an all-reduce that needed the
            # peer now gone: nothing of it was committed, so its slot is free again for this state.
            self._saver.retract()
        previous = self._saver.slots.previous
        if previous is not None and previous[1] == step:
            return None
        # Every rank waits for the slowest keep before it trains again: worth it only where redoing the
        # steps since the last save would take longer than writing this one (medians of this attempt).
        measured = self._interval.report(failed=False)
        if previous is not None and (step - previous[1]) * measured.step_s < measured.write_s:
            return (f"redoing {step - previous[1]} step(s) ({measured.step_s * 1e3:.0f} ms each) costs less than "
                    f"writing them ({measured.write_s * 1e3:.0f} ms)")
        return self._saver.keep(step, state, lockstep=lockstep, wait_s=min(self._saver.writer.timeout_s, KEEP_WAIT_S),
                                threads=self._resume.read_threads)  # fmt: skip

    def save(self, step: int, state: Mapping[str, Any]) -> float:
        """Stage this rank's part of the state after ``step`` and write it in the background; the stall (s).

        Not in the stall, in :attr:`waited_s` instead: waiting for the previous write and allocating the
        host buffer. Both are one-offs -- the interval keeps saves further apart than a write takes
        (:func:`elastic_ddp.memory.policy.interval`), and the buffer is kept -- so counting them as the
        cost of every save would space saves out for good after the first ones.
        """
        started = _now()
        ok = self._wait_writer()
        return self._saver.save(step, state, started=started, waited_s=_now() - started, ok=ok)

    def _wait_writer(self) -> bool:
        """Wait for the save in flight; False (the tier then stops on this rank) if it failed."""
        outcome = self._saver.wait()
        if outcome is Outcome.DONE:
            # The save is complete: its stall (not yet replaced by the next save's) and its write's times.
            self._interval.save_done(self.cost_s, self._saver.times.write_s)
        return outcome is not Outcome.FAILED

    # ---------------------------------------------------------------------------- measurements

    @property
    def cost_s(self) -> float:
        """What a save costs the training loop (:func:`elastic_ddp.memory.interval.save_cost`): its stall,
        plus what its background work takes from the steps it overlaps -- measured directly (on the CPU
        the write's CPU time, times :attr:`NodeShape.cpu_weight`; on a GPU the copies' time on the
        training stream: :attr:`NodeShape.direct_cost`) or, where larger, from the steps' times."""
        times = self._saver.times
        shape = self.shape
        direct = times.write_cpu_s * shape.cpu_weight if shape.direct_cost == "write_cpu" else times.copies_s
        return save_cost(times.stall_s, direct, self._interval.background_s)

    def report(self) -> Report:
        """This rank's share of the stop agreement (:class:`~elastic_ddp.memory.interval.Report`)."""
        return self._interval.report(failed=self._saver.local_failure is not None)

    # What run.py, the benchmarks and the tests read: the parts' numbers under the tier's names.
    interval = property(lambda self: self._interval.interval, doc="Steps between saves, as agreed.")
    interval_why = property(lambda self: self._interval.why, doc="Why :attr:`interval`, in words.")
    step_s = property(lambda self: self._interval.steps.last_s, doc="The last step's time without a save's stall.")
    background_s = property(lambda self: self._interval.background_s, doc="policy.background_cost at the last save.")
    stall_s = property(lambda self: self._saver.times.stall_s, doc="The last save's stall, without its one-off waits.")
    waited_s = property(lambda self: self._saver.times.waited_s, doc="The last save's wait (previous write, buffer).")
    write_s = property(lambda self: self._saver.times.write_s, doc="Wall time of the last finished background write.")
    write_cpu_s = property(lambda self: self._saver.times.write_cpu_s, doc="CPU time of the last finished write.")
    copies_s = property(lambda self: self._saver.times.copies_s, doc="On a GPU: the last measured copies' cost.")
    saves = property(lambda self: self._saver.saves, doc="Saves staged in this attempt.")
    skipped_saves = property(lambda self: self._saver.skipped_saves, doc="Saves every rank skipped.")
    read_threads = property(lambda self: self._resume.read_threads, doc="Threads a part's checksum uses at a restore.")
    write_threads = property(lambda self: self._saver.writer.threads, doc="Threads a part's checksum uses at a save.")

    # --------------------------------------------------------------------------------- teardown

    def close(self) -> None:
        """Wait for the save in flight and release the directory and the tier's threads (its states stay
        for a restart)."""
        if not self.enabled:
            self.store.close()  # a tier turned off at the survey holds the directory until here
            return
        self._wait_writer()
        self._saver.close()
        self.store.close()

    def remove(self) -> None:
        """After a normal end, once every local rank has closed: local rank 0 deletes the run's directory."""
        if self.enabled and self.ranks.local_rank == 0:
            self.store.remove()
