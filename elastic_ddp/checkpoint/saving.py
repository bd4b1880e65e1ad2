"""The save pipeline of :class:`~elastic_ddp.checkpoint.manager.CheckpointManager`: from state to a commit.

A save (:meth:`CheckpointSaver.save`) runs in order:

1. *stage* (foreground): the ranks compare what they hold, each copies its share of what is the
   same everywhere (and its own per-rank state) to host memory -- or, for a blocking save of CPU
   tensors, uses it in place;
2. *preflight* (rank 0): a step already committed is not saved again; a leftover of an interrupted
   save at that step, or a checkpoint of it that failed verification at resume, is cleared;
3. *write* (every rank): its files, hashed on the way, reported to rank 0;
4. *commit* (rank 0): ``index.json``, then ``manifest.json`` -- the commit point -- once every
   report is complete and every file durable, behind the commit fence; every rank learns the outcome;
5. *clean up* (rank 0): retention, then leftovers of interrupted older saves.

Steps 2 to 5 run in a background thread for an async save; a blocking save runs 2 to 4 before it
returns and leaves 5 to the background. A failed save never raises into the training loop: it is
logged, counted and described (:attr:`~CheckpointSaver.failed_saves`,
:attr:`~CheckpointSaver.last_error`), and rank 0 removes what it left uncommitted.
"""

from __future__ import annotations

import concurrent.futures
import enum
import functools
import importlib.metadata
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from elastic_ddp.checkpoint import fence
from elastic_ddp.checkpoint import index as ix
from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.catalog import STEP_DIR_RE, read_checkpoint, retention_plan, step_dir_name
from elastic_ddp.checkpoint.divergence import AllMax, Classifier, all_max_over
from elastic_ddp.checkpoint.errors import CheckpointError, describe_error
from elastic_ddp.checkpoint.group import CheckpointGroup, state_dicts
from elastic_ddp.checkpoint.loading import CheckpointLoader
from elastic_ddp.checkpoint.sharded import ShardWriter, Snapshot, WriteJob, snapshot, write_files
from elastic_ddp.checkpoint.staging import ShareStager, Staged
from elastic_ddp.checkpoint.storage import StorageError, join
from elastic_ddp.checkpoint.tree import TreeError
from elastic_ddp.faults import at_point
from elastic_ddp.state import Stateful, synced_paths

log = logging.getLogger("elastic_ddp.checkpoint")


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


@functools.cache  # constant for the process; reading package metadata parses files (~0.6 ms a save)
def _versions() -> dict[str, str]:
    try:
        ours = importlib.metadata.version("elastic-ddp")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree: record that, not fail
        ours = "unknown"
    return {"torch": torch.__version__, "elastic_ddp": ours}


class CheckpointSaver:
    """Saves checkpoints of ``group`` (see the module docstring); :meth:`save`, :meth:`wait` and
    :meth:`close` are collective.

    ``identity`` and :attr:`init_from` are recorded in every manifest rank 0 commits (see
    :func:`~elastic_ddp.checkpoint.manifest.build`). ``loader``: the same manager's loader, whose
    findings a save follows -- it drops the checkpoint the loader holds for a resume (training has
    gone on), replaces one that failed verification, and retention keeps the one last resumed from.
    At most one save (or the retention after it) is in flight, in one background thread.
    """

    def __init__(self, group: CheckpointGroup, loader: CheckpointLoader, *, identity: dict[str, Any]) -> None:
        self._group = group
        self._loader = loader
        self.identity = identity
        self.init_from: dict[str, str] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-save")
        self._pending: concurrent.futures.Future[bool] | None = None
        cfg = group.cfg
        self._writer = ShardWriter(files_per_writer=cfg.write_threads, min_file_bytes=int(cfg.min_file_mb * (1 << 20)))
        self._stager = ShareStager()
        self._classifier = Classifier()  # the last save's decision of what differs, checked in one collective
        self._committed: set[int] = set()  # rank 0: steps known committed under the run's URL (retention)
        self.failed_saves = 0
        self.consecutive_failed_saves = 0
        self.last_error: str | None = None
        self.last_save: SaveStats | None = None
        self._last_ok = True
        self._closed = False

    def save(self, step: int, state: Mapping[str, Stateful], *, blocking: bool | None = None) -> bool:
        """Stage ``state`` as step ``step`` and write and commit it: in the background, returning True at
        once, or (``blocking``; None follows ``cfg.async_save``) before returning whether it committed.
        Waits for the save in flight first. Raises only for misuse (a closed saver, a negative step)
        and, as ``TypeError``, for state a checkpoint cannot hold; failures of the save are counted.
        """
        if self._closed:
            raise RuntimeError("This CheckpointManager is closed; no more saves can be started.")
        if step < 0:
            raise ValueError(f"The checkpoint step ({step}) must not be negative.")
        group = self._group
        blocking = (not group.cfg.async_save) if blocking is None else blocking
        self.wait()
        self._loader.release()  # training goes on: a checkpoint read for a resume is no longer needed
        start = time.perf_counter()
        try:
            snap = snapshot(state_dicts(state), synced=synced_paths(state), all_max=self._all_max(),
                            classifier=self._classifier)
        except TreeError as exc:
            raise TypeError(str(exc)) from None
        job = self._writer.prepare(snap, rank=group.rank, writers=range(group.world_size))
        staged = self._stager.stage(job.sources, copy=not blocking)
        ckpt_url = join(group.url, step_dir_name(step))
        if blocking:
            return self._save_now(_Save(step, ckpt_url, snap, job, staged, start, None))
        stall = time.perf_counter() - start
        self._pending = self._executor.submit(self._save_now, _Save(step, ckpt_url, snap, job, staged, start, stall))
        return True

    def wait(self) -> bool:
        """Block until the save in flight and its retention (if any) are done; True unless the most recent
        save failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        return self._last_ok

    def close(self) -> bool:
        """Finish the pending save and release the threads (the group's I/O threads too), the staging
        buffers and what the loader holds; True unless that save failed."""
        if self._closed:
            return True
        ok = self.wait()
        self._executor.shutdown(wait=True)
        self._group.io.shutdown(wait=True)
        self._stager.release()
        self._loader.release()
        self._closed = True
        if not ok:
            log.error("[%d/-] The last checkpoint save failed: %s", self._group.rank, self.last_error)
        return ok

    def _save_now(self, save: _Save) -> bool:
        rank = self._group.rank
        try:
            done = self._write_and_commit(save)
        except Exception as exc:  # a failed save must never take training down; it is surfaced instead
            self.failed_saves += 1
            self.consecutive_failed_saves += 1
            self.last_error = (
                f"The checkpoint of step {save.step} at {save.url!r} failed: {describe_error(exc, self._group.url)}"
            )
            log.error("[%d/%d] %s", rank, save.step, self.last_error)
            # A fenced group leaves the directory alone: the group that owns the run may be writing it.
            if rank == 0 and not isinstance(exc, fence.StaleWriterError):
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
            rank, save.step, save.url, nbytes, elapsed, self.last_save.stall_s,
        )
        if rank == 0:
            if save.stall_s is None:
                # A blocking save: training waits for the commit, not for deleting older
                # checkpoints (seconds of requests on S3); the next save, wait() or close() does.
                self._pending = self._executor.submit(self._after_commit, save.step)
            else:
                self._after_commit(save.step)
        return True

    def _write_and_commit(self, save: _Save) -> _Written:
        coll, rank = self._group.coll, self._group.rank
        # 1. Rank 0 decides whether to write, and clears a leftover of an interrupted save at this step.
        if coll.broadcast(self._preflight, save.url) is _Preflight.COMMITTED:
            log.warning("[%d/%d] %s is already committed; not saving it again.", rank, save.step, save.url)
            return _Written(already_committed=True)
        at_point("before_write", rank)
        # 2. Every rank writes its own files, hashing them on the way; failures go into the report.
        report = self._write_files(save)
        at_point("after_write", rank)
        # 3. Rank 0 collects the reports (O(N) in all, not an all-gather), writes index.json and the
        #    manifest (the commit point) if every report is complete, and tells everyone how it went.
        reports = coll.gather(report)
        commit = coll.broadcast(self._commit, save, reports)
        if commit.refused is not None:
            raise CheckpointError(commit.refused)
        return _Written(commit.nbytes, sum(f.size for f in report.files))

    def _write_files(self, save: _Save) -> _Report:
        group = self._group
        report = _Report(group.rank, [], save.job.rank_file, save.job.rank_entry, save.snap.digest)
        try:
            report.files = write_files(
                group.storage, save.url, save.staged, group.io, sync=group.storage.is_local, rank=group.rank
            )
        except Exception as exc:  # reported to rank 0, which then refuses to commit
            report.error = f"rank {group.rank}: {describe_error(exc, group.url)}"
        return report

    def _preflight(self, ckpt_url: str) -> _Preflight:
        storage, failed_verification = self._group.storage, self._loader.failed_verification
        manifest_url = join(ckpt_url, mf.MANIFEST_NAME)
        if storage.exists(manifest_url) and ckpt_url not in failed_verification:
            return _Preflight.COMMITTED
        self._group.check_fence(f"clear {ckpt_url} for a new save")
        if ckpt_url in failed_verification:
            # The run resumed from an older checkpoint because this one is damaged; training has
            # now reached its step again, so a sound copy replaces it (manifest first, as in retention).
            log.warning(
                "[%d/-] Replacing %s, which failed verification at resume, with a new save.", self._group.rank, ckpt_url
            )
            storage.remove_file(manifest_url)
            failed_verification.discard(ckpt_url)
        storage.remove_tree(ckpt_url)
        return _Preflight.WRITE

    def _commit(self, save: _Save, reports: list[_Report]) -> _Commit:
        group = self._group
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
            return _Commit(
                refused=f"the ranks' file reports {sorted(written)} do not match the planned files {planned}."
            )
        data = index.to_bytes()
        group.storage.write_bytes_atomic(join(save.url, ix.INDEX_NAME), data)
        manifest = mf.build(
            step=save.step,
            world_size=group.world_size,
            time_s=time.time(),
            versions=dict(_versions()),
            identity=self.identity,
            files=[*written.values(), mf.FileRecord(ix.INDEX_NAME, len(data), mf.hash_bytes(data))],
            rdzv_round=group.rdzv_round,
            init_from=self.init_from,
        )
        # index.json was renamed into place and its directory fsync'd after every data file was
        # created and fsync'd, so every file of the checkpoint is durable before the manifest exists.
        at_point("before_manifest", group.rank)
        group.check_fence(f"commit {save.url}")
        group.storage.write_bytes_atomic(
            join(save.url, mf.MANIFEST_NAME), json.dumps(manifest, sort_keys=True, indent=1).encode()
        )
        at_point("after_manifest", group.rank)
        return _Commit(nbytes=int(manifest["bytes"]))

    def _owns_run(self, action: str, step: int) -> bool:
        """Whether this group may still clean up (the fence names its round); logs why not."""
        try:
            self._group.check_fence(action)
        except fence.StaleWriterError:
            return False
        except StorageError as exc:  # the fence is unreadable: deleting nothing is the safe choice
            log.warning("[%d/%d] Not cleaning up: the fence could not be read: %s", self._group.rank, step, exc)
            return False
        return True

    def _remove_uncommitted(self, ckpt_url: str, step: int) -> None:
        storage = self._group.storage
        try:
            if not self._owns_run(f"remove the uncommitted {ckpt_url}", step):
                return
            if not storage.exists(join(ckpt_url, mf.MANIFEST_NAME)):
                storage.remove_tree(ckpt_url)
        except Exception as exc:  # storage may be what failed; the directory has no manifest, so it is inert
            log.warning("[%d/%d] Could not remove the uncommitted %s: %s", self._group.rank, step, ckpt_url, exc)

    def _after_commit(self, step: int) -> None:
        """Rank 0, after a commit: retention, then leftovers of interrupted saves older than ``step``."""
        group = self._group
        storage, url, rank = group.storage, group.url, group.rank
        try:
            if not self._owns_run(f"apply retention and remove leftovers under {url}", step):
                return
            self._committed.add(step)
            committed, uncommitted = self._step_dirs(step)
            resumed_step = self._loader.resumed_step
            protected = {resumed_step} if resumed_step is not None and resumed_step > step else set()
            protected.add(step)
            delete, why = retention_plan(
                committed,
                keep_last=group.cfg.keep_last,
                keep_every=group.cfg.keep_every,
                protected=protected,
            )
            if delete:
                log.info("[%d/%d] Retention: %s.", rank, step, why)
            for old in delete:
                old_url = join(url, step_dir_name(old))
                self._committed.discard(old)
                # Manifest first: a half-deleted checkpoint is then merely an uncommitted leftover.
                storage.remove_file(join(old_url, mf.MANIFEST_NAME))
                storage.remove_tree(old_url)
            for old in uncommitted:
                if old < step:  # a newer directory may be a save in progress elsewhere: leave it alone
                    leftover = join(url, step_dir_name(old))
                    log.info("[%d/%d] Removing %s, left over by an interrupted save.", rank, step, leftover)
                    storage.remove_tree(leftover)
        except Exception as exc:  # the new checkpoint is committed; cleanup can be retried next time
            log.warning("[%d/%d] Checkpoint cleanup failed (will retry after the next save): %s", rank, step, exc)

    def _step_dirs(self, step: int) -> tuple[list[int], list[int]]:
        """The steps of the checkpoint directories under the run's URL: committed (a readable manifest), and
        not (no manifest: a leftover, or a save in progress elsewhere). One listing; a manifest is read only
        for a directory not yet known as committed -- known are the ones this saver committed or found
        committed (``self._committed``), so a save's retention lists once and reads nothing in the steady
        state, instead of a read of every kept checkpoint's manifest (requests on S3)."""
        storage, url = self._group.storage, self._group.url
        committed, uncommitted = [], []
        for name in storage.list_dirs(url):
            match = STEP_DIR_RE.match(name)
            if not match:
                continue
            found = int(match.group(1))
            if found in self._committed:
                committed.append(found)
                continue
            ckpt_url = join(url, name)
            if not storage.exists(join(ckpt_url, mf.MANIFEST_NAME)):
                uncommitted.append(found)
                continue
            try:
                read_checkpoint(storage, ckpt_url)
            except CheckpointError as exc:  # neither kept count nor leftover: as list_checkpoints skips it
                log.warning("[%d/%d] Skipping %s: %s", self._group.rank, step, ckpt_url, exc)
                continue
            self._committed.add(found)
            committed.append(found)
        return committed, uncommitted

    def _all_max(self) -> AllMax | None:
        """The element-wise maximum over the ranks, for the save's comparison of what they hold: on the
        training group's device (NCCL on GPUs: no host round trip before the result), else the
        checkpoint's own gloo group. Called in the foreground, where the training group is in use anyway."""
        if not self._group.distributed or self._group.world_size == 1:
            return None
        transport = self._group.transport()
        return all_max_over(transport.group, transport.device)
