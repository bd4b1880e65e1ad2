"""Fault injection for the tests: make one rank fail in a chosen way at a chosen step or point.

``ELASTIC_DDP_FAULT="<action>@<where>[:rank=R][:restart=N][:until=PATH]"``, several joined by ``,``:
on global rank ``R`` (default 0), in the attempt whose ``TORCHELASTIC_RESTART_COUNT`` is ``N``
(default: every attempt), at ``<where>`` do ``<action>``.

``<where>`` is either a step -- the start of optimizer step ``<step>`` (1-based, the step being
computed) -- or a named point of a checkpoint save (:data:`POINTS`): ``before_write``,
``mid_write`` (after the first bytes of a data file), ``after_write``, ``before_manifest``
(rank 0, every file durable) or ``after_manifest`` (rank 0, committed, before the clean-up).

``<action>``:

* ``raise``: raise :class:`InjectedFault` (a Python exception);
* ``kill``: SIGKILL this worker (a segfault, the OOM killer);
* ``hang``: sleep forever (a stuck rank);
* ``wait``: hold here until the file ``until=PATH`` exists (a writer delayed across a failure);
  ``until=`` is the last option and runs to the end of the fault (the path may hold ``:``).

Examples: ``raise@12:rank=1:restart=0``; ``kill@before_manifest``;
``wait@before_manifest:until=/tmp/release,hang@6:restart=0``.

The value is parsed once per process (again only if it changes); a malformed one is a
``ValueError`` naming what is wrong. Unset (every real run): one environment lookup per step or point.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

from elastic_ddp.contract import ENV_FAULT

__all__ = ["ACTIONS", "ENV_FAULT", "POINTS", "Fault", "InjectedFault", "at_point", "at_step", "parse_faults"]

ACTIONS = ("raise", "kill", "hang", "wait")
POINTS = ("before_write", "mid_write", "after_write", "before_manifest", "after_manifest")
_GRAMMAR = f"'<{'|'.join(ACTIONS)}>@<step|point>[:rank=R][:restart=N][:until=PATH]'"

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """The failure asked for by ``ELASTIC_DDP_FAULT``."""


@dataclass(frozen=True)
class Fault:
    """One parsed fault: ``at`` is a step (int) or a point name (str)."""

    action: str
    at: int | str
    rank: int = 0
    restart: int | None = None
    until: str | None = None


def _parse_one(item: str, text: str) -> Fault:
    item, has_until, until = item.strip().partition(":until=")
    head, *options = item.split(":")
    action, _, where = head.partition("@")
    if action not in ACTIONS or not (where.isdigit() or where in POINTS):
        raise ValueError(f"{ENV_FAULT}={text!r}: {head!r} is not {_GRAMMAR} (points: {', '.join(POINTS)})")
    fields: dict[str, int] = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in ("rank", "restart") or not value.isdigit():
            raise ValueError(f"{ENV_FAULT}={text!r}: unknown option {option!r} (rank=R, restart=N, until=PATH)")
        fields[key] = int(value)
    if (action == "wait") != bool(has_until and until):
        raise ValueError(f"{ENV_FAULT}={text!r}: 'wait' needs ':until=PATH', and only 'wait' takes it ({item!r})")
    return Fault(action, int(where) if where.isdigit() else where, until=until or None, **fields)


def parse_faults(text: str) -> tuple[Fault, ...]:
    """Parse an ``ELASTIC_DDP_FAULT`` value; ``ValueError`` names what is wrong."""
    return tuple(_parse_one(item, text) for item in text.split(","))


_parsed: tuple[str, tuple[Fault, ...]] = ("", ())


def _faults(text: str) -> tuple[Fault, ...]:
    global _parsed
    if _parsed[0] != text:
        _parsed = (text, parse_faults(text))
    return _parsed[1]


def at_step(step: int, rank: int) -> None:
    """Fail here if ``ELASTIC_DDP_FAULT`` asks for it at the start of ``step`` on ``rank``."""
    text = os.environ.get(ENV_FAULT)
    if text:
        _act(_faults(text), step, rank, f"step {step}", text)


def at_point(name: str, rank: int) -> None:
    """Fail or wait here if ``ELASTIC_DDP_FAULT`` asks for it at the point ``name`` on ``rank``."""
    text = os.environ.get(ENV_FAULT)
    if text:
        _act(_faults(text), name, rank, name, text)


def _act(faults: tuple[Fault, ...], at: int | str, rank: int, where: str, text: str) -> None:
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for fault in faults:
        if fault.at != at or fault.rank != rank or (fault.restart is not None and fault.restart != restart):
            continue
        if fault.action == "raise":
            raise InjectedFault(f"injected failure at {where} on rank {rank} ({ENV_FAULT}={text})")
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.action == "wait":
            if not os.path.exists(fault.until):
                what = "step" if isinstance(at, int) else "save"
                log.warning("Fault at %s on rank %d: holding this %s until %s exists.", where, rank, what, fault.until)
                while not os.path.exists(fault.until):
                    time.sleep(0.05)
            continue
        while True:  # hang
            time.sleep(3600)
