"""The memory tier's two decisions, as pure functions that also say why.

* :func:`interval` -- how often to save into node memory so that the measured cost of a save stays
  within the budget (``checkpoint.memory_overhead`` of the step time, aiming at ``AIM`` of it, for
  the measurement's noise), and no more often than its
  background write can keep up with: every step when both fit.
* :func:`background_cost` -- what a save's background work (its write, on GPUs its copies) takes
  from the steps it overlaps, measured from the step times of one run: the steps a save's write
  touches against the steps it does not, interleaved within seconds of each other.
* :func:`choose_resume` -- where a (re)starting job resumes from: the newest state available
  anywhere (any surviving node's memory, or the durable checkpoint), preferring memory on a tie
  because reading node memory is far faster than object storage -- and, when some state in node
  memory lets every rank restore its own per-rank values (BatchNorm statistics and the like, see
  elastic_ddp/checkpoint/divergence.py), the newest such state over a newer one that does not.

No I/O and no clock here: the callers measure and the tests move the numbers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Candidate", "Choice", "background_cost", "choose_resume", "interval"]

# Never wait longer than this many steps between memory saves, whatever the measurements say: a
# budget that asks for more means the tier is too slow to be worth it, and the durable tier rules.
MAX_INTERVAL = 1000
# The budget is a ceiling, and a save's measured cost moves between runs of the same job (by ~15 %
# on the CPU benchmark; docs/memory-tier.md, "Measured here"): aiming at the budget itself would land
# above it as often as below. The interval aims at this share of it.
AIM = 0.8


def interval(
    cost_s: float, step_s: float, budget: float, write_s: float = 0.0, told: bool = True
) -> tuple[int, str]:
    """Steps between memory saves so that ``cost_s / steps <= AIM * budget * step_s``, and why.

    ``cost_s``: the training time one memory save takes (its stall, and what its background write
    takes from training); ``step_s``: the time of a step without a save; ``budget``: the allowed
    fraction of step time (e.g. 0.02); ``write_s``: how long a save's background write takes from
    its start to its commit. Never fewer steps than the write takes: a save that found the previous
    write still running would wait for it. 1 when it fits every step (or nothing was measured yet),
    unless not ``told``: while the step times cannot yet tell what a save's background work costs
    (:func:`background_cost`), every 2nd step -- saving every step leaves no step between saves to
    weigh it against.
    """
    if budget <= 0:
        raise ValueError(f"The memory tier's overhead budget ({budget}) must be positive.")
    steps, why = _within_budget(cost_s, step_s, budget, write_s)
    if steps == 1 and not told:
        return 2, why + "; every 2 steps until the steps between saves tell what the background work costs"
    return steps, why


def _within_budget(cost_s: float, step_s: float, budget: float, write_s: float) -> tuple[int, str]:
    if cost_s <= 0 or step_s <= 0:
        return 1, "no measurement yet: every step"
    by_cost = max(1, math.ceil(cost_s / (AIM * budget * step_s)))
    by_write = max(1, math.ceil(write_s / step_s))
    steps = max(by_cost, by_write)
    why = (f"a save costs {cost_s * 1e3:.1f} ms, a step takes {step_s * 1e3:.1f} ms, budget {budget:.1%} "
           f"(aiming at {AIM * budget:.1%})")  # fmt: skip
    if by_write > by_cost:
        why += f", and its background write takes {write_s * 1e3:.0f} ms"
    if steps > MAX_INTERVAL:
        return MAX_INTERVAL, why + f": capped at every {MAX_INTERVAL} steps"
    return steps, why + (": every step" if steps == 1 else f": every {steps} steps")


# What background_cost needs before it answers: enough saves that one slow step does not move a
# phase's median, and enough untouched steps to say what a step takes without a save.
MIN_SAVES = 16
MIN_UNTOUCHED = 32


def background_cost(steps: Sequence[tuple[int, float]], touched: int) -> float | None:
    """The step time a save's background work adds, per save, from ``(phase, step time)`` samples.

    ``phase`` counts the steps since the last save (1: the step right after it, while its write
    starts; the save's own step has the largest phase of its round), each step time without a
    save's stall. The first ``touched`` phases overlap the write; the others are the run without the
    tier, at the same time on the same host -- so what the direct measures cannot see (caches and
    memory bandwidth the write shares with the step, a rank waiting for a slower one) is counted,
    and a host that drifts by more than the budget between runs does not matter. The cost: the sum
    over the touched phases of their median step time minus the untouched steps' median. ``None``
    when it cannot be told: fewer than ``MIN_SAVES`` samples of a touched phase or ``MIN_UNTOUCHED``
    untouched steps (saves every step, or writes as long as the interval).
    """
    touched = max(1, touched)
    by_phase: dict[int, list[float]] = {}
    for phase, seconds in steps:
        by_phase.setdefault(phase, []).append(seconds)
    untouched = [s for phase, times in by_phase.items() if phase > touched for s in times]
    if len(untouched) < MIN_UNTOUCHED or any(len(by_phase.get(p, ())) < MIN_SAVES for p in range(1, touched + 1)):
        return None
    clean = statistics.median(untouched)
    return sum(statistics.median(by_phase[p]) - clean for p in range(1, touched + 1))


@dataclass(frozen=True)
class Candidate:
    """A complete state of ``step`` in node ``node``'s memory. ``exact``: every rank of this start
    holds its own part of it (same rank, same world size), so each restores its own per-rank values;
    a state without per-rank values is always exact."""

    node: int
    step: int
    exact: bool = True


@dataclass(frozen=True)
class Choice:
    """Where to resume from: ``tier`` is ``"memory"`` (from ``node``), ``"durable"`` or ``"none"``."""

    tier: str
    step: int
    node: int = -1
    why: str = ""


def choose_resume(memory: Sequence[Candidate], durable_step: int | None) -> Choice:
    """The newest state available anywhere; memory wins a tie (it is read locally, at memory speed).

    When some state in node memory is ``exact``, only exact ones compete with the durable checkpoint:
    at the world size they were saved at, every rank then gets its own per-rank values back, for at
    most one memory save more redone (a rank killed while writing the newest one leaves the previous
    one complete everywhere). Among nodes holding the same step, the lowest node id serves it, so
    every rank that evaluates this with the same inputs picks the same source.
    """
    newest = max((c.step for c in memory), default=None)
    if any(c.exact for c in memory):
        memory = [c for c in memory if c.exact]
    best = max(memory, key=lambda c: (c.step, -c.node), default=None)
    if best is not None and (durable_step is None or best.step >= durable_step):
        holders = sorted({c.node for c in memory if c.step == best.step})
        older = (f"; step {newest} is newer, but not every rank holds its own part of it, and step {best.step} "
                 "gives every rank its own per-rank values back") if newest is not None and newest > best.step else ""  # fmt: skip
        return Choice(
            "memory", best.step, best.node,
            f"node memory holds step {best.step} (nodes {holders}); the newest durable checkpoint is "
            + ("none" if durable_step is None else f"step {durable_step}") + older,
        )  # fmt: skip
    if durable_step is not None:
        newest_memory = "none" if best is None else f"step {best.step}"
        return Choice("durable", durable_step, why=f"the durable checkpoint of step {durable_step} is newer than node memory ({newest_memory})")
    return Choice("none", 0, why="no state in node memory and no durable checkpoint")
