"""Fault injection for the chaos tests: make one rank fail in a chosen way at a chosen step.

``ELASTIC_DDP_FAULT="<action>@<step>[:rank=<R>][:restart=<N>]"`` -- at the start of optimizer
step ``<step>`` (1-based, the step being computed), on global rank ``R`` (default 0), in the
attempt whose ``TORCHELASTIC_RESTART_COUNT`` is ``N`` (default: every attempt), do ``<action>``:

* ``raise``: raise :class:`InjectedFault` (a Python exception in the training loop);
* ``kill``: SIGKILL this worker (a segfault, the OOM killer);
* ``hang``: sleep forever without entering the next collective (a stuck rank).

Unset (every real run): :func:`maybe_inject` is one dictionary lookup per step.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

__all__ = ["ENV_FAULT", "InjectedFault", "maybe_inject", "parse_fault"]

ENV_FAULT = "ELASTIC_DDP_FAULT"
_ACTIONS = ("raise", "kill", "hang")


class InjectedFault(RuntimeError):
    """The failure asked for by ``ELASTIC_DDP_FAULT``."""


@dataclass(frozen=True)
class Fault:
    action: str
    step: int
    rank: int = 0
    restart: int | None = None


def parse_fault(text: str) -> Fault:
    """Parse an ``ELASTIC_DDP_FAULT`` value; ``ValueError`` names what is wrong."""
    head, *options = text.strip().split(":")
    action, _, step = head.partition("@")
    if action not in _ACTIONS or not step.isdigit():
        raise ValueError(f"{ENV_FAULT}={text!r}: expected '<{'|'.join(_ACTIONS)}>@<step>[:rank=R][:restart=N]'")
    fields: dict[str, int] = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in ("rank", "restart") or not value.isdigit():
            raise ValueError(f"{ENV_FAULT}={text!r}: unknown option {option!r} (rank=R, restart=N)")
        fields[key] = int(value)
    return Fault(action, int(step), **fields)


def maybe_inject(step: int, rank: int) -> None:
    """Fail here if ``ELASTIC_DDP_FAULT`` asks for it at ``step`` on ``rank`` (see the module docstring)."""
    text = os.environ.get(ENV_FAULT)
    if not text:
        return
    fault = parse_fault(text)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if fault.step != step or fault.rank != rank or (fault.restart is not None and fault.restart != restart):
        return
    if fault.action == "raise":
        raise InjectedFault(f"injected failure at step {step} on rank {rank} ({ENV_FAULT}={text})")
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang
        time.sleep(3600)
