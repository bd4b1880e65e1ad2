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
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch.distributed as dist

from elastic_ddp.rendezvous.client import EtcdClient, EtcdError, KeyValue, LeaseKeeper

__all__ = ["DEFAULT_STORE_LEASE_TTL", "DEFAULT_STORE_TIMEOUT", "EtcdV3Store"]

DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)  # c10d's default store timeout
# Long enough to survive an etcd outage of a few minutes without losing keys (the keeper
# refreshes every ttl/3), short enough that a crashed run's keys go away soon.
DEFAULT_STORE_LEASE_TTL = 600


def _to_bytes(data: str | bytes | bytearray) -> bytes:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    raise TypeError(f"Store keys and values must be str or bytes, not {type(data).__name__}.")


def _seconds(timeout: timedelta | float) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class EtcdV3Store(dist.Store):
    """A :class:`torch.distributed.Store` keeping its keys under ``prefix`` in etcd.

    Args:
        client: The etcd client (owned by the caller).
        prefix: etcd key prefix for this store (a ``/`` is appended if missing).
        timeout: Default wait of ``get``/``wait`` (timedelta or seconds).
        lease_ttl: TTL of the lease every key is attached to, in seconds.

    Errors: a wait that times out raises :class:`torch.distributed.DistStoreError` (what torch's
    barrier code catches); etcd failures raise ``DistStoreError`` too, chained to the cause.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        timeout: timedelta | float = DEFAULT_STORE_TIMEOUT,
        lease_ttl: int = DEFAULT_STORE_LEASE_TTL,
    ) -> None:
        super().__init__()  # required by the pybind trampoline
        if not prefix:
            raise ValueError("The etcd store prefix must be a non-empty string.")
        self._client = client
        self._prefix = _to_bytes(prefix if prefix.endswith("/") else prefix + "/")
        self._lease = LeaseKeeper(client, lease_ttl, name="etcd-store-lease")
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

    # -- writes ------------------------------------------------------------------------------

    def set(self, key: str | bytes, value: str | bytes) -> None:
        """Write ``value`` under ``key`` (overwriting)."""
        self._etcd("set a key", lambda: self._client.put(self._key(key), _to_bytes(value), lease=self._lease.lease_id))

    def multi_set(self, keys: Sequence[str | bytes], values: Sequence[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values.")
        for key, value in zip(keys, values):
            self.set(key, value)

    def add(self, key: str | bytes, amount: int) -> int:
        """Atomically add ``amount`` to the decimal integer at ``key`` (missing = 0); returns the sum."""
        etcd_key = self._key(key)
        current: KeyValue | None = self._etcd("read a counter", self._client.get, etcd_key)
        while True:
            base = 0 if current is None else self._as_int(key, current.value)
            revision = 0 if current is None else current.mod_revision
            written, current = self._etcd(
                "update a counter",
                lambda: self._client.compare_and_put(
                    etcd_key, str(base + amount).encode(), revision, lease=self._lease.lease_id
                ),
            )
            if written:
                return base + amount
            # Lost the race: the transaction returned the winner's value; retry from it after a
            # short random pause so that many adders do not collide in lockstep.
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
        """Current values of the present keys, and a revision no later than any of the reads."""
        found, revision = {}, None
        for key in keys:
            kvs, rev = self._etcd("read a key", self._client.get_with_revision, self._key(key))
            revision = rev if revision is None else min(revision, rev)
            if kvs:
                found[_to_bytes(key)] = kvs[0].value
        return found, revision or 0

    def _wait_read(self, keys: Sequence[str | bytes], timeout: timedelta | float | None) -> dict[bytes, bytes]:
        wanted = [_to_bytes(k) for k in keys]
        seconds = _seconds(self.timeout if timeout is None else timeout)
        deadline = time.monotonic() + seconds
        while True:
            found, revision = self._read(wanted)
            if len(found) == len(set(wanted)):
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [k.decode(errors="replace") for k in wanted if k not in found]
                raise dist.DistStoreError(
                    f"Timed out after {seconds:g} s waiting for store keys {missing} under etcd prefix "
                    f"'{self.prefix}'."
                )
            # Any change under our prefix since the read wakes us; then re-read. Watching the
            # prefix (not each key) keeps it one watch however many keys are awaited.
            self._etcd(
                "watch for keys",
                lambda: self._client.wait_for_change(self._prefix, revision + 1, remaining, prefix=True),
            )

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

    def getNumKeys(self) -> int:  # noqa: N802
        return self.num_keys()

    def close(self, revoke: bool = False) -> None:
        """Stop the lease keeper; with ``revoke`` delete this store's keys written by this object."""
        self._lease.close(revoke=revoke)
