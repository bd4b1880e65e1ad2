"""Keeping etcd leases alive: :class:`LeaseKeepAlive`, the one lease keeper of this package.

A renewal is handled by the etcd leader in memory -- no raft entry, no disk write -- so keeping a
lease alive costs etcd one small message per period.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import grpc
from etcd3 import etcdrpc

from elastic_ddp.etcd.client import EtcdClient
from elastic_ddp.etcd.errors import EtcdError

__all__ = ["LeaseKeepAlive"]

log = logging.getLogger(__name__)


class LeaseKeepAlive:
    """Keeps leases alive from one daemon thread over one gRPC stream; an expired lease is reported.

    Each lease is renewed every ``every`` seconds. All renewals of this object share one
    long-lived ``LeaseKeepAlive`` stream (a call per renewal would cost a new stream and a gRPC
    thread each time); a renewal whose answer takes longer than ``deadline`` has its stream
    cancelled by a watchdog and the next member is tried. A failed renewal is retried at the next
    period (the lease's TTL leaves room for a few); ``on_expired`` is called once when etcd
    answers that the lease is gone, and the lease is no longer renewed.
    """

    def __init__(self, client: EtcdClient, deadline: float, name: str = "etcd-keep-alive") -> None:
        if deadline <= 0:
            raise ValueError(f"The keep-alive request deadline ({deadline}) must be a positive number of seconds.")
        self._client = client
        self._deadline = float(deadline)
        self._name = name
        self._lock = threading.Condition()
        self._leases: dict[int, tuple[float, float, Callable[[int], None] | None]] = {}  # id -> (every, due, cb)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._failing_since: float | None = None
        self._requests: queue.Queue | None = None
        self._responses = None

    def add(self, lease_id: int, every: float, on_expired: Callable[[int], None] | None = None) -> None:
        """Renew ``lease_id`` every ``every`` seconds from now on (replacing an earlier :meth:`add`).

        ``on_expired`` runs on the keep-alive thread: it must be quick and must not call etcd.
        """
        if every <= 0:
            raise ValueError(f"The keep-alive period ({every}) must be a positive number of seconds.")
        with self._lock:
            if self._closed:
                raise RuntimeError("The lease keep-alive is closed.")
            self._leases[lease_id] = (float(every), time.monotonic() + every, on_expired)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def remove(self, lease_id: int) -> None:
        with self._lock:
            self._leases.pop(lease_id, None)

    def close(self) -> None:
        """Stop renewing and end the thread (a renewal in flight ends within ``deadline``); the
        leases themselves are the caller's to revoke."""
        with self._lock:
            self._closed = True
            self._leases.clear()
            self._lock.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # The watchdog cancels a renewal stuck past its deadline (checked every 0.25 s).
            thread.join(self._deadline + 1.0)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed:
                    now = time.monotonic()
                    due = [(lease_id, entry) for lease_id, entry in self._leases.items() if entry[1] <= now]
                    if due:
                        break
                    wake = min((entry[1] for entry in self._leases.values()), default=now + 3600)
                    self._lock.wait(wake - now)
                if self._closed:
                    self._close_stream()
                    return
                for lease_id, (every, _, callback) in due:
                    self._leases[lease_id] = (every, now + every, callback)
            for lease_id, (_, _, callback) in due:
                self._renew(lease_id, callback)

    def _renew(self, lease_id: int, callback: Callable[[int], None] | None) -> None:
        try:
            ttl = self._client.request(lambda: self._exchange(lease_id))
        except Exception as exc:  # noqa: BLE001 - see below
            self._close_stream()
            if self._failing_since is None:
                self._failing_since = time.monotonic()
                # etcd may be briefly unreachable (failover, restart, election); the next period
                # retries and the TTL leaves room for that, so warn once and carry on. Anything
                # else is logged too but must not end the thread: a node whose renewals stopped
                # would silently drop out of its job.
                log.warning("Renewing etcd lease %x failed (%s); retrying every period.", lease_id, exc,
                            exc_info=not isinstance(exc, EtcdError))  # fmt: skip
            return
        if self._failing_since is not None:
            log.warning("etcd lease renewals work again after %.1f s.", time.monotonic() - self._failing_since)
            self._failing_since = None
        if ttl <= 0:
            with self._lock:
                self._leases.pop(lease_id, None)
            if callback is not None:
                try:
                    callback(lease_id)
                except Exception:  # an owner's bug must not stop the renewal of every other lease
                    log.exception("An etcd lease expiry callback failed.")

    def _exchange(self, lease_id: int) -> int:
        """One renewal on the stream (opened on the client's current member if needed): its TTL."""
        if self._responses is None:
            self._requests = queue.Queue()
            self._responses = self._client.open_keep_alive(iter(self._requests.get, None))
        responses = self._responses
        self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
        expired = _WATCHDOG.arm(responses, self._deadline)
        try:
            response = next(responses)
        except StopIteration:
            self._close_stream()
            raise self._client.connection_error("closed the lease keep-alive stream") from None
        except grpc.RpcError:
            self._close_stream()
            if expired.is_set():
                self._client.fail_endpoint()  # the next attempt goes to another member
                raise self._client.connection_error(f"did not renew a lease within {self._deadline:g} s") from None
            raise  # mapped (and retried on the next member when unavailable) by EtcdClient.request
        finally:
            _WATCHDOG.disarm(responses)
        return int(response.TTL)

    def _close_stream(self) -> None:
        requests, responses = self._requests, self._responses
        self._requests = self._responses = None
        if requests is not None:
            requests.put(None)
        if responses is not None:
            responses.cancel()


class _Watchdog:
    """Cancels gRPC stream calls that have waited past their deadline (one thread per process,
    however many keep-alive streams there are)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[object, float, threading.Event]] = {}
        self._thread: threading.Thread | None = None

    def arm(self, call, seconds: float) -> threading.Event:
        """Cancel ``call`` unless :meth:`disarm` comes within ``seconds``; the event is set if it did."""
        expired = threading.Event()
        with self._lock:
            self._armed[id(call)] = (call, time.monotonic() + seconds, expired)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="etcd-deadline-watchdog", daemon=True)
                self._thread.start()
        return expired

    def disarm(self, call) -> None:
        with self._lock:
            self._armed.pop(id(call), None)

    def _run(self) -> None:
        while True:
            time.sleep(0.25)
            now = time.monotonic()
            with self._lock:
                late = [(key, entry) for key, entry in self._armed.items() if entry[1] <= now]
                for key, _ in late:
                    del self._armed[key]
            for _, (call, _, expired) in late:
                expired.set()
                call.cancel()


_WATCHDOG = _Watchdog()
