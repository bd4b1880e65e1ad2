"""Agent side of a node that is going away saying so the moment its stop checkpoint is committed.

A preempted node (its torchrun agent got SIGTERM) stops at an agreed step with every other node, and
then only leaves; the survivors, waiting for their restart, start their next round once its agent
has left the rendezvous. torch's agent leaves only after its workers are gone and it has unwound --
0.3-0.5 s after the commit here, more on a host with big workers -- and every rank of the job waits
that long. So a worker whose stop came from outside (not from its agent restarting it for a
membership change) tells its agent as soon as the stop checkpoint is committed
(:func:`elastic_ddp.agent_marks.report_leaving`), and the agent's rendezvous handler leaves the round then
(:class:`LeavingListener`), while its workers are still on their way out.

The channel is a Unix datagram socket in the agent's directory (``ELASTIC_DDP_SETTINGS_ERROR_DIR``,
where workers already report invalid settings): one datagram per worker, no connection, nothing
written when nobody listens.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from elastic_ddp.contract import LEAVING_SOCKET, MAX_LEAVING_MESSAGE

__all__ = ["LeavingListener"]

log = logging.getLogger(__name__)


class LeavingListener:
    """A thread that calls ``on_leaving(why)`` for each worker's :func:`~elastic_ddp.agent_marks.report_leaving`
    (the callback makes repeats harmless: every worker of the node reports)."""

    def __init__(self, directory: str, on_leaving: Callable[[str], None]) -> None:
        self._path = Path(directory, LEAVING_SOCKET)
        self._on_leaving = on_leaving
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(str(self._path))
        except OSError:
            self._sock.close()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="rdzv-leaving", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                message = self._sock.recv(MAX_LEAVING_MESSAGE)
            except OSError:
                return
            if self._closed:
                return
            try:
                self._on_leaving(message.decode("utf-8", errors="replace"))
            except Exception:  # noqa: BLE001 - the agent leaves at its exit anyway; the thread must not die
                log.exception("Could not leave the rendezvous early.")

    def close(self) -> None:
        """Stop listening; the thread ends (it is woken by a datagram of its own)."""
        if self._closed:
            return
        self._closed = True
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as waker:
                waker.sendto(b"", str(self._path))
        except OSError:
            pass
        self._thread.join(timeout=5.0)
        self._sock.close()
        self._path.unlink(missing_ok=True)
