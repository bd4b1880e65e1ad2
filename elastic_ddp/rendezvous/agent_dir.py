"""The agent's directory: where its workers reach it (a settings error, the marks of why they are
stopped, the socket on which they say the node leaves, the template's socket).

One per torchrun agent, in the temp directory -- or in /tmp where the temp directory's path is too
long for the sockets in it (a Unix socket's path holds at most 107 bytes: a Slurm job's or a test
harness's deep TMPDIR would fail the template's bind and lose warm starts); the handler removes its
own when it leaves. An agent
killed outright (SIGKILL, the OOM killer, a node's processes killed by hand) cannot, and on a host
that outlives it (bare metal, a Slurm node) its directory would stay for good: so each new one
removes those of agents that are gone first, told apart by the owner mark each directory holds:
the agent's host, PID namespace, pid and start time (a reused pid does not pass for the agent,
and a temp directory shared by several hosts or containers keeps the others' directories, whose
pids mean nothing here).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile

from elastic_ddp.contract import AGENT_DIR_PREFIX as PREFIX
from elastic_ddp.contract import OWNER_FILE, PRESTART_SOCKET
from elastic_ddp.processes import marks_a_live_process, process_mark

__all__ = ["PREFIX", "agent_dir_parents", "create_agent_dir", "remove_dirs_of_gone_agents"]

log = logging.getLogger(__name__)

# The longest path of a socket in an agent directory: <parent>/<PREFIX><8 random characters>/ and the
# template's staging name, PRESTART_SOCKET.<pid> (Linux pids have at most 7 digits); AF_UNIX's
# sun_path holds 107 bytes and a NUL.
_LONGEST_SOCKET = len(f"/{PREFIX}xxxxxxxx/{PRESTART_SOCKET}.4194304")
_MAX_SOCKET_PATH = 107
_SHORT_PARENT = "/tmp"


def agent_dir_parents() -> list[str]:
    """Where agent directories go, first choice first: the temp directory, and /tmp when the temp
    directory's path leaves no room for the sockets (see the module docstring)."""
    parent = tempfile.gettempdir()
    if len(parent) + _LONGEST_SOCKET <= _MAX_SOCKET_PATH or os.path.realpath(parent) == _SHORT_PARENT:
        return [parent]
    return [_SHORT_PARENT, parent]


def create_agent_dir() -> str:
    """A new directory for this agent, marked as its own, after removing those of agents that are gone.

    Raises:
        OSError: the directory could not be created or marked (none is left behind).
    """
    parents = agent_dir_parents()
    for parent in parents:
        remove_dirs_of_gone_agents(parent)
    if len(parents) > 1:
        log.info("The temp directory %s is too long a path for the agent's sockets; its directory goes in %s.",
                 parents[1], parents[0])  # fmt: skip
    path = tempfile.mkdtemp(prefix=PREFIX, dir=parents[0])
    mark = process_mark(os.getpid())
    try:
        if mark is None:
            raise OSError(f"the start time of process {os.getpid()} is unknown (no /proc)")
        # Written beside and renamed into place: a sweep never reads half a mark as another's.
        with open(os.path.join(path, f".{OWNER_FILE}"), "w", encoding="utf-8") as file:
            file.write(f"{_where()}\n{mark}")
        os.replace(os.path.join(path, f".{OWNER_FILE}"), os.path.join(path, OWNER_FILE))
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def remove_dirs_of_gone_agents(parent: str | None = None) -> int:
    """Remove the agent directories in ``parent`` (the temp directory) that belong to this user and
    whose agent no longer runs; the number removed.

    A directory without a mark is left alone (it is being created, or older than the marks), and
    so is one marked on another host or in another PID namespace (its agent's liveness cannot be
    told from here).
    """
    parent = parent or tempfile.gettempdir()
    uid = os.getuid()
    here = _where()
    removed = 0
    try:
        entries = list(os.scandir(parent))
    except OSError as exc:
        log.debug("Cannot list %s for agent directories left behind (%s).", parent, exc)
        return 0
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            with open(os.path.join(entry.path, OWNER_FILE), encoding="utf-8") as file:
                where, _, mark = file.read().partition("\n")
        except (OSError, UnicodeDecodeError):
            continue
        if where != here or marks_a_live_process(mark):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed += not os.path.exists(entry.path)
    if removed:
        log.info("Removed %d directory(ies) of torchrun agents that are gone from %s.", removed, parent)
    return removed


def _where() -> str:
    """This host and PID namespace: where a pid names one process."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = "-"
    return f"{socket.gethostname()} {namespace}"
