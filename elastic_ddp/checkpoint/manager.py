"""CheckpointManager: sharded, atomic, verified checkpoints of a DDP run over any fsspec URL.

Layout under ``cfg.url``::

    step-000000100/            one directory per checkpoint
        shard-00000-00.bin     raw tensor bytes: rank 0's first share of the replicated state
        shard-00001-00.bin ... each rank writes ~1/N of it (and its own per-rank state)
        index.json             which bytes of which tensor are where, plus the plain values (JSON)
        manifest.json          the commit point: written last, by rank 0, once every file is durable

The manager is the run's one handle on its checkpoints and composes three parts: the ranks and
what they share (:mod:`~elastic_ddp.checkpoint.group`), the save pipeline
(:mod:`~elastic_ddp.checkpoint.saving`) and the loader (:mod:`~elastic_ddp.checkpoint.loading`).

Contracts:

* What is saved is a mapping of names to stateful objects (``state_dict()``/``load_state_dict()``,
  see :mod:`elastic_ddp.state`). At each save the ranks compare what they hold
  (:mod:`~elastic_ddp.checkpoint.divergence`): what is the same on every rank -- DDP's model
  parameters, optimizer, scheduler, data cursor -- is staged and written once in total, each rank
  copying and writing only its share (:mod:`~elastic_ddp.checkpoint.layout`); what differs across
  ranks (BatchNorm statistics, an EMA of them, a per-rank counter) is written by each rank for
  itself, never cut into several ranks' bytes. A load at the saving world size gives every rank its
  own values back; at another world size every rank gets rank 0's, and one line says which.
* A resume reads every byte of the checkpoint once in total: each rank reads a share of the files,
  checking their checksums as they stream in (:meth:`latest` and :meth:`resolve` do this; the bytes
  are kept for :meth:`load`), and :meth:`load` hands the state to every rank over the process group
  (NCCL on GPUs, gloo on CPUs). Nothing of a checkpoint reaches a state object before every file
  it is made of checked out, and nothing is ever unpickled.
* Every rank of the process group constructs the manager, and calls :meth:`save`, :meth:`latest`,
  :meth:`resolve`, :meth:`load`, :meth:`wait`, :meth:`check_shared_storage` and :meth:`close` in
  the same order with the same arguments (step): they are collective. Without an initialized
  process group the manager works alone (world size 1): the CLI and unit tests.
* The manager records the run's *identity* (the settings a resume must not change) in every
  manifest; deciding whether a checkpoint may be resumed is the caller's.
* Only directories with a parseable manifest are checkpoints. With ``ELASTIC_DDP_CHECKPOINT_KEY``
  set, only those whose manifest's signature checks out.
* A failed save never raises into the training loop: it is logged, counted in ``failed_saves`` and
  described in ``last_error``; nothing that looks committed is left behind.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from elastic_ddp.checkpoint import fence, probe
from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.catalog import (
    CheckpointInfo,
    list_checkpoints,
    read_checkpoint,
    retention_plan,
    step_dir_name,
    verify_checkpoint,
)
from elastic_ddp.checkpoint.errors import CheckpointError
from elastic_ddp.checkpoint.group import CheckpointGroup
from elastic_ddp.checkpoint.loading import CheckpointLoader, LoadStats
from elastic_ddp.checkpoint.saving import CheckpointSaver, SaveStats
from elastic_ddp.checkpoint.storage import join
from elastic_ddp.config import CheckpointConfig
from elastic_ddp.state import Stateful

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "LoadStats",
    "SaveStats",
    "list_checkpoints",
    "read_checkpoint",
    "retention_plan",
    "step_dir_name",
    "verify_checkpoint",
]


class CheckpointManager:
    """Saves, lists, verifies, selects and loads checkpoints of one run (see the module docstring).

    ``identity`` (JSON-able values by setting name, e.g. ``{"train.seed": 1337}``) is recorded in
    every manifest (see :attr:`CheckpointInfo.identity`). ``process_group``: the group whose ranks
    share the checkpoint (default: the world); the manager creates a gloo group of its own over those
    ranks, collectively, for its saves, and restores over ``process_group`` itself. ``rdzv_round``:
    the rendezvous round this worker group was formed in; when given, rank 0 claims the URL for this
    round and refuses to commit or clean up once a newer group claimed it (see
    :mod:`elastic_ddp.checkpoint.fence`). None: no fencing (a job without this package's rendezvous).
    ``check_storage``: with more than one rank, run :meth:`check_shared_storage` at once, so a URL
    that is not shared by all nodes stops the job before it trains.

    ``init_from``: the pretrained weights the run started from, recorded in every manifest rank 0
    commits from then on (see :func:`~elastic_ddp.checkpoint.manifest.build`); set it before the
    first save, the same on every rank. None: the run started from its own initialisation.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        identity: Mapping[str, Any] | None = None,
        process_group: Any = None,
        rdzv_round: int | None = None,
        check_storage: bool = True,
    ) -> None:
        if not cfg.url:
            raise ValueError("checkpoint.url must not be empty when a CheckpointManager is built.")
        self._group = CheckpointGroup(cfg, process_group=process_group, rdzv_round=rdzv_round)
        self.cfg = cfg
        self.url = self._group.url
        self.storage = self._group.storage
        self.rank, self.world_size = self._group.rank, self._group.world_size
        self.rdzv_round = rdzv_round
        # The loader waits for the save in flight before each of its collectives (same gloo group);
        # the saver follows what the loader found (see their classes).
        self._loader = CheckpointLoader(self._group, wait_for_save=self.wait)
        self._saver = CheckpointSaver(self._group, self._loader, identity=dict(identity or {}))
        self._storage_shared = False
        if rdzv_round is not None:
            self._group.coll.broadcast(fence.claim, self.storage, rdzv_round)
        if check_storage and self.world_size > 1:
            self.check_shared_storage()

    # ------------------------------------------------------------------------- what it reports

    @property
    def identity(self) -> dict[str, Any]:
        """The settings a resume must not change, recorded in every manifest."""
        return self._saver.identity

    @property
    def init_from(self) -> dict[str, str] | None:
        """The pretrained weights recorded in every manifest committed from now on (see the class docstring)."""
        return self._saver.init_from

    @init_from.setter
    def init_from(self, record: dict[str, str] | None) -> None:
        self._saver.init_from = record

    @property
    def failed_saves(self) -> int:
        """How many saves failed in this manager's life."""
        return self._saver.failed_saves

    @property
    def consecutive_failed_saves(self) -> int:
        """How many saves failed since the last one that succeeded."""
        return self._saver.consecutive_failed_saves

    @property
    def last_error(self) -> str | None:
        """Why the last failed save failed, naming its step and URL; None while none failed."""
        return self._saver.last_error

    @property
    def last_save(self) -> SaveStats | None:
        """The numbers of the last completed save on this rank."""
        return self._saver.last_save

    @property
    def last_load(self) -> LoadStats | None:
        """The numbers of the last load on this rank."""
        return self._loader.last_load

    def metrics(self) -> dict[str, float]:
        """Scalars for the metrics writer: the last completed save's and load's figures and the failure count."""
        scalars = {"ckpt/failed_saves": float(self.failed_saves)}
        last_save, last_load = self.last_save, self.last_load
        if last_save is not None:
            scalars.update({
                "ckpt/stall_s": last_save.stall_s,
                "ckpt/save_s": last_save.save_s,
                "ckpt/bytes": float(last_save.bytes),
                "ckpt/throughput_bytes_per_s": last_save.throughput_bytes_per_s,
                "ckpt/staged_bytes": float(last_save.staged_bytes),
            })  # fmt: skip
        if last_load is not None:
            scalars.update({
                "ckpt/load_read_s": last_load.read_s,
                "ckpt/load_exchange_s": last_load.exchange_s,
                "ckpt/load_bytes_read": float(last_load.bytes_read),
            })  # fmt: skip
        return scalars

    # ----------------------------------------------------------------------------------- saving

    def save(self, step: int, state: Mapping[str, Stateful], *, blocking: bool | None = None) -> bool:
        """Checkpoint ``state`` as step ``step``: what is the same on every rank once in total, what
        differs across ranks per rank (see the module docstring). Every rank passes the same names.

        ``blocking`` None follows ``cfg.async_save``. An async save returns once this rank's share is
        copied to host memory (on GPUs: once the copies are queued); the write and commit run in the
        background. A blocking save returns once the checkpoint is committed; deleting the older
        checkpoints that retention drops runs in the background either way. A previous save still
        in flight (or its retention) is waited for first. Failures do not raise: they
        are logged, counted in ``failed_saves`` (and ``consecutive_failed_saves``) and described in
        ``last_error``. Returns False if a blocking save failed. Raises ``TypeError`` at once for
        state a checkpoint cannot hold (naming where it is).
        """
        return self._saver.save(step, state, blocking=blocking)

    def wait(self) -> bool:
        """Block until the save in flight and its retention (if any) are done; True unless the most recent
        save failed."""
        return self._saver.wait()

    def close(self) -> bool:
        """Finish the pending save and release the threads and buffers; True unless that save failed."""
        return self._saver.close()

    def remove_all(self) -> None:
        """Delete every committed checkpoint under the URL, each manifest first (collective; rank 0 deletes).

        For a new run told to replace an old one. Refused on every rank
        (:class:`~elastic_ddp.checkpoint.fence.StaleWriterError`) when a newer group owns the URL;
        a storage failure raises :class:`CheckpointError` on every rank.
        """
        self.wait()
        self._loader.release()

        def remove() -> None:
            self._group.check_fence(f"delete the checkpoints under {self.url}")
            for info in self.list():
                # Manifest first: a half-deleted checkpoint is then merely an uncommitted leftover.
                self.storage.remove_file(join(info.url, mf.MANIFEST_NAME))
                self.storage.remove_tree(info.url)

        self._group.coll.broadcast(remove)

    # ------------------------------------------------------------------------- shared storage

    def check_shared_storage(self, *, reader: bool | None = None) -> None:
        """Prove that every node sees the same checkpoint storage (collective; see
        :mod:`elastic_ddp.checkpoint.probe`). Raises :class:`CheckpointError` on every rank, naming
        ``cfg.url`` and the ranks that could not read rank 0's probe, when ``checkpoint.url`` is not
        storage shared by all nodes. ``reader``: whether this rank reads the probe (default: one
        rank per node, from ``LOCAL_RANK``). Once it passed, later calls return at once (every rank
        knows it passed, so they all skip alike)."""
        if self._storage_shared:
            return
        probe.check_shared_storage(self.storage, self._group.coll, reader=reader)
        self._storage_shared = True

    # ------------------------------------------------------------------------ finding, loading

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints under ``cfg.url``, oldest first (not verified; local, not collective)."""
        return self._loader.list()

    def list_collective(self) -> list[CheckpointInfo]:
        """:meth:`list` read once by rank 0 and given to every rank (collective).

        Raises :class:`CheckpointError` on every rank when listing fails.
        """
        return self._loader.list_collective()

    def verify(self, info: CheckpointInfo) -> mf.VerifyResult:
        """Check every file of ``info`` on this process alone (not collective)."""
        return verify_checkpoint(self._group.storage_for(info.url), info)

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint that verifies (collective); older ones are tried in turn.

        Verifying is reading: each rank reads its share of the files, checking them as they stream
        in, and keeps the bytes for :meth:`load` (about ``checkpoint size / ranks`` of host memory per
        rank until then), so the checkpoint is read once in total.
        """
        return self._loader.latest()

    def resolve(self, resume: str) -> CheckpointInfo | None:
        """The checkpoint ``resume`` selects (``cfg.resume`` semantics), verified; collective.

        ``'auto'``: newest committed, verified checkpoint or None; ``'never'``: None; a step number:
        that step; a URL: that checkpoint. Raises CheckpointError if an explicitly named checkpoint
        is missing or fails verification.
        """
        return self._loader.resolve(resume)

    def load(self, info: CheckpointInfo, state: Mapping[str, Stateful]) -> bool:
        """Load ``info`` into ``state``, at any world size; collective. Returns whether every rank got its
        own values back: True at the saving world size (or when nothing differed across ranks), False
        when the per-rank values came from rank 0 (another world size; logged once).

        Every object of ``state`` must be in the checkpoint (a :class:`CheckpointError` names the
        missing ones); objects in the checkpoint but not in ``state`` are left alone and their bytes
        are not sent. Tensors are loaded in place into what the objects' ``state_dict()`` returns,
        then handed to their ``load_state_dict()``. Unless :meth:`latest`/:meth:`resolve` just read
        ``info``, it is read and verified first (a failure raises CheckpointError).
        """
        return self._loader.load(info, state)
