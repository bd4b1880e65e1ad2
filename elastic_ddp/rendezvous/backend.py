"""The rendezvous state of one run as a single etcd v3 key, updated by compare-and-set.

torch's ``DynamicRendezvousHandler`` keeps the whole rendezvous (participants, heartbeats, round)
as one pickled blob and needs only a fenced read-modify-write of it. That maps onto one etcd key:

* ``get_state()`` reads the key; the token is the key's ``mod_revision``.
* ``set_state(state, token)`` is one transaction: "if mod_revision == token (or, without a token,
  if the key was never created) put the new state; in both cases return the key". Of two writers
  holding the same token exactly one wins; the loser gets the winner's state and token.

The value is base64 so that a corrupt value is detectable (undecodable) instead of reaching
``pickle``. The key is attached to a lease of ``ttl`` seconds (default 2 h) that each writer
refreshes when it writes, so the key of a run nobody touches any more expires.
"""

from __future__ import annotations

import binascii
import threading
import time
from base64 import b64decode, b64encode
from typing import NoReturn

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic_ddp.etcd import EtcdClient, EtcdError, KeyValue, WatchStream

__all__ = ["DEFAULT_KEY_PREFIX", "DEFAULT_STATE_TTL", "EtcdV3RendezvousBackend", "state_key"]

DEFAULT_KEY_PREFIX = "/elastic_ddp/rendezvous"
DEFAULT_STATE_TTL = 7200  # 2 hours, torch's etcd-v2 default

# A lease is refreshed at most this often (fraction of its TTL): one extra round trip per
# half hour rather than one per heartbeat write.
_LEASE_REFRESH_FRACTION = 0.25

CONNECTION_FAILED_MESSAGE = "The connection to etcd has failed. See inner exception for details."


def state_key(key_prefix: str, run_id: str) -> str:
    """The etcd key holding the rendezvous state of ``run_id``."""
    return f"{key_prefix.rstrip('/')}/{run_id}/state"


def raise_rendezvous_error(exc: EtcdError) -> NoReturn:
    """Re-raise a client error as the rendezvous error torch's handler expects."""
    # Auth and other server-side refusals are connection-level failures too from torch's point
    # of view (the state could not be read or written); the message keeps the reason and the
    # endpoints, which the client's error names.
    raise RendezvousConnectionError(f"{CONNECTION_FAILED_MESSAGE} ({exc})") from exc


class EtcdV3RendezvousBackend(RendezvousBackend):
    """A :class:`RendezvousBackend` on etcd's v3 API.

    Args:
        client: The etcd client (owned by the caller).
        run_id: The run id; the state lives at ``<key_prefix>/<run_id>/state``.
        key_prefix: The etcd key prefix shared by all runs.
        ttl: Seconds the state outlives its last write (default 2 h).
        name: The backend name reported to torch, which requires it to equal the
            ``--rdzv-backend`` the handler was created for ("etcd-v3" or "etcd").

    Only :class:`RendezvousConnectionError` (etcd unreachable or refusing) and
    :class:`RendezvousStateError` (stored value corrupt) are raised.
    """

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        ttl: int | None = None,
        name: str = "etcd-v3",
    ) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        if ttl is not None and ttl < 1:
            raise ValueError(f"The rendezvous state TTL ({ttl}) must be at least one second.")
        self._name = name
        self._client = client
        self._key = state_key(key_prefix or DEFAULT_KEY_PREFIX, run_id)
        self._ttl = int(ttl or DEFAULT_STATE_TTL)
        self._lease_lock = threading.Lock()
        self._lease_id: int | None = None
        self._lease_refreshed_at = 0.0
        # Holds a stream and a thread only while a wait_for_state_change runs.
        self._watches = WatchStream(client, name="etcd-state-watch")

    @property
    def name(self) -> str:
        """See base class."""
        return self._name

    @property
    def key(self) -> str:
        """The etcd key holding the state."""
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        try:
            kv = self._client.get(self._key)
        except EtcdError as exc:
            raise_rendezvous_error(exc)
        return None if kv is None else self._decode(kv)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        if token is None:
            revision = 0  # create-only: the key must never have existed
        else:
            try:
                revision = int(token)
            except (TypeError, ValueError):
                revision = -1
            if revision <= 0:
                # Not a token this backend issued: report the current state, write nothing.
                current = self.get_state()
                return None if current is None else (*current, False)
        try:
            written, kv = self._client.compare_and_put(
                self._key, b64encode(state), revision, lease=self._lease_for_write()
            )
        except EtcdError as exc:
            raise_rendezvous_error(exc)
        if kv is None:
            return None  # a token for a key that no longer exists (expired or deleted)
        return (*self._decode(kv), written)

    def wait_for_state_change(self, token: Token | None, timeout: float) -> bool:
        """Block until the state changes after the revision ``token`` names, or ``timeout`` s pass.

        Returns True when it changed (or may have: the watch could not be set up, e.g. that
        revision was compacted), False on timeout. A node waiting in a rendezvous uses this to
        react to a join or a completed round at once instead of polling every second.
        """
        try:
            revision = int(token) if token is not None else 0
        except (TypeError, ValueError):
            revision = 0
        try:
            return self._watches.wait_for_change(self._key, revision + 1, timeout)
        except EtcdError:
            return True  # let the next read find out; it reports a lasting outage itself

    def _decode(self, kv: KeyValue) -> tuple[bytes, Token]:
        try:
            state = b64decode(kv.value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RendezvousStateError(
                f"The rendezvous state stored at etcd key '{self._key}' is corrupt (not base64). "
                "See inner exception for details."
            ) from exc
        return state, kv.mod_revision

    def _lease_for_write(self) -> int:
        """This node's lease for the state key: granted once, refreshed every ttl/4 of writes."""
        with self._lease_lock:
            now = time.monotonic()
            if self._lease_id is not None and now - self._lease_refreshed_at < self._ttl * _LEASE_REFRESH_FRACTION:
                return self._lease_id
            if self._lease_id is not None and self._client.refresh_lease(self._lease_id) > 0:
                self._lease_refreshed_at = now
                return self._lease_id
            self._lease_id = self._client.grant_lease(self._ttl)
            self._lease_refreshed_at = now
            return self._lease_id
