"""A thin, exception-safe wrapper over the etcd v3 client (the only module importing ``etcd3``).

Everything above this module (the rendezvous backend, the c10d store, the plugin) talks to etcd
through :class:`EtcdClient` and sees only the exceptions defined here, so neither ``grpc`` nor
``etcd3`` types cross the module boundary.

Failover: the endpoint list is handed to ``etcd3.MultiEndpointEtcd3Client`` with failover on.
That client marks an endpoint failed on UNAVAILABLE / DEADLINE_EXCEEDED but does not retry the
request; :meth:`EtcdClient._call` retries on the next endpoint after UNAVAILABLE (the connection
was refused or dropped), going round the list for up to ``_UNAVAILABLE_RETRY_S`` so that a member
that has just come back is dialled again. A dropped connection can lose the reply of a request
that was applied, so a retried write may be applied twice: plain puts and deletes are idempotent,
compare-and-set transactions fail their compare the second time and report the state their first
attempt left, and the one non-idempotent write above this module, the store's ``add``, carries
its own proof of application (see ``store.py``). A timed-out request is reported, not retried;
the next request goes to the next endpoint.

Long-lived work has its own classes: :class:`WatchStream` (every watch of one client on one gRPC
stream, resumed from the last revision seen after a failure) and :class:`LeaseKeepAlive` (one
thread renewing leases; a renewal is no raft entry, so keeping a lease alive costs etcd no disk
write).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar, Union

import etcd3
import etcd3.exceptions
import etcd3.transactions
import etcd3.utils
import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2

__all__ = [
    "DEFAULT_PORT",
    "Backoff",
    "Compare",
    "DeleteRange",
    "EtcdAuthError",
    "EtcdClient",
    "EtcdCompactedError",
    "EtcdConnectionError",
    "EtcdError",
    "EtcdLeaseNotFoundError",
    "KeyValue",
    "LeaseKeepAlive",
    "LeaseKeeper",
    "Put",
    "Range",
    "RangeResult",
    "TxnResult",
    "WatchEvent",
    "WatchStream",
    "parse_endpoints",
    "prefix_end",
]

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


class EtcdError(Exception):
    """Base class of every error raised by :class:`EtcdClient`."""


class EtcdConnectionError(EtcdError):
    """No endpoint answered in time (refused, unreachable, timed out or unavailable)."""


class EtcdAuthError(EtcdError):
    """The user/password was rejected, or the user lacks permission for the request."""


class EtcdCompactedError(EtcdError):
    """A read or watch asked for a revision that etcd has already compacted away."""


class EtcdLeaseNotFoundError(EtcdError):
    """A write named a lease that does not exist (it expired or was revoked)."""


@dataclass(frozen=True)
class KeyValue:
    """One stored key: its value and the revisions etcd uses for compare-and-set."""

    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


def prefix_end(prefix: bytes | str) -> bytes:
    """The first key after every key starting with ``prefix`` (a range's exclusive end)."""
    return etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(prefix))


def _b(data: bytes | str) -> bytes:
    return etcd3.utils.to_bytes(data)


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction: ``target`` of ``key`` compared with ``value``.

    Build with the class methods; ``target`` is ``"mod"``, ``"create"`` (revisions) or
    ``"value"``; ``op`` is ``"=="`` or ``"!="``.
    """

    key: bytes
    target: str
    value: int | bytes
    op: str = "=="

    @classmethod
    def mod_revision(cls, key: bytes | str, revision: int) -> Compare:
        """True when the key was last written at ``revision`` (0: the key does not exist)."""
        return cls(_b(key), "mod", int(revision))

    @classmethod
    def absent(cls, key: bytes | str) -> Compare:
        """True when the key does not exist."""
        return cls(_b(key), "create", 0)

    @classmethod
    def value_is(cls, key: bytes | str, value: bytes | str) -> Compare:
        return cls(_b(key), "value", _b(value))

    def message(self) -> etcdrpc.Compare:
        result = etcdrpc.Compare.EQUAL if self.op == "==" else etcdrpc.Compare.NOT_EQUAL
        if self.target == "mod":
            return etcdrpc.Compare(result=result, target=etcdrpc.Compare.MOD, key=self.key, mod_revision=self.value)
        if self.target == "create":
            return etcdrpc.Compare(result=result, target=etcdrpc.Compare.CREATE, key=self.key, create_revision=self.value)
        return etcdrpc.Compare(result=result, target=etcdrpc.Compare.VALUE, key=self.key, value=self.value)


@dataclass(frozen=True)
class Put:
    """Write ``value`` at ``key``, attached to ``lease`` (0: none)."""

    key: bytes | str
    value: bytes | str
    lease: int = 0


@dataclass(frozen=True)
class DeleteRange:
    """Delete ``key``, or every key in ``[key, range_end)`` when ``range_end`` is given."""

    key: bytes | str
    range_end: bytes | None = None

    @classmethod
    def prefix(cls, prefix: bytes | str) -> DeleteRange:
        return cls(prefix, prefix_end(prefix))


@dataclass(frozen=True)
class Range:
    """Read ``key`` or ``[key, range_end)``.

    ``revision`` > 0 reads the store as it was then; ``count_only`` returns only how many keys
    there are; ``limit`` caps the keys returned (``count`` still counts them all);
    ``descending`` returns the largest keys first.
    """

    key: bytes | str
    range_end: bytes | None = None
    revision: int = 0
    keys_only: bool = False
    count_only: bool = False
    limit: int = 0
    descending: bool = False

    @classmethod
    def prefix(cls, prefix: bytes | str, **kwargs) -> Range:
        return cls(prefix, prefix_end(prefix), **kwargs)

    def message(self) -> etcdrpc.RangeRequest:
        request = etcdrpc.RangeRequest(
            key=_b(self.key), revision=self.revision, keys_only=self.keys_only, count_only=self.count_only,
            limit=self.limit,
        )  # fmt: skip
        if self.range_end is not None:
            request.range_end = self.range_end
        if self.descending:
            request.sort_order = etcdrpc.RangeRequest.DESCEND
            request.sort_target = etcdrpc.RangeRequest.KEY
        return request


Op = Union[Put, DeleteRange, Range]


@dataclass(frozen=True)
class RangeResult:
    """The keys a :class:`Range` found (none for ``count_only``), their count, and the revision
    the read was served at."""

    kvs: list[KeyValue]
    count: int
    revision: int


@dataclass(frozen=True)
class TxnResult:
    """Whether the conditions held, the store revision after the transaction, and one result per
    operation of the branch that ran: :class:`RangeResult` for a range, the number of deleted keys
    for a delete, ``None`` for a put."""

    succeeded: bool
    revision: int
    results: list[RangeResult | int | None]


def _request_op(op: Op) -> etcdrpc.RequestOp:
    if isinstance(op, Put):
        return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=_b(op.key), value=_b(op.value), lease=op.lease))
    if isinstance(op, DeleteRange):
        request = etcdrpc.DeleteRangeRequest(key=_b(op.key))
        if op.range_end is not None:
            request.range_end = op.range_end
        return etcdrpc.RequestOp(request_delete_range=request)
    return etcdrpc.RequestOp(request_range=op.message())


def _range_result(response, revision: int) -> RangeResult:
    return RangeResult([_kv(kv) for kv in response.kvs], int(response.count), revision)


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


def _rpc_error(exc: BaseException | None) -> grpc.RpcError | None:
    """The gRPC error behind ``exc``: itself, or the one etcd3 was handling when it raised."""
    for candidate in (exc, getattr(exc, "__cause__", None), getattr(exc, "__context__", None)):
        if isinstance(candidate, grpc.RpcError):
            return candidate
    return None


def _unavailable_reason(exc: BaseException) -> str:
    """Why gRPC could not reach etcd, in words; TLS handshake failures are named as such.

    A TLS failure looks like any other UNAVAILABLE to gRPC; without this the user would only
    read "unavailable" and look for a network problem instead of a wrong CA or a missing
    client certificate.
    """
    rpc = _rpc_error(exc)
    details = rpc.details() if rpc is not None and callable(getattr(rpc, "details", None)) else ""
    details = details or ""
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return (
            "TLS handshake failed: certificate verify failed (the server's certificate is not signed "
            "by the CA bundle given as ca_cert)"
        )
    if "BAD_CERTIFICATE" in details or "CERTIFICATE_REQUIRED" in details:
        return (
            "TLS handshake failed: the server rejected the client certificate (none was given, or it "
            "is not signed by a CA the server trusts; set ssl_cert and ssl_cert_key)"
        )
    if "handshake" in details.lower():
        return f"TLS handshake failed ({details})"
    return details


def _kv(kv) -> KeyValue:
    return KeyValue(kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.lease)


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
        self._raw._current_endpoint_label = eps[0].netloc
        if user is not None:
            try:
                self._call(self._authenticate)
            except BaseException:
                self.close()  # else gRPC keeps reconnecting the abandoned channel in the background
                raise

    # -- plumbing ------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"EtcdClient({','.join(self.endpoints)!r})"

    def _authenticate(self) -> None:
        with self._auth_lock:
            resp = self._raw.authstub.Authenticate(
                etcd3.etcdrpc.AuthenticateRequest(name=self._user, password=self._password), self.timeout
            )
            self._raw.metadata = (("token", resp.token),)
            self._raw.call_credentials = None  # metadata alone carries the token
            self._raw._clear_old_stubs()  # the watcher caches the old metadata

    def _call(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` mapping errors; retry on another endpoint when the request was not applied."""
        reauthenticated = False
        give_up_at = time.monotonic() + min(_UNAVAILABLE_RETRY_S, self.timeout)
        attempts = len(self._hosts)

        def next_attempt(exc: BaseException) -> None:
            nonlocal attempts
            attempts -= 1
            if attempts > 0:
                return
            if time.monotonic() >= give_up_at:
                raise self._connection_error("is unavailable", exc) from exc
            # Every endpoint refused: go round again after a pause. Skipping failed members is
            # meant to spread requests over healthy ones; with none healthy, try them all.
            time.sleep(0.1)
            attempts = len(self._hosts)
            for endpoint in self._raw.endpoints.values():
                endpoint.last_failed = 0

        while True:
            try:
                return fn()
            except (etcd3.exceptions.ConnectionFailedError, etcd3.exceptions.NoServerAvailableError) as exc:
                next_attempt(exc)
            except (etcd3.exceptions.ConnectionTimeoutError, etcd3.exceptions.WatchTimedOut) as exc:
                raise self._connection_error(f"did not answer within {self.timeout:g} s") from exc
            except grpc.RpcError as exc:
                code = exc.code() if callable(getattr(exc, "code", None)) else None
                details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
                if code == grpc.StatusCode.UNAVAILABLE:
                    # Raised raw by the calls this class makes on etcd3's stubs directly.
                    self._fail_endpoint()
                    next_attempt(exc)
                    continue
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    self._fail_endpoint()  # the next request tries another member
                    raise self._connection_error(f"did not answer within {self.timeout:g} s") from exc
                if "required revision has been compacted" in (details or ""):
                    raise EtcdCompactedError(f"etcd at {self._endpoint_text()} has compacted the revision asked for: {details}") from exc
                if "requested lease not found" in (details or ""):
                    raise EtcdLeaseNotFoundError(f"etcd at {self._endpoint_text()} does not know the lease: {details}") from exc
                if code == grpc.StatusCode.UNAUTHENTICATED and self._user is not None and not reauthenticated:
                    # Expired or foreign-member token: authenticate again once and retry. The
                    # authentication runs inside this loop so that its errors (a password changed
                    # meanwhile) are mapped like any other.
                    reauthenticated = True
                    fn = self._reauthenticating(fn)
                    continue
                if code in (
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.INVALID_ARGUMENT,
                ) and ("auth" in (details or "") or "permission" in (details or "")):
                    who = f"user {self._user!r}" if self._user is not None else "no user (auth may be enabled)"
                    raise EtcdAuthError(
                        f"etcd at {self._endpoint_text()} refused the request for {who}: {details}"
                    ) from exc
                raise EtcdError(f"etcd at {self._endpoint_text()} failed a request: {code}: {details}") from exc
            except etcd3.exceptions.Etcd3Exception as exc:
                raise EtcdError(f"etcd at {self._endpoint_text()} failed a request: {exc!r}") from exc

    def _endpoint_text(self) -> str:
        return ",".join(self.endpoints)

    def _fail_endpoint(self) -> None:
        """Mark the member in use as failed, so the next request (or stream) goes to another."""
        self._raw.endpoint_in_use.fail()
        self._raw._clear_old_stubs()

    def _grpc_kwargs(self) -> dict:
        return {"credentials": self._raw.call_credentials, "metadata": self._raw.metadata}

    def _reauthenticating(self, fn: Callable[[], _T]) -> Callable[[], _T]:
        def again() -> _T:
            self._authenticate()
            return fn()

        return again

    def _connection_error(self, what: str, exc: BaseException | None = None) -> EtcdConnectionError:
        reason = _unavailable_reason(exc) if exc is not None else ""
        return EtcdConnectionError(f"etcd at {self._endpoint_text()} {what}" + (f": {reason}." if reason else "."))

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

    # -- key/value -----------------------------------------------------------------------------

    def get(self, key: bytes | str) -> KeyValue | None:
        """The key's current value and revisions, or ``None`` when it does not exist."""
        resp = self._call(lambda: self._raw.get_response(key))
        return _kv(resp.kvs[0]) if resp.kvs else None

    def get_with_revision(self, key: bytes | str, prefix: bool = False) -> tuple[list[KeyValue], int]:
        """The key (or every key under a prefix) and the store revision the read was served at."""
        kwargs = {"range_end": etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(key))} if prefix else {}
        resp = self._call(lambda: self._raw.get_response(key, **kwargs))
        return [_kv(kv) for kv in resp.kvs], resp.header.revision

    def get_prefix(self, prefix: bytes | str) -> list[KeyValue]:
        """Every key starting with ``prefix``, sorted by key."""
        return self.get_with_revision(prefix, prefix=True)[0]

    def count_prefix(self, prefix: bytes | str) -> int:
        """How many keys start with ``prefix``."""
        end = etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(prefix))
        resp = self._call(lambda: self._raw.get_response(prefix, range_end=end, count_only=True))
        return int(resp.count)

    def put(self, key: bytes | str, value: bytes | str, lease: int | None = None) -> int:
        """Write unconditionally; returns the new revision."""
        resp = self._call(lambda: self._raw.put(key, value, lease=lease))
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
        succeeded, responses = self._call(
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
        return bool(self._call(lambda: self._raw.delete(key)))

    def delete_prefix(self, prefix: bytes | str) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""
        return int(self._call(lambda: self._raw.delete_prefix(prefix)).deleted)

    def range(self, request: Range) -> RangeResult:
        """One range read (see :class:`Range`).

        Raises:
            EtcdCompactedError: ``request.revision`` is older than etcd's compaction point.
        """
        message = request.message()
        response = self._call(lambda: self._raw.kvstub.Range(message, self.timeout, **self._grpc_kwargs()))
        return _range_result(response, int(response.header.revision))

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
            success=[_request_op(op) for op in success],
            failure=[_request_op(op) for op in failure],
        )
        response = self._call(lambda: self._raw.kvstub.Txn(request, self.timeout, **self._grpc_kwargs()))
        revision = int(response.header.revision)
        results: list[RangeResult | int | None] = []
        for item in response.responses:
            kind = item.WhichOneof("response")
            if kind == "response_range":
                results.append(_range_result(item.response_range, revision))
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

    # -- leases --------------------------------------------------------------------------------

    def grant_lease(self, ttl: int, lease_id: int = 0) -> int:
        """A new lease of ``ttl`` seconds; returns its id (``lease_id``, when given and free).

        Raises:
            EtcdError: ``lease_id`` names a lease that exists (see :meth:`ensure_lease`).
        """
        request = etcdrpc.LeaseGrantRequest(TTL=int(ttl), ID=int(lease_id))
        return int(self._call(lambda: self._raw.leasestub.LeaseGrant(request, self.timeout, **self._grpc_kwargs())).ID)

    def ensure_lease(self, lease_id: int, ttl: int) -> None:
        """Make sure lease ``lease_id`` exists, granting it with ``ttl`` seconds if it does not.

        Several clients may call this for the same id at once; all of them return with the lease
        in place. Looking first keeps the usual case (the lease exists) off the raft log.
        """
        if self.lease_ttl(lease_id) > 0:
            return
        try:
            self.grant_lease(ttl, lease_id)
        except EtcdError as exc:
            if "lease already exists" not in str(exc):
                raise

    def refresh_lease(self, lease_id: int, timeout: float | None = None) -> int:
        """Reset the lease to its full TTL; returns that TTL, or 0 if the lease has expired.

        ``timeout`` (default: the client's) bounds the request: a keep-alive must not wait on a
        silent member for longer than the lease has left.
        """
        deadline = self.timeout if timeout is None else timeout

        def once() -> int:
            request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
            for response in self._raw.leasestub.LeaseKeepAlive(iter([request]), deadline, **self._grpc_kwargs()):
                return int(response.TTL)
            return 0

        return self._call(once)

    def lease_ttl(self, lease_id: int) -> int:
        """Seconds left on the lease; -1 if it has expired or never existed."""
        return int(self._call(lambda: self._raw.get_lease_info(lease_id)).TTL)

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease, deleting every key attached to it."""
        self._call(lambda: self._raw.revoke_lease(lease_id))

    # -- watches -------------------------------------------------------------------------------

    def wait_for_change(self, key: bytes | str, start_revision: int, timeout: float, prefix: bool = False) -> bool:
        """Block until the key (or a key under the prefix) changes at or after ``start_revision``.

        Returns True when a change arrived (or when that revision was compacted away, so the
        caller must read again anyway), False when ``timeout`` seconds passed first. Passing the
        revision of a previous read (+1) makes this race-free: changes made between that read and
        the watch's creation are delivered too.

        The watch is one gRPC call bounded by ``timeout`` and ends with it: no thread or stream
        outlives the wait (etcd3's own watch helper keeps a thread per client for good, which
        wakes ten times a second while the process lives).

        Raises:
            EtcdError: etcd refused the watch (e.g. no permission for the key).
        """
        if timeout <= 0:
            return False
        request = etcdrpc.WatchCreateRequest(key=_b(key), start_revision=int(start_revision))
        if prefix:
            request.range_end = prefix_end(key)

        def once() -> bool:
            stub = etcdrpc.WatchStub(self._raw.channel)
            call = stub.Watch(iter([etcdrpc.WatchRequest(create_request=request)]), timeout, **self._grpc_kwargs())
            try:
                for response in call:
                    if response.events or response.compact_revision:
                        return True
                    if response.canceled:
                        raise EtcdError(
                            f"etcd at {self._endpoint_text()} refused to watch {request.key!r}: "
                            f"{response.cancel_reason or 'no reason given'}"
                        )
                return False
            except grpc.RpcError as exc:
                # The wait's own bound, not a slow member. etcd may end the stream itself when the
                # deadline passes, reporting UNKNOWN "context deadline exceeded".
                code = exc.code() if callable(getattr(exc, "code", None)) else None
                details = (exc.details() if callable(getattr(exc, "details", None)) else "") or ""
                if code == grpc.StatusCode.DEADLINE_EXCEEDED or "deadline exceeded" in details:
                    return False
                raise
            finally:
                call.cancel()

        return self._call(once)


class Backoff:
    """Pauses between tries of something etcd did not answer, until a deadline.

    Each pause doubles from ``first`` up to ``most`` seconds and is jittered (x0.5 to x1.5), so
    that 1,000 nodes that lost etcd together do not come back in step. :meth:`pause` sleeps and
    returns True, or returns False at once when the pause would end past ``deadline`` (monotonic)
    -- the caller then gives up with the error it has.
    """

    def __init__(self, deadline: float, first: float = 0.5, most: float = 5.0) -> None:
        self.deadline = deadline
        self._first, self._most = first, most
        self._next = first

    def pause(self) -> bool:
        if time.monotonic() + self._next >= self.deadline:
            return False
        time.sleep(self._next * random.uniform(0.5, 1.5))
        self._next = min(self._next * 2, self._most)
        return True

    def reset(self) -> None:
        """etcd answered: the next pause starts short again."""
        self._next = self._first


class LeaseKeeper:
    """Keeps one lease alive from a daemon thread, refreshing every ``ttl / 3`` seconds.

    If the lease has expired (etcd unreachable for longer than the TTL), a new lease is granted;
    callers read :attr:`lease_id` at each write so new keys attach to the live lease.
    """

    def __init__(self, client: EtcdClient, ttl: int, name: str = "etcd-lease-keeper") -> None:
        if ttl < 1:
            raise ValueError(f"The lease TTL ({ttl}) must be at least one second.")
        self._client = client
        self.ttl = int(ttl)
        self._lock = threading.Lock()
        self._lease_id: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._name = name

    @property
    def lease_id(self) -> int:
        """The live lease's id, granting it (and starting the refresh thread) on first use."""
        with self._lock:
            if self._lease_id is None:
                self._lease_id = self._client.grant_lease(self.ttl)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
            return self._lease_id

    def _run(self) -> None:
        while not self._stop.wait(max(self.ttl / 3.0, 0.5)):
            with self._lock:
                lease_id = self._lease_id
            if lease_id is None:
                continue
            try:
                if self._client.refresh_lease(lease_id) <= 0:
                    with self._lock:
                        if self._lease_id == lease_id:
                            self._lease_id = None  # expired: the next write grants a new one
            except EtcdError:
                # etcd may be briefly unreachable (failover, restart); the next tick retries and
                # the TTL leaves slack for that, so log and carry on rather than kill the thread.
                log.warning("Refreshing etcd lease %x failed; will retry.", lease_id, exc_info=True)

    def close(self, revoke: bool = False) -> None:
        """Stop refreshing and end the refresh thread; with ``revoke`` also delete the lease and its
        keys now. Returns within about two request timeouts even when etcd is unreachable (a
        refresh in flight, then the revocation); a lease that could not be revoked expires after
        its TTL."""
        self._stop.set()
        with self._lock:
            lease_id, self._lease_id = self._lease_id, None
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # A refresh in flight ends within the client's timeout; the thread then sees the stop.
            thread.join(self._client.timeout + 1.0)
        if revoke and lease_id is not None:
            try:
                self._client.revoke_lease(lease_id)
            except EtcdError:
                log.debug("Revoking etcd lease %x failed; it will expire on its own.", lease_id, exc_info=True)


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
    ) -> Watch:
        """Watch ``key`` (every key under it with ``prefix``) from ``start_revision`` on.

        ``no_put`` delivers deletions only (a watch of many keys that cares only about keys going
        away costs its watcher nothing while they are written). Returns at once; the watch is
        created on the stream asynchronously and delivers from ``start_revision`` regardless.
        """
        raw = _b(key)
        spec = _WatchSpec(raw, prefix_end(raw) if prefix else None, no_put, prev_kv, int(start_revision), on_events, on_resync)
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
        with self._lock:
            spec = self._specs.pop(local_id, None)
            if spec is None or spec.server_id is None or self._requests is None:
                return
            self._by_server_id.pop(spec.server_id, None)
            self._requests.put(etcdrpc.WatchRequest(cancel_request=etcdrpc.WatchCancelRequest(watch_id=spec.server_id)))

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
                while not self._closed and not self._specs:
                    self._lock.wait()
                if self._closed:
                    return
                requests: queue.Queue = queue.Queue()
                self._requests = requests
                self._pending = []
                self._by_server_id = {}
                for local_id, spec in self._specs.items():
                    spec.server_id = None
                    self._send_create(local_id, spec)
            try:
                stub = etcdrpc.WatchStub(self._client._raw.channel)
                call = stub.Watch(iter(requests.get, None), **self._client._grpc_kwargs())
                with self._lock:
                    self._call = call
                    if self._closed:
                        call.cancel()
                for response in call:
                    if self._down_since is not None:
                        log.warning("The etcd watch is back after %.1f s.", time.monotonic() - self._down_since)
                        self._down_since = None
                    backoff = 0.1
                    self._handle(response)
                error: BaseException | None = None
            except grpc.RpcError as exc:
                error = exc
            except etcd3.exceptions.NoServerAvailableError as exc:
                error = exc
            with self._lock:
                self._requests, self._call = None, None
                if self._closed:
                    return
            requests.put(None)
            code = error.code() if isinstance(error, grpc.RpcError) and callable(getattr(error, "code", None)) else None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, None):
                self._client._fail_endpoint()
            if self._down_since is None:
                self._down_since = time.monotonic()
                # A stream ends for expected reasons (a member restarting, a failover); say so once
                # per outage, and carry on: watches resume where they stopped.
                log.warning("The etcd watch stream at %s failed (%s); reconnecting.", self._client, _describe(error))
            time.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    def _handle(self, response) -> None:
        resync = None
        with self._lock:
            if response.created:
                local_id = self._pending.pop(0) if self._pending else None
                spec = self._specs.get(local_id) if local_id is not None else None
                if spec is None:  # cancelled before it was created
                    if self._requests is not None:
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
                log.error("etcd cancelled the watch of %r: %s", spec.key, response.cancel_reason or "no reason given")
                return
            events = [_event(e) for e in response.events]
            if events:
                spec.next_revision = max(spec.next_revision, events[-1].mod_revision + 1)
            callback = spec.on_events
        if resync is not None:
            _safe(resync)
        if events:
            _safe(callback, events)


def _event(event) -> WatchEvent:
    kind = "delete" if event.type == kv_pb2.Event.DELETE else "put"
    prev = _kv(event.prev_kv) if event.HasField("prev_kv") else None
    return WatchEvent(kind, event.kv.key, event.kv.value, int(event.kv.mod_revision), int(event.kv.lease), prev)


def _safe(callback: Callable, *args) -> None:
    try:
        callback(*args)
    except Exception:  # a subscriber's bug must not stop every other watch of the stream
        log.exception("An etcd watch callback failed.")


def _describe(error: BaseException | None) -> str:
    if isinstance(error, grpc.RpcError) and callable(getattr(error, "code", None)):
        return f"{error.code().name}: {error.details()}"
    return repr(error) if error is not None else "the server ended it"


class LeaseKeepAlive:
    """Keeps leases alive from one daemon thread over one gRPC stream; an expired lease is reported.

    Each lease is renewed every ``every`` seconds. A renewal is handled by the etcd leader in
    memory -- no raft entry, no disk write -- so an idle node costs etcd one small message per
    period. All renewals of this object share one long-lived ``LeaseKeepAlive`` stream (a call per
    renewal would cost a new stream and a gRPC thread each time); a renewal whose answer takes
    longer than ``deadline`` has its stream cancelled by a watchdog and the next member is tried. A
    failed renewal is retried at the next period (the lease's TTL leaves room for a few);
    ``on_expired`` is called once when etcd answers that the lease is gone.
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
        """Renew ``lease_id`` every ``every`` seconds from now on (replacing an earlier :meth:`add`)."""
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
            ttl = self._client._call(lambda: self._exchange(lease_id))
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
                _safe(callback, lease_id)

    def _exchange(self, lease_id: int) -> int:
        """One renewal on the stream (opened on the client's current member if needed): its TTL."""
        if self._responses is None:
            self._requests = queue.Queue()
            stub = etcdrpc.LeaseStub(self._client._raw.channel)
            self._responses = stub.LeaseKeepAlive(iter(self._requests.get, None), **self._client._grpc_kwargs())
        responses = self._responses
        self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))
        expired = _WATCHDOG.arm(responses, self._deadline)
        try:
            response = next(responses)
        except StopIteration:
            self._close_stream()
            raise self._client._connection_error("closed the lease keep-alive stream") from None
        except grpc.RpcError:
            self._close_stream()
            if expired.is_set():
                self._client._fail_endpoint()  # the next attempt goes to another member
                raise self._client._connection_error(f"did not renew a lease within {self._deadline:g} s") from None
            raise  # mapped (and retried on the next member when unavailable) by EtcdClient._call
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
