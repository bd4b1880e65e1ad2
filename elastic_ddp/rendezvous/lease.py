"""A node's liveness in etcd: its own lease, and its share in keeping the run's lease alive.

The node's lease is what the other nodes see of it: its registration is written under it, so the
lease ending -- revoked when the node leaves, or expired ``lease_ttl`` seconds after its last
renewal -- removes the node from its round, and every member learns it through its watch. No clock
of one host is compared with another's. Renewals run in a background thread, one small request per
``keep_alive_interval``, which etcd's leader answers from memory: no raft entry, no revision.

The run's lease (the round record's, :func:`elastic_ddp.rendezvous.view.run_lease_id`) is renewed by
every node that has seen it, rarely (a quarter of ``run_ttl``), so the record outlives any one node
and expires ``run_ttl`` after the last one is gone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from elastic_ddp.etcd import EtcdClient, EtcdConnectionError, EtcdError, LeaseKeepAlive
from elastic_ddp.rendezvous.settings import HandlerSettings

__all__ = ["NodeLease"]

log = logging.getLogger(__name__)


class NodeLease:
    """This node's lease: granted when first needed (:meth:`ensure`), renewed in the background until
    it ends or is revoked; then the next :meth:`ensure` grants a new one.

    Thread safety: the lease is read and replaced under a lock, since the join (the agent's thread),
    the renewal thread (an expiry) and the leaving listener (:meth:`revoke_early`) all reach it.

    Args:
        client: The etcd client; the caller owns it.
        settings: ``lease_ttl``, ``keep_alive_interval``, ``keep_alive_deadline``, ``run_ttl``.
        node: This node's name, for the log.
        on_lost: Called (from the renewal thread) when etcd reports that the node's lease ended, so
            that a join waiting in a round learns it must register again.
        name: The renewal thread's name.
    """

    def __init__(
        self, client: EtcdClient, settings: HandlerSettings, node: str, on_lost: Callable[[], None], name: str
    ) -> None:
        self._client = client
        self._settings = settings
        self._node_text = node
        self._on_lost = on_lost
        self._keep_alive = LeaseKeepAlive(client, settings.keep_alive_deadline, name=name)
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._lost = False  # this node's lease ended (renewals starved or etcd unreachable)
        self._run_lease_renewed = False

    @property
    def current(self) -> int | None:
        """The node's lease, None when it has none (not granted yet, ended or revoked)."""
        with self._lock:
            return self._lease

    def ensure(self) -> int:
        """The node's lease, granted now (and kept alive from now on) if it has none."""
        with self._lock:
            if self._lease is not None:
                return self._lease
        lease = self._client.grant_lease(self._settings.lease_ttl)
        with self._lock:
            self._lease = lease
        self._keep_alive.add(lease, self._settings.keep_alive_interval, self._on_expired)
        return lease

    def forget(self) -> None:
        """etcd refused a write naming the lease (it ended): the next :meth:`ensure` grants another."""
        with self._lock:
            self._lease = None

    def take_lost(self) -> bool:
        """True once after etcd reported that the node's lease ended (its registration went with it)."""
        with self._lock:
            lost, self._lost = self._lost, False
            return lost

    def _on_expired(self, lease: int) -> None:
        with self._lock:
            if self._lease == lease:
                self._lease = None
                self._lost = True
        self._on_lost()
        log.warning("etcd reports that the lease of node '%s' has ended: the other nodes see it as gone. It "
                    "joins again at its next rendezvous.", self._node_text)  # fmt: skip

    def renew_run_lease(self, lease: int) -> None:
        """Keep the run's lease (``lease``, read with the round record; 0: none) alive from now on."""
        if lease and not self._run_lease_renewed:
            self._run_lease_renewed = True
            self._keep_alive.add(lease, max(self._settings.run_ttl / 4, 1.0), self._on_run_lease_expired)

    def _on_run_lease_expired(self, lease: int) -> None:
        self._run_lease_renewed = False

    def revoke_early(self, why: str) -> None:
        """Revoke the node's lease while its agent goes on (its stop checkpoint is committed, ``why``):
        the others stop waiting for it now. Should the agent join again after all, the lease counts
        as lost, so the join registers again under a new one."""
        with self._lock:
            lease, self._lease = self._lease, None
            self._lost = lease is not None
        if lease is None:
            return
        self._keep_alive.remove(lease)
        try:
            self._client.revoke_lease(lease)
        except EtcdError as exc:
            log.warning("The node '%s' could not leave the rendezvous early (%s); the others notice when its lease "
                        "ends.", self._node_text, exc)  # fmt: skip
            return
        log.info("The node '%s' left the rendezvous '%s' as its stop checkpoint was committed (%s).", self._node_text,
                 self._settings.run_id, why)  # fmt: skip

    def stop(self) -> None:
        """Stop renewing (the renewal thread ends); the leases stay until revoked or expired."""
        self._keep_alive.close()

    def revoke(self) -> bool:
        """Revoke the node's lease, so its registration is gone at once; False when etcd was found
        unreachable (a revocation of another lease is then not worth trying: it would wait out the
        request timeout too)."""
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is None:
            return True
        try:
            self._client.revoke_lease(lease)
            log.info("The node '%s' left the rendezvous '%s'.", self._node_text, self._settings.run_id)
        except EtcdError as exc:
            log.warning("The node '%s' could not leave the rendezvous at once (%s); the others notice within %d s.",
                        self._node_text, exc, self._settings.lease_ttl)  # fmt: skip
            return not isinstance(exc, EtcdConnectionError)
        return True
