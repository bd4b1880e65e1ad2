"""A small, exception-safe etcd v3 client: requests, failover between members, auth and TLS.

Failover: the endpoint list is handed to ``etcd3.MultiEndpointEtcd3Client`` with failover on.
That client marks an endpoint failed on UNAVAILABLE / DEADLINE_EXCEEDED but does not retry the
request; :meth:`EtcdClient.request` retries on the next endpoint after UNAVAILABLE (the
connection was refused or dropped), going round the list for up to ``_UNAVAILABLE_RETRY_S`` so
that a member that has just come back is dialled again. A dropped connection can lose the reply
of a request that was applied, so a retried write may be applied twice: plain puts and deletes
are idempotent, compare-and-set transactions fail their compare the second time and report the
state their first attempt left, and the one non-idempotent write above this package, the store's
``add``, carries its own proof of application (see ``elastic_ddp/rendezvous/store.py``). A
timed-out request is reported, not retried; the next request goes to the next endpoint.

Errors are mapped in :mod:`elastic_ddp.etcd.errors`; what this module needs of etcd3 beyond its
documented API goes through :mod:`elastic_ddp.etcd._etcd3`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import etcd3
import etcd3.transactions
import grpc
from etcd3 import etcdrpc

from elastic_ddp.etcd import _etcd3
from elastic_ddp.etcd.errors import (
    EtcdCompactedError, EtcdConnectionError, EtcdError, EtcdLeaseExistsError, Fault, classify, connection_error,
    to_etcd_error,
)  # fmt: skip
from elastic_ddp.etcd.ops import (
    Compare, DeleteRange, KeyValue, Op, Put, Range, RangeResult, TxnResult, key_value, prefix_end, range_result,
    request_op,
)  # fmt: skip

__all__ = ["DEFAULT_PORT", "EtcdClient", "parse_endpoints"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379

# After a connection failure an endpoint is skipped for this long. etcd3's default (300 s) would
# make a single-endpoint client useless for five minutes after one blip of its only server.
_ENDPOINT_RETRY_S = 1.0
# How long a request keeps going round the endpoints while all of them refuse: just over gRPC's
# reconnect backoff (capped at 1 s below), so a member back from a restart is reached.
_UNAVAILABLE_RETRY_S = 1.5

# Channel options. gRPC pings connections with open streams, so a watch on a member that vanished
# without a TCP reset (power loss, a black-holed network) fails within ~15 s instead of hanging
# (etcd refuses pings more often than every 5 s and pings on idle connections, hence no
# permit-without-calls). gRPC's reconnect backoff grows to 120 s by default and every request
# fails at once while it runs, so a member back after a restart would stay unused for minutes --
# longer than a lease lives; capped at 1 s, requests reach it within a second of its return.
_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]

_T = TypeVar("_T")


def parse_endpoints(endpoints: str | Sequence[str], default_port: int = DEFAULT_PORT) -> list[tuple[str, int]]:
    """Parse ``"h1:p1,h2,[::1]:p3"`` (or a list of such items) into ``[(host, port), ...]``.

    Raises:
        ValueError: an empty list, an empty item or a port that is not an integer in 1..65535.
    """
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = []
    for raw in items:
        item = raw.strip()
        if not item:
            raise ValueError(f"The etcd endpoint list ({endpoints!r}) contains an empty entry.")
        host, port_text = item, None
        if item.startswith("["):  # [IPv6]:port
            host, _, rest = item[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else None
        elif item.count(":") == 1:
            host, port_text = item.split(":")
        if port_text is None or port_text == "":
            port = default_port
        else:
            try:
                port = int(port_text)
            except ValueError:
                port = -1
            if not 1 <= port <= 65535:
                raise ValueError(
                    f"The etcd endpoint '{item}' has an invalid port '{port_text}'; "
                    "expected an integer between 1 and 65535."
                )
        if not host:
            raise ValueError(f"The etcd endpoint '{item}' has an empty host.")
        parsed.append((host, port))
    if not parsed:
        raise ValueError("The etcd endpoint list is empty.")
    return parsed


def _tls_credentials(ca_cert: str | None, cert: str | None, key: str | None):
    """gRPC channel credentials; ``ca_cert=None`` trusts the system's root certificates."""

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise ValueError(f"Cannot read the TLS file '{path}' for etcd: {exc.strerror}.") from exc

    return grpc.ssl_channel_credentials(read(ca_cert), read(key), read(cert))


class EtcdClient:
    """A small, thread-safe etcd v3 client with failover, TLS, auth and a per-request timeout.

    Args:
        endpoints: ``"host:port,host:port"`` or a sequence of such strings; port defaults to 2379.
        timeout: Seconds each request may take before :class:`EtcdConnectionError`.
        ca_cert: Path of the CA bundle; when given, TLS is used for every endpoint.
        cert, key: Paths of the client certificate and its private key (mutual TLS); both or none.
        user, password: etcd user credentials; both or none.
        tls: Use TLS; default: when ``ca_cert`` is given. TLS without ``ca_cert`` verifies the
            server against the system's root certificates.

    Constructing the client does not contact etcd unless ``user`` is given (authentication needs a
    round trip); connection problems surface on the first request.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: float = 10.0,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
        tls: bool | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"The etcd request timeout ({timeout}) must be a positive number of seconds.")
        if (cert is None) != (key is None):
            raise ValueError("A client certificate and its key must be given together (got only one).")
        if (user is None) != (password is None):
            raise ValueError("An etcd user and password must be given together (got only one).")
        self._hosts = parse_endpoints(endpoints)
        self.endpoints = [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self._hosts]
        self.timeout = float(timeout)
        self._user, self._password = user, password
        self._auth_lock = threading.Lock()
        if tls is None:
            tls = ca_cert is not None
        if not tls and (ca_cert is not None or cert is not None):
            raise ValueError("TLS files were given for etcd but TLS is off (tls=False).")
        creds = _tls_credentials(ca_cert, cert, key) if tls else None
        eps = [
            etcd3.Endpoint(
                h, p, secure=creds is not None, creds=creds, time_retry=_ENDPOINT_RETRY_S, opts=_CHANNEL_OPTIONS
            )
            for h, p in self._hosts
        ]
        # Auth is done by us (see _authenticate) so that its errors are mapped and a token can be
        # renewed after failover: etcd's default "simple" tokens are valid on one member only.
        self._raw = etcd3.MultiEndpointEtcd3Client(endpoints=eps, timeout=self.timeout, failover=True)
        # Start with the first endpoint listed (etcd3 picks a random one); users list the
        # closest member first.
        _etcd3.start_at(self._raw, eps[0])
        if user is not None:
            try:
                self.request(self._authenticate)
            except BaseException:
                self.close()  # else gRPC keeps reconnecting the abandoned channel in the background
                raise

    # -- plumbing (also used by the watch stream and the lease keep-alive of this package) -----

    def __repr__(self) -> str:
        return f"EtcdClient({','.join(self.endpoints)!r})"

    def _authenticate(self) -> None:
        with self._auth_lock:
            resp = self._raw.authstub.Authenticate(
                etcdrpc.AuthenticateRequest(name=self._user, password=self._password), self.timeout
            )
            _etcd3.install_token(self._raw, resp.token)

    def request(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` (a request on this client's etcd3 client or stubs) mapping its errors to
        :class:`EtcdError`; retry on another endpoint when the request was not applied."""
        reauthenticated = False
        give_up_at = time.monotonic() + min(_UNAVAILABLE_RETRY_S, self.timeout)
        attempts = len(self._hosts)

        def next_attempt(exc: BaseException) -> None:
            nonlocal attempts
            attempts -= 1
            if attempts > 0:
                return
            if time.monotonic() >= give_up_at:
                raise self._mapped(exc) from exc
            # Every endpoint refused: go round again after a pause. Skipping failed members is
            # meant to spread requests over healthy ones; with none healthy, try them all.
            time.sleep(0.1)
            attempts = len(self._hosts)
            _etcd3.forget_failures(self._raw)

        while True:
            try:
                return fn()
            except Exception as exc:
                fault = classify(exc)
                if fault is None:
                    raise
                if fault is Fault.UNAVAILABLE:
                    # etcd3's own methods mark the member failed; the calls this class makes on
                    # etcd3's stubs directly do not. Marking it again changes nothing.
                    self.fail_endpoint()
                    next_attempt(exc)
                    continue
                if fault is Fault.TIMED_OUT:
                    self.fail_endpoint()  # the next request tries another member
                elif fault is Fault.UNAUTHENTICATED and self._user is not None and not reauthenticated:
                    # Expired or foreign-member token: authenticate again once and retry. The
                    # authentication runs inside this loop so that its errors (a password changed
                    # meanwhile) are mapped like any other.
                    reauthenticated = True
                    fn = self._reauthenticating(fn)
                    continue
                raise self._mapped(exc) from exc

    def _mapped(self, exc: BaseException) -> EtcdError:
        return to_etcd_error(exc, where=self._endpoint_text(), user=self._user, timeout=self.timeout)

    def _endpoint_text(self) -> str:
        return ",".join(self.endpoints)

    def fail_endpoint(self) -> None:
        """Mark the member in use as failed, so the next request (or stream) goes to another."""
        _etcd3.fail_endpoint_in_use(self._raw)

    def open_watch(self, requests):
        """A ``Watch`` stream on the member in use, sending ``requests`` (an iterator of
        ``WatchRequest``); returns gRPC's call. Run it inside :meth:`request`: with no member
        available it raises etcd3's error."""
        return etcdrpc.WatchStub(self._raw.channel).Watch(requests, **self._options())

    def open_keep_alive(self, requests):
        """A ``LeaseKeepAlive`` stream on the member in use (see :meth:`open_watch`)."""
        return etcdrpc.LeaseStub(self._raw.channel).LeaseKeepAlive(requests, **self._options())

    def _reauthenticating(self, fn: Callable[[], _T]) -> Callable[[], _T]:
        def again() -> _T:
            self._authenticate()
            return fn()

        return again

    def connection_error(self, what: str) -> EtcdConnectionError:
        """``etcd at <endpoints> <what>.``"""
        return connection_error(self._endpoint_text(), what)

    def close(self) -> None:
        """Close every channel; the client must not be used afterwards."""
        try:
            self._raw.close()
        except Exception:  # closing a broken channel is best effort
            log.debug("Closing the etcd client failed.", exc_info=True)

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _options(self) -> dict:
        return _etcd3.call_options(self._raw)

    # -- key/value -----------------------------------------------------------------------------

    def get(self, key: bytes | str) -> KeyValue | None:
        """The key's current value and revisions, or ``None`` when it does not exist."""
        resp = self.request(lambda: self._raw.get_response(key))
        return key_value(resp.kvs[0]) if resp.kvs else None

    def get_with_revision(self, key: bytes | str, prefix: bool = False) -> tuple[list[KeyValue], int]:
        """The key (or every key under a prefix) and the store revision the read was served at."""
        kwargs = {"range_end": prefix_end(key)} if prefix else {}
        resp = self.request(lambda: self._raw.get_response(key, **kwargs))
        return [key_value(kv) for kv in resp.kvs], resp.header.revision

    def get_prefix(self, prefix: bytes | str) -> list[KeyValue]:
        """Every key starting with ``prefix``, sorted by key."""
        return self.get_with_revision(prefix, prefix=True)[0]

    def count_prefix(self, prefix: bytes | str) -> int:
        """How many keys start with ``prefix``."""
        end = prefix_end(prefix)
        resp = self.request(lambda: self._raw.get_response(prefix, range_end=end, count_only=True))
        return int(resp.count)

    def put(self, key: bytes | str, value: bytes | str, lease: int | None = None) -> int:
        """Write unconditionally; returns the new revision."""
        resp = self.request(lambda: self._raw.put(key, value, lease=lease))
        return resp.header.revision

    def compare_and_put(
        self, key: bytes | str, value: bytes | str, mod_revision: int, lease: int | None = None
    ) -> tuple[bool, KeyValue | None]:
        """Write only if the key's mod revision is ``mod_revision`` (0: only if it does not exist).

        One transaction. Returns ``(written, current)`` where ``current`` is the key as stored
        after the transaction (ours when written, the winner's otherwise; ``None`` if absent).
        """
        txn = etcd3.transactions
        cond = txn.Create(key) == 0 if mod_revision == 0 else txn.Mod(key) == mod_revision
        succeeded, responses = self.request(
            lambda: self._raw.transaction(
                compare=[cond], success=[txn.Put(key, value, lease=lease), txn.Get(key)], failure=[txn.Get(key)]
            )
        )
        ranges = [r for r in responses if isinstance(r, list)]
        current = ranges[-1] if ranges else []
        if not current:
            return bool(succeeded), None
        value_read, meta = current[0]
        return bool(succeeded), KeyValue(meta.key, value_read, meta.mod_revision, meta.create_revision, meta.lease_id)

    def delete(self, key: bytes | str) -> bool:
        """Delete a key; True if it existed."""
        return bool(self.request(lambda: self._raw.delete(key)))

    def delete_prefix(self, prefix: bytes | str) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""
        return int(self.request(lambda: self._raw.delete_prefix(prefix)).deleted)

    def range(self, request: Range) -> RangeResult:
        """One range read (see :class:`~elastic_ddp.etcd.ops.Range`).

        Raises:
            EtcdCompactedError: ``request.revision`` is older than etcd's compaction point.
        """
        message = request.message()
        response = self.request(lambda: self._raw.kvstub.Range(message, self.timeout, **self._options()))
        return range_result(response, int(response.header.revision))

    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        """One transaction: if every condition holds run ``success``, else ``failure``.

        Any write in either branch makes it one raft entry, applied or not. Retried on another
        member only when it cannot have been applied (see the module docstring).

        A transaction that only reads (no conditions, ranges only) is sent as range reads of one
        revision instead: etcd before 3.5.5 crashes when a client's deadline cancels a read-only
        transaction while it is served (etcd-io/etcd#14110) -- a loaded etcd, and 1,000 nodes
        reading at once, make that likely. The result is the same: every read sees the store at
        the revision of the first.
        """
        if not any(isinstance(op, (Put, DeleteRange)) for op in (*success, *failure)):
            if compare or failure:
                raise ValueError("A transaction that only reads takes no conditions; read with range() or txn([], ranges).")
            return self._read_together(success)
        request = etcdrpc.TxnRequest(
            compare=[c.message() for c in compare],
            success=[request_op(op) for op in success],
            failure=[request_op(op) for op in failure],
        )
        response = self.request(lambda: self._raw.kvstub.Txn(request, self.timeout, **self._options()))
        revision = int(response.header.revision)
        results: list[RangeResult | int | None] = []
        for item in response.responses:
            kind = item.WhichOneof("response")
            if kind == "response_range":
                results.append(range_result(item.response_range, revision))
            elif kind == "response_delete_range":
                results.append(int(item.response_delete_range.deleted))
            else:
                results.append(None)
        return TxnResult(bool(response.succeeded), revision, results)

    def _read_together(self, ranges: Sequence[Range]) -> TxnResult:
        """``ranges`` as of one revision: the first at the newest, the others pinned to the
        revision it was served at (a range that names its own revision keeps it)."""
        pinned_by_caller = any(r.revision for r in ranges)
        attempt = 1
        while True:
            results: list[RangeResult | int | None] = []
            revision = 0
            try:
                for request in ranges:
                    if revision and not request.revision:
                        request = replace(request, revision=revision)
                    result = self.range(request)
                    revision = revision or result.revision
                    results.append(result)
                return TxnResult(True, revision, results)
            except EtcdCompactedError:
                # Compacted between two of the reads: read again from the newest revision. (A
                # caller's own revision would fail the same way every time.)
                if pinned_by_caller or attempt == 3:
                    raise
                attempt += 1

    # -- leases (kept alive by elastic_ddp.etcd.leases.LeaseKeepAlive) ---------------------------

    def grant_lease(self, ttl: int, lease_id: int = 0) -> int:
        """A new lease of ``ttl`` seconds; returns its id (``lease_id``, when given and free).

        Raises:
            EtcdLeaseExistsError: ``lease_id`` names a lease that exists (see :meth:`ensure_lease`).
        """
        request = etcdrpc.LeaseGrantRequest(TTL=int(ttl), ID=int(lease_id))
        return int(self.request(lambda: self._raw.leasestub.LeaseGrant(request, self.timeout, **self._options())).ID)

    def ensure_lease(self, lease_id: int, ttl: int) -> None:
        """Make sure lease ``lease_id`` exists, granting it with ``ttl`` seconds if it does not.

        Several clients may call this for the same id at once; all of them return with the lease
        in place. Looking first keeps the usual case (the lease exists) off the raft log.
        """
        if self.lease_ttl(lease_id) > 0:
            return
        try:
            self.grant_lease(ttl, lease_id)
        except EtcdLeaseExistsError:
            pass  # another client granted it meanwhile

    def refresh_lease(self, lease_id: int) -> int:
        """Reset the lease to its full TTL; returns that TTL, or 0 if the lease has expired.

        One renewal on a stream of its own, for a caller that renews now and then; a lease kept
        alive all the time is :class:`~elastic_ddp.etcd.leases.LeaseKeepAlive`'s.
        """

        def once() -> int:
            request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
            for response in self._raw.leasestub.LeaseKeepAlive(iter([request]), self.timeout, **self._options()):
                return int(response.TTL)
            return 0

        return self.request(once)

    def lease_ttl(self, lease_id: int) -> int:
        """Seconds left on the lease; -1 if it has expired or never existed."""
        return int(self.request(lambda: self._raw.get_lease_info(lease_id)).TTL)

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease, deleting every key attached to it."""
        self.request(lambda: self._raw.revoke_lease(lease_id))
