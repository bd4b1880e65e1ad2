"""torch's DynamicRendezvousHandler, taught three things an elastic job on real clusters needs.

1. **A node that left is a membership change.** Stock torch restarts a healthy worker group only
   when ``num_nodes_waiting() > 0``, i.e. when a node *joins*. When a node is preempted, the
   survivors' workers commit a checkpoint with the leaving node and then wait (see
   ``elastic_ddp.loop``); :meth:`ElasticRendezvousHandler.num_nodes_waiting` also reports a
   change when a participant of this node's round is gone, so the survivors' agents restart
   their workers at the smaller world size -- without spending one of ``--max-restarts``.
2. **A preempted node leaves at once.** torchrun does not shut the handler down after a signal
   (that would close the rendezvous for everyone), so the leaving node would stay listed until
   its heartbeat expires. An ``atexit`` hook removes it from the round's participants instead;
   a rendezvous already closed (the job finished) is left alone.
3. **An etcd outage is not a failure of the job.** The agent polls ``num_nodes_waiting()``
   every monitor interval; stock torch lets a backend error there kill the agent. Here it is
   logged (once per outage) and reported as "no change", so training, which does not use etcd,
   goes on. When etcd comes back, every node's heartbeat is as old as the outage: for one
   keep-alive window after the backend answers again, :class:`OutageTolerantStateHolder` does
   not expire anyone, giving live nodes the chance to heartbeat instead of all being dropped.

4. **A waiting node wakes when the state changes.** torch's op executor sleeps a fixed second
   between polls of the state while it waits for others to join or for a round to complete;
   :class:`WatchingOpExecutor` waits on an etcd watch of the state key instead (at most that same
   second, and never past the last-call deadline), so a group forms as soon as its last member
   writes, without more reads of etcd than one per change.

Also exported to the workers (through the agent's environment, which torchrun copies into every
worker): ``ELASTIC_DDP_RDZV_ROUND``, the rendezvous round the worker group was formed in, so
checkpoint commits can be fenced against stale writers of an older round.

This module subclasses private parts of ``torch.distributed.elastic.rendezvous.
dynamic_rendezvous`` (the state holder, the exit operation); it is the one place that does.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from datetime import datetime, timedelta, timezone

from torch.distributed import Store
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

__all__ = [
    "ENV_RDZV_ROUND", "ElasticRendezvousHandler", "OutageTolerantStateHolder", "WatchingOpExecutor",
    "create_elastic_handler",
]  # fmt: skip

log = logging.getLogger(__name__)

ENV_RDZV_ROUND = "ELASTIC_DDP_RDZV_ROUND"  # also named in elastic_ddp.distributed
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


def create_elastic_handler(store: Store, backend: RendezvousBackend, params: RendezvousParameters) -> ElasticRendezvousHandler:
    """The handler for ``params`` (torch's rdzv_conf keys, as torch's ``create_handler`` reads them)."""
    timeout = RendezvousTimeout(
        _seconds(params, "join_timeout"),
        _seconds(params, "last_call_timeout"),
        _seconds(params, "close_timeout"),
        _seconds(params, "heartbeat") or _seconds(params, "heartbeat_timeout"),
    )
    keep_alive_interval = params.get_as_int("keep_alive_interval", 5)
    keep_alive_max_attempt = params.get_as_int("keep_alive_max_attempt", 3)
    if keep_alive_interval is None or keep_alive_max_attempt is None:
        raise ValueError("The rendezvous options 'keep_alive_interval' and 'keep_alive_max_attempt' must be integers.")
    settings = RendezvousSettings(
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        timeout,
        keep_alive_interval=timedelta(seconds=keep_alive_interval),
        keep_alive_max_attempt=keep_alive_max_attempt,
    )
    node = ElasticRendezvousHandler._node_desc_generator.generate(params.local_addr)
    holder = OutageTolerantStateHolder(backend, settings)
    return ElasticRendezvousHandler(node, settings, backend.name, store, holder)
