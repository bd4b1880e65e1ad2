"""Where this package's log records go: stderr, one line each, tagged with the process's role.

The library logs through ``logging.getLogger(__name__)`` everywhere and configures nothing on
import. Processes this package owns call :func:`configure_logging` once: the recipe's workers
(tagged ``rank N``) and the torchrun agent through the rendezvous plugin (tagged ``agent``), so
membership changes, fallbacks and failed saves are visible in every node's log.
``ELASTIC_DDP_LOG_LEVEL`` (default ``INFO``) sets the level.
"""

from __future__ import annotations

import logging
import os
import sys

from elastic_ddp.contract import ENV_LOG_LEVEL

__all__ = ["ENV_LOG_LEVEL", "configure_logging"]


def configure_logging(tag: str) -> logging.Logger:
    """Send the ``elastic_ddp`` loggers' records to stderr as ``[elastic_ddp tag] TIME LEVEL message``.

    Idempotent: a second call only updates the tag. An invalid level names the variable.
    """
    level_name = os.environ.get(ENV_LOG_LEVEL, "INFO").strip().upper()
    level = logging.getLevelName(level_name)
    if not isinstance(level, int):
        raise ValueError(f"{ENV_LOG_LEVEL}={level_name!r} is not a logging level (DEBUG, INFO, WARNING, ERROR).")
    logger = logging.getLogger("elastic_ddp")
    formatter = logging.Formatter(f"[elastic_ddp {tag}] %(asctime)s %(levelname)s %(message)s")
    handler = next((h for h in logger.handlers if getattr(h, "_elastic_ddp", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler._elastic_ddp = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    handler.setFormatter(formatter)
    logger.setLevel(level)
    logger.propagate = False
    return logger
