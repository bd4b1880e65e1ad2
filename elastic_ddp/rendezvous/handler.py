"""torchrun's rendezvous handler on etcd v3, with per-node state that scales to 1,000 nodes.

The protocol (:mod:`elastic_ddp.rendezvous.rounds`, keys in :mod:`elastic_ddp.rendezvous.view`):
each node owns a lease and, while it takes part in a round, one registration key under it;
liveness is the lease (no clocks of different hosts are compared), death is the lease ending,
which every member of the node's round sees through a watch. A round is decided by small
compare-and-set transactions on one round record; ranks are read with O(1)-sized range reads.

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

What the handler adds to torch's ``DynamicRendezvousHandler`` behaviour, which it otherwise
follows (``min:max`` nodes, last call, join and close timeouts, spare nodes when a round is
full, closing at shutdown):

1. **A node that left is a membership change.** torch restarts a healthy worker group only when
   a node waits to join; here a member whose lease ended also counts, so when a preempted node
   leaves, the survivors' agents restart their workers at the smaller size without spending one
   of ``--max-restarts``.
2. **A node that exits leaves at once**: an ``atexit`` hook revokes its lease (torchrun does not
   shut the handler down after a signal, since that would close the rendezvous for everyone).
3. **An etcd outage is not a job failure.** ``num_nodes_waiting()`` never calls etcd, so it
   cannot fail; watches and lease renewals retry in the background, and etcd itself restores
   every lease's full TTL when a leader takes over (after a restart or an election), so live
   nodes are not dropped for the outage.
4. **Each round hosts a fresh worker store** on its rank-0 agent, listening before any worker of
   the round starts (:meth:`_bootstrap`), and the round is exported to the workers as
   ``ELASTIC_DDP_RDZV_ROUND``. Round numbers only grow: the first round of a run is numbered after
   the etcd revision it was created at, so even a run whose keys expired and were created again
   never reuses a number (checkpoint commits are fenced by it).
5. **Invalid settings end the job on every node, spending no restart.** The handler gives its
   agent's workers a directory of its own (``ELASTIC_DDP_SETTINGS_ERROR_DIR``, with the agent's
   pid); a worker whose settings are invalid writes the message there and waits to be stopped
   (:func:`elastic_ddp.worker.launch.launch`). ``num_nodes_waiting()`` finds it (one ``open`` of a missing
   file per call otherwise) and asks for a new round -- torch's agent restarts a healthy group
   for that without counting a restart, while a worker that had exited would cost one -- and
   ``next_rendezvous()`` then closes the rendezvous with the message as its reason (one
   compare-and-set) and raises :class:`InvalidSettingsError` with it, which torchrun prints last
   and exits 1 with. The other nodes see the closed record through their watch: their
   ``num_nodes_waiting()`` asks for a new round too, and their join raises the same error.
6. **A round after a failure waits for no dead node.** Each agent listens on a port of its own
   and names it in its registration (:mod:`elastic_ddp.rendezvous.liveness`). The node that
   starts a round's last call probes the previous round's nodes that have not come over: a
   refused connection (the agent is gone) removes that node's registration, so the round
   completes as soon as every surviving node is back, without waiting out the last call or the
   dead node's lease. At most ``_PROBE_LIMIT`` nodes are probed at a time, by one node: O(1)
   connections and one read per probe, whatever the job's size.
7. **The first round waits for the start-up skew of a cluster**: its last call lasts
   ``first_round_timeout`` (torch's 30 s; it ends at once when ``max_nodes`` registered), so nodes
   started seconds apart form one round instead of costing the job one restart each; later
   rounds use ``last_call_timeout``.
8. **A member whose agent is gone is noticed in moments, not after its lease.** While a round
   trains, each member probes the next member in key order (the last probes the first; one
   connection per ``_SUCCESSOR_PROBE_INTERVAL_S``, whatever the job's size; the successor is read
   in the same transaction that tells the node its rank). A refusal removes the member's
   registration (compare-and-delete on the key as read), which every member sees through its
   watch (1.): the agents restart their workers within a second of a node's death, whatever the
   workers' collectives do -- NCCL may wait for a dead peer until its own timeout. Before they
   stop their workers, the agents leave a mark for them (:func:`elastic_ddp.agent_marks.report_members_gone`):
   a rank waiting on a peer that is gone cannot reach a step boundary, so it leaves within a second
   instead of waiting out its stop grace (or torchrun's 30 s before SIGKILL).
9. **A join costs no durable checkpoint.** When a new round opens while every member of this
   node's round stays, the agent marks that before it stops its workers
   (:func:`elastic_ddp.agent_marks.report_nodes_joining`): their stop only admits a node, so the
   agreed step goes to node memory, which every old member keeps, instead of storage.
10. **Workers start warm.** Before its first join the node starts its workers' template
    (:mod:`elastic_ddp.prestart`): every worker of every round is a fork of it. A node joining a
    running job registers once the template has imported torch and this library, so it does not
    stop the others' workers for the seconds of its own imports. At a job's first formation it
    registers at once (every worker starts then anyway): the imports overlap the rendezvous, the
    first workers wait for the template's torch, and it imports the rest while they train.
11. **A node that is going away leaves the round when its stop checkpoint is committed**, not
    once its workers have exited and its agent has unwound (0.3-0.5 s more, on the path of every
    rank's restart): its workers, signalled from outside (a preemption), say so through a socket
    in the agent's directory (:mod:`elastic_ddp.rendezvous.leaving`), and the handler revokes the
    node's lease at once. Should the agent go on after all (its workers alone were signalled), it joins
    again at its next rendezvous, as a node whose lease ended does.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import random
import shutil
import socket
import threading
import time
import weakref
from dataclasses import dataclass, replace

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elastic_ddp.contract import ENV_AGENT_PID, ENV_PRESTART, ENV_RDZV_ROUND, ENV_SETTINGS_ERROR_DIR
from elastic_ddp.prestart import Template, without_shim
from elastic_ddp.agent_marks import clear_restart_marks, read_settings_error, report_members_gone, report_nodes_joining
from elastic_ddp.etcd import (
    Backoff, Compare, DeleteRange, EtcdClient, EtcdCompactedError, EtcdConnectionError, EtcdError, EtcdLeaseNotFoundError,
    KeyValue, LeaseKeepAlive, Put, Range, TxnResult, WatchStream, prefix_end,
)  # fmt: skip
from elastic_ddp.rendezvous.rounds import (
    COMPLETE, LAST_CALL, MAX_REASON_LENGTH, OPEN, RoundRecord, Seen, Step, decide, node_key,
)  # fmt: skip
from elastic_ddp.rendezvous.agent_dir import create_agent_dir
from elastic_ddp.rendezvous.leaving import LeavingListener
from elastic_ddp.rendezvous.liveness import LivenessListener, SuccessorWatch, parse_address, probe
from elastic_ddp.rendezvous.store import EtcdV3Store
from elastic_ddp.rendezvous.view import RoundView, RunKeys, Snapshot, run_lease_id

__all__ = ["ENV_RDZV_ROUND", "EtcdRendezvousHandler", "HandlerSettings", "InvalidSettingsError"]

log = logging.getLogger(__name__)

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
# While a round trains, each member probes the next one this often (module docstring, 8.).
_SUCCESSOR_PROBE_INTERVAL_S = 0.25
# How long a node joining a running job waits for its workers' template to finish its imports (a
# few seconds; longer only on a starved host, which then starts its workers as usual).
TEMPLATE_WARM_WAIT_S = 60.0


class InvalidSettingsError(RendezvousClosedError):
    """The rendezvous is closed because a worker's settings are invalid; the message ends with them.

    A ``RendezvousClosedError``: torch's agent does not catch it, so torchrun exits 1 with it as the
    last thing it prints, on every node.
    """


@dataclass(frozen=True)
class HandlerSettings:
    """Everything the handler needs besides its etcd client and store (see the plugin for the
    rdzv_conf keys and defaults).

    ``last_call_timeout``: how long a round after the first waits, once it has ``min_nodes``, for
    nodes it cannot account for; ``first_round_timeout``: the same for a run's first round (the
    start-up skew of a cluster's nodes); ``lease_ttl``: seconds a node stays registered after its
    last renewal (the time to notice a dead node that cannot be probed); ``keep_alive_interval``: seconds between renewals; ``keep_alive_deadline``: the
    longest one renewal may take before the next member is tried; ``run_ttl``: seconds the round
    record outlives the last node of the run.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    key_prefix: str
    join_timeout: float = 600.0
    last_call_timeout: float = 2.0
    first_round_timeout: float = 30.0
    close_timeout: float = 10.0
    keep_alive_interval: float = 1.0
    lease_ttl: int = 5
    keep_alive_deadline: float = 2.5
    run_ttl: int = 7200

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("The run id must be a non-empty string.")
        if self.min_nodes < 1:
            raise ValueError(f"The minimum number of nodes ({self.min_nodes}) must be greater than zero.")
        if self.max_nodes < self.min_nodes:
            raise ValueError(
                f"The maximum number of nodes ({self.max_nodes}) must be greater than or equal to the minimum "
                f"number of nodes ({self.min_nodes})."
            )
        if self.lease_ttl < 2 or self.lease_ttl <= self.keep_alive_interval:
            raise ValueError(
                f"The node lease TTL ({self.lease_ttl} s = keep_alive_interval x keep_alive_max_attempt) must be at "
                f"least 2 s and longer than keep_alive_interval ({self.keep_alive_interval} s), or a node would be "
                "dropped between two renewals."
            )
        for name in ("join_timeout", "last_call_timeout", "first_round_timeout", "close_timeout", "keep_alive_interval",
                     "keep_alive_deadline"):
            if getattr(self, name) <= 0:
                raise ValueError(f"The rendezvous setting '{name}' ({getattr(self, name)}) must be positive.")


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


class EtcdRendezvousHandler(RendezvousHandler):
    """See the module docstring. torchrun creates it through the plugin's ``create_rdzv_handler``.

    Args:
        client: The etcd client, shared with ``store``; the handler owns both and closes them when
            it leaves (:meth:`leave`).
        store: The c10d store of the run (under ``<prefix>/<run>/store/``); each round's
            agents see it through a ``PrefixStore`` of that round.
        settings: Timeouts, liveness and the key prefix.
        backend_name: The ``--rdzv-backend`` name torch asked for ("etcd" or "etcd-v3").
        local_addr: This node's address (torchrun's ``--local-addr``); default: its FQDN.
    """

    def __init__(
        self,
        client: EtcdClient,
        store: EtcdV3Store,
        settings: HandlerSettings,
        backend_name: str = "etcd-v3",
        local_addr: str | None = None,
    ) -> None:
        self._client = client
        self._store = store
        self._settings = settings
        self._backend_name = backend_name
        self._addr = local_addr or socket.getfqdn()
        with _LOCAL_IDS_LOCK:
            local_id = next(_LOCAL_IDS)
        self._node = node_key(self._addr, os.getpid(), local_id)
        self._node_text = f"{self._addr}_{os.getpid()}_{local_id}"
        self._keys = RunKeys(settings.key_prefix, settings.run_id)
        self._run_lease = run_lease_id(settings.key_prefix, settings.run_id)
        self._stream = WatchStream(client, name=f"rdzv-watch-{local_id}")
        self._view = RoundView(client, self._keys, self._stream)
        self._keep_alive = LeaseKeepAlive(client, settings.keep_alive_deadline, name=f"rdzv-keep-alive-{local_id}")
        try:
            self._liveness: LivenessListener | None = LivenessListener(self._addr)
        except OSError as exc:  # the others then notice this node's death by its lease, as before
            log.warning("The node '%s' cannot listen for liveness probes (%s).", self._node_text, exc)
            self._liveness = None
        registration = {"node": self._node_text, **({"probe": self._liveness.address} if self._liveness else {})}
        self._registration = json.dumps(registration, separators=(",", ":"))
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._lease_lost = False  # this node's lease ended (renewals starved or etcd unreachable)
        self._run_lease_renewed = False
        self._registered: int | None = None  # the round this node has a registration key in
        self._joined: int | None = None  # the last round this node was a member of
        self._joined_total = 0  # registrations of that round at its completion
        self._reported: tuple | None = None
        self._successor: SuccessorWatch | None = None
        self._finished = False
        self._worker_store_server: dist.Store | None = None  # hosted while this node is a round's rank 0
        # Where this agent's workers report invalid settings (module docstring, 5.); the workers
        # inherit the agent's environment when they start.
        try:
            self._settings_error_dir = create_agent_dir()
            os.environ[ENV_SETTINGS_ERROR_DIR] = self._settings_error_dir
            os.environ[ENV_AGENT_PID] = str(os.getpid())
        except OSError as exc:  # the job runs as before: a bad setting then costs every restart
            log.warning("No directory for workers to report invalid settings in (%s).", exc)
            self._settings_error_dir = ""
        self._leaving: LeavingListener | None = None
        if self._settings_error_dir:
            try:
                self._leaving = LeavingListener(self._settings_error_dir, self._leave_round_early)
            except OSError as exc:  # the node then leaves once its workers are gone, as torch's agent does
                log.warning("The node '%s' cannot listen for its workers' departure (%s).", self._node_text, exc)
        self._template: Template | None = None
        atexit.register(_leave_at_exit, weakref.ref(self))

    def _start_template(self) -> bool:
        """Before the first workers start (and again should it die): the node's template, from which
        workers fork warm (:mod:`elastic_ddp.prestart`; ``ELASTIC_DDP_PRESTART=0`` turns it off).
        True when it was started now."""
        if not self._settings_error_dir or os.environ.get(ENV_PRESTART, "1") == "0":
            return False
        if self._template is not None:
            if self._template.alive:
                return False
            # Killed (by hand, by the OOM killer): the next workers start warm again.
            log.warning("The workers' template of node '%s' is gone; starting another.", self._node_text)
            self._template.close()
        try:
            self._template = Template(self._settings_error_dir)
        except OSError as exc:
            log.warning("The node '%s' could not start its workers' template (%s); they start as usual.",
                        self._node_text, exc)  # fmt: skip
            return False
        os.environ.update(self._template.environment())
        return True

    # -- RendezvousHandler -------------------------------------------------------------------

    def get_backend(self) -> str:
        return self._backend_name

    def get_run_id(self) -> str:
        return self._settings.run_id

    @property
    def settings(self) -> HandlerSettings:
        return self._settings

    @property
    def node(self) -> str:
        """This node as torch would name it: ``<address>_<pid>_<n>``."""
        return self._node_text

    @property
    def settings_error_dir(self) -> str:
        """The directory this agent's workers report invalid settings in (``ELASTIC_DDP_SETTINGS_ERROR_DIR``)."""
        return self._settings_error_dir

    @property
    def use_agent_store(self) -> bool:
        """Always: the workers are clients of the store this round's rank-0 agent hosts (:meth:`_bootstrap`)."""
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round (see the module docstring); blocks until it completes with this node.

        Raises:
            InvalidSettingsError: a worker of this node reported invalid settings (the rendezvous
                is closed with them for every node), or another node's did.
            RendezvousClosedError, RendezvousGracefulExitError: the rendezvous is closed.
            RendezvousTimeoutError: no round completed with this node within ``join_timeout``.
            RendezvousConnectionError: etcd failed or refused a request.
            RendezvousStateError: the round record is corrupt.
        """
        message = read_settings_error(self._settings_error_dir)
        if message is not None:
            raise self._close_for_settings(message)
        if self._start_template() and self._joined is None and self._job_is_running():
            # A node arriving at a running job restarts every worker when it registers: it
            # registers once its own workers can start warm, not seconds later in their imports.
            # At a job's first formation every worker starts anyway: the node registers at once,
            # its workers wait for the template's torch (as they would for their own imports),
            # and the template imports the rest while they train.
            self._template.warm_up(min(TEMPLATE_WARM_WAIT_S, self._settings.join_timeout))
        log.info("The node '%s' attempts to join the next round of the rendezvous '%s'.", self._node_text,
                 self._settings.run_id)  # fmt: skip
        self._view.stop_following()
        self._stop_successor_watch()
        clear_restart_marks(self._settings_error_dir)  # the next workers start in a group of live nodes
        self._reported = None
        try:
            rank, world_size, round_ = self._join()
        except EtcdError as exc:
            raise RendezvousConnectionError(
                f"The connection to etcd has failed while joining the rendezvous '{self._settings.run_id}' ({exc})."
            ) from exc
        os.environ[ENV_RDZV_ROUND] = str(round_)
        log.info("The node '%s' has joined round %d of the rendezvous '%s' as rank %d in a world of size %d.",
                 self._node_text, round_, self._settings.run_id, rank, world_size)  # fmt: skip
        store = dist.PrefixStore(f"round-{round_:012d}", self._store)
        return RendezvousInfo(store, rank, world_size, self._bootstrap(rank, store))

    def _job_is_running(self) -> bool:
        """Whether the run has a complete round (this node's arrival would restart its workers);
        False when etcd cannot say (the join that follows reports that)."""
        try:
            record = self._view.refresh().record
        except EtcdError:
            return False
        return record is not None and record.state == COMPLETE and not record.closed

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for a new round, or members of this node's round that are gone; 1 when
        the job must end (a worker of this node reported invalid settings, or the rendezvous was
        closed with a reason): ``next_rendezvous()`` then raises it.

        Answered from watched state (no etcd request), so it never fails: during an etcd outage
        it reports no change, and training, which does not use etcd, goes on.
        """
        if self._joined is None or self._finished:
            return 0
        if read_settings_error(self._settings_error_dir) is not None:
            self._report(("settings",), "A worker of node '%s' reported invalid settings; ending the job on every node "
                         "(no restart can fix them).", self._node_text)  # fmt: skip
            return 1
        snapshot = self._view.snapshot()
        record = snapshot.record
        if record is not None and record.closed:
            if record.reason:
                self._report(("closed", record.reason), "The rendezvous '%s' was closed: %s", self._settings.run_id,
                             record.reason)  # fmt: skip
                return 1
            return 0
        if record is None or record.round > self._joined:
            if record is not None and not self._view.gone():
                # Every member stays: the workers stop only to take a node in (elastic_ddp.worker.stop).
                report_nodes_joining(self._settings_error_dir, f"round {record.round} was opened after round {self._joined}")
            self._report(("new round", None if record is None else record.round),
                         "A node is waiting to join the rendezvous '%s' (round %s opened after round %d); restarting "
                         "the workers to admit it.", self._settings.run_id,
                         "-" if record is None else record.round, self._joined)  # fmt: skip
            return 1
        gone = self._view.gone()
        if gone:
            report_members_gone(self._settings_error_dir, f"{len(gone)} node(s) left round {self._joined}")
            self._report(("gone", gone), "%d node(s) left round %d of the rendezvous '%s'; restarting the workers at "
                         "the new membership.", len(gone), self._joined, self._settings.run_id)  # fmt: skip
            return len(gone)
        return 0

    def is_closed(self) -> bool:
        try:
            snapshot = self._view.refresh()
        except EtcdError as exc:
            raise RendezvousConnectionError(f"The connection to etcd has failed ({exc}).") from exc
        return snapshot.record is not None and snapshot.record.closed

    def set_closed(self) -> None:
        """Mark the rendezvous closed: every node's next attempt to join fails."""
        self._close()

    def shutdown(self) -> bool:
        """Close the rendezvous (with a worker's settings error as the reason, if one was reported),
        then leave it and release what the handler holds (see :meth:`leave`); False if closing
        failed.

        One difference from :meth:`leave`: when other nodes were members of this node's last round,
        the store's lease is left to expire (``DEFAULT_STORE_LEASE_TTL`` after its keeper stopped)
        instead of being revoked. torch's agent shuts down after its exit barrier, and the others may
        still be waiting in theirs for barrier keys this node wrote under that lease; revoking it
        could delete them before they are read, and those nodes would then wait out the whole
        barrier timeout (300 s).
        """
        if self._finished:
            return True
        try:
            message = read_settings_error(self._settings_error_dir)
            self._close(self._settings_reason(message) if message is not None else "")
            return True
        except (RendezvousConnectionError, RendezvousTimeoutError) as exc:
            log.warning("The node '%s' could not close the rendezvous '%s' (%s).", self._node_text,
                        self._settings.run_id, exc)  # fmt: skip
            return False
        finally:
            self._leave(revoke_store=self._joined_total <= 1)

    def leave(self) -> None:
        """Revoke this node's lease, so its registration is gone at once, and release everything the
        handler holds: its threads, the store's lease (with the store's keys written by this node),
        a shared TCPStore it hosts and the etcd connection. Idempotent; the handler cannot join
        again afterwards.

        Bounded when etcd is unreachable: each revocation waits at most the request timeout
        (``read_timeout``), and once one found etcd unreachable the other is not tried; the leases
        then expire on their own.
        """
        self._leave(revoke_store=True)

    def _leave(self, revoke_store: bool) -> None:
        if self._finished:
            return
        self._finished = True
        self._stop_successor_watch()
        self._view.close()
        self._keep_alive.close()
        self._stream.close()
        if self._liveness is not None:
            self._liveness.close()
        if self._leaving is not None:
            self._leaving.close()
        if self._template is not None:
            self._template.close()
            self._template = None
            without_shim(os.environ)
        if self._settings_error_dir and os.environ.get(ENV_SETTINGS_ERROR_DIR) == self._settings_error_dir:
            os.environ.pop(ENV_SETTINGS_ERROR_DIR, None)
            os.environ.pop(ENV_AGENT_PID, None)
        if self._settings_error_dir:
            shutil.rmtree(self._settings_error_dir, ignore_errors=True)
        with self._lock:
            lease, self._lease = self._lease, None
        reachable = True
        if lease is not None:
            try:
                self._client.revoke_lease(lease)
                log.info("The node '%s' left the rendezvous '%s'.", self._node_text, self._settings.run_id)
            except EtcdError as exc:
                reachable = not isinstance(exc, EtcdConnectionError)
                log.warning("The node '%s' could not leave the rendezvous at once (%s); the others notice within %d s.",
                            self._node_text, exc, self._settings.lease_ttl)  # fmt: skip
        self._store.close(revoke=revoke_store and reachable)
        self._worker_store_server = None  # its server thread ends with it; no worker is left to use it
        self._client.close()

    def _leave_round_early(self, why: str) -> None:
        """A worker of this node reported that the node leaves the job, its stop checkpoint committed
        (:mod:`elastic_ddp.rendezvous.leaving`): revoke the node's lease now, so the others start their
        next round without waiting for this agent's exit. Not when this agent itself is restarting its
        workers for a membership change (it reported one): then the node stays."""
        if self._finished or self._joined is None or self._reported is not None:
            return
        with self._lock:
            lease, self._lease = self._lease, None
            # Should the agent join again after all, it registers under a new lease (_register_again).
            self._lease_lost = lease is not None
        if lease is None:
            return
        self._keep_alive.remove(lease)
        try:
            self._client.revoke_lease(lease)
        except EtcdError as exc:
            log.warning("The node '%s' could not leave the rendezvous early (%s); the others notice when its lease ends.",
                        self._node_text, exc)  # fmt: skip
            return
        log.info("The node '%s' left the rendezvous '%s' as its stop checkpoint was committed (%s).", self._node_text,
                 self._settings.run_id, why)  # fmt: skip

    # -- joining -------------------------------------------------------------------------------

    def _join(self) -> tuple[int, int, int]:
        """The protocol loop: (rank, world size, round) once a round completed with this node.

        etcd being slow or out of reach (a leader election, a restarted or overloaded member) does
        not fail the join while its timeout lasts: the step is tried again after a pause. Every
        write of the protocol is a compare-and-set on the round record or a put of this node's own
        key, so a step whose reply was lost can be repeated.
        """
        if self._finished:
            raise RendezvousClosedError(f"The node '{self._node_text}' has left the rendezvous '{self._settings.run_id}'.")
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
                log.warning("etcd answers node '%s' again after %.1f s.", self._node_text, time.monotonic() - failing_since)
                backoff.reset()
                failing_since = None
            if member is not None:
                return member

    def _join_step(self, known: _Knowledge) -> tuple[int, int, int] | None:
        """One decision of the protocol and its step: (rank, world size, round) once this node is
        a member of a completed round, else None."""
        settings = self._settings
        if self._finished:
            raise RendezvousClosedError(f"The node '{self._node_text}' has left the rendezvous '{settings.run_id}'.")
        self._ensure_lease()
        self._view.start()
        if self._view.take_resync():
            self._view.refresh()
        if self._take_lost_lease():
            self._register_again(known)
        snap = self._view.snapshot()
        self._renew_run_lease(snap)
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
            with self._lock:
                self._lease = None
            self._registered = None
            known.count = None
            self._ensure_lease()
            self._view.refresh()

    def _take_lost_lease(self) -> bool:
        """True once after this node's lease ended (see :meth:`_on_lease_expired`)."""
        with self._lock:
            lost, self._lease_lost = self._lease_lost, False
            return lost

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

    def _ensure_lease(self) -> int:
        with self._lock:
            if self._lease is not None:
                return self._lease
        lease = self._client.grant_lease(self._settings.lease_ttl)
        with self._lock:
            self._lease = lease
        self._keep_alive.add(lease, self._settings.keep_alive_interval, self._on_lease_expired)
        return lease

    def _on_lease_expired(self, lease: int) -> None:
        with self._lock:
            if self._lease == lease:
                self._lease = None
                self._lease_lost = True
        self._view.wake()  # a join waiting in a round must register again (see _register_again)
        log.warning("etcd reports that the lease of node '%s' has ended: the other nodes see it as gone. It "
                    "joins again at its next rendezvous.", self._node_text)  # fmt: skip

    def _renew_run_lease(self, snap: Snapshot) -> None:
        if snap.lease and not self._run_lease_renewed:
            self._run_lease_renewed = True
            self._keep_alive.add(snap.lease, max(self._settings.run_ttl / 4, 1.0), self._on_run_lease_expired)

    def _on_run_lease_expired(self, lease: int) -> None:
        self._run_lease_renewed = False

    def _registration_ops(self, round_: int, previous: int) -> list:
        """Delete this node's older registration, write the new one, count the round's (and those
        still left in the round before, when it had any)."""
        ops: list = []
        if self._registered is not None and self._registered != round_:
            ops.append(DeleteRange(self._keys.join(self._registered, self._node)))
        lease = self._ensure_lease()
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
        result = self._client.txn([Compare.mod_revision(self._keys.round, snap.mod_revision)], ops, [Range(self._keys.round)])
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
        ops.append(Put(self._keys.join(round_, self._node), self._registration, self._ensure_lease()))
        result = self._client.txn([Compare.mod_revision(self._keys.round, snap.mod_revision)], ops, [Range(self._keys.round)])
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
                result = self._client.txn(compare, [Put(self._keys.round, record.encode(), snap.lease or self._run_lease)],
                                          [Range(self._keys.round)])  # fmt: skip
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
                Range(mine + b"\x00", prefix_end(prefix), revision=at, limit=1),  # the successor (8.)
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
        """Probe the member after this one in key order, the first after the last (8.)."""
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
        """The successor refused a probe: remove its registration, as it was read (8.)."""
        try:
            result = self._client.txn([Compare.mod_revision(member.key, member.mod_revision)], [DeleteRange(member.key)])
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

    def _bootstrap(self, rank: int, store: dist.Store) -> RendezvousStoreInfo:
        """MASTER_ADDR/PORT for the workers: a TCPStore that this round's rank-0 agent hosts, new at
        every round (no key of a dead group survives, and no node serves more than its rounds as
        rank 0), listening before it is named to the others through the round's store -- so before
        any worker of the round connects. (Hosted by rank 0's worker, as torch does without the
        shared store, a worker that connected before that one listened waited out torch's connect
        back-off: 0.3-0.6 s, measured, on the path of every restart.)"""
        self._worker_store_server = None  # the last round's: its workers are gone
        port = 0
        if rank == 0:
            # The server listens on every interface and is named to the workers by this node's address;
            # the name given here is only where the store object's own client connects.
            self._worker_store_server = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            port = self._worker_store_server.port
        return RendezvousStoreInfo.build(rank, store, local_addr=self._addr, server_port=port)

    # -- closing -------------------------------------------------------------------------------

    def _settings_reason(self, message: str) -> str:
        reason = (f"the settings of a worker of node '{self._node_text}' are invalid (no restart can fix them):\n"
                  f"{message.strip()}")  # fmt: skip
        return reason if len(reason) <= MAX_REASON_LENGTH else reason[: MAX_REASON_LENGTH - 6] + " [...]"

    def _close_for_settings(self, message: str) -> InvalidSettingsError:
        """Close the rendezvous with this node's workers' settings error as the reason (the other
        nodes exit with it); the error to raise, also when etcd could not be told."""
        reason = self._settings_reason(message)
        log.error("A worker of node '%s' reported invalid settings; closing the rendezvous '%s' for every node.",
                  self._node_text, self._settings.run_id)  # fmt: skip
        try:
            self._close(reason)
        except (RendezvousConnectionError, RendezvousTimeoutError) as exc:
            log.warning("The node '%s' could not close the rendezvous '%s' (%s); the other nodes end when their "
                        "own workers fail.", self._node_text, self._settings.run_id, exc)  # fmt: skip
        return InvalidSettingsError(f"The rendezvous '{self._settings.run_id}' is closed: {reason}")

    def _close(self, reason: str = "") -> None:
        """Mark the rendezvous closed (with ``reason``, unless it was closed with one already)."""
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
                    compare, lease = Compare.mod_revision(self._keys.round, snap.mod_revision), snap.lease or self._run_lease
                result = self._client.txn([compare], [Put(self._keys.round, record.encode(), lease)], [Range(self._keys.round)])
                self._apply(result, record)
                wrote = wrote or result.succeeded
                snap = self._view.snapshot()
        except EtcdError as exc:
            raise RendezvousConnectionError(f"The connection to etcd has failed while closing the rendezvous ({exc}).") from exc
        if wrote:
            log.info("The node '%s' has closed the rendezvous '%s'.", self._node_text, self._settings.run_id)

    def _report(self, change: tuple, message: str, *args) -> None:
        if change != self._reported:
            self._reported = change
            log.info(message, *args)


def _leave_at_exit(handler_ref: weakref.ref) -> None:
    handler = handler_ref()
    if handler is None:
        return
    try:
        handler.leave()
    except Exception as exc:  # noqa: BLE001 - the lease expires by itself anyway
        log.warning("Could not leave the rendezvous at exit (%s); the others notice when the lease expires.", exc)


def _probe_address(value: bytes) -> tuple[str, int] | None:
    """Where a registration's agent answers liveness probes; None when it names none."""
    try:
        return parse_address(str(json.loads(value)["probe"]))
    except (ValueError, TypeError, KeyError):
        return None
