"""Facts about processes: when one started (Linux ``/proc``), and which is this worker's agent."""

from __future__ import annotations

import os

__all__ = ["adopt_agent", "agent_pid", "marks_a_live_process", "process_mark", "start_ticks"]

# Set in a worker forked from its node's template (elastic_ddp.prestart), whose parent is the template.
_ADOPTED_AGENT: int | None = None


def adopt_agent(pid: int) -> None:
    """In a worker forked from the node's template: its torchrun agent is ``pid``, not its parent."""
    global _ADOPTED_AGENT
    _ADOPTED_AGENT = pid


def agent_pid() -> int:
    """The torchrun agent that started this worker: its parent, unless the worker was forked from the
    node's template (:func:`adopt_agent`). In a process of the worker's own it is that process's parent."""
    return _ADOPTED_AGENT if _ADOPTED_AGENT is not None else os.getppid()


def start_ticks(pid: int | str = "self") -> int | None:
    """When process ``pid`` started, in clock ticks since boot; None when it is gone or unknown.

    With the pid it names a process uniquely (a reused pid has another start time); against
    ``/proc/uptime`` it gives a process's age.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # Field 22 of stat(5); the fields after the command name, which may hold spaces and ")".
            return int(stat.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_mark(pid: int) -> str | None:
    """``<pid>-<start time>`` of a live process, None when it is gone or unknown: the start time
    tells a reused pid from the process that had it."""
    started = start_ticks(pid)
    return None if started is None else f"{pid}-{started}"


def marks_a_live_process(mark: str) -> bool:
    """Whether the process a :func:`process_mark` names still runs (False for anything else)."""
    pid = mark.split("-", 1)[0]
    return pid.isdigit() and process_mark(int(pid)) == mark
