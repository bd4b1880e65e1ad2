"""CheckpointManager: sharded, atomic, verified checkpoints of a DDP run over any fsspec URL.

Layout under ``cfg.url``::

    step-000000100/            one directory per checkpoint
        shard-00000-00.bin     raw tensor bytes: rank 0's first share of the replicated state
        shard-00001-00.bin ... each rank writes ~1/N of it (and its own per-rank state)
        index.json             which bytes of which tensor are where, plus the plain values (JSON)
        manifest.json          the commit point: written last, by rank 0, once every file is durable

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

import concurrent.futures
import enum
import importlib.metadata
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint import fence, probe
from elastic_ddp.checkpoint import index as ix
from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.catalog import (
    STEP_DIR_RE,
    CheckpointInfo,
    list_checkpoints,
    read_checkpoint,
    read_index,
    retention_plan,
    step_dir_name,
    verify_checkpoint,
)
from elastic_ddp.checkpoint.collectives import Collectives, global_rank
from elastic_ddp.checkpoint.errors import CheckpointError, CheckpointVerificationError, describe_error
from elastic_ddp.checkpoint.exchange import Transport, distribute
from elastic_ddp.checkpoint.layout import assign_holders
from elastic_ddp.checkpoint.divergence import AllMax, all_max_over
from elastic_ddp.checkpoint.sharded import (
    ShardWriter,
    Snapshot,
    WriteJob,
    describe_per_rank,
    destinations,
    files_to_read,
    read_files,
    restore_rank_values,
    restore_tree,
    snapshot,
    write_files,
)
from elastic_ddp.checkpoint.staging import ShareStager, Staged
from elastic_ddp.checkpoint.storage import Storage, StorageError, join, normalize_url
from elastic_ddp.checkpoint.tree import TreeError
from elastic_ddp.config import CheckpointConfig
from elastic_ddp.faults import at_point
from elastic_ddp.state import Stateful, check_stateful, synced_paths

log = logging.getLogger("elastic_ddp.checkpoint")

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


def _state_dicts(state: Mapping[str, Stateful]) -> dict[str, Any]:
    """``{name: obj.state_dict()}``, after checking that every name and object can be checkpointed."""
    out = {}
    for name, obj in state.items():
        check_stateful(name, obj)
        out[name] = obj.state_dict()
    return out


@dataclass(frozen=True)
class SaveStats:
    """Numbers of the last completed save, for metrics.

    ``stall_s``: how long ``save()`` blocked the training step; ``save_s``: from ``save()`` to the
    commit; ``bytes``: size of all the checkpoint's files; ``throughput_bytes_per_s``: bytes / save_s;
    ``staged_bytes``: host memory this rank copied the state into (0 for a blocking save of CPU
    tensors, which writes them in place); ``written_bytes``: bytes this rank wrote.
    """

    step: int
    stall_s: float
    save_s: float
    bytes: int
    throughput_bytes_per_s: float
    staged_bytes: int = 0
    written_bytes: int = 0


@dataclass(frozen=True)
class LoadStats:
    """Numbers of the last load on this rank: ``bytes_read`` from storage (its share of the files,
    plus ``index.json`` on rank 0), ``read_s`` reading and verifying them, ``exchange_s`` handing the
    state to every rank, ``bytes_received`` over the process group (or copied locally)."""

    step: int
    bytes_read: int
    read_s: float
    exchange_s: float
    bytes_received: int


@dataclass
class _Save:
    """One save on its way: what this rank writes, and (on rank 0) what the index needs."""

    step: int
    url: str
    snap: Snapshot
    job: WriteJob
    staged: Staged
    start: float
    stall_s: float | None


class _Preflight(enum.Enum):
    """Rank 0's decision before a save: the step is already committed, or its directory is clear to write."""

    COMMITTED = enum.auto()
    WRITE = enum.auto()


@dataclass(frozen=True)
class _Commit:
    """Rank 0's commit, told to every rank: the checkpoint's bytes, or why it refused to commit."""

    nbytes: int = 0
    refused: str | None = None


@dataclass(frozen=True)
class _Written:
    """A save done: the checkpoint's bytes and this rank's, or nothing (the step was already committed)."""

    nbytes: int = 0
    written: int = 0
    already_committed: bool = False


@dataclass
class _Report:
    """What a rank tells rank 0 after writing its files."""

    rank: int
    files: list[mf.FileRecord]
    rank_file: str | None
    rank_entry: ix.RankState | None
    digest: str
    error: str | None = None


@dataclass
class _Held:
    """A checkpoint read and verified by :meth:`CheckpointManager.latest`/``resolve``, kept for ``load``.

    ``view``: the index as this load uses it -- the index itself at the saving world size (every rank
    restores its own per-rank values), else :meth:`~elastic_ddp.checkpoint.index.Index.as_shared` of
    rank 0 (rank 0's values for everyone).
    """

    key: tuple[str, str]
    index: ix.Index
    view: ix.Index
    same_size: bool
    holders: dict[str, int]
    buffers: dict[str, torch.Tensor]
    bytes_read: int
    read_s: float


def _versions() -> dict[str, str]:
    try:
        ours = importlib.metadata.version("elastic-ddp")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree: record that, not fail
        ours = "unknown"
    return {"torch": torch.__version__, "elastic_ddp": ours}


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
        self.cfg = cfg
        self.url = normalize_url(cfg.url)
        self.storage = Storage(self.url, cfg.storage_options)
        self.identity = dict(identity or {})
        self.init_from: dict[str, str] | None = None
        self._distributed = dist.is_available() and dist.is_initialized()
        self._group = process_group
        self._pg: Any = None
        if self._distributed:
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            # A group of its own: background save collectives then never interleave with (and so
            # cannot deadlock against) the training loop's collectives on the default group.
            self._pg = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=cfg.timeout_s))
        else:
            self.rank, self.world_size = 0, 1
        self._coll = Collectives(self._pg, self.rank, self.world_size, distributed=self._distributed, url=self.url)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-save")
        self._io = concurrent.futures.ThreadPoolExecutor(max_workers=cfg.write_threads, thread_name_prefix="ckpt-io")
        self._pending: concurrent.futures.Future[bool] | None = None
        self._writer = ShardWriter(files_per_writer=cfg.write_threads, min_file_bytes=int(cfg.min_file_mb * (1 << 20)))
        self._stager = ShareStager()
        self._held: _Held | None = None
        self._resumed_step: int | None = None
        self._failed_verification: set[str] = set()
        self.failed_saves = 0
        self.consecutive_failed_saves = 0
        self.last_error: str | None = None
        self.last_save: SaveStats | None = None
        self.last_load: LoadStats | None = None
        self._last_ok = True
        self._closed = False
        self.rdzv_round = rdzv_round
        self._storage_shared = False
        if rdzv_round is not None:
            self._coll.broadcast(fence.claim, self.storage, rdzv_round)
        if check_storage and self.world_size > 1:
            self.check_shared_storage()

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
        if self._closed:
            raise RuntimeError("This CheckpointManager is closed; no more saves can be started.")
        if step < 0:
            raise ValueError(f"The checkpoint step ({step}) must not be negative.")
        blocking = (not self.cfg.async_save) if blocking is None else blocking
        self.wait()
        self._held = None  # training goes on: a checkpoint read for a resume is no longer needed
        start = time.perf_counter()
        try:
            snap = snapshot(_state_dicts(state), synced=synced_paths(state), all_max=self._all_max())
        except TreeError as exc:
            raise TypeError(str(exc)) from None
        job = self._writer.prepare(snap, rank=self.rank, writers=range(self.world_size))
        staged = self._stager.stage(job.sources, copy=not blocking)
        ckpt_url = join(self.url, step_dir_name(step))
        if blocking:
            return self._save_now(_Save(step, ckpt_url, snap, job, staged, start, None))
        stall = time.perf_counter() - start
        self._pending = self._executor.submit(self._save_now, _Save(step, ckpt_url, snap, job, staged, start, stall))
        return True

    def wait(self) -> bool:
        """Block until the save in flight and its retention (if any) are done; True unless the most recent save failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        return self._last_ok

    def close(self) -> bool:
        """Finish the pending save and release the threads and buffers; True unless that save failed."""
        if self._closed:
            return True
        ok = self.wait()
        self._executor.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self._stager.release()
        self._held = None
        self._closed = True
        if not ok:
            log.error("[%d/-] The last checkpoint save failed: %s", self.rank, self.last_error)
        return ok

    def _save_now(self, save: _Save) -> bool:
        try:
            done = self._write_and_commit(save)
        except Exception as exc:  # a failed save must never take training down; it is surfaced instead
            self.failed_saves += 1
            self.consecutive_failed_saves += 1
            self.last_error = f"The checkpoint of step {save.step} at {save.url!r} failed: {describe_error(exc, self.url)}"
            log.error("[%d/%d] %s", self.rank, save.step, self.last_error)
            # A fenced group leaves the directory alone: the group that owns the run may be writing it.
            if self.rank == 0 and not isinstance(exc, fence.StaleWriterError):
                self._remove_uncommitted(save.url, save.step)
            self._last_ok = False
            return False
        self._last_ok = True
        self.consecutive_failed_saves = 0
        if done.already_committed:
            return True  # already committed by an earlier save of the same step
        nbytes = done.nbytes
        elapsed = time.perf_counter() - save.start
        self.last_save = SaveStats(
            step=save.step,
            stall_s=elapsed if save.stall_s is None else save.stall_s,
            save_s=elapsed,
            bytes=nbytes,
            throughput_bytes_per_s=nbytes / elapsed if elapsed > 0 else 0.0,
            staged_bytes=save.staged.staged_bytes,
            written_bytes=done.written,
        )
        log.info(
            "[%d/%d] Checkpoint committed at %s: %d bytes in %.2f s (training stalled %.3f s).",
            self.rank, save.step, save.url, nbytes, elapsed, self.last_save.stall_s,
        )
        if self.rank == 0:
            if save.stall_s is None:
                # A blocking save: training waits for the commit, not for deleting older
                # checkpoints (seconds of requests on S3); the next save, wait() or close() does.
                self._pending = self._executor.submit(self._after_commit, save.step)
            else:
                self._after_commit(save.step)
        return True

    def _write_and_commit(self, save: _Save) -> _Written:
        # 1. Rank 0 decides whether to write, and clears a leftover of an interrupted save at this step.
        if self._coll.broadcast(self._preflight, save.url) is _Preflight.COMMITTED:
            log.warning("[%d/%d] %s is already committed; not saving it again.", self.rank, save.step, save.url)
            return _Written(already_committed=True)
        at_point("before_write", self.rank)
        # 2. Every rank writes its own files, hashing them on the way; failures go into the report.
        report = self._write_files(save)
        at_point("after_write", self.rank)
        # 3. Rank 0 collects the reports (O(N) in all, not an all-gather), writes index.json and the
        #    manifest (the commit point) if every report is complete, and tells everyone how it went.
        reports = self._coll.gather(report)
        commit = self._coll.broadcast(self._commit, save, reports)
        if commit.refused is not None:
            raise CheckpointError(commit.refused)
        return _Written(commit.nbytes, sum(f.size for f in report.files))

    def _write_files(self, save: _Save) -> _Report:
        report = _Report(self.rank, [], save.job.rank_file, save.job.rank_entry, save.snap.digest)
        try:
            report.files = write_files(
                self.storage, save.url, save.staged, self._io, sync=self.storage.is_local, rank=self.rank
            )
        except Exception as exc:  # reported to rank 0, which then refuses to commit
            report.error = f"rank {self.rank}: {describe_error(exc, self.url)}"
        return report

    def _check_fence(self, action: str) -> None:
        if self.rdzv_round is None:
            return
        try:
            fence.check(self.storage, self.rdzv_round, action)
        except fence.StaleWriterError as exc:
            # Said at once: telling the other ranks may block for checkpoint.timeout_s when the
            # group is gone, which is exactly when a writer is stale.
            log.error("[%d/-] %s", self.rank, exc)
            raise

    def _preflight(self, ckpt_url: str) -> _Preflight:
        manifest_url = join(ckpt_url, mf.MANIFEST_NAME)
        if self.storage.exists(manifest_url) and ckpt_url not in self._failed_verification:
            return _Preflight.COMMITTED
        self._check_fence(f"clear {ckpt_url} for a new save")
        if ckpt_url in self._failed_verification:
            # The run resumed from an older checkpoint because this one is damaged; training has
            # now reached its step again, so a sound copy replaces it (manifest first, as in retention).
            log.warning("[%d/-] Replacing %s, which failed verification at resume, with a new save.", self.rank, ckpt_url)
            self.storage.remove_file(manifest_url)
            self._failed_verification.discard(ckpt_url)
        self.storage.remove_tree(ckpt_url)
        return _Preflight.WRITE

    def _commit(self, save: _Save, reports: list[_Report]) -> _Commit:
        errors = [r.error for r in reports if r.error]
        if errors:
            return _Commit(refused="; ".join(errors))
        differ = [r.rank for r in reports if r.digest != save.snap.digest]
        if differ:
            return _Commit(refused=(
                f"ranks {differ} saved state whose names, dtypes, shapes or per-rank parts differ from rank 0's; "
                "every rank must save the same objects under the same names."
            ))  # fmt: skip
        rank_states = {r.rank: (r.rank_file, r.rank_entry) for r in reports if r.rank_entry is not None}
        index = ix.build(save.snap.specs, save.snap.state, save.job.layout.files, rank_states, save.snap.per_rank)
        written = {f.name: f for r in reports for f in r.files}
        expected = {f.name: f.size for f in index.files}
        if {name: f.size for name, f in written.items()} != expected:
            planned = sorted(expected)
            return _Commit(refused=f"the ranks' file reports {sorted(written)} do not match the planned files {planned}.")
        data = index.to_bytes()
        self.storage.write_bytes_atomic(join(save.url, ix.INDEX_NAME), data)
        manifest = mf.build(
            step=save.step,
            world_size=self.world_size,
            time_s=time.time(),
            versions=_versions(),
            identity=self.identity,
            files=[*written.values(), mf.FileRecord(ix.INDEX_NAME, len(data), mf.hash_bytes(data))],
            rdzv_round=self.rdzv_round,
            init_from=self.init_from,
        )
        # index.json was renamed into place and its directory fsync'd after every data file was
        # created and fsync'd, so every file of the checkpoint is durable before the manifest exists.
        at_point("before_manifest", self.rank)
        self._check_fence(f"commit {save.url}")
        self.storage.write_bytes_atomic(
            join(save.url, mf.MANIFEST_NAME), json.dumps(manifest, sort_keys=True, indent=1).encode()
        )
        at_point("after_manifest", self.rank)
        return _Commit(nbytes=int(manifest["bytes"]))

    def _owns_run(self, action: str, step: int) -> bool:
        """Whether this group may still clean up (the fence names its round); logs why not."""
        try:
            self._check_fence(action)
        except fence.StaleWriterError:
            return False
        except StorageError as exc:  # the fence is unreadable: deleting nothing is the safe choice
            log.warning("[%d/%d] Not cleaning up: the fence could not be read: %s", self.rank, step, exc)
            return False
        return True

    def _remove_uncommitted(self, ckpt_url: str, step: int) -> None:
        try:
            if not self._owns_run(f"remove the uncommitted {ckpt_url}", step):
                return
            if not self.storage.exists(join(ckpt_url, mf.MANIFEST_NAME)):
                self.storage.remove_tree(ckpt_url)
        except Exception as exc:  # storage may be what failed; the directory has no manifest, so it is inert
            log.warning("[%d/%d] Could not remove the uncommitted %s: %s", self.rank, step, ckpt_url, exc)

    def _after_commit(self, step: int) -> None:
        """Rank 0, after a commit: retention, then leftovers of interrupted saves older than ``step``."""
        try:
            if not self._owns_run(f"apply retention and remove leftovers under {self.url}", step):
                return
            committed = list_checkpoints(self.storage)
            protected = {self._resumed_step} if self._resumed_step is not None and self._resumed_step > step else set()
            protected.add(step)
            delete, why = retention_plan(
                [c.step for c in committed],
                keep_last=self.cfg.keep_last,
                keep_every=self.cfg.keep_every,
                protected=protected,
            )
            if delete:
                log.info("[%d/%d] Retention: %s.", self.rank, step, why)
            for old in delete:
                old_url = join(self.url, step_dir_name(old))
                # Manifest first: a half-deleted checkpoint is then merely an uncommitted leftover.
                self.storage.remove_file(join(old_url, mf.MANIFEST_NAME))
                self.storage.remove_tree(old_url)
            for name in self.storage.list_dirs(self.url):
                match = STEP_DIR_RE.match(name)
                if not match or int(match.group(1)) >= step:
                    continue  # a newer directory may be a save in progress elsewhere: leave it alone
                leftover = join(self.url, name)
                if not self.storage.exists(join(leftover, mf.MANIFEST_NAME)):
                    log.info("[%d/%d] Removing %s, left over by an interrupted save.", self.rank, step, leftover)
                    self.storage.remove_tree(leftover)
        except Exception as exc:  # the new checkpoint is committed; cleanup can be retried next time
            log.warning("[%d/%d] Checkpoint cleanup failed (will retry after the next save): %s", self.rank, step, exc)

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
        probe.check_shared_storage(self.storage, self._coll, reader=reader)
        self._storage_shared = True

    # --------------------------------------------------------------------------------- selection

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints under ``cfg.url``, oldest first (not verified; local, not collective)."""
        return list_checkpoints(self.storage)

    def list_collective(self) -> list[CheckpointInfo]:
        """:meth:`list` read once by rank 0 and given to every rank (collective).

        Raises :class:`CheckpointError` on every rank when listing fails.
        """
        self.wait()
        listed = self._coll.attempt(self.list)
        if listed.error is not None:
            raise CheckpointError(f"Listing checkpoints under {self.url!r} failed: {listed.error}") from listed.error
        return listed.value

    def remove_all(self) -> None:
        """Delete every committed checkpoint under the URL, each manifest first (collective; rank 0 deletes).

        For a new run told to replace an old one. Refused on every rank
        (:class:`~elastic_ddp.checkpoint.fence.StaleWriterError`) when a newer group owns the URL;
        a storage failure raises :class:`CheckpointError` on every rank.
        """
        self.wait()
        self._held = None

        def remove() -> None:
            self._check_fence(f"delete the checkpoints under {self.url}")
            for info in self.list():
                # Manifest first: a half-deleted checkpoint is then merely an uncommitted leftover.
                self.storage.remove_file(join(info.url, mf.MANIFEST_NAME))
                self.storage.remove_tree(info.url)

        self._coll.broadcast(remove)

    def verify(self, info: CheckpointInfo) -> mf.VerifyResult:
        """Check every file of ``info`` on this process alone (not collective)."""
        return verify_checkpoint(self._storage_for(info.url), info)

    def metrics(self) -> dict[str, float]:
        """Scalars for the metrics writer: the last completed save's and load's figures and the failure count."""
        scalars = {"ckpt/failed_saves": float(self.failed_saves)}
        if self.last_save is not None:
            scalars.update({
                "ckpt/stall_s": self.last_save.stall_s,
                "ckpt/save_s": self.last_save.save_s,
                "ckpt/bytes": float(self.last_save.bytes),
                "ckpt/throughput_bytes_per_s": self.last_save.throughput_bytes_per_s,
                "ckpt/staged_bytes": float(self.last_save.staged_bytes),
            })  # fmt: skip
        if self.last_load is not None:
            scalars.update({
                "ckpt/load_read_s": self.last_load.read_s,
                "ckpt/load_exchange_s": self.last_load.exchange_s,
                "ckpt/load_bytes_read": float(self.last_load.bytes_read),
            })  # fmt: skip
        return scalars

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint that verifies (collective); older ones are tried in turn.

        Verifying is reading: each rank reads its share of the files, checking them as they stream
        in, and keeps the bytes for :meth:`load` (about ``checkpoint size / ranks`` of host memory per
        rank until then), so the checkpoint is read once in total.
        """
        for info in reversed(self.list_collective()):
            try:
                self._hold(info)
                return info
            except CheckpointVerificationError as exc:
                self._failed_verification.add(info.url)
                log.warning(
                    "[%d/-] Skipping checkpoint %s: file %r failed verification (%s); trying the previous one.",
                    self.rank, info.url, exc.bad_file, exc.reason,
                )
        return None

    def resolve(self, resume: str) -> CheckpointInfo | None:
        """The checkpoint ``resume`` selects (``cfg.resume`` semantics), verified; collective.

        ``'auto'``: newest committed, verified checkpoint or None; ``'never'``: None; a step number:
        that step; a URL: that checkpoint. Raises CheckpointError if an explicitly named checkpoint
        is missing or fails verification.
        """
        resume = resume.strip()
        if resume == "never":
            return None
        if resume == "auto":
            return self.latest()
        ckpt_url = join(self.url, step_dir_name(int(resume))) if resume.isdigit() else normalize_url(resume)
        self.wait()
        read = self._coll.attempt(read_checkpoint, self._storage_for(ckpt_url), ckpt_url)
        if read.error is not None:
            raise CheckpointError(f"checkpoint.resume={resume!r}: {read.error}")
        info = read.value
        try:
            self._hold(info)
        except CheckpointVerificationError as exc:
            raise CheckpointError(
                f"checkpoint.resume={resume!r}: file {exc.bad_file!r} of {ckpt_url!r} failed verification ({exc.reason})."
            ) from None
        return info

    def _storage_for(self, ckpt_url: str) -> Storage:
        return self.storage if ckpt_url.startswith(self.url + "/") else Storage(ckpt_url, self.cfg.storage_options)

    def _hold(self, info: CheckpointInfo) -> _Held:
        """Read and verify ``info`` collectively, keeping this rank's share; raises
        :class:`CheckpointVerificationError` (the same on every rank) if any file fails."""
        if self._held is not None and self._held.key == info.key:
            return self._held
        self._held = None
        storage = self._storage_for(info.url)
        start = time.perf_counter()
        before = storage.bytes_read
        read = self._coll.attempt(read_index, storage, info)
        if isinstance(read.error, CheckpointVerificationError):
            raise read.error
        if read.error is not None:
            raise CheckpointVerificationError(str(read.error), ix.INDEX_NAME, f"reading failed: {read.error}")
        index = read.value
        same_size = info.world_size == self.world_size
        try:
            if same_size and index.has_per_rank and index.ranks() != list(range(self.world_size)):
                raise ix.IndexFormatError(f"it holds per-rank entries of ranks {index.ranks()}, not of all {self.world_size}")
            view = index if same_size else index.as_shared(0)
        except ix.IndexFormatError as exc:
            raise CheckpointVerificationError(f"{info.url}: {exc}", ix.INDEX_NAME, str(exc)) from None
        # At the saving world size every file goes back to its writer (each rank finds its own
        # per-rank values among them); at another, files that hold only other ranks' are skipped.
        files = [(f.name, f.writer, f.size) for f in view.files if same_size or f.pieces]
        holders = assign_holders(files, range(self.world_size), by_writer=same_size)
        problem: CheckpointVerificationError | None = None
        buffers: dict[str, torch.Tensor] = {}
        try:
            buffers = read_files(
                storage, info.url, files_to_read(index, holders, self.rank), mf.file_records(info.manifest), self._io
            )
        except CheckpointVerificationError as exc:
            problem = exc
        failed = self._coll.first_failure(problem is not None)
        if failed is not None:
            verdict = self._coll.broadcast_from(failed, (problem.bad_file, problem.reason, str(problem)) if problem else None)
            raise CheckpointVerificationError(verdict[2], verdict[0], verdict[1])
        self._held = _Held(info.key, index, view, same_size, holders, buffers, storage.bytes_read - before,
                           time.perf_counter() - start)  # fmt: skip
        return self._held

    # ------------------------------------------------------------------------------------ loading

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
        self.wait()
        try:
            held = self._hold(info)
        except CheckpointVerificationError as exc:
            raise CheckpointError(
                f"Checkpoint {info.url!r} cannot be loaded: file {exc.bad_file!r} failed verification ({exc.reason})."
            ) from None
        self._held = None  # the buffers go once this load is done, whatever happens
        index, view = held.index, held.view
        templates = _state_dicts(state)
        own_names = set(index.own_names) if held.same_size else set()
        missing = sorted(set(templates) - set(view.state) - own_names)
        if missing:
            raise CheckpointError(
                f"Checkpoint {info.url!r} has no state named {', '.join(repr(m) for m in missing)}; it holds "
                f"{sorted(set(view.state) | own_names)}. It was saved by a run that did not register it."
            )
        start = time.perf_counter()
        shared = [name for name in templates if name in view.state]
        try:
            dests, finish = destinations(view, shared, templates)
            problem = None
        except TreeError as exc:
            dests, finish, problem = {}, None, str(exc)
        self._coll.agree(problem, f"Checkpoint {info.url!r} does not fit this run's state")
        received = distribute(view, held.holders, held.buffers, dests, self.rank, self._transport())
        own: dict[str, Any] = {}
        if held.same_size and index.has_per_rank:
            # This rank's own values: in the file it wrote, which it read itself (no collective).
            file = index.rank_file(self.rank)
            section = held.buffers[file.name][file.pieces_bytes(index.tensors) :]
            try:
                own = restore_rank_values(section, index.per_rank, index.tensors, dests, file.rank_state.state,
                                          file.rank_state.tensors, templates, "index.json")  # fmt: skip
            except TreeError as exc:
                raise CheckpointError(f"Checkpoint {info.url!r}: this rank's own state cannot be restored: {exc}") from None
        finish()
        for name, obj in state.items():
            try:
                obj.load_state_dict(restore_tree(view, name, dests) if name in view.state else own[name])
            except Exception as exc:  # the object's own check (shapes, keys) failed: name it
                raise CheckpointError(
                    f"Loading {name!r} from checkpoint {info.url!r} failed: {type(exc).__name__}: {exc}"
                ) from exc
        exact = held.same_size or not index.has_per_rank
        if not exact and self.rank == 0:
            log.warning(
                "[%d/%d] %s was saved at world size %d and this run has %d: what differed across its ranks (%s) "
                "is restored from rank 0's values on every rank, so it is not per-rank exact.",
                self.rank, info.step, info.url, info.world_size, self.world_size, describe_per_rank(index),
            )  # fmt: skip
        self._resumed_step = info.step
        self.last_load = LoadStats(info.step, held.bytes_read, held.read_s, time.perf_counter() - start, received)
        log.info("[%d/%d] Resumed from %s (saved at world size %d).", self.rank, info.step, info.url, info.world_size)
        return exact

    def _all_max(self) -> AllMax | None:
        """The element-wise maximum over the ranks, for the save's comparison of what they hold: on the
        training group's device (NCCL on GPUs: no host round trip before the result), else the
        manager's gloo group. Called in the foreground, where the training group is in use anyway."""
        if not self._distributed or self.world_size == 1:
            return None
        transport = self._transport()
        return all_max_over(transport.group, transport.device)

    def _transport(self) -> Transport:
        """For the foreground's collectives: the training group (NCCL with buffers on this rank's GPU, or
        gloo on CPUs), else the manager's gloo group.

        The training group, not the manager's, wherever it can carry the bytes: its timeout is
        ``dist.timeout_s``, so a peer that hangs while the others compare or distribute state is
        detected as quickly as one that hangs in a training step -- not after ``checkpoint.timeout_s``.
        """
        if not self._distributed:
            return Transport(torch.device("cpu"), None, lambda r: r, False)
        backend = str(dist.get_backend(self._group)).lower()
        if "nccl" in backend and torch.cuda.is_available():
            group = self._group
            device = torch.device("cuda", torch.cuda.current_device())
        elif "gloo" in backend:
            group, device = self._group, torch.device("cpu")
        else:
            group, device = self._pg, torch.device("cpu")
        return Transport(device, group, lambda r: global_rank(group, r), True)
