"""What a checkpoint's save pipeline and its loader share: the ranks that checkpoint one URL together.

:class:`CheckpointGroup` holds the storage, this rank's place among the ranks, the process groups
they talk over, the I/O threads that write and read the files, and the commit fence of
:mod:`~elastic_ddp.checkpoint.fence`. :func:`state_dicts` is how both take state from the objects a
run registers. :class:`~elastic_ddp.checkpoint.manager.CheckpointManager` builds one group and hands
it to its :class:`~elastic_ddp.checkpoint.saving.CheckpointSaver` and
:class:`~elastic_ddp.checkpoint.loading.CheckpointLoader`.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint import fence
from elastic_ddp.checkpoint.collectives import Collectives, global_rank
from elastic_ddp.checkpoint.exchange import Transport
from elastic_ddp.checkpoint.storage import Storage, normalize_url
from elastic_ddp.config import CheckpointConfig
from elastic_ddp.state import Stateful, check_stateful

log = logging.getLogger("elastic_ddp.checkpoint")


def state_dicts(state: Mapping[str, Stateful]) -> dict[str, Any]:
    """``{name: obj.state_dict()}``, after checking that every name and object can be checkpointed."""
    out = {}
    for name, obj in state.items():
        check_stateful(name, obj)
        out[name] = obj.state_dict()
    return out


class CheckpointGroup:
    """The ranks of ``process_group`` (default: the world) checkpointing ``cfg.url``; built collectively.

    With an initialized process group it creates a gloo group of its own over those ranks
    (:attr:`coll` runs on it); without one this process works alone (rank 0 of 1). ``rdzv_round``:
    the rendezvous round the group was formed in, which :meth:`check_fence` compares with the
    fence; None: no fencing. :attr:`io` runs the file writes and reads (``cfg.write_threads``
    threads); the saver's ``close()`` shuts it down once the last save is done.
    """

    def __init__(self, cfg: CheckpointConfig, *, process_group: Any, rdzv_round: int | None) -> None:
        self.cfg = cfg
        self.url = normalize_url(cfg.url)
        self.storage = Storage(self.url, cfg.storage_options)
        self.rdzv_round = rdzv_round
        self.distributed = dist.is_available() and dist.is_initialized()
        self.process_group = process_group
        self.own_group: Any = None
        if self.distributed:
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            # A group of its own: background save collectives then never interleave with (and so
            # cannot deadlock against) the training loop's collectives on the default group.
            self.own_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=cfg.timeout_s))
        else:
            self.rank, self.world_size = 0, 1
        self.coll = Collectives(self.own_group, self.rank, self.world_size, distributed=self.distributed, url=self.url)
        self.io = concurrent.futures.ThreadPoolExecutor(max_workers=cfg.write_threads, thread_name_prefix="ckpt-io")

    def storage_for(self, ckpt_url: str) -> Storage:
        """The storage that holds ``ckpt_url``: the group's own under its URL, else one opened for it."""
        return self.storage if ckpt_url.startswith(self.url + "/") else Storage(ckpt_url, self.cfg.storage_options)

    def check_fence(self, action: str) -> None:
        """Raise :class:`~elastic_ddp.checkpoint.fence.StaleWriterError` (logged here) if a newer group
        owns the URL; ``action`` says what was about to happen. Nothing to check without a round."""
        if self.rdzv_round is None:
            return
        try:
            fence.check(self.storage, self.rdzv_round, action)
        except fence.StaleWriterError as exc:
            # Said at once: telling the other ranks may block for checkpoint.timeout_s when the
            # group is gone, which is exactly when a writer is stale.
            log.error("[%d/-] %s", self.rank, exc)
            raise

    def transport(self) -> Transport:
        """For the foreground's collectives: the training group (NCCL with buffers on this rank's GPU, or
        gloo on CPUs), else the group's own gloo group.

        The training group, not the group's own, wherever it can carry the bytes: its timeout is
        ``dist.timeout_s``, so a peer that hangs while the others compare or distribute state is
        detected as quickly as one that hangs in a training step -- not after ``checkpoint.timeout_s``.
        """
        if not self.distributed:
            return Transport(torch.device("cpu"), None, lambda r: r, False)
        backend = str(dist.get_backend(self.process_group)).lower()
        if "nccl" in backend and torch.cuda.is_available():
            group = self.process_group
            device = torch.device("cuda", torch.cuda.current_device())
        elif "gloo" in backend:
            group, device = self.process_group, torch.device("cpu")
        else:
            group, device = self.own_group, torch.device("cpu")
        return Transport(device, group, lambda r: global_rank(group, r), True)
