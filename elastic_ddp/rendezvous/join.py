"""The rendezvous protocol carried out against etcd: :class:`JoinExecutor` does for one node what
:func:`elastic_ddp.rendezvous.rounds.decide` asks for, one step at a time, as torch's
``DynamicRendezvousHandler`` has its op executor apply what its ops decide. torchrun's agent reaches
it through the handler (:mod:`elastic_ddp.rendezvous.handler`); what the node does for its workers
is not its business (:mod:`elastic_ddp.rendezvous.node`).

The protocol (:mod:`elastic_ddp.rendezvous.rounds`, keys in :mod:`elastic_ddp.rendezvous.view`):
each node owns a lease (:mod:`elastic_ddp.rendezvous.lease`) and, while it takes part in a round,
one registration key under it; liveness is the lease (no clocks of different hosts are compared),
death is the lease ending, which every member of the node's round sees through a watch. A round is
decided by small compare-and-set transactions on one round record; ranks are read with O(1)-sized
range reads.

What it costs etcd (N nodes; "write" = one raft entry):

* Forming a round: per node one transaction to register (the first node's also opens the round)
  and O(1)-sized reads; one transaction starts the last call and one completes the round.
  ~N + 2 writes, none of them larger than ~200 bytes; each node receives O(1) watch events.
* Steady state (a completed round, training): nothing but lease renewals, one small request per
  node per ``keep_alive_interval``, handled by the etcd leader in memory -- no raft entry, no
  revision, no database growth. ``num_nodes_waiting()`` is answered from watched state.
* A node leaving: its lease ends (revoked at exit, or expired ``keep_alive_interval *
  keep_alive_max_attempt`` seconds after it stopped renewing): one deletion, one event per member.
* Live data: ~100 bytes per node plus the round record and torch's per-round store keys (the
  completing node deletes the store keys of rounds before the previous one).

Beyond torch's protocol:

* **Round numbers only grow**: the first round of a run is numbered after the etcd revision it was
  created at, so even a run whose keys expired and were created again never reuses a number
  (checkpoint commits are fenced by it).
* **A dead node holds up no round and is noticed in moments** (:mod:`elastic_ddp.rendezvous.liveness`
  says how). The node that starts a round's last call probes the previous round's nodes that have
  not come over -- at most ``_PROBE_LIMIT`` at a time, by one node: O(1) connections and one read
  per probe, whatever the job's size. While a round trains, each member probes the next member in
  key order, the last the first (*the successor watch*, one connection per
  ``_SUCCESSOR_PROBE_INTERVAL_S``; the successor is read in the same transaction that tells the node
  its rank). A refusal removes the registration (compare-and-delete on the key as read), so the
  round completes as soon as every surviving node is back, and every member of a training round
  sees the departure through its watch.
* **The first round waits for the start-up skew of a cluster**: its last call lasts
  ``first_round_timeout`` (torch's 30 s; it ends at once when ``max_nodes`` registered), so nodes
  started seconds apart form one round instead of costing the job one restart each; later rounds
  use ``last_call_timeout``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, replace

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from elastic_ddp.etcd import (
    Backoff, Compare, DeleteRange, EtcdClient, EtcdCompactedError, EtcdConnectionError, EtcdError,
    EtcdLeaseNotFoundError, KeyValue, Put, Range, TxnResult, WatchStream, prefix_end,
)  # fmt: skip
from elastic_ddp.rendezvous.lease import NodeLease
from elastic_ddp.rendezvous.liveness import LivenessListener, SuccessorWatch, parse_address, probe
from elastic_ddp.rendezvous.rounds import (
    COMPLETE, LAST_CALL, OPEN, RoundRecord, Seen, Step, decide, node_key,
)  # fmt: skip
from elastic_ddp.rendezvous.settings import HandlerSettings
from elastic_ddp.rendezvous.store import EtcdV3Store
from elastic_ddp.rendezvous.view import RoundView, RunKeys, Snapshot, run_lease_id

__all__ = ["InvalidSettingsError", "JoinExecutor"]

log = logging.getLogger(__name__)

# Numbers the nodes of one process apart (torch's launcher tests run many agents in one process).
_LOCAL_IDS = itertools.count()
_LOCAL_IDS_LOCK = threading.Lock()
# A waiting node re-reads the round record at least this often, in case its watch is stuck on a
# member that stopped answering without closing the connection.
_MAX_WAIT_S = 10.0
# How often a node waiting for the previous round's nodes counts them again (they move over with
# a write the waiting node sees anyway; this catches those that died instead).
_PREVIOUS_RECHECK_S = 1.0
# Nodes that find no round record wait up to this long (at random) before creating it, as torch
# does before its first round: of 1,000 nodes starting together, most then see the record the
# first one created (through their watch) instead of each sending a transaction that fails.
_CREATE_JITTER_S = 0.3
# The node that called a round probes the previous round's stragglers this long after its call
# (the live ones are moving over meanwhile), then every _PROBE_INTERVAL_S; at most _PROBE_LIMIT
# of them (more left means the others are still stopping their workers: nothing to decide yet),
# each for at most _PROBE_TIMEOUT_S.
_PROBE_DELAY_S = 0.1
_PROBE_INTERVAL_S = 0.5
_PROBE_LIMIT = 64
_PROBE_TIMEOUT_S = 0.5
# While a round trains, each member probes the next one this often (the successor watch, module docstring).
_SUCCESSOR_PROBE_INTERVAL_S = 0.25


class InvalidSettingsError(RendezvousClosedError):
    """The rendezvous is closed because a worker's settings are invalid; the message ends with them.

    A ``RendezvousClosedError``: torch's agent does not catch it, so torchrun exits 1 with it as the
    last thing it prints, on every node.
    """


@dataclass
class _Knowledge:
    """What one call of next_rendezvous learnt about rounds it does not take part in yet."""

    count: int | None = None
    previous_left: int | None = None
    rejected: int | None = None
    size: tuple[int, int, int] | None = None  # (round, members, registrations at completion)
    last_call: tuple[int, int, float] | None = None  # (round, record revision, due)
    calling: int | None = None  # the round whose last call this node started (it probes for it)
    next_probe: float = 0.0  # monotonic
    spare: bool = False
    create_delayed: bool = False
    deadline: float = 0.0  # monotonic; the join timeout's (a spare that may take part gets a new one)


class JoinExecutor:
    """Carries out the steps :func:`~elastic_ddp.rendezvous.rounds.decide` returns for one node, against
    etcd: registration, counts, last call, completion, membership, and the round record's closing.
    Holds what that takes: the node's lease, its liveness port, the watched view of the run and,
    while the node is a member of a round, the probe of its successor.

    Thread safety: :meth:`join` runs in one thread at a time (torchrun's agent's); :meth:`stop`,
    :meth:`revoke_early` and the view's questions may come from any other.

    Args:
        client: The etcd client; the caller owns it and closes it after :meth:`stop`.
        store: The c10d store of the run: completing a round drops its keys of rounds before the
            previous one in the same write.
        settings: Node counts, timeouts, liveness and the key prefix.
        addr: This node's address, in its name and its liveness port's.
    """

    def __init__(self, client: EtcdClient, store: EtcdV3Store, settings: HandlerSettings, addr: str) -> None:
        self._client = client
        self._store = store
        self._settings = settings
        with _LOCAL_IDS_LOCK:
            local_id = next(_LOCAL_IDS)
        self._node = node_key(addr, os.getpid(), local_id)
        self._node_text = f"{addr}_{os.getpid()}_{local_id}"
        self._keys = RunKeys(settings.key_prefix, settings.run_id)
        self._run_lease = run_lease_id(settings.key_prefix, settings.run_id)
        self._stream = WatchStream(client, name=f"rdzv-watch-{local_id}")
        self._view = RoundView(client, self._keys, self._stream)
        # A join waiting in a round must register again when the lease ends (see _register_again).
        self._lease = NodeLease(client, settings, self._node_text, self._view.wake, name=f"rdzv-keep-alive-{local_id}")
        try:
            self._liveness: LivenessListener | None = LivenessListener(addr)
        except OSError as exc:  # the others then notice this node's death by its lease, as before
            log.warning("The node '%s' cannot listen for liveness probes (%s).", self._node_text, exc)
            self._liveness = None
        registration = {"node": self._node_text, **({"probe": self._liveness.address} if self._liveness else {})}
        self._registration = json.dumps(registration, separators=(",", ":"))
        self._registered: int | None = None  # the round this node has a registration key in
        self._joined: int | None = None  # the last round this node was a member of
        self._joined_total = 0  # registrations of that round at its completion
        self._successor: SuccessorWatch | None = None
        self._left = False

    @property
    def node(self) -> str:
        """This node as torch would name it: ``<address>_<pid>_<n>``."""
        return self._node_text

    @property
    def view(self) -> RoundView:
        """The run's round record and the departures of this node's round, as watched (no request)."""
        return self._view

    @property
    def joined(self) -> int | None:
        """The last round this node was a member of; None before its first."""
        return self._joined

    @property
    def joined_total(self) -> int:
        """Registrations of that round at its completion (more than one: other nodes took part)."""
        return self._joined_total

    @property
    def left(self) -> bool:
        """Whether :meth:`stop` was called: the node cannot join again."""
        return self._left

    def stop_following(self) -> None:
        """Stop watching the members of the last round and probing its successor: a new join begins."""
        self._view.stop_following()
        self._stop_successor_watch()

    def revoke_early(self, why: str) -> None:
        """Leave the round now, while the agent goes on (see :meth:`NodeLease.revoke_early`)."""
        self._lease.revoke_early(why)

    def stop(self) -> None:
        """End every thread the executor runs (successor probe, watches, renewals, liveness port);
        a join under way, and every later one, fails with ``RendezvousClosedError``. The node's
        lease stays until :meth:`revoke` (or its expiry)."""
        self._left = True
        self._stop_successor_watch()
        self._view.close()
        self._lease.stop()
        self._stream.close()
        if self._liveness is not None:
            self._liveness.close()

    def revoke(self) -> bool:
        """Revoke the node's lease, taking its registration with it; False when etcd was unreachable."""
        return self._lease.revoke()

    # -- joining -------------------------------------------------------------------------------

    def join(self) -> tuple[int, int, int]:
        """The protocol loop: (rank, world size, round) once a round completed with this node.

        etcd being slow or out of reach (a leader election, a restarted or overloaded member) does
        not fail the join while its timeout lasts: the step is tried again after a pause. Every
        write of the protocol is a compare-and-set on the round record or a put of this node's own
        key, so a step whose reply was lost can be repeated.

        Raises what :meth:`_join_step` raises, and ``EtcdConnectionError`` once etcd did not answer until
        the join timeout.
        """
        known = _Knowledge(deadline=time.monotonic() + self._settings.join_timeout)
        backoff, failing_since = Backoff(known.deadline), None
        while True:
            try:
                member = self._join_step(known)
            except EtcdConnectionError as exc:
                backoff.deadline = known.deadline  # a spare that may take part got a new one
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("etcd did not answer node '%s' while it joins the rendezvous '%s' (%s); trying again "
                                "until the join timeout.", self._node_text, self._settings.run_id, exc)  # fmt: skip
                if not backoff.pause():
                    raise
                continue
            if failing_since is not None:
                log.warning("etcd answers node '%s' again after %.1f s.", self._node_text,
                            time.monotonic() - failing_since)  # fmt: skip
                backoff.reset()
                failing_since = None
            if member is not None:
                return member

    def _join_step(self, known: _Knowledge) -> tuple[int, int, int] | None:
        """One decision of the protocol and its step: (rank, world size, round) once this node is
        a member of a completed round, else None."""
        settings = self._settings
        if self._left:
            raise RendezvousClosedError(f"The node '{self._node_text}' has left the rendezvous '{settings.run_id}'.")
        self._lease.ensure()
        self._view.start()
        if self._view.take_resync():
            self._view.refresh()
        if self._lease.take_lost():
            self._register_again(known)
        snap = self._view.snapshot()
        self._lease.renew_run_lease(snap.lease)
        record = snap.record
        now = time.monotonic()
        due = self._last_call_due(record, snap, known, now)
        size = known.size[1] if known.size and record and known.size[0] == record.round else None
        seen = Seen(
            record, self._registered, known.count, known.previous_left, self._joined, known.rejected, size,
            bool(self._view.gone()) if known.spare else False, due, known.spare,
        )  # fmt: skip
        step, why = decide(seen, settings.min_nodes, settings.max_nodes, now, known.deadline)
        log.debug("Rendezvous '%s', node '%s': %s, because %s.", settings.run_id, self._node_text, step.value, why)
        try:
            if step is Step.CHECK_MEMBERSHIP:
                member = self._membership(record, known)
                if member is not None:
                    return member
            elif step is Step.CREATE:
                if known.create_delayed:
                    self._create(snap, known)
                else:
                    known.create_delayed = True
                    self._view.wait(snap.version, random.uniform(0, _CREATE_JITTER_S))
            elif step is Step.REGISTER:
                self._register(snap, known, record.round, opening=False, previous=record.previous)
            elif step is Step.OPEN_NEXT:
                if known.spare:  # as in torch: a spare that may take part gets a fresh join deadline
                    known.deadline = time.monotonic() + settings.join_timeout
                    known.spare = False
                    self._view.stop_following()
                self._register(snap, known, record.round + 1, opening=True, previous=self._total(record, known))
            elif step is Step.MARK_LAST_CALL:
                self._mark_last_call(snap, known)
            elif step is Step.COMPLETE:
                self._complete(snap, known)
            elif step is Step.MEASURE:
                known.size = (record.round, *self._round_size(record))
            elif step is Step.WAIT_FOR_PREVIOUS:
                self._wait(snap, min(_PREVIOUS_RECHECK_S, max(known.deadline - time.monotonic(), 0.0)))
                self._recount(record, known)
            elif step is Step.WAIT:
                probing = known.calling == record.round and record.previous and record.state == LAST_CALL
                if probing and now >= known.next_probe:
                    known.next_probe = now + _PROBE_INTERVAL_S
                    if self._probe_previous(record, known):
                        return None  # decide again with the new counts
                wake = min(known.deadline, due if due is not None else known.deadline)
                if probing:
                    wake = min(wake, known.next_probe)
                self._wait(snap, min(max(wake - time.monotonic(), 0.0), _MAX_WAIT_S))
            elif step is Step.WAIT_REDUNDANT:
                if self._registered != record.round and not self._register_as_spare(snap, known):
                    return None  # the record moved on: decide again
                if not known.spare:
                    known.spare = True
                    self._view.follow_members(record.round, record.completed_at, None)
                    log.info("Round %d of the rendezvous '%s' is full; the node '%s' waits as a spare.",
                             record.round, settings.run_id, self._node_text)  # fmt: skip
                self._wait(snap, _MAX_WAIT_S)
            elif step is Step.TIMEOUT:
                self._withdraw()
                raise RendezvousTimeoutError(
                    f"The node '{self._node_text}' could not join the rendezvous '{settings.run_id}' within the "
                    f"join timeout ({settings.join_timeout:g} s): {why}."
                )
            elif step is Step.CLOSED:
                if record.reason:
                    raise InvalidSettingsError(f"The rendezvous '{settings.run_id}' is closed: {record.reason}")
                raise RendezvousClosedError(f"The rendezvous '{settings.run_id}' is closed.")
            elif step is Step.GRACEFUL_EXIT:
                raise RendezvousGracefulExitError(f"The rendezvous '{settings.run_id}' is closed; {why}.")
        except EtcdLeaseNotFoundError:
            # A lease named in the write ended: this node's (etcd unreachable for longer than
            # its TTL; its registration went with it) or the run's (the round record with it).
            # Start over with a new lease and a fresh look at the record.
            log.warning("A lease of the rendezvous ended under node '%s'; registering again.", self._node_text)
            self._lease.forget()
            self._registered = None
            known.count = None
            self._lease.ensure()
            self._view.refresh()

    def _register_again(self, known: _Knowledge) -> None:
        """This node's lease ended while it was joining: its registration went with it, so the
        round would wait for a node that no longer counts (or complete without it). Register again,
        under a new lease -- unless the round it registered for already completed with it: the
        registration existed at ``completed_at``, so it is a member, and the others will see it
        leave and start a new round."""
        record = self._view.snapshot().record
        registered = self._registered
        member = (record is not None and record.state == COMPLETE and record.round == registered
                  and known.rejected != registered)  # fmt: skip
        if registered is None or member:
            return
        log.warning("The lease of node '%s' ended while it waited in round %d of the rendezvous '%s'; it registers "
                    "again.", self._node_text, registered, self._settings.run_id)  # fmt: skip
        self._registered = None  # a spare registers again as a spare (WAIT_REDUNDANT)
        known.count = None

    def _last_call_due(self, record: RoundRecord | None, snap: Snapshot, known: _Knowledge, now: float) -> float | None:
        """When this node completes a round in last call: the node that started the last call
        after ``last_call_timeout``; every other registered node later, as a stand-in in case
        that node died (after a lease TTL more, plus up to a second of jitter so that stand-ins
        do not all write at once)."""
        if record is None or record.state != LAST_CALL or self._registered != record.round:
            known.last_call = None
            return None
        if known.last_call is None or known.last_call[:2] != (record.round, snap.mod_revision):
            stand_in = self._last_call_timeout(record) + self._settings.lease_ttl + random.uniform(0, 1.0)
            known.last_call = (record.round, snap.mod_revision, now + stand_in)
        return known.last_call[2]

    def _wait(self, snap: Snapshot, timeout: float) -> None:
        if not self._view.wait(snap.version, timeout) and timeout >= _MAX_WAIT_S:
            self._view.refresh()  # nothing for a while: make sure the watch did not miss it

    def _registration_ops(self, round_: int, previous: int) -> list:
        """Delete this node's older registration, write the new one, count the round's (and those
        still left in the round before, when it had any)."""
        ops: list = []
        if self._registered is not None and self._registered != round_:
            ops.append(DeleteRange(self._keys.join(self._registered, self._node)))
        lease = self._lease.ensure()
        ops.append(Put(self._keys.join(round_, self._node), self._registration, lease))
        ops.extend(self._count_ops(round_, previous))
        return ops

    def _count_ops(self, round_: int, previous: int) -> list:
        ops = [Range.prefix(self._keys.joins(round_), count_only=True)]
        if previous and round_ >= 1:
            ops.append(Range.prefix(self._keys.joins(round_ - 1), count_only=True))
        return ops

    def _take_counts(self, results: list, previous: int, known: _Knowledge) -> None:
        if previous:
            known.count, known.previous_left = results[-2].count, results[-1].count
        else:
            known.count, known.previous_left = results[-1].count, None

    def _recount(self, record: RoundRecord, known: _Knowledge) -> None:
        """Read the round's registrations and those left in the round before (one read-only
        transaction)."""
        result = self._client.txn([], self._count_ops(record.round, record.previous))
        self._take_counts(result.results, record.previous, known)

    def _total(self, record: RoundRecord, known: _Knowledge) -> int:
        """Registrations of the completed ``record`` at its completion, as far as known (0: not)."""
        if self._joined == record.round:
            return self._joined_total
        if known.size is not None and known.size[0] == record.round:
            return known.size[2]
        return 0

    def _apply(self, result: TxnResult, written: RoundRecord | None) -> None:
        """Fold a transaction on the round record into the view: ours when it succeeded (the
        record we wrote, at the transaction's revision), the current one (read in the failure
        branch) when it did not."""
        if result.succeeded:
            if written is not None:
                kv = KeyValue(self._keys.round, written.encode(), result.revision, 0, 0)
                self._view.update(kv, result.revision)
            return
        current = result.results[-1]
        self._view.update(current.kvs[0] if current.kvs else None, current.revision)

    def _create(self, snap: Snapshot, known: _Knowledge) -> None:
        # Numbered after the revision at which the record was seen missing: every earlier
        # round number of this run was written at an earlier revision, so numbers only grow.
        record = RoundRecord(round=snap.read_revision + 1)
        self._client.ensure_lease(self._run_lease, self._settings.run_ttl)
        ops = [Put(self._keys.round, record.encode(), self._run_lease), *self._registration_ops(record.round, 0)]
        result = self._client.txn([Compare.absent(self._keys.round)], ops, [Range(self._keys.round)])
        self._after_registration(result, record, record.round, 0, known)

    def _register(self, snap: Snapshot, known: _Knowledge, round_: int, opening: bool, previous: int) -> None:
        ops = self._registration_ops(round_, previous)
        record = None
        if opening:
            record = RoundRecord(round=round_, previous=previous)
            ops.insert(0, Put(self._keys.round, record.encode(), snap.lease or self._run_lease))
        compare = [Compare.mod_revision(self._keys.round, snap.mod_revision)]
        result = self._client.txn(compare, ops, [Range(self._keys.round)])
        self._after_registration(result, record, round_, previous, known)

    def _register_as_spare(self, snap: Snapshot, known: _Knowledge) -> bool:
        """Register for the full, completed round as a spare; False if the record changed first.

        The key is created after the round's ``completed_at``, so it never counts as a member
        (membership is read at that revision) nor as a departed member when it moves on. It does
        count among the round's registrations still left when the next round opens: the members
        that open it then wait for the spare to come over (or its lease to end) instead of
        completing the next round without it.
        """
        round_ = snap.record.round
        ops: list = []
        if self._registered is not None:
            ops.append(DeleteRange(self._keys.join(self._registered, self._node)))
        ops.append(Put(self._keys.join(round_, self._node), self._registration, self._lease.ensure()))
        compare = [Compare.mod_revision(self._keys.round, snap.mod_revision)]
        result = self._client.txn(compare, ops, [Range(self._keys.round)])
        self._apply(result, None)
        if result.succeeded:
            self._registered, known.rejected = round_, round_
        return result.succeeded

    def _after_registration(
        self, result: TxnResult, record: RoundRecord | None, round_: int, previous: int, known: _Knowledge
    ) -> None:
        self._apply(result, record)
        if result.succeeded:
            self._registered = round_
            self._take_counts(result.results, previous, known)
            known.rejected = None

    def _mark_last_call(self, snap: Snapshot, known: _Knowledge) -> None:
        record = replace(snap.record, state=LAST_CALL)
        result = self._client.txn(
            [Compare.mod_revision(self._keys.round, snap.mod_revision)],
            [Put(self._keys.round, record.encode(), snap.lease or self._run_lease)],
            [Range(self._keys.round)],
        )
        self._apply(result, record)
        if result.succeeded:
            now = time.monotonic()
            known.last_call = (record.round, result.revision, now + self._last_call_timeout(record))
            known.calling, known.next_probe = record.round, now + _PROBE_DELAY_S
            log.info("Round %d of the rendezvous '%s' has its minimum of %d node(s); it completes within %g s, at "
                     "once when %d nodes registered%s.", record.round, self._settings.run_id, self._settings.min_nodes,
                     self._last_call_timeout(record), self._settings.max_nodes,
                     f" or every live node of round {record.round - 1} is back" if record.previous else "")  # fmt: skip

    def _last_call_timeout(self, record: RoundRecord) -> float:
        """The first round of a run waits for the start-up skew of its nodes, later ones do not."""
        return self._settings.last_call_timeout if record.previous else self._settings.first_round_timeout

    def _probe_previous(self, record: RoundRecord, known: _Knowledge) -> bool:
        """Remove the registrations left in the round before ``record`` whose agent is gone (see
        :mod:`elastic_ddp.rendezvous.liveness`) and count again; True when some were removed."""
        left = self._client.range(Range.prefix(self._keys.joins(record.round - 1), limit=_PROBE_LIMIT + 1))
        if not left.kvs or len(left.kvs) > _PROBE_LIMIT:
            return False
        addresses = {kv.key: address for kv in left.kvs if (address := _probe_address(kv.value)) is not None}
        gone = probe(addresses, _PROBE_TIMEOUT_S)
        if not gone:
            return False
        # Only a key as it was probed is removed: a node that re-registered since is not touched.
        by_key = {kv.key: kv for kv in left.kvs}
        for key in gone:
            self._client.txn([Compare.mod_revision(key, by_key[key].mod_revision)], [DeleteRange(key)])
        log.info("Round %d of the rendezvous '%s': %d node(s) of round %d refuse connections (their agent is gone); "
                 "the round no longer waits for them.", record.round, self._settings.run_id, len(gone),
                 record.round - 1)  # fmt: skip
        self._recount(record, known)
        return True

    def _complete(self, snap: Snapshot, known: _Knowledge) -> None:
        round_ = snap.record.round
        compare = [Compare.mod_revision(self._keys.round, snap.mod_revision)]
        if snap.record.state == LAST_CALL and (known.count or 0) < self._settings.max_nodes:
            count = self._client.range(Range.prefix(self._keys.joins(round_), count_only=True)).count
            if count < self._settings.min_nodes:
                # Nodes left during the last call: back to waiting for the minimum.
                record = replace(snap.record, state=OPEN)
                put = Put(self._keys.round, record.encode(), snap.lease or self._run_lease)
                result = self._client.txn(compare, [put], [Range(self._keys.round)])
                self._apply(result, record)
                known.count, known.previous_left = count, None
                return
        record = replace(snap.record, state=COMPLETE, completed_at=0)
        # The store keys of rounds before the previous one have no reader left; the completing
        # write drops them in the same raft entry.
        cleanup = self._store.delete_range_ops("round-", f"round-{round_ - 1:012d}") if round_ >= 1 else []
        result = self._client.txn(
            compare,
            [Put(self._keys.round, record.encode(), snap.lease or self._run_lease), *cleanup],
            [Range(self._keys.round)],
        )
        self._apply(result, record)

    def _round_size(self, record: RoundRecord) -> tuple[int, int]:
        """(members, registrations) of a completed round: its registrations at ``completed_at``,
        members at most max_nodes of them ((0, 0) when that revision was compacted: the round is
        then treated as not full)."""
        try:
            request = Range.prefix(self._keys.joins(record.round), count_only=True, revision=record.completed_at)
            total = self._client.range(request).count
        except EtcdCompactedError:
            return 0, 0
        return min(total, self._settings.max_nodes), total

    def _membership(self, record: RoundRecord, known: _Knowledge) -> tuple[int, int, int] | None:
        """(rank, world size, round) if this node is a member of the completed round, else None
        (and the round's size is remembered for the next decision)."""
        round_, at = record.round, record.completed_at
        prefix, mine = self._keys.joins(round_), self._keys.join(round_, self._node)
        try:
            result = self._client.txn([], [
                Range.prefix(prefix, count_only=True, revision=at),
                Range(prefix, mine + b"\x00", revision=at, keys_only=True, limit=1, descending=True),
                Range(mine + b"\x00", prefix_end(prefix), revision=at, limit=1),  # the successor (the successor watch)
            ])  # fmt: skip
        except EtcdCompactedError:
            known.rejected, known.size = round_, (round_, 0, 0)
            return None
        total, upto, after = result.results
        size = min(total.count, self._settings.max_nodes)
        rank = upto.count - 1
        present = bool(upto.kvs) and upto.kvs[0].key == mine
        known.size = (round_, size, total.count)
        if size < self._settings.min_nodes or not present or rank >= size:
            known.rejected = round_
            if size < self._settings.min_nodes:
                log.info("Round %d of the rendezvous '%s' completed with %d node(s), fewer than the minimum (%d); "
                         "it is abandoned.", round_, self._settings.run_id, size, self._settings.min_nodes)  # fmt: skip
            return None
        last_member = None
        if total.count > size:
            # More registrations than max_nodes: the first max_nodes keys are the members. Only
            # then is the list read (O(max_nodes), once), to tell members' departures apart.
            members = self._client.range(Range.prefix(prefix, revision=at, keys_only=True, limit=size))
            last_member = members.kvs[-1].key
        self._joined, self._joined_total = round_, total.count
        self._view.follow_members(round_, at, last_member)
        self._watch_successor(round_, at, after.kvs[0] if after.kvs else None, last_member)
        return rank, size, round_

    def _watch_successor(self, round_: int, at: int, after: KeyValue | None, last_member: bytes | None) -> None:
        """Probe the member after this one in key order, the first after the last (the successor watch,
        module docstring)."""
        if after is None or (last_member is not None and after.key > last_member):
            try:  # the last member: one more read, by one node of the round
                first = self._client.range(Range.prefix(self._keys.joins(round_), revision=at, limit=1)).kvs
            except EtcdError as exc:
                log.debug("No successor to probe in round %d (%s); its lease tells if it dies.", round_, exc)
                return
            after = first[0] if first else None
        if after is None or after.key == self._keys.join(round_, self._node):
            return  # a round of one
        address = _probe_address(after.value)
        if address is None:
            return
        self._successor = SuccessorWatch(
            address, lambda: self._remove_gone_member(round_, after), _SUCCESSOR_PROBE_INTERVAL_S, _PROBE_TIMEOUT_S,
            name=f"rdzv-successor-{self._node_text}",
        )  # fmt: skip

    def _remove_gone_member(self, round_: int, member: KeyValue) -> None:
        """The successor refused a probe: remove its registration, as it was read."""
        try:
            compare = [Compare.mod_revision(member.key, member.mod_revision)]
            result = self._client.txn(compare, [DeleteRange(member.key)])
        except EtcdError as exc:
            log.warning("A member of round %d of the rendezvous '%s' refuses connections (its agent is gone), but its "
                        "registration could not be removed (%s); its lease ends within %d s.", round_,
                        self._settings.run_id, exc, self._settings.lease_ttl)  # fmt: skip
            return
        if result.succeeded:
            log.info("A member of round %d of the rendezvous '%s' refuses connections (its agent is gone): removed its "
                     "registration, so every member restarts now.", round_, self._settings.run_id)  # fmt: skip

    def _stop_successor_watch(self) -> None:
        if self._successor is not None:
            self._successor.stop()
            self._successor = None

    def _withdraw(self) -> None:
        """Remove this node's registration from a round it gives up on (best effort)."""
        if self._registered is None:
            return
        try:
            self._client.delete(self._keys.join(self._registered, self._node))
        except EtcdError:
            log.debug("Could not withdraw the registration of '%s'; its lease removes it.", self._node_text)
        self._registered = None

    # -- closing -------------------------------------------------------------------------------

    def close(self, reason: str = "") -> None:
        """Mark the rendezvous closed (with ``reason``, unless it was closed with one already): every
        node's next join fails, and those waiting in a round see it through their watch.

        Raises:
            RendezvousTimeoutError: not closed within ``close_timeout``.
            RendezvousConnectionError: etcd failed or refused a request.
        """
        deadline = time.monotonic() + self._settings.close_timeout

        def done(record: RoundRecord | None) -> bool:
            return record is not None and record.closed and bool(record.reason or not reason)

        wrote = False
        try:
            snap = self._view.refresh()
            while not done(snap.record):
                if time.monotonic() > deadline:
                    raise RendezvousTimeoutError(
                        f"The rendezvous '{self._settings.run_id}' could not be closed within the close timeout "
                        f"({self._settings.close_timeout:g} s)."
                    )
                if snap.record is None:
                    record = RoundRecord(round=snap.read_revision + 1, closed=True, reason=reason)
                    self._client.ensure_lease(self._run_lease, self._settings.run_ttl)
                    compare, lease = Compare.absent(self._keys.round), self._run_lease
                else:
                    record = replace(snap.record, closed=True, reason=snap.record.reason or reason)
                    compare = Compare.mod_revision(self._keys.round, snap.mod_revision)
                    lease = snap.lease or self._run_lease
                put = Put(self._keys.round, record.encode(), lease)
                result = self._client.txn([compare], [put], [Range(self._keys.round)])
                self._apply(result, record)
                wrote = wrote or result.succeeded
                snap = self._view.snapshot()
        except EtcdError as exc:
            raise RendezvousConnectionError(
                f"The connection to etcd has failed while closing the rendezvous ({exc})."
            ) from exc
        if wrote:
            log.info("The node '%s' has closed the rendezvous '%s'.", self._node_text, self._settings.run_id)


def _probe_address(value: bytes) -> tuple[str, int] | None:
    """Where a registration's agent answers liveness probes; None when it names none."""
    try:
        return parse_address(str(json.loads(value)["probe"]))
    except (ValueError, TypeError, KeyError):
        return None
