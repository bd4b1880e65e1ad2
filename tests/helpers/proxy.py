"""A TCP proxy in front of a server (etcd in the tests) whose subclasses decide what gets through.

Each accepted connection is paired with one to ``upstream`` and pumped both ways by two threads;
:meth:`TcpProxy.forward` sees every chunk and says whether to pass it, and whether the connection
ends after it. A test's proxy misbehaves the way a network or a member can without saying so.
"""

from __future__ import annotations

import socket
import threading

__all__ = ["TcpProxy"]


class TcpProxy:
    """Listens on 127.0.0.1:``port`` and forwards to ``upstream`` as :meth:`forward` decides."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def forward(self, data: bytes, to_server: bool, target: socket.socket) -> bool:
        """Pass ``data`` on to ``target`` (or not); return False to end this connection after it."""
        target.sendall(data)
        return True

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, to_server: bool) -> None:
        try:
            while data := source.recv(65536):
                if not self.forward(data, to_server, target):
                    break
        except OSError:
            pass
        for sock in (source, target):
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            try:
                sock.close()
            except OSError:
                pass
