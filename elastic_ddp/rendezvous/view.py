"""A run's keys in etcd and one node's watched view of them.

Layout under ``<key_prefix>/<run_id>/``:

============================  ==============================================  ==================
key                           holds                                           lease
============================  ==============================================  ==================
``round``                     the round record (JSON, ~60 bytes; a closing    the run's lease
                              reason adds at most 2,000 characters)
``joins/<round>/<node>``      a node's registration for a round (its address)  the node's lease
``store/...``                 the c10d store's keys (``EtcdV3Store``)         the store's lease
============================  ==============================================  ==================

Round numbers in keys are zero-padded so that rounds sort numerically.

The run's lease has an id derived from the prefix and run id (:func:`run_lease_id`), so every
node of the run renews the same lease without agreeing on it first, and a run's round record
outlives any one node but expires ``run_ttl`` seconds after the last node of the run is gone.

:class:`RoundView` keeps what a node needs between etcd round trips -- the newest round record
and the departures of the members of its round -- from two watches on the node's one watch
stream, so that ``num_nodes_waiting()``, which torchrun's agent calls every monitor interval,
answers from memory: at 1,000 nodes and a 0.1 s interval that is 10,000 calls a second that cost
etcd nothing. What reaches a node: one event per change of the round record, and one per
departure of a member of its round; registrations of other nodes are filtered out by etcd
(``NOPUT``), so forming a round of N nodes costs each node O(1) events, not O(N).
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, replace

from elastic_ddp.etcd import EtcdClient, KeyValue, Range, WatchEvent, WatchStream
from elastic_ddp.rendezvous.rounds import RoundRecord

__all__ = ["RoundView", "RunKeys", "Snapshot", "run_lease_id"]


def run_lease_id(key_prefix: str, run_id: str) -> int:
    """The id of a run's shared lease: a positive 63-bit hash of ``<key_prefix>/<run_id>``."""
    digest = hashlib.sha256(f"{key_prefix.rstrip('/')}/{run_id}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF) or 1


@dataclass(frozen=True)
class RunKeys:
    """The etcd keys of one run."""

    key_prefix: str
    run_id: str

    @property
    def base(self) -> str:
        return f"{self.key_prefix.rstrip('/')}/{self.run_id}/"

    @property
    def round(self) -> bytes:
        return f"{self.base}round".encode()

    def joins(self, round_: int) -> bytes:
        """The prefix of round ``round_``'s registrations."""
        return f"{self.base}joins/{round_:012d}/".encode()

    def join(self, round_: int, node: str) -> bytes:
        return self.joins(round_) + node.encode()

    @property
    def store(self) -> str:
        return f"{self.base}store/"


@dataclass(frozen=True)
class Snapshot:
    """The round record as last seen: the record (None: absent), the revision it was written at
    (0: absent), the lease it is attached to, a counter that grows with every change seen, and
    the newest revision at which the record was read or watched."""

    record: RoundRecord | None
    mod_revision: int
    lease: int
    version: int
    read_revision: int = 0


class RoundView:
    """The newest round record of a run and the departures of one round's members, kept by watches.

    :meth:`start` reads the record once and watches it from there; :meth:`update` folds in
    what the node learnt from its own transactions (newer revisions win, so a watch event and the
    node's own write of the same change count once). :meth:`follow_members` watches the
    registrations of a completed round for deletions (a lease that ended: a node that left or
    died) and :meth:`gone` lists them.
    """

    def __init__(self, client: EtcdClient, keys: RunKeys, stream: WatchStream) -> None:
        self._client = client
        self._keys = keys
        self._stream = stream
        self._cond = threading.Condition()
        self._snapshot = Snapshot(None, 0, 0, 0)
        self._round_watch = None
        self._members_watch = None
        self._members: tuple[int, int, bytes | None] | None = None  # (round, completed_at, last member key)
        self._gone: set[bytes] = set()
        self._resynced = False

    # -- the round record ----------------------------------------------------------------------

    def start(self) -> Snapshot:
        """Read the record (one range read) and watch it from the revision after that read."""
        if self._round_watch is not None:
            return self.snapshot()
        result = self._client.range(Range(self._keys.round))
        self.update(result.kvs[0] if result.kvs else None, result.revision)
        self._round_watch = self._stream.watch(
            self._keys.round, self._on_round_events, start_revision=result.revision + 1, on_resync=self._on_resync
        )
        return self.snapshot()

    def snapshot(self) -> Snapshot:
        with self._cond:
            return self._snapshot

    def update(self, kv: KeyValue | None, revision: int) -> Snapshot:
        """Fold in the round key as read at ``revision`` (``kv`` None: absent at that revision)."""
        with self._cond:
            current = self._snapshot
            read = max(current.read_revision, revision)
            if kv is not None and kv.mod_revision > current.mod_revision:
                record = RoundRecord.decode(kv.value, self._keys.round.decode(), kv.mod_revision)
                self._set(Snapshot(record, kv.mod_revision, kv.lease, current.version + 1, read))
            elif kv is None and current.record is not None and revision > current.mod_revision:
                self._set(Snapshot(None, 0, 0, current.version + 1, read))
            elif read != current.read_revision:
                self._snapshot = replace(current, read_revision=read)
            return self._snapshot

    def wait(self, version: int, timeout: float) -> bool:
        """Block until the view changed after ``version`` (a record change, a member gone, a
        resync) or ``timeout`` seconds passed; True if it changed."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while self._snapshot.version == version:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def wake(self) -> None:
        """Wake whoever waits on the view (something outside it changed: the node's lease ended)."""
        with self._cond:
            self._set(replace(self._snapshot, version=self._snapshot.version + 1))

    def _set(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        self._cond.notify_all()

    def _on_round_events(self, events: list[WatchEvent]) -> None:
        for event in events:
            if event.kind == "put":
                self.update(KeyValue(event.key, event.value, event.mod_revision, 0, event.lease), event.mod_revision)
            else:
                self.update(None, event.mod_revision)

    def _on_resync(self) -> None:
        # Events were compacted away while the stream was down: the next read must go to etcd.
        with self._cond:
            self._resynced = True
            self._set(replace(self._snapshot, version=self._snapshot.version + 1))

    def take_resync(self) -> bool:
        """True once after the watch lost events to compaction (the caller re-reads the record)."""
        with self._cond:
            resynced, self._resynced = self._resynced, False
            return resynced

    def refresh(self) -> Snapshot:
        """Read the record from etcd now (after a resync)."""
        result = self._client.range(Range(self._keys.round))
        return self.update(result.kvs[0] if result.kvs else None, result.revision)

    # -- members of a completed round ----------------------------------------------------------

    def follow_members(self, round_: int, completed_at: int, last_member: bytes | None) -> None:
        """Watch round ``round_``'s registrations for deletions after ``completed_at``.

        A deletion counts when the key existed at ``completed_at`` (its create revision is not
        later) and sorts no later than ``last_member`` (None: every registration is a member).
        """
        self.stop_following()
        with self._cond:
            self._members = (round_, completed_at, last_member)
            self._gone = set()
        self._members_watch = self._stream.watch(
            self._keys.joins(round_), self._on_member_events, start_revision=completed_at + 1,
            prefix=True, no_put=True, prev_kv=True,
        )  # fmt: skip

    def stop_following(self) -> None:
        if self._members_watch is not None:
            self._members_watch.cancel()
            self._members_watch = None
        with self._cond:
            self._members = None
            self._gone = set()

    def gone(self) -> frozenset[bytes]:
        """Registration keys of the followed round's members that were deleted."""
        with self._cond:
            return frozenset(self._gone)

    def _on_member_events(self, events: list[WatchEvent]) -> None:
        with self._cond:
            if self._members is None:
                return
            _, completed_at, last_member = self._members
            for event in events:
                created = event.prev.create_revision if event.prev is not None else 0
                if event.kind != "delete" or not 0 < created <= completed_at:
                    continue
                if last_member is not None and event.key > last_member:
                    continue
                self._gone.add(event.key)
            if self._gone:
                self._set(replace(self._snapshot, version=self._snapshot.version + 1))

    def close(self) -> None:
        """Stop both watches and wake anyone waiting on the view."""
        self.stop_following()
        if self._round_watch is not None:
            self._round_watch.cancel()
            self._round_watch = None
        with self._cond:
            self._set(replace(self._snapshot, version=self._snapshot.version + 1))
