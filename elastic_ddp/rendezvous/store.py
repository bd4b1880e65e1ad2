"""A c10d ``Store`` on etcd v3, used by torch's rendezvous handler and elastic agent.

What uses it (torch 2.13): ``RendezvousStoreInfo.build`` (rank 0 ``set``s MASTER_ADDR/PORT, the
others ``get`` them, waiting), the agent's exit barrier (``add``, ``set``, ``wait`` with a short
timeout, expecting :class:`torch.distributed.DistStoreError`), and ``synchronize``/``get_all``
(``multi_get``). All keys arrive wrapped in a per-round ``PrefixStore``.

Layout: store key ``k`` lives at etcd key ``<prefix>/k`` with the value's raw bytes. Every key is
attached to one lease per store object, kept alive by a daemon thread while the process lives,
so the keys of a finished (or crashed) run expire ``lease_ttl`` seconds after its last process.
Blocking reads wait on an etcd watch started at the revision of the read that missed, so a key
written between the read and the watch is never missed and nothing polls.

``add`` survives failover exactly once. A connection can drop after etcd applied a write but
before the reply arrived; the client then retries on another member. A retried compare-and-set
of the counter fails its compare (the first attempt moved the revision), and without more the
caller could not tell "applied, reply lost" from "someone else added". So each ``add`` writes, in
the same transaction, a ledger key ``<prefix>.adds/<key>/<store id>`` holding the id of that
call; the retry's failure branch reads it back, and finding its own id means the first attempt
was applied. One ledger key per (store object, counter) is overwritten, never accumulated, and
lives on the store's lease; adds of one store object (and its clones) are serialised so the
ledger is not overwritten by a sibling in between.

Many keys at once go in few requests: writes (``multi_set``) in transactions of up to
``_MAX_TXN_OPS`` puts (etcd's default ``--max-txn-ops`` is 128), reads (``multi_get``, the
waits) as one range read over the span of the keys: at 1,000 nodes torch's agent on rank 0
reads and writes one key per node each round, which is 1 + 8 round trips this way instead of
2,000.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch.distributed as dist

from elastic_ddp.etcd import (
    Backoff, Compare, DeleteRange, EtcdClient, EtcdConnectionError, EtcdError, KeyValue, LeaseKeepAlive, Put, Range,
    WatchStream,
)  # fmt: skip

__all__ = ["DEFAULT_STORE_LEASE_TTL", "DEFAULT_STORE_TIMEOUT", "EtcdV3Store"]

log = logging.getLogger(__name__)

DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)  # c10d's default store timeout
# Long enough to survive an etcd outage of a few minutes without losing keys (the keeper
# refreshes every ttl/3), short enough that a crashed run's keys go away soon.
DEFAULT_STORE_LEASE_TTL = 600
_MAX_TXN_OPS = 128  # etcd's default --max-txn-ops


def _to_bytes(data: str | bytes | bytearray) -> bytes:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    raise TypeError(f"Store keys and values must be str or bytes, not {type(data).__name__}.")


def _seconds(timeout: timedelta | float) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class _Lease:
    """The store's lease: granted at the first write, renewed every ``ttl / 3`` seconds, granted
    anew after it expired (etcd unreachable for longer than the TTL); writers read
    :attr:`lease_id` at each write so new keys attach to the live lease."""

    def __init__(self, client: EtcdClient, ttl: int) -> None:
        if ttl < 1:
            raise ValueError(f"The lease TTL ({ttl}) must be at least one second.")
        self._client = client
        self.ttl = int(ttl)
        self._lock = threading.Lock()
        self._lease_id: int | None = None
        self._closed = False
        # A renewal may wait for as long as any request (the TTL leaves room for several).
        self._keep_alive = LeaseKeepAlive(client, client.timeout, name="etcd-store-lease")

    @property
    def lease_id(self) -> int:
        with self._lock:
            if self._lease_id is None:
                self._lease_id = self._client.grant_lease(self.ttl)
                if not self._closed:  # a write after close() gets a lease that simply expires
                    self._keep_alive.add(self._lease_id, max(self.ttl / 3.0, 0.5), self._expired)
            return self._lease_id

    def _expired(self, lease_id: int) -> None:
        with self._lock:
            if self._lease_id == lease_id:
                self._lease_id = None  # the next write grants a new one

    def close(self, revoke: bool = False) -> None:
        """Stop renewing; with ``revoke`` also delete the lease and its keys now. Returns within
        about two request timeouts even when etcd is unreachable (a renewal in flight, then the
        revocation); a lease that could not be revoked expires after its TTL."""
        with self._lock:
            self._closed = True
        self._keep_alive.close()
        with self._lock:
            lease_id, self._lease_id = self._lease_id, None
        if revoke and lease_id is not None:
            try:
                self._client.revoke_lease(lease_id)
            except EtcdError:
                log.debug("Revoking etcd lease %x failed; it will expire on its own.", lease_id, exc_info=True)


class _Shared:
    """What a store and its clones share: the lease, the watch stream of the blocking reads, the
    add lock and ledger identity, the clones."""

    def __init__(self, client: EtcdClient, lease_ttl: int) -> None:
        self.lease = _Lease(client, lease_ttl)
        self.watches = WatchStream(client, name="etcd-store-watch")
        self.lock = threading.Lock()
        self.add_lock = threading.Lock()
        self.store_id = uuid.uuid4().hex
        self._calls = itertools.count()
        self.clones: list[EtcdV3Store] = []

    def next_call_id(self) -> bytes:
        return f"{self.store_id}:{next(self._calls)}".encode()

    @staticmethod
    def ledger_prefix(store_prefix: bytes) -> bytes:
        # Beside the store's prefix, not under it: ledger keys are no store keys.
        return store_prefix.rstrip(b"/") + b".adds/"

    def ledger_key(self, store_prefix: bytes, key: bytes) -> bytes:
        # The counter's key first, so that a range of store keys and its ledger range line up.
        return self.ledger_prefix(store_prefix) + key + b"/" + self.store_id.encode()


class EtcdV3Store(dist.Store):
    """A :class:`torch.distributed.Store` keeping its keys under ``prefix`` in etcd.

    Args:
        client: The etcd client (owned by the caller).
        prefix: etcd key prefix for this store (a ``/`` is appended if missing).
        timeout: Default wait of ``get``/``wait`` (timedelta or seconds).
        lease_ttl: TTL of the lease every key is attached to, in seconds.

    Errors: a wait that times out raises :class:`torch.distributed.DistStoreError` whose message
    says "timeout" (what torch's barrier code catches and what users search logs for); etcd
    failures raise ``DistStoreError`` too, chained to the cause.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        timeout: timedelta | float = DEFAULT_STORE_TIMEOUT,
        lease_ttl: int = DEFAULT_STORE_LEASE_TTL,
        *,
        _shared: _Shared | None = None,
    ) -> None:
        super().__init__()  # required by the pybind trampoline
        if not prefix:
            raise ValueError("The etcd store prefix must be a non-empty string.")
        self._client = client
        self._prefix = _to_bytes(prefix if prefix.endswith("/") else prefix + "/")
        self._shared = _shared or _Shared(client, lease_ttl)
        self._lease = self._shared.lease
        self.set_timeout(timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout))

    @property
    def prefix(self) -> str:
        return self._prefix.decode()

    def _key(self, key: str | bytes) -> bytes:
        return self._prefix + _to_bytes(key)

    def _etcd(self, what: str, fn, *args):
        """Call the client, turning its errors into the c10d store error type."""
        try:
            return fn(*args)
        except EtcdError as exc:
            raise dist.DistStoreError(f"The etcd store could not {what}: {exc}") from exc

    def clone(self) -> EtcdV3Store:
        """Another store object on the same keys, client and lease, for use from another thread.

        torch calls this from C++ (e.g. when it splits or shrinks a process group) and holds only
        a C++ reference to the result; pybind drops the Python half of an object no Python name
        refers to, after which C++ calls into it fail with "Not implemented". The original store
        therefore keeps every clone alive (a few hundred bytes each; torch clones once per group
        it creates).
        """
        twin = EtcdV3Store(self._client, self.prefix, self.timeout, _shared=self._shared)
        with self._shared.lock:
            self._shared.clones.append(twin)
        return twin

    # -- writes ------------------------------------------------------------------------------

    def set(self, key: str | bytes, value: str | bytes) -> None:
        """Write ``value`` under ``key`` (overwriting)."""
        self._etcd("set a key", lambda: self._client.put(self._key(key), _to_bytes(value), lease=self._lease.lease_id))

    def multi_set(self, keys: Sequence[str | bytes], values: Sequence[str | bytes]) -> None:
        """Write every pair, in transactions of up to 128 puts."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values.")
        pairs = list(zip(keys, values))
        for start in range(0, len(pairs), _MAX_TXN_OPS):
            lease = self._lease.lease_id
            puts = [Put(self._key(k), _to_bytes(v), lease) for k, v in pairs[start : start + _MAX_TXN_OPS]]
            self._etcd("set keys", self._client.txn, [], puts)

    def add(self, key: str | bytes, amount: int) -> int:
        """Atomically add ``amount`` to the decimal integer at ``key`` (missing = 0); returns the sum.

        Applied exactly once even when a reply is lost and the request retried on another member
        (see the module docstring).
        """
        etcd_key = self._key(key)
        ledger = self._shared.ledger_key(self._prefix, _to_bytes(key))
        with self._shared.add_lock:
            call_id = self._shared.next_call_id()
            current: KeyValue | None = self._etcd("read a counter", self._client.get, etcd_key)
            while True:
                base = 0 if current is None else self._as_int(key, current.value)
                revision = 0 if current is None else current.mod_revision
                total = base + amount
                lease = self._lease.lease_id
                result = self._etcd(
                    "update a counter",
                    self._client.txn,
                    [Compare.mod_revision(etcd_key, revision)],
                    [Put(etcd_key, str(total).encode(), lease), Put(ledger, call_id, lease)],
                    [Range(etcd_key), Range(ledger)],
                )
                if result.succeeded:
                    return total
                counter, last = result.results
                if last.kvs and last.kvs[0].value == call_id:
                    # This call's first attempt was applied; only its reply was lost.
                    return total
                # Lost the race: retry from the winner's value after a short random pause so
                # that many adders do not collide in lockstep.
                current = counter.kvs[0] if counter.kvs else None
                time.sleep(random.uniform(0, 0.01))

    @staticmethod
    def _as_int(key, value: bytes) -> int:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"The store value of key {key!r} ({value!r}) is not an integer, so add() cannot apply.") from None

    def compare_set(self, key: str | bytes, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """c10d semantics: set ``desired`` if the key holds ``expected`` (or is missing and
        ``expected`` is empty); return the value now stored. A missing key with a non-empty
        ``expected`` returns ``expected`` unchanged, as TCPStore does."""
        etcd_key, expected, desired = self._key(key), _to_bytes(expected_value), _to_bytes(desired_value)
        current: KeyValue | None = self._etcd("read a key", self._client.get, etcd_key)
        while True:
            if current is None and expected:
                return expected
            if current is not None and current.value != expected:
                return current.value
            revision = 0 if current is None else current.mod_revision
            written, current = self._etcd(
                "compare-and-set a key",
                lambda: self._client.compare_and_put(etcd_key, desired, revision, lease=self._lease.lease_id),
            )
            if written:
                return desired

    def delete_key(self, key: str | bytes) -> bool:
        """Delete ``key``; True if it existed."""
        return self._etcd("delete a key", self._client.delete, self._key(key))

    # -- reads -------------------------------------------------------------------------------

    def _read(self, keys: Iterable[str | bytes]) -> tuple[dict[bytes, bytes], int]:
        """Current values of the present keys, and the revision they were read at.

        One range read from the smallest of the keys to the largest: the many keys torch reads
        at once (one per node, e.g. ``role_info/<rank>``) sort together. Should other keys lie
        between them, so that the span holds more than a few times as many keys as wanted, each key
        is read on its own, all as of one revision (range reads pinned to it; see
        :meth:`EtcdClient.txn` on why not one read-only transaction)."""
        wanted = list(dict.fromkeys(_to_bytes(k) for k in keys))
        if not wanted:
            return {}, 0
        full = sorted(self._key(k) for k in wanted)
        span = self._etcd("read keys", self._client.range, Range(full[0], full[-1] + b"\0", limit=2 * len(full) + 16))
        if span.count <= len(span.kvs):  # the whole span came back
            values = {kv.key: kv.value for kv in span.kvs}
            return {k: values[self._key(k)] for k in wanted if self._key(k) in values}, span.revision
        result = self._etcd("read keys", self._client.txn, [], [Range(self._key(k)) for k in wanted])
        found = {k: read.kvs[0].value for k, read in zip(wanted, result.results) if read.kvs}
        return found, result.revision

    def _wait_read(self, keys: Sequence[str | bytes], timeout: timedelta | float | None) -> dict[bytes, bytes]:
        wanted = [_to_bytes(k) for k in keys]
        seconds = _seconds(self.timeout if timeout is None else timeout)
        deadline = time.monotonic() + seconds
        backoff = Backoff(deadline)
        while True:
            try:
                found, revision = self._read(wanted)
                if len(found) == len(set(wanted)):
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [k.decode(errors="replace") for k in wanted if k not in found]
                    raise dist.DistStoreError(
                        f"Store wait timeout after {seconds:g} s: the keys {missing} under etcd prefix "
                        f"'{self.prefix}' were not set."
                    )
                # Any change under our prefix since the read wakes us; then re-read. Watching the
                # prefix (not each key) keeps it one watch however many keys are awaited.
                self._etcd(
                    "watch for keys",
                    lambda: self._shared.watches.wait_for_change(self._prefix, revision + 1, remaining, prefix=True),
                )
            except dist.DistStoreError as exc:
                # etcd did not answer in time (overloaded, electing a leader): the wait's own
                # timeout, not one request's, decides when to give up.
                if not isinstance(exc.__cause__, EtcdConnectionError) or not backoff.pause():
                    raise

    def get(self, key: str | bytes) -> bytes:
        """The value of ``key``, waiting up to the store timeout for it to be set."""
        return self._wait_read([key], None)[_to_bytes(key)]

    def multi_get(self, keys: Sequence[str | bytes]) -> list[bytes]:
        found = self._wait_read(keys, None)
        return [found[_to_bytes(k)] for k in keys]

    def wait(self, keys: Sequence[str | bytes], timeout: timedelta | None = None) -> None:
        """Block until every key exists (up to ``timeout``, default the store timeout)."""
        self._wait_read(keys, timeout)

    def check(self, keys: Sequence[str | bytes]) -> bool:
        """True if every key exists now (no waiting)."""
        found, _ = self._read(keys)
        return len(found) == len({_to_bytes(k) for k in keys})

    # torch's pybind trampoline forwards these two under their C++ names.
    def deleteKey(self, key: str | bytes) -> bool:  # noqa: N802
        return self.delete_key(key)

    def num_keys(self) -> int:
        """How many keys this store holds (all rounds)."""
        return self._etcd("count keys", self._client.count_prefix, self._prefix)

    def delete_range_ops(self, start: str, end: str) -> list[DeleteRange]:
        """Transaction operations deleting the store keys in ``[start, end)`` and their add ledger
        entries (for a caller that folds the cleanup into a write it makes anyway)."""
        ledger = self._shared.ledger_prefix(self._prefix)
        return [
            DeleteRange(self._key(start), self._key(end)),
            DeleteRange(ledger + _to_bytes(start), ledger + _to_bytes(end)),
        ]

    def list_keys(self) -> list[str]:
        """Every key this store holds, in etcd's (byte) order."""
        result = self._etcd("list keys", self._client.range, Range.prefix(self._prefix, keys_only=True))
        return [kv.key[len(self._prefix) :].decode(errors="replace") for kv in result.kvs]

    def getNumKeys(self) -> int:  # noqa: N802
        return self.num_keys()

    def close(self, revoke: bool = False) -> None:
        """Stop renewing the lease (shared with the clones); with ``revoke`` also delete every key
        written through this store or its clones."""
        self._lease.close(revoke=revoke)
