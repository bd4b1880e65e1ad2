"""The template's wire format: length-prefixed JSON messages, file descriptors passed beside them.

Standard library only: the worker side (``shim/sitecustomize.py``) loads this file by its path
before any package is imported, so that a worker that starts as usual has paid for nothing.
"""

from __future__ import annotations

import json
import os
import socket
import struct

__all__ = ["read_message", "send_message"]

_HEADER = struct.Struct("!I")
_MAX_MESSAGE = 16 << 20


def send_message(conn: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    """One length-prefixed JSON message, with ``fds`` passed along (SCM_RIGHTS)."""
    data = json.dumps(message).encode()
    payload = _HEADER.pack(len(data)) + data
    sent = 0
    if fds:
        sent = conn.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
    conn.sendall(payload[sent:])


def read_message(conn: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """The next message and the fds that came with it; ``(None, [])`` at end of stream."""
    fds: list[int] = []
    buffer = b""
    need = _HEADER.size
    length = None
    while True:
        if max_fds and not fds:
            space = socket.CMSG_SPACE(max_fds * struct.calcsize("i"))
            chunk, ancillary, _, _ = conn.recvmsg(need - len(buffer), space)
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    count = len(data) // struct.calcsize("i")
                    fds += list(struct.unpack(f"{count}i", data[: count * struct.calcsize("i")]))
        else:
            chunk = conn.recv(need - len(buffer))
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None, []
        buffer += chunk
        if len(buffer) < need:
            continue
        if length is None:
            (length,) = _HEADER.unpack(buffer)
            if length > _MAX_MESSAGE:
                raise ValueError(f"A prestart message of {length} bytes is too large.")
            buffer, need = b"", length
            if length == 0:
                return {}, fds
            continue
        return json.loads(buffer), fds
