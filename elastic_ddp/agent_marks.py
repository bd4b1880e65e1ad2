"""The agent directory's marks: how a torchrun agent and its workers tell each other why a worker stops.

Files and a socket in the directory the agent exports to its workers (``contract.ENV_SETTINGS_ERROR_DIR``):
a worker reports invalid settings (the agent then ends the job on every node instead of restarting
it) and that its node leaves; the agent marks, before it signals its workers, that nodes of their
round are gone or that a node waits to join. Both sides import this module -- the agent's rendezvous
handler and the worker's stop handling -- so it holds no torch and nothing of either side.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from elastic_ddp.contract import (
    ENV_AGENT_PID, ENV_SETTINGS_ERROR_DIR, LEAVING_SOCKET, MAX_LEAVING_MESSAGE, MEMBERS_GONE_FILE, NODES_JOINING_FILE,
    SETTINGS_ERROR_FILE,
)  # fmt: skip
from elastic_ddp.processes import agent_pid

__all__ = [
    "clear_restart_marks", "members_gone", "nodes_joining", "read_settings_error", "report_leaving",
    "report_members_gone", "report_nodes_joining", "report_settings_error",
]  # fmt: skip


def report_settings_error(message: str) -> bool:
    """Tell this worker's torchrun agent that its settings are invalid; True if there is one to tell.

    Only a worker started by an agent with this package's rendezvous handler has one (the
    handler exports :data:`ENV_SETTINGS_ERROR_DIR` and :data:`ENV_AGENT_PID`); a process that merely
    inherited them (a subprocess of a worker) has another parent and reports nothing. The agent
    then ends the job on every node instead of restarting workers whose settings cannot change.
    """
    directory = _agents_directory()
    return bool(directory) and _write_whole(directory, SETTINGS_ERROR_FILE, message)


def report_leaving(why: str) -> bool:
    """Tell this worker's agent that the node leaves the job (``why``: stopped from outside, a
    preemption), its stop checkpoint committed, so that it leaves the rendezvous now rather than
    once its workers are gone; True if the agent's handler listens. Best effort, never blocking."""
    directory = _agents_directory()
    if not directory:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)  # a full queue must not hold up the worker's exit
            sock.sendto(why.encode("utf-8")[:MAX_LEAVING_MESSAGE], str(Path(directory, LEAVING_SOCKET)))
    except OSError:
        return False
    return True


def _agents_directory() -> str:
    """The directory this worker's agent exported to it (:data:`ENV_SETTINGS_ERROR_DIR`); "" when
    there is none, or when this process only inherited it (a subprocess of a worker: its parent is
    not the agent named by :data:`ENV_AGENT_PID`)."""
    directory = os.environ.get(ENV_SETTINGS_ERROR_DIR, "")
    if not directory or os.environ.get(ENV_AGENT_PID, "") != str(agent_pid()):
        return ""
    return directory


def read_settings_error(directory: str) -> str | None:
    """The message a worker reported into ``directory`` (:func:`report_settings_error`); None: none."""
    return _read(directory, SETTINGS_ERROR_FILE)


def report_members_gone(directory: str, why: str) -> None:
    """Agent side: the workers are about to be stopped because ``why`` (nodes of their round are
    gone); written whole before the signal (see :class:`StopSignal`). Best effort."""
    if directory:
        _write_whole(directory, MEMBERS_GONE_FILE, why)


def members_gone(directory: str) -> str | None:
    """Worker side: why the agent stops the workers, when nodes of their round are gone; else None."""
    return _read(directory, MEMBERS_GONE_FILE)


def report_nodes_joining(directory: str, why: str) -> None:
    """Agent side: the workers are about to be stopped only because ``why`` (a node is waiting to
    join; every member of their round stays); written whole before the signal. Best effort: without
    it the stop is committed to the durable tier."""
    if directory:
        _write_whole(directory, NODES_JOINING_FILE, why)


def nodes_joining(directory: str) -> str | None:
    """Worker side: why the agent stops the workers, when only to admit a joining node; else None."""
    return _read(directory, NODES_JOINING_FILE)


def clear_restart_marks(directory: str) -> None:
    """Agent side, before a new round: its workers start in a group of live nodes, with nothing pending."""
    if directory:
        for name in (MEMBERS_GONE_FILE, NODES_JOINING_FILE):
            Path(directory, name).unlink(missing_ok=True)


def _write_whole(directory: str, name: str, text: str) -> bool:
    """Write ``text`` to ``directory/name`` whole or not at all (the other side may read it at any
    moment); False if it could not be written."""
    path = Path(directory) / name
    partial = path.with_name(f".{name}.{os.getpid()}")
    try:
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    except OSError:
        return False
    return True


def _read(directory: str, name: str) -> str | None:
    """The text of ``directory/name``; None when there is none (or no directory)."""
    if not directory:
        return None
    try:
        return (Path(directory) / name).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
