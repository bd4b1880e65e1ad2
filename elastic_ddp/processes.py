"""Facts about processes from Linux ``/proc``: when a process started."""

from __future__ import annotations

__all__ = ["start_ticks"]


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
