"""What the rendezvous handler does on its own node for the agent's workers, beside the protocol
(:mod:`elastic_ddp.rendezvous.join`): :class:`NodeServices`.

* **The agent's directory** (:mod:`elastic_ddp.rendezvous.agent_dir`), exported to the workers as
  ``ELASTIC_DDP_SETTINGS_ERROR_DIR`` with the agent's pid: where a worker reports invalid settings
  and finds the marks of why its agent stops it (:mod:`elastic_ddp.agent_marks`), and where the
  sockets below live. Removed when the node leaves.
* **Each round hosts a fresh worker store** on its rank-0 agent, listening before any worker of the
  round starts (:meth:`NodeServices.bootstrap`), and the round is exported to the workers as
  ``ELASTIC_DDP_RDZV_ROUND``.
* **Workers start warm.** Before its first join the node starts its workers' template
  (:mod:`elastic_ddp.prestart`): every worker of every round is a fork of it. A node joining a
  running job registers once the template has imported torch and this library, so it does not stop
  the others' workers for the seconds of its own imports. At a job's first formation it registers at
  once (every worker starts then anyway): the imports overlap the rendezvous, the first workers wait
  for the template's torch, and it imports the rest while they train.
* **A node that is going away leaves the round when its stop checkpoint is committed**, not once its
  workers have exited and its agent has unwound (0.3-0.5 s more, on the path of every rank's
  restart): its workers, signalled from outside (a preemption), say so through a socket in the
  agent's directory (:mod:`elastic_ddp.rendezvous.leaving`), and the handler revokes the node's
  lease at once. Should the agent go on after all (its workers alone were signalled), it joins
  again at its next rendezvous, as a node whose lease ended does.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousStoreInfo

from elastic_ddp.agent_marks import clear_restart_marks, read_settings_error, report_members_gone, report_nodes_joining
from elastic_ddp.contract import ENV_AGENT_PID, ENV_PRESTART, ENV_RDZV_ROUND, ENV_SETTINGS_ERROR_DIR
from elastic_ddp.prestart import Template, without_shim
from elastic_ddp.rendezvous.agent_dir import create_agent_dir
from elastic_ddp.rendezvous.leaving import LeavingListener

__all__ = ["TEMPLATE_WARM_WAIT_S", "NodeServices"]

log = logging.getLogger(__name__)

# How long a node joining a running job waits for its workers' template to finish its imports (a
# few seconds; longer only on a starved host, which then starts its workers as usual).
TEMPLATE_WARM_WAIT_S = 60.0


class NodeServices:
    """The agent's directory, environment, workers' template and workers' store, for one handler.

    Each service that cannot be set up is logged and left out, and the job runs without it: without
    a directory a bad setting costs every restart, without the leaving socket the node leaves once
    its workers are gone, without a template the workers start as usual.

    Args:
        node: This node's name, for the log.
        addr: This node's address, by which the workers reach the store its agent hosts.
        on_leaving: Called (from the leaving socket's thread) with a worker's reason when the node
            leaves the job, its stop checkpoint committed.
    """

    def __init__(self, node: str, addr: str, on_leaving: Callable[[str], None]) -> None:
        self._node_text = node
        self._addr = addr
        self._worker_store_server: dist.Store | None = None  # hosted while this node is a round's rank 0
        # Where this agent's workers report invalid settings; the workers inherit the agent's
        # environment when they start.
        try:
            self._directory = create_agent_dir()
            os.environ[ENV_SETTINGS_ERROR_DIR] = self._directory
            os.environ[ENV_AGENT_PID] = str(os.getpid())
        except OSError as exc:  # the job runs as before: a bad setting then costs every restart
            log.warning("No directory for workers to report invalid settings in (%s).", exc)
            self._directory = ""
        self._leaving: LeavingListener | None = None
        if self._directory:
            try:
                self._leaving = LeavingListener(self._directory, on_leaving)
            except OSError as exc:  # the node then leaves once its workers are gone, as torch's agent does
                log.warning("The node '%s' cannot listen for its workers' departure (%s).", self._node_text, exc)
        self._template: Template | None = None

    @property
    def directory(self) -> str:
        """The agent's directory (``ELASTIC_DDP_SETTINGS_ERROR_DIR``); empty when it has none."""
        return self._directory

    def settings_error(self) -> str | None:
        """The message a worker of this node reported its settings invalid with; None: none (one
        ``open`` of a missing file)."""
        return read_settings_error(self._directory)

    def report_nodes_joining(self, why: str) -> None:
        """Tell the workers, before they are stopped, that their stop only admits a node."""
        report_nodes_joining(self._directory, why)

    def report_members_gone(self, why: str) -> None:
        """Tell the workers, before they are stopped, that members of their round are gone."""
        report_members_gone(self._directory, why)

    def clear_restart_marks(self) -> None:
        """The next workers start in a group of live nodes: no mark of why the last ones stopped."""
        clear_restart_marks(self._directory)

    def start_template(self) -> bool:
        """Before the first workers start (and again should it die): the node's template, from which
        workers fork warm (:mod:`elastic_ddp.prestart`; ``ELASTIC_DDP_PRESTART=0`` turns it off).
        True when it was started now."""
        if not self._directory or os.environ.get(ENV_PRESTART, "1") == "0":
            return False
        if self._template is not None:
            if self._template.alive:
                return False
            # Killed (by hand, by the OOM killer): the next workers start warm again.
            log.warning("The workers' template of node '%s' is gone; starting another.", self._node_text)
            self._template.close()
        try:
            self._template = Template(self._directory)
        except OSError as exc:
            log.warning("The node '%s' could not start its workers' template (%s); they start as usual.",
                        self._node_text, exc)  # fmt: skip
            return False
        os.environ.update(self._template.environment())
        return True

    def warm_up_template(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s`` (and ``TEMPLATE_WARM_WAIT_S``), for the template just started to
        import everything, not only torch: for a node about to restart every rank of a running job."""
        self._template.warm_up(min(TEMPLATE_WARM_WAIT_S, timeout_s))

    def export_round(self, round_: int) -> None:
        """Name the round the next workers belong to (``ELASTIC_DDP_RDZV_ROUND``); they inherit it."""
        os.environ[ENV_RDZV_ROUND] = str(round_)

    def bootstrap(self, rank: int, store: dist.Store) -> RendezvousStoreInfo:
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

    def close(self) -> None:
        """Stop listening, stop the template, take this agent's names out of the environment and
        remove its directory."""
        if self._leaving is not None:
            self._leaving.close()
        if self._template is not None:
            self._template.close()
            self._template = None
            without_shim(os.environ)
        if self._directory and os.environ.get(ENV_SETTINGS_ERROR_DIR) == self._directory:
            os.environ.pop(ENV_SETTINGS_ERROR_DIR, None)
            os.environ.pop(ENV_AGENT_PID, None)
        if self._directory:
            shutil.rmtree(self._directory, ignore_errors=True)

    def drop_worker_store(self) -> None:
        """Stop hosting the workers' store: its server thread ends with it; no worker is left to use it."""
        self._worker_store_server = None
