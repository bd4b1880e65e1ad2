"""Test-only fault injection at named points of a checkpoint save.

``ELASTIC_DDP_CHECKPOINT_FAULT_POINT="POINT:RANK"`` makes that rank SIGKILL itself at POINT;
``"POINT:RANK:wait=PATH"`` holds it there until PATH exists (a writer delayed across a failure).
Points: ``before_write``, ``mid_write`` (after the first bytes of a data file), ``after_write``,
``before_manifest`` (rank 0, every file durable), ``after_manifest`` (rank 0, committed, before the
clean-up). Unset in normal runs: one environment lookup per point.
"""

from __future__ import annotations

import logging
import os
import signal
import time

ENV_FAULT_POINT = "ELASTIC_DDP_CHECKPOINT_FAULT_POINT"

log = logging.getLogger(__name__)


def fault_point(name: str, rank: int) -> None:
    """Act on :data:`ENV_FAULT_POINT` if it names ``name`` for ``rank``."""
    text = os.environ.get(ENV_FAULT_POINT)
    if not text:
        return
    point, _, wait = text.partition(":wait=")
    if point != f"{name}:{rank}":
        return
    if not wait:
        os.kill(os.getpid(), signal.SIGKILL)
    if not os.path.exists(wait):
        log.warning("Fault point %s: holding this save until %s exists.", point, wait)
        while not os.path.exists(wait):
            time.sleep(0.05)
