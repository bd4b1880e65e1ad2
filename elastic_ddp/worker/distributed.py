"""Process-group setup from torchrun's environment: backend, device, timeouts and network interfaces.

Workers started by torchrun find their place in the job in environment variables. A script run
without torchrun (``python recipes/train.py``) becomes a job of one rank, so the same code path
serves a laptop, a CI machine and a cluster.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.config import DistConfig
from elastic_ddp.contract import ENV_RDZV_ROUND
from elastic_ddp.processes import start_ticks

log = logging.getLogger(__name__)

# Set by torchrun for every worker (torch.distributed.elastic.agent.server.local_elastic_agent).
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
ENV_RUN_ID = "TORCHELASTIC_RUN_ID"
ENV_GROUP_RANK = "GROUP_RANK"
ENV_GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"  # nodes (agents) in the worker group
ENV_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
# Network interfaces: NCCL's and gloo's own variables. The library's gloo groups (stop agreement,
# checkpoints) must use the interface the user chose for NCCL on a multi-NIC node.
ENV_NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
ENV_GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
# torch's NCCL watchdog: 2 ("clean up only") aborts the communicators on an error or timeout and
# lets the training thread raise, so the failure is recorded; torch's default tears the process
# down from the watchdog thread, before anything can record why.
ENV_NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_ERRORS_RAISE = "2"


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in the job, fixed for the life of the worker process."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    restart_count: int
    node_rank: int
    local_world_size: int = 1
    rdzv_round: int | None = None  # None when the agent's rendezvous is not this package's

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def attempt_id(environ: Mapping[str, str] | None = None) -> str:
    """The id of this worker's attempt: the same string on every rank of one worker group (one
    rendezvous round), another one for every other group. ``environ`` defaults to ``os.environ``.

    The step ledger (:mod:`elastic_ddp.data.ledger`) and the failure report
    (:mod:`elastic_ddp.worker.failures`) name attempts by it. torchrun's ``TORCHELASTIC_RESTART_COUNT``
    cannot serve across nodes: each agent counts its own restarts (a failure counts on the failed
    node only, a membership change on none, a node that joined later or replaced another has counted
    fewer), so the ranks of one group carry different counts. The id is, by what is available:

    * ``"<MASTER_ADDR>:<MASTER_PORT>/round-<N>"`` under this package's etcd handler, which exports
      the round to the workers (``ELASTIC_DDP_RDZV_ROUND``). Round numbers only grow; the round's
      store address (which every agent reads from the round's rendezvous) tells the rounds of
      another etcd apart.
    * ``"<MASTER_ADDR>:<MASTER_PORT>"`` with another rendezvous over several nodes
      (``GROUP_WORLD_SIZE`` > 1, e.g. ``c10d``): the worker store of the round's rank-0 worker, a
      new one per round where this package is installed
      (:func:`elastic_ddp.rendezvous.plugin._per_round_worker_store`). A later round may be given the
      same port again; :func:`elastic_ddp.data.ledger.read_ledger` tells such attempts apart.
    * ``"<MASTER_ADDR>:<MASTER_PORT>/<TORCHELASTIC_RESTART_COUNT>"`` on one node (``--standalone``,
      a script run without torchrun): one agent's count numbers its groups. Ledgers and failure
      records written before the round was used have this form on every node.

    Unset variables read as ``local``, ``0`` and ``0``.
    """
    env = os.environ if environ is None else environ
    store = f"{env.get(ENV_MASTER_ADDR, 'local')}:{env.get(ENV_MASTER_PORT, '0')}"
    round_ = env.get(ENV_RDZV_ROUND, "")
    if round_:
        return f"{store}/round-{round_}"
    nodes = env.get(ENV_GROUP_WORLD_SIZE, "")
    if nodes.isdigit() and int(nodes) > 1:
        return store
    return f"{store}/{env.get(ENV_RESTART_COUNT, '0')}"


def process_age_s() -> float | None:
    """Seconds since this process started (Linux ``/proc``, to 0.01 s); None where unknown.

    What a restart spends before the script's first line (interpreter, imports) is only seen from
    the process's own start.
    """
    started = start_ticks()
    try:
        with open("/proc/uptime") as uptime:
            up = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None if started is None else up - started / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_backend(requested: str, cuda_available: bool) -> str:
    """``auto`` means nccl where CUDA is available and gloo elsewhere."""
    if requested == "auto":
        return "nccl" if cuda_available else "gloo"
    if requested == "nccl" and not cuda_available:
        raise ValueError("dist.backend is 'nccl', but CUDA is not available on this machine; use 'gloo' or 'auto'.")
    return requested


def select_device(local_rank: int, cuda_devices: int, visible: str | None) -> torch.device:
    """This rank's CUDA device: ``cuda:LOCAL_RANK`` when that many devices are visible, else the one
    visible device (a scheduler that gives each process its own GPU through ``CUDA_VISIBLE_DEVICES``).

    Raises ``ValueError`` naming ``LOCAL_RANK`` and ``CUDA_VISIBLE_DEVICES`` when neither fits.
    """
    if local_rank < cuda_devices:
        return torch.device("cuda", local_rank)
    if cuda_devices == 1:
        return torch.device("cuda", 0)
    raise ValueError(
        f"LOCAL_RANK is {local_rank} but {cuda_devices} CUDA device(s) are visible "
        f"(CUDA_VISIBLE_DEVICES={visible!r}): start at most one process per visible GPU "
        "(torchrun --nproc-per-node), or give each process exactly one device."
    )


def _host_interfaces() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:  # not every platform can list them; gloo then picks by host name
        return []


def gloo_interface_from_nccl(environ: dict[str, str], interfaces: list[str] | None = None) -> str | None:
    """The ``GLOO_SOCKET_IFNAME`` to use when only ``NCCL_SOCKET_IFNAME`` names interfaces, else None.

    NCCL's value may be a prefix list (``eth,ib``: every interface whose name starts with one), an
    exact list (``=eth0,eth1``) or an exclusion (``^docker``); gloo takes exact names only (a prefix
    such as ``eth`` makes it fail: "Unable to find address for: eth"). An exact list carries over as
    it is. A prefix list becomes the first of this host's ``interfaces`` (default: all of them, in
    the kernel's order) that matches a prefix, trying the prefixes in their order: one interface,
    because every rank must give gloo the same number of them, and nodes may differ in how many
    match. An exclusion, an empty value or a prefix that matches nothing leaves gloo to pick by
    host name, as without the variable.
    """
    if environ.get(ENV_GLOO_SOCKET_IFNAME):
        return None
    value = environ.get(ENV_NCCL_SOCKET_IFNAME, "").strip()
    if not value or value.startswith("^"):
        return None
    if value.startswith("="):
        return value[1:]
    names = _host_interfaces() if interfaces is None else interfaces
    for prefix in filter(None, (part.strip() for part in value.split(","))):
        for name in names:
            if name.startswith(prefix):
                return name
    return None


def init_distributed(cfg: DistConfig) -> DistContext:
    """Create the default process group from torchrun's environment and pick this rank's device.

    On CUDA machines each rank uses its device (:func:`select_device`) and nccl; elsewhere the CPU and
    gloo. ``cfg.timeout_s`` bounds every collective, so a dead or hung peer breaks the group in
    seconds instead of torch's default 10 minutes, and torchrun can restart the workers.
    """
    if ENV_WORLD_SIZE not in os.environ:
        # Not under torchrun: a job of one rank on a private rendezvous.
        os.environ.update(
            {ENV_RANK: "0", ENV_WORLD_SIZE: "1", ENV_LOCAL_RANK: "0",
             ENV_MASTER_ADDR: "127.0.0.1", ENV_MASTER_PORT: str(_free_port())}
        )
    rank = int(os.environ[ENV_RANK])
    world_size = int(os.environ[ENV_WORLD_SIZE])
    local_rank = int(os.environ.get(ENV_LOCAL_RANK, "0"))
    backend = resolve_backend(cfg.backend, torch.cuda.is_available())
    interface = gloo_interface_from_nccl(dict(os.environ))
    if interface:
        os.environ[ENV_GLOO_SOCKET_IFNAME] = interface
        log.info("Using NCCL_SOCKET_IFNAME's interface(s) %s for the gloo groups too.", interface)

    if backend == "nccl":
        device = select_device(local_rank, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        torch.cuda.set_device(device)
        os.environ.setdefault(ENV_NCCL_ASYNC_ERROR_HANDLING, NCCL_ERRORS_RAISE)
    else:
        device = torch.device("cpu")

    group_started = time.monotonic()
    dist.init_process_group(
        backend=backend,
        timeout=timedelta(seconds=cfg.timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    group_s = time.monotonic() - group_started
    restart_count = int(os.environ.get(ENV_RESTART_COUNT, "0"))
    age = process_age_s()
    log.info(
        "Rank %d of world size %d on %s (%s); torchrun restart %d of at most %s, rendezvous round %s; ready %s after "
        "its process started (process group %.2f s).",
        rank, world_size, device, backend, restart_count, os.environ.get(ENV_MAX_RESTARTS, "0"),
        os.environ.get(ENV_RDZV_ROUND, "-"), "?" if age is None else f"{age:.2f} s", group_s,
    )  # fmt: skip
    return DistContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend=backend,
        restart_count=restart_count,
        node_rank=int(os.environ.get(ENV_GROUP_RANK, "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        rdzv_round=int(os.environ[ENV_RDZV_ROUND]) if os.environ.get(ENV_RDZV_ROUND, "").isdigit() else None,
    )


def new_gloo_group(timeout_s: float) -> Any:
    """A gloo group over all ranks (collective), for the library's host-side coordination; None alone."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def shutdown_distributed() -> None:
    """Destroy the default process group if there is one (safe to call twice)."""
    if dist.is_initialized():
        # Destroying gloo groups right after DDP's last all-reduce can deadlock in torch 2.13 (the
        # group's destructor joins a thread that waits for the GIL); a barrier drains them first.
        dist.barrier()
        dist.destroy_process_group()
