"""Watching etcd keys: :class:`WatchStream`, the one watch mechanism of this package.

Every watch of one stream object shares one gRPC stream, resumed from the last revision seen
after a failure; a wait for one change (:meth:`WatchStream.wait_for_change`) is a watch of the
same stream that ends with its wait.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2

from elastic_ddp.etcd.client import EtcdClient
from elastic_ddp.etcd.errors import EtcdError, Fault, classify, describe
from elastic_ddp.etcd.ops import KeyValue, key_value, prefix_end, to_bytes

__all__ = ["Watch", "WatchEvent", "WatchStream"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch: ``kind`` is ``"put"`` or ``"delete"``; ``prev`` is the key as it
    was before the change (only when the watch asked for it with ``prev_kv``)."""

    kind: str
    key: bytes
    value: bytes
    mod_revision: int
    lease: int = 0
    prev: KeyValue | None = None


@dataclass
class _WatchSpec:
    key: bytes
    range_end: bytes | None
    no_put: bool
    prev_kv: bool
    next_revision: int
    on_events: Callable[[list[WatchEvent]], None]
    on_resync: Callable[[], None] | None
    on_cancelled: Callable[[str], None] | None
    server_id: int | None = None


@dataclass
class Watch:
    """A handle on one watch of a :class:`WatchStream`; :meth:`cancel` ends it."""

    stream: WatchStream
    local_id: int
    _cancelled: bool = field(default=False, repr=False)

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            self.stream._cancel(self.local_id)


class WatchStream:
    """Every watch of one client multiplexed on one gRPC stream, resumed after failures.

    :meth:`watch` registers a watch starting at an explicit revision (the revision of the read
    the caller's state came from, plus one), so nothing between that read and the watch is
    missed. When the stream fails (member down, failover, etcd restart), a daemon thread opens a
    new one on the next member and re-creates every watch from the revision after the last event
    it delivered: callers see each change once, in revision order, with no gap. If that revision
    was compacted meanwhile, the watch continues from the compaction point and ``on_resync`` is
    called so the caller re-reads what it may have missed.

    The stream and its thread exist only while there are watches: once the last one is cancelled
    both end, so an object used for occasional waits holds nothing between them.

    Callbacks run on the stream's thread: they must be quick and must not call etcd.
    """

    def __init__(self, client: EtcdClient, name: str = "etcd-watch") -> None:
        self._client = client
        self._name = name
        self._lock = threading.Condition()
        self._specs: dict[int, _WatchSpec] = {}
        self._by_server_id: dict[int, int] = {}
        self._pending: list[int] = []  # local ids whose create request awaits its "created" reply
        self._requests: queue.Queue | None = None
        self._call = None
        self._next_id = 1
        self._closed = False
        self._thread: threading.Thread | None = None
        self._down_since: float | None = None

    def watch(
        self,
        key: bytes | str,
        on_events: Callable[[list[WatchEvent]], None],
        *,
        start_revision: int,
        prefix: bool = False,
        no_put: bool = False,
        prev_kv: bool = False,
        on_resync: Callable[[], None] | None = None,
        on_cancelled: Callable[[str], None] | None = None,
    ) -> Watch:
        """Watch ``key`` (every key under it with ``prefix``) from ``start_revision`` on.

        ``no_put`` delivers deletions only (a watch of many keys that cares only about keys going
        away costs its watcher nothing while they are written). Returns at once; the watch is
        created on the stream asynchronously and delivers from ``start_revision`` regardless.
        When etcd refuses or ends the watch for good (no permission for the key, say),
        ``on_cancelled`` gets etcd's reason; without it the reason is logged as an error.
        """
        raw = to_bytes(key)
        spec = _WatchSpec(
            raw, prefix_end(raw) if prefix else None, no_put, prev_kv, int(start_revision), on_events, on_resync,
            on_cancelled,
        )  # fmt: skip
        with self._lock:
            if self._closed:
                raise RuntimeError("The etcd watch stream is closed.")
            local_id = self._next_id
            self._next_id += 1
            self._specs[local_id] = spec
            if self._requests is not None:
                self._send_create(local_id, spec)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._lock.notify_all()
        return Watch(self, local_id)

    def wait_for_change(self, key: bytes | str, start_revision: int, timeout: float, prefix: bool = False) -> bool:
        """Block until the key (or a key under the prefix) changes at or after ``start_revision``.

        Returns True when a change arrived (or when that revision was compacted away, so the
        caller must read again anyway), False when ``timeout`` seconds passed first. Passing the
        revision of a previous read (+1) makes this race-free: changes made between that read and
        the watch's creation are delivered too. The watch ends with the wait; etcd being
        unreachable meanwhile makes it wait out its ``timeout``.

        Raises:
            EtcdError: etcd refused the watch (e.g. no permission for the key).
        """
        if timeout <= 0:
            return False
        changed, refused = threading.Event(), []

        def on_cancelled(reason: str) -> None:
            refused.append(reason)
            changed.set()

        handle = self.watch(
            key, lambda _: changed.set(), start_revision=start_revision, prefix=prefix, on_resync=changed.set,
            on_cancelled=on_cancelled,
        )  # fmt: skip
        try:
            changed.wait(timeout)
        finally:
            handle.cancel()
        if refused:
            raise EtcdError(f"etcd at {','.join(self._client.endpoints)} refused to watch {to_bytes(key)!r}: {refused[0]}")
        return changed.is_set()

    def close(self) -> None:
        """End every watch and the stream's thread."""
        with self._lock:
            self._closed = True
            self._specs.clear()
            call, requests = self._call, self._requests
            self._lock.notify_all()
        if requests is not None:
            requests.put(None)
        if call is not None:
            call.cancel()

    # -- internals ---------------------------------------------------------------------------

    def _cancel(self, local_id: int) -> None:
        call = None
        with self._lock:
            spec = self._specs.pop(local_id, None)
            if spec is None:
                return
            if not self._specs and self._requests is not None:
                # The last watch: end the stream; the thread sees it and ends too.
                call, requests = self._call, self._requests
                self._call = self._requests = None
                requests.put(None)
            elif spec.server_id is not None and self._requests is not None:
                self._by_server_id.pop(spec.server_id, None)
                self._requests.put(etcdrpc.WatchRequest(cancel_request=etcdrpc.WatchCancelRequest(watch_id=spec.server_id)))
        if call is not None:
            call.cancel()

    def _send_create(self, local_id: int, spec: _WatchSpec) -> None:
        request = etcdrpc.WatchCreateRequest(key=spec.key, start_revision=spec.next_revision, prev_kv=spec.prev_kv)
        if spec.range_end is not None:
            request.range_end = spec.range_end
        if spec.no_put:
            request.filters.append(etcdrpc.WatchCreateRequest.NOPUT)
        self._pending.append(local_id)
        self._requests.put(etcdrpc.WatchRequest(create_request=request))

    def _run(self) -> None:
        backoff = 0.1
        while True:
            with self._lock:
                if self._closed or not self._specs:
                    self._thread = None
                    return
                requests: queue.Queue = queue.Queue()
                self._requests = requests
                self._pending = []
                self._by_server_id = {}
                for local_id, spec in self._specs.items():
                    spec.server_id = None
                    self._send_create(local_id, spec)
            call, error = None, None
            try:
                call = self._client.request(lambda: self._client.open_watch(iter(requests.get, None)))
                with self._lock:
                    if self._requests is requests:
                        self._call = call
                    else:  # closed, or its last watch cancelled, while it opened
                        call.cancel()
                for response in call:
                    if self._down_since is not None:
                        log.warning("The etcd watch is back after %.1f s.", time.monotonic() - self._down_since)
                        self._down_since = None
                    backoff = 0.1
                    self._handle(response)
            except (grpc.RpcError, EtcdError) as exc:
                error = exc
            with self._lock:
                ended_here = self._requests is not requests  # by close() or by the last cancel
                if not ended_here:
                    self._requests, self._call = None, None
                if self._closed or not self._specs:
                    self._thread = None
                    return
            requests.put(None)
            if ended_here:
                continue  # a watch came after the last one was cancelled: open a new stream at once
            if error is None or isinstance(error, EtcdError) or classify(error) in (Fault.UNAVAILABLE, Fault.TIMED_OUT):
                self._client.fail_endpoint()
            if self._down_since is None:
                self._down_since = time.monotonic()
                # A stream ends for expected reasons (a member restarting, a failover); say so once
                # per outage, and carry on: watches resume where they stopped.
                log.warning("The etcd watch stream at %s failed (%s); reconnecting.", self._client, describe(error))
            time.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    def _handle(self, response) -> None:
        resync = cancelled = None
        with self._lock:
            if response.created:
                local_id = self._pending.pop(0) if self._pending else None
                spec = self._specs.get(local_id) if local_id is not None else None
                if spec is None:  # cancelled before it was created
                    if self._requests is not None and not response.canceled:
                        cancel = etcdrpc.WatchCancelRequest(watch_id=response.watch_id)
                        self._requests.put(etcdrpc.WatchRequest(cancel_request=cancel))
                    return
                spec.server_id = response.watch_id
                self._by_server_id[response.watch_id] = local_id
            local_id = self._by_server_id.get(response.watch_id)
            spec = self._specs.get(local_id) if local_id is not None else None
            if spec is None:
                return
            if response.compact_revision:
                # The revision asked for is gone: carry on from the oldest one kept and let the
                # caller re-read what it may have missed.
                spec.next_revision = int(response.compact_revision)
                spec.server_id = None
                self._by_server_id.pop(response.watch_id, None)
                if self._requests is not None:
                    self._send_create(local_id, spec)
                resync = spec.on_resync
            elif response.canceled:
                # etcd refused or ended the watch for a reason a retry would not change (a
                # permission, a future revision): stop it and say why.
                self._by_server_id.pop(response.watch_id, None)
                self._specs.pop(local_id, None)
                reason = response.cancel_reason or "no reason given"
                if spec.on_cancelled is None:
                    log.error("etcd cancelled the watch of %r: %s", spec.key, reason)
                    return
                cancelled = (spec.on_cancelled, reason)
            events = [_event(e) for e in response.events]
            if events:
                spec.next_revision = max(spec.next_revision, events[-1].mod_revision + 1)
            callback = spec.on_events
        if cancelled is not None:
            _safe(*cancelled)
            return
        if resync is not None:
            _safe(resync)
        if events:
            _safe(callback, events)


def _event(event) -> WatchEvent:
    kind = "delete" if event.type == kv_pb2.Event.DELETE else "put"
    prev = key_value(event.prev_kv) if event.HasField("prev_kv") else None
    return WatchEvent(kind, event.kv.key, event.kv.value, int(event.kv.mod_revision), int(event.kv.lease), prev)


def _safe(callback: Callable, *args) -> None:
    try:
        callback(*args)
    except Exception:  # a subscriber's bug must not stop every other watch of the stream
        log.exception("An etcd watch callback failed.")
