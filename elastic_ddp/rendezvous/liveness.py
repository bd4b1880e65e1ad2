"""Whether a node's agent process still runs, asked of the node itself instead of waiting for its lease.

A node's etcd lease tells the others it is gone only once its TTL has passed (5 s by default,
and etcd grants no TTL under ~2 s). But a node whose processes were killed on a host that still
runs -- a crashed or OOM-killed agent, a pod deleted with its container -- refuses TCP connections
at once. Each agent therefore listens on a port of its own (:class:`LivenessListener`: accept,
close, nothing else) and names it in its registration. When a round waits for the nodes of the
previous round, the node that called it *probes* those that have not come over
(:func:`probe`): a refused connection proves the agent is gone, so its registration is removed
and the round completes without waiting for the lease or the last call. A connection that
succeeds, or no answer (a host that is down or unreachable drops packets instead of refusing
them), proves nothing: the round then waits as before.

While a round trains, each member also watches one other -- the next in the round's key order, the
last watching the first -- with :class:`SuccessorWatch`: a probe every quarter second, so a
member whose agent is gone is removed within moments, and every agent restarts its workers
through the watch it already has on the round's members, whatever the workers' collectives are
doing (NCCL may wait for a dead peer until its own timeout). A ring costs each node one
connection per probe interval, whatever the job's size.
"""

from __future__ import annotations

import concurrent.futures
import errno
import selectors
import socket
import threading

__all__ = ["LivenessListener", "SuccessorWatch", "parse_address", "probe"]

# Refusals that can only come from the probed host's kernel: nothing listens on the port.
_REFUSED = {errno.ECONNREFUSED}
# Probes of one round at once: a failure leaves a handful of nodes behind, never thousands.
_MAX_PARALLEL = 32


class _Acceptor:
    """One daemon thread per process that accepts (and closes) connections for every listener in
    it: an agent has one, but a process that simulates many nodes must not need a thread each."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread: threading.Thread | None = None

    def add(self, server: socket.socket) -> None:
        with self._lock:
            self._selector.register(server, selectors.EVENT_READ)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="rdzv-liveness", daemon=True)
                self._thread.start()
        self._wake_w.send(b"x")

    def remove(self, server: socket.socket) -> None:
        with self._lock:
            self._selector.unregister(server)
        self._wake_w.send(b"x")

    def _serve(self) -> None:
        while True:
            with self._lock:
                if len(self._selector.get_map()) == 1:  # only the wake-up socket: no listener left
                    self._thread = None
                    return
            for key, _ in self._selector.select():
                if key.fileobj is self._wake_r:
                    self._wake_r.recv(4096)
                    continue
                try:
                    connection, _ = key.fileobj.accept()
                except OSError:  # closed meanwhile, or the peer gave up
                    continue
                connection.close()


_ACCEPTOR = _Acceptor()


class LivenessListener:
    """A TCP port that accepts and closes connections while this process runs (until :meth:`close`).

    Bound on every interface (IPv6 and IPv4 where the host has both) on a free port; the address
    other nodes reach it at is ``host`` (the node's advertised address) and :attr:`port`.
    """

    def __init__(self, host: str) -> None:
        if socket.has_dualstack_ipv6():
            self._socket = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128)
        else:
            self._socket = socket.create_server(("", 0), backlog=128)
        self._socket.setblocking(False)
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        self._closed = False
        _ACCEPTOR.add(self._socket)

    @property
    def address(self) -> str:
        """``host:port`` (``[host]:port`` for an IPv6 literal), as :func:`parse_address` reads it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def close(self) -> None:
        """Stop listening: from now on a probe of this node is refused. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _ACCEPTOR.remove(self._socket)
        self._socket.close()


def parse_address(text: str) -> tuple[str, int] | None:
    """``(host, port)`` from ``host:port`` or ``[v6]:port``; None for anything else."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def _refused(address: tuple[str, int], timeout: float) -> bool:
    try:
        with socket.create_connection(address, timeout=timeout):
            return False
    except OSError as exc:
        return exc.errno in _REFUSED


def probe(addresses: dict[bytes, tuple[str, int]], timeout: float) -> list[bytes]:
    """The keys of ``addresses`` whose agent is certainly gone (its port refused a connection).

    Every address is tried at once (at most 32 in parallel), each for at most ``timeout`` seconds.
    """
    if not addresses:
        return []
    workers = min(len(addresses), _MAX_PARALLEL)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="rdzv-probe") as pool:
        refused = dict(zip(addresses, pool.map(lambda a: _refused(a, timeout), addresses.values())))
    return [key for key, gone in refused.items() if gone]


class SuccessorWatch:
    """Probe ``address`` every ``interval`` s (each probe bounded by ``timeout``) on a daemon thread
    until it refuses a connection -- then call ``on_gone`` once and end -- or until :meth:`stop`."""

    def __init__(self, address: tuple[str, int], on_gone, interval: float, timeout: float, name: str) -> None:
        self.address = address
        self._on_gone = on_gone
        self._interval = interval
        self._timeout = timeout
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            if _refused(self.address, self._timeout) and not self._stopped.is_set():
                self._on_gone()
                return

    def stop(self) -> None:
        """End the watch (at once; a probe in flight finishes without effect). Idempotent."""
        self._stopped.set()
