"""Process-group setup from torchrun's environment: backend, device and timeouts.

Workers started by torchrun find their place in the job in environment variables. A script run
without torchrun (``python recipes/train.py``) becomes a job of one rank, so the same code path
serves a laptop, a CI machine and a cluster.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_ddp.config import DistConfig

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
ENV_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
# Set by this package's rendezvous handler in the agent, inherited by its workers.
ENV_RDZV_ROUND = "ELASTIC_DDP_RDZV_ROUND"


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
    rdzv_round: int | None = None  # None when the agent's rendezvous is not this package's

    @property
    def is_main(self) -> bool:
        return self.rank == 0


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


def init_distributed(cfg: DistConfig) -> DistContext:
    """Create the default process group from torchrun's environment and pick this rank's device.

    On CUDA machines each rank uses ``cuda:LOCAL_RANK`` and nccl; elsewhere the CPU and gloo.
    ``cfg.timeout_s`` bounds every collective, so a dead or hung peer breaks the group in seconds
    instead of torch's default 30 minutes, and torchrun can restart the workers.
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

    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # Surface NCCL errors and timeouts as exceptions in the training thread instead of a hang.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    else:
        device = torch.device("cpu")

    dist.init_process_group(
        backend=backend,
        timeout=timedelta(seconds=cfg.timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    restart_count = int(os.environ.get(ENV_RESTART_COUNT, "0"))
    log.info(
        "Rank %d of world size %d on %s (%s); torchrun restart %d of at most %s, rendezvous round %s.",
        rank, world_size, device, backend, restart_count, os.environ.get(ENV_MAX_RESTARTS, "0"),
        os.environ.get(ENV_RDZV_ROUND, "-"),
    )  # fmt: skip
    return DistContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend=backend,
        restart_count=restart_count,
        node_rank=int(os.environ.get(ENV_GROUP_RANK, "0")),
        rdzv_round=int(os.environ[ENV_RDZV_ROUND]) if os.environ.get(ENV_RDZV_ROUND, "").isdigit() else None,
    )


def shutdown_distributed() -> None:
    """Destroy the default process group if there is one (safe to call twice)."""
    if dist.is_initialized():
        # Destroying gloo groups right after DDP's last all-reduce can deadlock in torch 2.13 (the
        # group's destructor joins a thread that waits for the GIL); a barrier drains them first.
        dist.barrier()
        dist.destroy_process_group()
