"""The rendezvous handler this package shipped before per-node state: the baseline of the benchmarks.

torch's ``DynamicRendezvousHandler`` on ``EtcdV3RendezvousBackend``: the whole membership
(participants and a wall-clock heartbeat per node) is one pickled blob under one etcd key, and
every node rewrites it with a compare-and-set at every heartbeat (once a second). On top, as it
shipped: a node leaving restarts the survivors, a preempted node leaves at exit, an etcd outage
is not a failure, and waiting nodes wake on a watch of the state instead of polling.

Not part of the package: ``benchmarks/bench_rdzv_*.py`` and ``bench_recovery.py`` register it as
``--rdzv-backend=etcd-blob`` (:func:`register`; ``torchrun_blob.py`` does it for torchrun) to
measure it side by side with the handler that replaced it.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from datetime import datetime, timedelta, timezone

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousSettings,
    RendezvousTimeout,
    _Action,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _RendezvousContext,
    _RendezvousExitOp,
)

from elastic_ddp.contract import ENV_RDZV_ROUND

__all__ = ["BLOB_BACKEND", "create_blob_handler", "register"]

log = logging.getLogger(__name__)

BLOB_BACKEND = "etcd-blob"  # the --rdzv-backend name this baseline is registered under
# Its recovery defaults as it shipped (each heartbeat a write of the whole state, once a second).
BLOB_DEFAULTS = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 2,
                 "heartbeat_timeout": 5, "close_timeout": 10}  # fmt: skip
POLL_S = 1.0  # torch's fixed delay between polls: the longest a waiting node now waits
MIN_POLL_S = 0.05  # a floor between reads, so a burst of heartbeats cannot make a node spin


class OutageTolerantStateHolder(_BackendRendezvousStateHolder):
    """A state holder that does not declare everyone dead right after the backend was unreachable."""

    def __init__(self, backend: RendezvousBackend, settings: RendezvousSettings) -> None:
        super().__init__(backend, settings)
        self._last_failure: float | None = None
        window = settings.keep_alive_interval * (settings.keep_alive_max_attempt + 1)
        self._grace_s = window.total_seconds()

    def sync(self) -> bool | None:
        try:
            return super().sync()
        except RendezvousError:
            self._last_failure = time.monotonic()
            raise

    def _sanitize(self) -> None:
        if self._last_failure is not None and time.monotonic() - self._last_failure < self._grace_s:
            return  # heartbeats could not be written during the outage; let them catch up first
        super()._sanitize()

    @property
    def in_outage_grace(self) -> bool:
        return self._last_failure is not None and time.monotonic() - self._last_failure < self._grace_s

    def wait_for_change(self, timeout: float) -> None:
        """Return when the backend's state has changed since the last sync, or after ``timeout`` s;
        the next :meth:`sync` then reads the backend instead of serving its one-second cache."""
        wait = getattr(self._backend, "wait_for_state_change", None)
        if wait is None:  # a backend without watches: torch's fixed poll
            time.sleep(timeout)
            return
        if wait(self._token, timeout):
            self._last_sync_time = -1


class WatchingOpExecutor(_DistributedRendezvousOpExecutor):
    """torch's rendezvous op executor, waiting on state changes instead of sleeping between polls.

    The loop is torch's: sync, ask the operation's state handler for the next action, apply it
    locally and mark the state dirty for the next sync. Only ``SYNC`` (wait for others) differs.
    """

    _APPLY = {
        _Action.KEEP_ALIVE: "_keep_alive",
        _Action.ADD_TO_PARTICIPANTS: "_add_to_participants",
        _Action.ADD_TO_WAIT_LIST: "_add_to_wait_list",
        _Action.ADD_TO_REDUNDANCY_LIST: "_add_to_redundancy_list",
        _Action.REMOVE_FROM_PARTICIPANTS: "_remove_from_participants",
        _Action.REMOVE_FROM_WAIT_LIST: "_remove_from_wait_list",
        _Action.REMOVE_FROM_REDUNDANCY_LIST: "_remove_from_redundancy_list",
        _Action.MARK_RENDEZVOUS_COMPLETE: "_mark_rendezvous_complete",
        _Action.MARK_RENDEZVOUS_CLOSED: "_mark_rendezvous_closed",
    }

    def run(self, state_handler, deadline: float, update_deadline=None) -> None:
        action = None
        while action != _Action.FINISH:
            self._state_holder.sync()
            self._state = self._state_holder.state
            action = state_handler(_RendezvousContext(self._node, self._state, self._settings), deadline)
            if action == _Action.FINISH:
                continue
            if action == _Action.ERROR_CLOSED:
                raise RendezvousClosedError
            if action == _Action.ERROR_TIMEOUT:
                raise RendezvousTimeoutError
            if action == _Action.SYNC:
                self._wait(deadline)
                continue
            getattr(self, self._APPLY[action])()
            if action == _Action.REMOVE_FROM_REDUNDANCY_LIST and update_deadline:
                # As in torch: the node may now take part in the round, so it gets a fresh join deadline.
                deadline = update_deadline(self._settings.timeout.join)
            self._state_holder.mark_dirty()

    def _wait(self, deadline: float) -> None:
        started = time.monotonic()
        timeout = min(POLL_S, max(deadline - started, 0.0))
        last_call = self._state.deadline  # set once min_nodes joined: the round closes then
        if last_call is not None:
            timeout = min(timeout, max((last_call - datetime.now(timezone.utc)).total_seconds(), 0.0))
        self._state_holder.wait_for_change(timeout)  # create_elastic_handler gives every handler this holder
        rest = MIN_POLL_S - (time.monotonic() - started)
        if rest > 0:
            time.sleep(rest)


class ElasticRendezvousHandler(DynamicRendezvousHandler):
    """See the module docstring. Create with :func:`create_elastic_handler`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._joined_round: int | None = None
        self._joined_members: frozenset = frozenset()
        self._reported_change: tuple | None = None
        self._outage_since: float | None = None
        self._op_executor = WatchingOpExecutor(self._this_node, self._state_holder, self._settings)
        atexit.register(_leave_at_exit, weakref.ref(self))

    def next_rendezvous(self) -> RendezvousInfo:
        info = super().next_rendezvous()
        state = self._state_holder.state
        self._joined_round = state.round
        self._joined_members = frozenset(state.participants)
        os.environ[ENV_RDZV_ROUND] = str(state.round)
        return info

    def num_nodes_waiting(self) -> int:
        try:
            waiting = super().num_nodes_waiting()
        except RendezvousError as exc:
            if self._outage_since is None:
                self._outage_since = time.monotonic()
                log.warning(
                    "The rendezvous backend is unreachable (%s); training goes on, membership changes "
                    "wait until it is back.", exc,
                )  # fmt: skip
            return 0
        if self._outage_since is not None:
            log.warning(
                "The rendezvous backend is reachable again after %.1f s.", time.monotonic() - self._outage_since
            )
            self._outage_since = None
        if waiting or self._joined_round is None:
            return waiting
        state = self._state_holder.state
        if state.closed:
            return 0
        gone = self._joined_members - set(state.participants)
        if state.round != self._joined_round or gone:
            change = (state.round, frozenset(gone))
            if change != self._reported_change:
                self._reported_change = change
                log.info(
                    "%d node(s) left round %d of the rendezvous '%s'; restarting the workers at the new "
                    "membership.", max(len(gone), 1), self._joined_round, self._settings.run_id,
                )  # fmt: skip
            return max(len(gone), 1)
        return 0

    def leave(self) -> None:
        """Remove this node from the current round's participants (no-op if closed or not in it)."""
        self._stop_heartbeats()
        with self._heartbeat_lock:
            self._state_holder.sync()
            state = self._state_holder.state
            if state.closed or self._this_node not in state.participants:
                return
            deadline = time.monotonic() + self._settings.timeout.close.total_seconds()
            self._op_executor.run(_RendezvousExitOp(), deadline)
        log.info("The node '%s' left the rendezvous '%s'.", self._this_node, self._settings.run_id)


def _leave_at_exit(handler_ref: weakref.ref) -> None:
    handler = handler_ref()
    if handler is None or handler._joined_round is None:
        return
    try:
        handler.leave()
    except Exception as exc:  # noqa: BLE001 - the heartbeat expiry removes us anyway
        log.warning("Could not leave the rendezvous at exit (%s); the others notice within the keep-alive timeout.", exc)


def _seconds(params: RendezvousParameters, key: str) -> timedelta | None:
    value = params.get_as_int(key)
    return None if value is None else timedelta(seconds=value)


def create_blob_handler(params: RendezvousParameters) -> ElasticRendezvousHandler:
    """The baseline handler for ``params`` (torch's rdzv_conf keys; connection options as for
    ``elastic_ddp.rendezvous.plugin.create_backend``), under the backend name ``params.backend``."""
    from elastic_ddp.rendezvous.backend import EtcdV3RendezvousBackend
    from elastic_ddp.rendezvous.plugin import _key_prefix, create_client
    from elastic_ddp.rendezvous.store import EtcdV3Store

    params = RendezvousParameters(
        backend=params.backend, endpoint=params.endpoint, run_id=params.run_id, min_nodes=params.min_nodes,
        max_nodes=params.max_nodes, local_addr=params.local_addr,
        **{**BLOB_DEFAULTS, **{k: v for k, v in params.config.items() if v is not None}},
    )  # fmt: skip
    client = create_client(params)
    prefix = _key_prefix(params)
    backend = EtcdV3RendezvousBackend(client, params.run_id, key_prefix=prefix, name=params.backend)
    store = EtcdV3Store(client, f"{prefix}/{params.run_id}/store/")
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    timeout = RendezvousTimeout(
        _seconds(params, "join_timeout"),
        _seconds(params, "last_call_timeout"),
        _seconds(params, "close_timeout"),
        _seconds(params, "heartbeat") or _seconds(params, "heartbeat_timeout"),
    )
    settings = RendezvousSettings(
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        timeout,
        keep_alive_interval=timedelta(seconds=params.get_as_int("keep_alive_interval")),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt"),
    )
    node = ElasticRendezvousHandler._node_desc_generator.generate(params.local_addr)
    holder = OutageTolerantStateHolder(backend, settings)
    return ElasticRendezvousHandler(node, settings, backend.name, store, holder)


def register(name: str = BLOB_BACKEND) -> None:
    """Make ``--rdzv-backend=<name>`` (and torch's registry) create the baseline handler."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(name, create_blob_handler)
