"""The memory tier's two decisions, as pure functions that also say why.

* :func:`interval` -- how often to save into node memory so that the measured cost of a save stays
  within the budget (``checkpoint.memory_overhead`` of the step time), and no more often than its
  background write can keep up with: every step when both fit.
* :func:`choose_resume` -- where a (re)starting job resumes from: the newest state available
  anywhere (any surviving node's memory, or the durable checkpoint), preferring memory on a tie
  because reading node memory is far faster than object storage.

No I/O and no clock here: the callers measure and the tests move the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Candidate", "Choice", "choose_resume", "interval"]

# Never wait longer than this many steps between memory saves, whatever the measurements say: a
# budget that asks for more means the tier is too slow to be worth it, and the durable tier rules.
MAX_INTERVAL = 1000


def interval(cost_s: float, step_s: float, budget: float, write_s: float = 0.0) -> tuple[int, str]:
    """Steps between memory saves so that ``cost_s / steps <= budget * step_s``, and why.

    ``cost_s``: the training time one memory save takes (its stall, and what its background write
    takes from training); ``step_s``: the time of a step without a save; ``budget``: the allowed
    fraction of step time (e.g. 0.02); ``write_s``: how long a save's background write takes from
    its start to its commit. Never fewer steps than the write takes: a save that found the previous
    write still running would wait for it. 1 when it fits every step (or nothing was measured yet).
    """
    if budget <= 0:
        raise ValueError(f"The memory tier's overhead budget ({budget}) must be positive.")
    if cost_s <= 0 or step_s <= 0:
        return 1, "no measurement yet: every step"
    by_cost = max(1, math.ceil(cost_s / (budget * step_s)))
    by_write = max(1, math.ceil(write_s / step_s))
    steps = max(by_cost, by_write)
    why = f"a save costs {cost_s * 1e3:.1f} ms, a step takes {step_s * 1e3:.1f} ms, budget {budget:.1%}"
    if by_write > by_cost:
        why += f", and its background write takes {write_s * 1e3:.0f} ms"
    if steps > MAX_INTERVAL:
        return MAX_INTERVAL, why + f": capped at every {MAX_INTERVAL} steps"
    return steps, why + (": every step" if steps == 1 else f": every {steps} steps")


@dataclass(frozen=True)
class Candidate:
    """A committed state a rank can offer: its ``step`` in node ``node``'s memory."""

    node: int
    step: int


@dataclass(frozen=True)
class Choice:
    """Where to resume from: ``tier`` is ``"memory"`` (from ``node``), ``"durable"`` or ``"none"``."""

    tier: str
    step: int
    node: int = -1
    why: str = ""


def choose_resume(memory: Sequence[Candidate], durable_step: int | None) -> Choice:
    """The newest state available anywhere; memory wins a tie (it is read locally, at memory speed).

    Among nodes holding the same newest step, the lowest node id serves it, so every rank that
    evaluates this with the same inputs picks the same source.
    """
    best = max(memory, key=lambda c: (c.step, -c.node), default=None)
    if best is not None and (durable_step is None or best.step >= durable_step):
        holders = sorted({c.node for c in memory if c.step == best.step})
        return Choice(
            "memory", best.step, best.node,
            f"node memory holds step {best.step} (nodes {holders}); the newest durable checkpoint is "
            + ("none" if durable_step is None else f"step {durable_step}"),
        )  # fmt: skip
    if durable_step is not None:
        newest_memory = "none" if best is None else f"step {best.step}"
        return Choice("durable", durable_step, why=f"the durable checkpoint of step {durable_step} is newer than node memory ({newest_memory})")
    return Choice("none", 0, why="no state in node memory and no durable checkpoint")
