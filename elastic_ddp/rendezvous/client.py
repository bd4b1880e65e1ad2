"""A thin, exception-safe wrapper over the etcd v3 client (the only module importing ``etcd3``).

Everything above this module (the rendezvous backend, the c10d store, the plugin) talks to etcd
through :class:`EtcdClient` and sees only the exceptions defined here, so neither ``grpc`` nor
``etcd3`` types cross the module boundary.

Failover: the endpoint list is handed to ``etcd3.MultiEndpointEtcd3Client`` with failover on.
That client marks an endpoint failed on UNAVAILABLE / DEADLINE_EXCEEDED but does not retry the
request; :meth:`EtcdClient._call` retries once per endpoint, and only when the request cannot
have been applied (UNAVAILABLE: the connection was refused or dropped). A timed-out request is
reported, not retried, because a retried transaction could be applied twice; the next request
goes to the next endpoint.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import etcd3
import etcd3.exceptions
import etcd3.transactions
import etcd3.utils
import grpc

__all__ = [
    "DEFAULT_PORT",
    "EtcdAuthError",
    "EtcdClient",
    "EtcdConnectionError",
    "EtcdError",
    "KeyValue",
    "LeaseKeeper",
    "parse_endpoints",
]

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379

# After a connection failure an endpoint is skipped for this long. etcd3's default (300 s) would
# make a single-endpoint client useless for five minutes after one blip of its only server.
_ENDPOINT_RETRY_S = 1.0

_T = TypeVar("_T")


class EtcdError(Exception):
    """Base class of every error raised by :class:`EtcdClient`."""


class EtcdConnectionError(EtcdError):
    """No endpoint answered in time (refused, unreachable, timed out or unavailable)."""


class EtcdAuthError(EtcdError):
    """The user/password was rejected, or the user lacks permission for the request."""


@dataclass(frozen=True)
class KeyValue:
    """One stored key: its value and the revisions etcd uses for compare-and-set."""

    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


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
            etcd3.Endpoint(h, p, secure=creds is not None, creds=creds, time_retry=_ENDPOINT_RETRY_S)
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
        attempts = len(self._hosts)
        while True:
            try:
                return fn()
            except etcd3.exceptions.ConnectionFailedError as exc:
                attempts -= 1
                if attempts <= 0:
                    raise self._connection_error("is unavailable", exc) from exc
            except etcd3.exceptions.NoServerAvailableError as exc:
                raise self._connection_error("is unavailable (all endpoints failed recently)", exc) from exc
            except (etcd3.exceptions.ConnectionTimeoutError, etcd3.exceptions.WatchTimedOut) as exc:
                raise self._connection_error(f"did not answer within {self.timeout:g} s") from exc
            except grpc.RpcError as exc:
                code = exc.code() if callable(getattr(exc, "code", None)) else None
                details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
                if code == grpc.StatusCode.UNAVAILABLE:
                    # Raised raw by calls etcd3 does not wrap (authentication).
                    self._raw.endpoint_in_use.fail()
                    attempts -= 1
                    if attempts <= 0:
                        raise self._connection_error("is unavailable", exc) from exc
                    continue
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise self._connection_error(f"did not answer within {self.timeout:g} s") from exc
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

    # -- leases --------------------------------------------------------------------------------

    def grant_lease(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""
        return int(self._call(lambda: self._raw.lease(int(ttl))).id)

    def refresh_lease(self, lease_id: int) -> int:
        """Reset the lease to its full TTL; returns that TTL, or 0 if the lease has expired."""
        responses = self._call(lambda: list(self._raw.refresh_lease(lease_id)))
        return int(responses[0].TTL) if responses else 0

    def lease_ttl(self, lease_id: int) -> int:
        """Seconds left on the lease; -1 if it has expired or never existed."""
        return int(self._call(lambda: self._raw.get_lease_info(lease_id)).TTL)

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease, deleting every key attached to it."""
        self._call(lambda: self._raw.revoke_lease(lease_id))

    # -- watches -------------------------------------------------------------------------------

    def wait_for_change(self, key: bytes | str, start_revision: int, timeout: float, prefix: bool = False) -> bool:
        """Block until the key (or a key under the prefix) changes at or after ``start_revision``.

        Returns True when a change arrived, False when ``timeout`` seconds passed first. Passing
        the revision of a previous read (+1) makes this race-free: changes made between that read
        and the watch's creation are delivered too.
        """
        if timeout <= 0:
            return False
        kwargs = {"start_revision": start_revision}
        if prefix:
            kwargs["range_end"] = etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(key))
        try:
            self._call(lambda: self._raw.watch_once_response(key, timeout=timeout, **kwargs))
        except EtcdConnectionError as exc:
            # watch_once_response reports its own timeout as WatchTimedOut, which _call maps to a
            # connection error; tell the two apart by the cause.
            if isinstance(exc.__cause__, etcd3.exceptions.WatchTimedOut):
                return False
            raise
        return True


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
        """Stop refreshing; with ``revoke`` also delete the lease and its keys now."""
        self._stop.set()
        with self._lock:
            lease_id, self._lease_id = self._lease_id, None
        if revoke and lease_id is not None:
            try:
                self._client.revoke_lease(lease_id)
            except EtcdError:
                log.debug("Revoking etcd lease %x failed; it will expire on its own.", lease_id, exc_info=True)
