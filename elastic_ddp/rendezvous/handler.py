"""torchrun's rendezvous handler on etcd v3, with per-node state that scales to 1,000 nodes.

:class:`EtcdRendezvousHandler` is what torch's agent calls, and only that: it delegates the
protocol to :class:`~elastic_ddp.rendezvous.join.JoinExecutor` (the etcd side: registration,
rounds, leases, closing; the protocol and what it costs etcd are described there) and what the
node does for its workers to :class:`~elastic_ddp.rendezvous.node.NodeServices` (the agent's
directory and environment, the workers' template and store, the leaving socket).

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
   cannot fail; watches and lease renewals retry in the background, a join retries until its
   timeout, and etcd itself restores every lease's full TTL when a leader takes over (after a
   restart or an election), so live nodes are not dropped for the outage.
4. **Each round hosts a fresh worker store** on its rank-0 agent and is exported to the workers
   (:mod:`elastic_ddp.rendezvous.node`); round numbers only grow
   (:mod:`elastic_ddp.rendezvous.join`).
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
6. **A round after a failure waits for no dead node**, and 7. **the first round waits for the
   start-up skew of a cluster** (:mod:`elastic_ddp.rendezvous.join`).
8. **A member whose agent is gone is noticed in moments, not after its lease**: its predecessor in
   the round probes it and removes its registration (:mod:`elastic_ddp.rendezvous.join`), which
   every member sees through its watch (1.). Before they stop their workers, the agents leave a
   mark for them (:func:`elastic_ddp.agent_marks.report_members_gone`): a rank waiting on a peer
   that is gone cannot reach a step boundary, so it leaves within a second instead of waiting out
   its stop grace (or torchrun's 30 s before SIGKILL).
9. **A join costs no durable checkpoint.** When a new round opens while every member of this
   node's round stays, the agent marks that before it stops its workers
   (:func:`elastic_ddp.agent_marks.report_nodes_joining`): their stop only admits a node, so the
   agreed step goes to node memory, which every old member keeps, instead of storage.
10. **Workers start warm**, and 11. **a node that is going away leaves the round when its stop
    checkpoint is committed** (:mod:`elastic_ddp.rendezvous.node`).
"""

from __future__ import annotations

import atexit
import logging
import socket
import weakref

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousTimeoutError,
)

from elastic_ddp.etcd import EtcdClient, EtcdError
from elastic_ddp.rendezvous.join import InvalidSettingsError, JoinExecutor
from elastic_ddp.rendezvous.node import NodeServices
from elastic_ddp.rendezvous.rounds import COMPLETE, MAX_REASON_LENGTH
from elastic_ddp.rendezvous.settings import HandlerSettings
from elastic_ddp.rendezvous.store import EtcdV3Store

__all__ = ["EtcdRendezvousHandler", "HandlerSettings", "InvalidSettingsError"]

log = logging.getLogger(__name__)


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
        addr = local_addr or socket.getfqdn()
        self._reported: tuple | None = None  # the last change num_nodes_waiting() logged (and acted on)
        self._joiner = JoinExecutor(client, store, settings, addr)
        self._node = NodeServices(self._joiner.node, addr, self._leave_round_early)
        atexit.register(_leave_at_exit, weakref.ref(self))

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
        return self._joiner.node

    @property
    def settings_error_dir(self) -> str:
        """The directory this agent's workers report invalid settings in (``ELASTIC_DDP_SETTINGS_ERROR_DIR``)."""
        return self._node.directory

    @property
    def use_agent_store(self) -> bool:
        """Always: the workers are clients of the store this round's rank-0 agent hosts
        (:meth:`NodeServices.bootstrap <elastic_ddp.rendezvous.node.NodeServices.bootstrap>`)."""
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
        message = self._node.settings_error()
        if message is not None:
            raise self._close_for_settings(message)
        if self._node.start_template() and self._joiner.joined is None and self._job_is_running():
            # A node arriving at a running job restarts every worker when it registers: it
            # registers once its own workers can start warm, not seconds later in their imports.
            # At a job's first formation every worker starts anyway: the node registers at once,
            # its workers wait for the template's torch (as they would for their own imports),
            # and the template imports the rest while they train.
            self._node.warm_up_template(self._settings.join_timeout)
        log.info("The node '%s' attempts to join the next round of the rendezvous '%s'.", self.node,
                 self._settings.run_id)  # fmt: skip
        self._joiner.stop_following()
        self._node.clear_restart_marks()  # the next workers start in a group of live nodes
        self._reported = None
        try:
            rank, world_size, round_ = self._joiner.join()
        except EtcdError as exc:
            raise RendezvousConnectionError(
                f"The connection to etcd has failed while joining the rendezvous '{self._settings.run_id}' ({exc})."
            ) from exc
        self._node.export_round(round_)
        log.info("The node '%s' has joined round %d of the rendezvous '%s' as rank %d in a world of size %d.",
                 self.node, round_, self._settings.run_id, rank, world_size)  # fmt: skip
        store = dist.PrefixStore(f"round-{round_:012d}", self._store)
        return RendezvousInfo(store, rank, world_size, self._node.bootstrap(rank, store))

    def _job_is_running(self) -> bool:
        """Whether the run has a complete round (this node's arrival would restart its workers);
        False when etcd cannot say (the join that follows reports that)."""
        try:
            record = self._joiner.view.refresh().record
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
        joined, view = self._joiner.joined, self._joiner.view
        if joined is None or self._joiner.left:
            return 0
        if self._node.settings_error() is not None:
            self._report(("settings",), "A worker of node '%s' reported invalid settings; ending the job on every node "
                         "(no restart can fix them).", self.node)  # fmt: skip
            return 1
        snapshot = view.snapshot()
        record = snapshot.record
        if record is not None and record.closed:
            if record.reason:
                self._report(("closed", record.reason), "The rendezvous '%s' was closed: %s", self._settings.run_id,
                             record.reason)  # fmt: skip
                return 1
            return 0
        if record is None or record.round > joined:
            if record is not None and not view.gone():
                # Every member stays: the workers stop only to take a node in (elastic_ddp.worker.stop).
                self._node.report_nodes_joining(f"round {record.round} was opened after round {joined}")
            self._report(("new round", None if record is None else record.round),
                         "A node is waiting to join the rendezvous '%s' (round %s opened after round %d); restarting "
                         "the workers to admit it.", self._settings.run_id,
                         "-" if record is None else record.round, joined)  # fmt: skip
            return 1
        gone = view.gone()
        if gone:
            self._node.report_members_gone(f"{len(gone)} node(s) left round {joined}")
            self._report(("gone", gone), "%d node(s) left round %d of the rendezvous '%s'; restarting the workers at "
                         "the new membership.", len(gone), joined, self._settings.run_id)  # fmt: skip
            return len(gone)
        return 0

    def is_closed(self) -> bool:
        try:
            snapshot = self._joiner.view.refresh()
        except EtcdError as exc:
            raise RendezvousConnectionError(f"The connection to etcd has failed ({exc}).") from exc
        return snapshot.record is not None and snapshot.record.closed

    def set_closed(self) -> None:
        """Mark the rendezvous closed: every node's next attempt to join fails."""
        self._joiner.close()

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
        if self._joiner.left:
            return True
        try:
            message = self._node.settings_error()
            self._joiner.close(self._settings_reason(message) if message is not None else "")
            return True
        except (RendezvousConnectionError, RendezvousTimeoutError) as exc:
            log.warning("The node '%s' could not close the rendezvous '%s' (%s).", self.node,
                        self._settings.run_id, exc)  # fmt: skip
            return False
        finally:
            self._leave(revoke_store=self._joiner.joined_total <= 1)

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
        if self._joiner.left:
            return
        self._joiner.stop()
        self._node.close()
        reachable = self._joiner.revoke()
        self._store.close(revoke=revoke_store and reachable)
        self._node.drop_worker_store()
        self._client.close()

    def _leave_round_early(self, why: str) -> None:
        """A worker of this node reported that the node leaves the job, its stop checkpoint committed
        (:mod:`elastic_ddp.rendezvous.leaving`): revoke the node's lease now, so the others start their
        next round without waiting for this agent's exit. Not when this agent itself is restarting its
        workers for a membership change (it reported one): then the node stays."""
        if self._joiner.left or self._joiner.joined is None or self._reported is not None:
            return
        self._joiner.revoke_early(why)

    # -- closing -------------------------------------------------------------------------------

    def _settings_reason(self, message: str) -> str:
        reason = (f"the settings of a worker of node '{self.node}' are invalid (no restart can fix them):\n"
                  f"{message.strip()}")  # fmt: skip
        return reason if len(reason) <= MAX_REASON_LENGTH else reason[: MAX_REASON_LENGTH - 6] + " [...]"

    def _close_for_settings(self, message: str) -> InvalidSettingsError:
        """Close the rendezvous with this node's workers' settings error as the reason (the other
        nodes exit with it); the error to raise, also when etcd could not be told."""
        reason = self._settings_reason(message)
        log.error("A worker of node '%s' reported invalid settings; closing the rendezvous '%s' for every node.",
                  self.node, self._settings.run_id)  # fmt: skip
        try:
            self._joiner.close(reason)
        except (RendezvousConnectionError, RendezvousTimeoutError) as exc:
            log.warning("The node '%s' could not close the rendezvous '%s' (%s); the other nodes end when their "
                        "own workers fail.", self.node, self._settings.run_id, exc)  # fmt: skip
        return InvalidSettingsError(f"The rendezvous '{self._settings.run_id}' is closed: {reason}")

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

