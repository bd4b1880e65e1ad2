"""CheckpointManager: sharded, atomic, verified checkpoints of a DDP run over any fsspec URL.

Layout under ``cfg.url``::

    step-000000100/            one directory per checkpoint
        __0_0.distcp ...       DCP shards, written in parallel by several ranks
        .metadata              DCP's index (a pickle: never read before it is verified)
        manifest.json          the commit point: written last, by rank 0, once every shard is durable

Contracts:

* What is saved is a mapping of names to stateful objects (``state_dict()``/``load_state_dict()``,
  see :mod:`elastic_ddp.state`) that hold the same values on every rank -- DDP's replicated model,
  optimizer, scheduler, data cursor -- plus, optionally, per-rank objects whose values differ by
  rank (random generators). Replicated state is written once in total (each rank writes a share);
  per-rank state by each rank for itself, and restored only at the same world size.
* Every rank of the process group constructs the manager, and calls :meth:`save`, :meth:`latest`,
  :meth:`resolve`, :meth:`load`, :meth:`wait` and :meth:`close` in the same order with the same
  arguments (step): they are collective on the checkpoint's own gloo group. Without an initialized
  process group the manager works alone (world size 1): the CLI and unit tests.
* The manager records the run's *identity* (the settings a resume must not change) in every
  manifest; deciding whether a checkpoint may be resumed is the caller's.
* Only directories with a parseable manifest are checkpoints. A checkpoint is loaded only after
  each of its files matched the manifest's size and SHA-256 (and, with
  ``ELASTIC_DDP_CHECKPOINT_KEY`` set, after the manifest's signature checked out).
* A failed save never raises into the training loop: it is logged, counted in ``failed_saves`` and
  described in ``last_error``; nothing that looks committed is left behind.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import json
import logging
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from elastic_ddp.checkpoint import fence
from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.dcp_io import (
    DCP_ERRORS,
    METADATA_NAME,
    HashingWriter,
    HostStager,
    VerifiedReader,
    describe_error,
    fault_point,
)
from elastic_ddp.checkpoint.storage import Storage, StorageError, join, normalize_url
from elastic_ddp.config import CheckpointConfig
from elastic_ddp.state import RESERVED_PREFIX, Stateful, check_stateful

log = logging.getLogger("elastic_ddp.checkpoint")

STEP_DIR_RE = re.compile(r"^step-(\d{9,})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be found, verified or used. The message names it and says why."""


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def _rank_key(rank: int) -> str:
    return f"{RESERVED_PREFIX}{rank}"


def _state_dicts(state: Mapping[str, Stateful]) -> dict[str, Any]:
    """``{name: obj.state_dict()}``, after checking that every name and object can be checkpointed."""
    out = {}
    for name, obj in state.items():
        check_stateful(name, obj)
        out[name] = obj.state_dict()
    return out


def _saved_names(reader: VerifiedReader) -> set[str]:
    """Top-level state names stored in a checkpoint (from its verified DCP metadata)."""
    return {fqn.split(".", 1)[0] for fqn in reader.read_metadata().state_dict_metadata}


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as its manifest describes it."""

    step: int
    url: str
    world_size: int
    bytes: int
    time: float
    identity_digest: str
    identity: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    manifest: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_manifest(cls, url: str, manifest: dict[str, Any]) -> CheckpointInfo:
        return cls(
            step=manifest["step"],
            url=url,
            world_size=manifest["world_size"],
            bytes=int(manifest.get("bytes", 0)),
            time=float(manifest.get("time", 0.0)),
            identity_digest=manifest["identity_digest"],
            identity=dict(manifest["identity"]),
            manifest=manifest,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "url": self.url,
            "world_size": self.world_size,
            "bytes": self.bytes,
            "time": self.time,
            "identity_digest": self.identity_digest,
            "identity": self.identity,
            "versions": self.manifest.get("versions", {}),
            "signed": "signature" in self.manifest,
            "rdzv_round": self.manifest.get("rdzv_round"),
        }


@dataclass(frozen=True)
class SaveStats:
    """Numbers of the last completed save, for metrics.

    ``stall_s``: how long ``save()`` blocked the training step; ``save_s``: from ``save()`` to the
    commit; ``bytes``: size of all the checkpoint's files; ``throughput_bytes_per_s``: bytes / save_s.
    """

    step: int
    stall_s: float
    save_s: float
    bytes: int
    throughput_bytes_per_s: float


def _versions() -> dict[str, str]:
    try:
        ours = importlib.metadata.version("elastic-ddp")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree: record that, not fail
        ours = "unknown"
    return {"torch": torch.__version__, "elastic_ddp": ours}


def read_checkpoint(storage: Storage, ckpt_url: str) -> CheckpointInfo:
    """The checkpoint at ``ckpt_url`` from its manifest. Raises CheckpointError if it has none or a bad one."""
    where = f"{ckpt_url}/{mf.MANIFEST_NAME}"
    try:
        data = storage.read_bytes(join(ckpt_url, mf.MANIFEST_NAME))
    except FileNotFoundError:
        raise CheckpointError(
            f"{ckpt_url!r} is not a committed checkpoint: it has no {mf.MANIFEST_NAME}."
        ) from None
    try:
        manifest = mf.parse(data, where)
    except mf.ManifestError as exc:
        raise CheckpointError(str(exc)) from None
    return CheckpointInfo.from_manifest(ckpt_url, manifest)


def list_checkpoints(storage: Storage) -> list[CheckpointInfo]:
    """Committed checkpoints under ``storage.url``, oldest first. Unreadable manifests are skipped with a warning."""
    out = []
    for name in storage.list_dirs(storage.url):
        if not STEP_DIR_RE.match(name):
            continue
        ckpt_url = join(storage.url, name)
        if not storage.exists(join(ckpt_url, mf.MANIFEST_NAME)):
            continue  # an interrupted or in-progress save: never a checkpoint
        try:
            out.append(read_checkpoint(storage, ckpt_url))
        except CheckpointError as exc:
            log.warning("Skipping %s: %s", ckpt_url, exc)
    return sorted(out, key=lambda info: info.step)


def verify_checkpoint(storage: Storage, info: CheckpointInfo, names: list[str] | None = None) -> mf.VerifyResult:
    """Signature (when a key is set) and then files ``names`` (default all) against the manifest."""
    try:
        mf.check_signature(info.manifest, mf.signing_key(), f"{info.url}/{mf.MANIFEST_NAME}")
    except mf.ManifestError as exc:
        return mf.VerifyResult(False, mf.MANIFEST_NAME, str(exc))
    if METADATA_NAME not in info.manifest["files"]:
        return mf.VerifyResult(False, METADATA_NAME, "the manifest does not list it")
    try:
        return mf.verify_files(storage, info.url, info.manifest, names)
    except StorageError as exc:
        return mf.VerifyResult(False, "", f"reading failed: {exc}")


def retention_plan(
    steps: list[int], *, keep_last: int, keep_every: int | None, protected: set[int]
) -> tuple[list[int], str]:
    """Which committed steps to delete, and why: a pure function, no I/O.

    Keeps the newest ``keep_last``, every multiple of ``keep_every`` and the ``protected`` steps.
    """
    ordered = sorted(steps)
    keep = set(ordered[-keep_last:]) | protected
    if keep_every:
        keep |= {s for s in ordered if s % keep_every == 0}
    delete = [s for s in ordered if s not in keep]
    why = f"keep_last={keep_last}, keep_every={keep_every}, protected={sorted(protected)}: deleting {delete}"
    return delete, why


class CheckpointManager:
    """Saves, lists, verifies, selects and loads checkpoints of one run (see the module docstring).

    ``identity`` (JSON-able values by setting name, e.g. ``{"train.seed": 1337}``) is recorded in
    every manifest (see :attr:`CheckpointInfo.identity`). ``process_group``: the group whose ranks
    share the checkpoint (default: the world); the manager creates a gloo group of its own over those
    ranks, collectively. ``rdzv_round``: the rendezvous round this worker group was formed in; when
    given, rank 0 claims the URL for this round and refuses to commit once a newer group claimed it
    (see :mod:`elastic_ddp.checkpoint.fence`). None: no fencing (a job without this package's rendezvous).
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        identity: Mapping[str, Any] | None = None,
        process_group: Any = None,
        rdzv_round: int | None = None,
    ) -> None:
        if not cfg.url:
            raise ValueError("checkpoint.url must not be empty when a CheckpointManager is built.")
        self.cfg = cfg
        self.url = normalize_url(cfg.url)
        self.storage = Storage(self.url, cfg.storage_options)
        self.identity = dict(identity or {})
        self._distributed = dist.is_available() and dist.is_initialized()
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
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-save")
        self._pending: concurrent.futures.Future[bool] | None = None
        self._stager = HostStager()
        self._resumed_step: int | None = None
        self._verified: set[tuple[str, str]] = set()
        self._failed_verification: set[str] = set()
        self.failed_saves = 0
        self.consecutive_failed_saves = 0
        self.last_error: str | None = None
        self.last_save: SaveStats | None = None
        self._last_ok = True
        self._closed = False
        self.rdzv_round = rdzv_round
        if rdzv_round is not None and self.rank == 0:
            fence.claim(self.storage, rdzv_round)

    # ----------------------------------------------------------------------------------- saving

    def save(
        self,
        step: int,
        state: Mapping[str, Stateful],
        *,
        rank_state: Mapping[str, Stateful] | None = None,
        blocking: bool | None = None,
    ) -> bool:
        """Checkpoint ``state`` (replicated: the same values on every rank) and ``rank_state``
        (this rank's own values) as step ``step``.

        ``blocking`` None follows ``cfg.async_save``. An async save returns once the state is copied
        to host memory; the write and commit run in the background. A previous save still in flight is
        waited for first. Failures do not raise: they are logged, counted in ``failed_saves`` (and
        ``consecutive_failed_saves``) and described in ``last_error``. Returns False if a blocking save
        failed.
        """
        if self._closed:
            raise RuntimeError("This CheckpointManager is closed; no more saves can be started.")
        if step < 0:
            raise ValueError(f"The checkpoint step ({step}) must not be negative.")
        blocking = (not self.cfg.async_save) if blocking is None else blocking
        self.wait()
        start = time.perf_counter()
        snapshot = _state_dicts(state)
        if rank_state:
            snapshot[_rank_key(self.rank)] = _state_dicts(rank_state)
        if blocking:
            return self._save_now(step, snapshot, start, stall_s=None)
        staged = self._stager.stage(snapshot)
        stall = time.perf_counter() - start
        self._pending = self._executor.submit(self._save_now, step, staged, start, stall)
        return True

    def wait(self) -> bool:
        """Block until the save in flight (if any) is done; True unless the most recent save failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        return self._last_ok

    def close(self) -> bool:
        """Finish the pending save and release the background thread; True unless that save failed."""
        if self._closed:
            return True
        ok = self.wait()
        self._executor.shutdown(wait=True)
        self._closed = True
        if not ok:
            log.error("[%d/-] The last checkpoint save failed: %s", self.rank, self.last_error)
        return ok

    def _save_now(self, step: int, state: dict[str, Any], start: float, stall_s: float | None) -> bool:
        ckpt_url = join(self.url, step_dir_name(step))
        try:
            nbytes = self._write_and_commit(step, ckpt_url, state)
        except DCP_ERRORS as exc:  # a failed save must never take training down; it is surfaced instead
            self.failed_saves += 1
            self.consecutive_failed_saves += 1
            self.last_error = f"The checkpoint of step {step} at {ckpt_url!r} failed: {describe_error(exc)}"
            log.error("[%d/%d] %s", self.rank, step, self.last_error)
            # A fenced group leaves the directory alone: the group that owns the run may be writing it.
            if self.rank == 0 and not isinstance(exc, fence.StaleWriterError):
                self._remove_uncommitted(ckpt_url, step)
            self._last_ok = False
            return False
        self._last_ok = True
        self.consecutive_failed_saves = 0
        if nbytes is None:
            return True  # already committed by an earlier save of the same step
        elapsed = time.perf_counter() - start
        self.last_save = SaveStats(
            step=step,
            stall_s=elapsed if stall_s is None else stall_s,
            save_s=elapsed,
            bytes=nbytes,
            throughput_bytes_per_s=nbytes / elapsed if elapsed > 0 else 0.0,
        )
        log.info(
            "[%d/%d] Checkpoint committed at %s: %d bytes in %.2f s (training stalled %.3f s).",
            self.rank, step, ckpt_url, nbytes, elapsed, self.last_save.stall_s,
        )
        if self.rank == 0:
            self._after_commit(step)
        return True

    def _write_and_commit(self, step: int, ckpt_url: str, state: dict[str, Any]) -> int | None:
        # 1. Rank 0 decides whether to write, and clears a leftover of an interrupted save at this step.
        decision = self._broadcast(self._preflight, ckpt_url)
        if decision == "committed":
            log.warning("[%d/%d] %s is already committed; not saving it again.", self.rank, step, ckpt_url)
            return None
        fault_point("before_write", self.rank)
        # 2. DCP writes the shards in parallel; it propagates any rank's failure to every rank.
        writer = HashingWriter(
            ckpt_url,
            self.cfg.storage_options,
            rank=self.rank,
            sync_files=self.storage.is_local,
            threads=self.cfg.write_threads,
        )
        dcp.save(state, storage_writer=writer, process_group=self._pg)
        fault_point("after_write", self.rank)
        # 3. Each rank reports its files; rank 0 commits only if every report is complete.
        report = self._local_report(ckpt_url, writer.records)
        reports = self._all_gather(report)
        # 4. Rank 0 writes the manifest (the commit point) and tells everyone how it went.
        outcome = self._broadcast(self._commit, step, ckpt_url, reports)
        if isinstance(outcome, str):
            raise CheckpointError(outcome)
        return int(outcome)

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

    def _preflight(self, ckpt_url: str) -> str:
        manifest_url = join(ckpt_url, mf.MANIFEST_NAME)
        if self.storage.exists(manifest_url) and ckpt_url not in self._failed_verification:
            return "committed"
        self._check_fence(f"clear {ckpt_url} for a new save")
        if ckpt_url in self._failed_verification:
            # The run resumed from an older checkpoint because this one is damaged; training has
            # now reached its step again, so a sound copy replaces it (manifest first, as in retention).
            log.warning("[%d/-] Replacing %s, which failed verification at resume, with a new save.", self.rank, ckpt_url)
            self.storage.remove_file(manifest_url)
            self._failed_verification.discard(ckpt_url)
        self.storage.remove_tree(ckpt_url)
        return "write"

    def _local_report(self, ckpt_url: str, records: dict[str, tuple[int, str] | None]) -> Any:
        try:
            files = []
            for name, rec in sorted(records.items()):
                if rec is None:  # the stream was seeked: hash what actually landed
                    with self.storage.open_read(join(ckpt_url, name)) as stream:
                        rec = mf.hash_stream(stream)
                files.append(mf.FileRecord(name, rec[0], rec[1]))
            return files
        except Exception as exc:  # reported to rank 0, which then refuses to commit
            return f"rank {self.rank} could not account for its files: {exc}"

    def _commit(self, step: int, ckpt_url: str, reports: list[Any]) -> int | str:
        errors = [r for r in reports if isinstance(r, str)]
        if errors:
            return "; ".join(errors)
        files = [rec for report in reports for rec in report]
        names = [f.name for f in files]
        if METADATA_NAME not in names or len(set(names)) != len(names):
            return f"the ranks' file reports are inconsistent ({sorted(names)})."
        manifest = mf.build(
            step=step,
            world_size=self.world_size,
            time_s=time.time(),
            versions=_versions(),
            identity=self.identity,
            files=files,
            rdzv_round=self.rdzv_round,
        )
        fault_point("before_manifest", self.rank)
        self._check_fence(f"commit {ckpt_url}")
        data = json.dumps(manifest, sort_keys=True, indent=1).encode()
        self.storage.write_bytes_atomic(join(ckpt_url, mf.MANIFEST_NAME), data)
        return manifest["bytes"]

    def _remove_uncommitted(self, ckpt_url: str, step: int) -> None:
        try:
            if not self.storage.exists(join(ckpt_url, mf.MANIFEST_NAME)):
                self.storage.remove_tree(ckpt_url)
        except Exception as exc:  # storage may be what failed; the directory has no manifest, so it is inert
            log.warning("[%d/%d] Could not remove the uncommitted %s: %s", self.rank, step, ckpt_url, exc)

    def _after_commit(self, step: int) -> None:
        """Rank 0, after a commit: retention, then leftovers of interrupted saves older than ``step``."""
        try:
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

    # --------------------------------------------------------------------------------- selection

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints under ``cfg.url``, oldest first (not verified; local, not collective)."""
        return list_checkpoints(self.storage)

    def list_collective(self) -> list[CheckpointInfo]:
        """:meth:`list` read once by rank 0 and given to every rank (collective)."""
        self.wait()
        committed = self._broadcast(self.list, raise_errors=False)
        if isinstance(committed, Exception):
            raise CheckpointError(f"Listing checkpoints under {self.url!r} failed: {committed}") from committed
        return committed

    def remove_all(self) -> None:
        """Delete every checkpoint under the URL, manifests first (collective; rank 0 deletes).

        For a new run that is told to replace an old one; refused (:class:`~elastic_ddp.checkpoint.fence.
        StaleWriterError`) when a newer group owns the URL.
        """
        self.wait()

        def remove() -> None:
            self._check_fence(f"delete the checkpoints under {self.url}")
            for info in self.list():
                self.storage.remove_file(join(info.url, mf.MANIFEST_NAME))
                self.storage.remove_tree(info.url)

        self._broadcast(remove)

    def check_shared_storage(self) -> None:
        """Prove that every rank sees the same checkpoint storage (collective).

        Rank 0 writes a probe file with a random token under the URL; every rank reads it back. A
        rank that cannot -- its node has its own disk behind a local path -- would write shards no
        other node can read, and the checkpoints would never verify: raise :class:`CheckpointError`
        on every rank, naming the URL and those ranks, before any training.
        """

        def write() -> tuple[str, str]:
            token = uuid.uuid4().hex
            probe = join(self.url, f".probe-{token}")
            self.storage.makedirs(self.url)
            self.storage.write_bytes_atomic(probe, token.encode())
            return probe, token

        path, token = self._broadcast(write)
        try:
            seen = self.storage.read_bytes(path).decode() == token
        except (OSError, ValueError):
            seen = False
        blind = [rank for rank, ok in enumerate(self._all_gather(seen)) if not ok]
        if self.rank == 0:
            try:
                self.storage.remove_file(path)
            except StorageError as exc:  # a leftover probe is harmless; say so and go on
                log.warning("[0/-] Could not remove the storage probe %s: %s", path, exc)
        if blind:
            raise CheckpointError(
                f"checkpoint.url ({self.url}) is not storage shared by all nodes: rank(s) {blind} cannot read a "
                "file rank 0 wrote there (a local path on machines with their own disks?). Checkpoints would be "
                "split over the nodes and never resume. Set checkpoint.url to storage every node shares: an "
                "object store (s3://...) or a shared filesystem."
            )

    def verify(self, info: CheckpointInfo) -> mf.VerifyResult:
        """Check every file of ``info`` on this process alone (not collective)."""
        return verify_checkpoint(self.storage, info)

    def metrics(self) -> dict[str, float]:
        """Scalars for the metrics writer: the last completed save's figures and the failure count."""
        scalars = {"ckpt/failed_saves": float(self.failed_saves)}
        if self.last_save is not None:
            scalars.update({
                "ckpt/stall_s": self.last_save.stall_s,
                "ckpt/save_s": self.last_save.save_s,
                "ckpt/bytes": float(self.last_save.bytes),
                "ckpt/throughput_bytes_per_s": self.last_save.throughput_bytes_per_s,
            })  # fmt: skip
        return scalars

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint that verifies (collective); older ones are tried in turn."""
        self.wait()
        committed = self._broadcast(self.list, raise_errors=False)
        if isinstance(committed, Exception):
            raise CheckpointError(f"Listing checkpoints under {self.url!r} failed: {committed}") from committed
        for info in reversed(committed):
            result = self._verify_collective(info)
            if result.ok:
                return info
            self._failed_verification.add(info.url)
            log.warning(
                "[%d/-] Skipping checkpoint %s: file %r failed verification (%s); trying the previous one.",
                self.rank, info.url, result.bad_file, result.reason,
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
            info = self.latest()
        else:
            if resume.isdigit():
                ckpt_url = join(self.url, step_dir_name(int(resume)))
            else:
                ckpt_url = normalize_url(resume)
            storage = self.storage if ckpt_url.startswith(self.url) else Storage(ckpt_url, self.cfg.storage_options)
            self.wait()
            info = self._broadcast(read_checkpoint, storage, ckpt_url, raise_errors=False)
            if isinstance(info, Exception):
                raise CheckpointError(f"checkpoint.resume={resume!r}: {info}")
            result = self._verify_collective(info, storage)
            if not result.ok:
                raise CheckpointError(
                    f"checkpoint.resume={resume!r}: file {result.bad_file!r} of {ckpt_url!r} failed "
                    f"verification ({result.reason})."
                )
        return info

    def _verify_collective(self, info: CheckpointInfo, storage: Storage | None = None) -> mf.VerifyResult:
        """Every rank checks a share of the files; all ranks get the same verdict."""
        storage = storage or self.storage
        names = sorted(info.manifest["files"])[self.rank :: self.world_size]
        local = verify_checkpoint(storage, info, names)
        results = self._all_gather(local)
        bad = next((r for r in results if not r.ok), None)
        if bad is None:
            self._verified.add((info.url, mf.hash_bytes(mf.canonical_json(info.manifest))))
            return mf.VerifyResult(True)
        return bad

    # ------------------------------------------------------------------------------------ loading

    def load(
        self,
        info: CheckpointInfo,
        state: Mapping[str, Stateful],
        *,
        rank_state: Mapping[str, Stateful] | None = None,
    ) -> bool:
        """Load ``info`` into ``state`` (and ``rank_state``), at any world size; collective.

        Every object of ``state`` must be in the checkpoint (a :class:`CheckpointError` names the
        missing ones); objects in the checkpoint but not in ``state`` are left alone. Tensors are
        loaded in place into what the objects' ``state_dict()`` returns, then handed to their
        ``load_state_dict()``. ``rank_state`` is restored only when the checkpoint was written at this
        world size and every rank could restore its own; returns whether it was (False also
        without ``rank_state``). The checkpoint is verified first unless this manager already verified it.
        """
        self.wait()
        storage = self.storage if info.url.startswith(self.url) else Storage(info.url, self.cfg.storage_options)
        if (info.url, mf.hash_bytes(mf.canonical_json(info.manifest))) not in self._verified:
            result = self._verify_collective(info, storage)
            if not result.ok:
                raise CheckpointError(
                    f"Checkpoint {info.url!r} cannot be loaded: file {result.bad_file!r} failed verification "
                    f"({result.reason})."
                )
        reader = VerifiedReader(info.url, self.cfg.storage_options, info.manifest["files"])
        template = _state_dicts(state)
        saved = _saved_names(reader)
        # An object with an empty state (a disabled GradScaler) leaves nothing in the checkpoint.
        missing = sorted(name for name, values in template.items() if values and name not in saved)
        if missing:
            raise CheckpointError(
                f"Checkpoint {info.url!r} has no state named {', '.join(repr(m) for m in missing)}; it holds "
                f"{sorted(n for n in saved if not n.startswith(RESERVED_PREFIX))}. It was saved by a run that "
                "did not register it."
            )
        try:
            dcp.load(template, storage_reader=reader, process_group=self._pg)
        except DCP_ERRORS as exc:  # DCP wraps each rank's failure in its CheckpointException: name the checkpoint
            raise CheckpointError(f"Loading checkpoint {info.url!r} failed: {describe_error(exc)}") from exc
        for name, obj in state.items():
            try:
                obj.load_state_dict(template[name])
            except Exception as exc:  # the object's own check (shapes, keys) failed: name it
                raise CheckpointError(
                    f"Loading {name!r} from checkpoint {info.url!r} failed: {type(exc).__name__}: {exc}"
                ) from exc
        restored = self._load_rank_state(info, rank_state) if rank_state else False
        self._resumed_step = info.step
        log.info("[%d/%d] Resumed from %s (saved at world size %d).", self.rank, info.step, info.url, info.world_size)
        return restored

    def _load_rank_state(self, info: CheckpointInfo, rank_state: Mapping[str, Stateful]) -> bool:
        """Restore this rank's own state from ``info`` when every rank can; returns whether all did."""
        ok = info.world_size == self.world_size
        if ok:
            key = _rank_key(self.rank)
            template = {key: _state_dicts(rank_state)}
            reader = VerifiedReader(info.url, self.cfg.storage_options, info.manifest["files"])
            try:
                # Each rank reads only its own items: no collective.
                dcp.load(template, storage_reader=reader, no_dist=True)
            except DCP_ERRORS as exc:
                log.warning("[%d/%d] This rank's own state in %s cannot be restored: %s", self.rank, info.step,
                            info.url, describe_error(exc))  # fmt: skip
                ok = False
        ok = all(self._all_gather(ok))
        if ok:
            for name, obj in rank_state.items():
                obj.load_state_dict(template[key][name])
        return ok

    # ------------------------------------------------------------------------------- collectives

    def _broadcast(self, fn: Any, *args: Any, raise_errors: bool = True) -> Any:
        """Run ``fn(*args)`` on rank 0 and give its result to every rank.

        If ``fn`` raises, every rank raises it (``raise_errors``) or gets the exception as the value.
        """
        value: Any = None
        if self.rank == 0:
            try:
                value = fn(*args)
            except DCP_ERRORS as exc:  # shipped to every rank so all of them fail the same way
                # Client exceptions may not pickle; a CheckpointError carrying the message always does.
                value = exc if isinstance(exc, (CheckpointError, fence.StaleWriterError)) else CheckpointError(describe_error(exc))
        if self._distributed:
            box = [value]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self._pg, 0), group=self._pg)
            value = box[0]
        if isinstance(value, Exception) and raise_errors:
            raise value
        return value

    def _all_gather(self, obj: Any) -> list[Any]:
        if not self._distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._pg)
        return out
