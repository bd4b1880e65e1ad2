"""The loader of :class:`~elastic_ddp.checkpoint.manager.CheckpointManager`: finding a checkpoint and loading it.

:class:`CheckpointLoader` lists the committed checkpoints, picks the one a resume asks for (the
newest that verifies, or a named one) and loads it into the run's state objects, at any world size.
Finding is reading: each rank reads its share of the files, checking their checksums as they stream
in, and keeps the bytes until :meth:`~CheckpointLoader.load` hands the state to every rank over the
process group, so a resume reads every byte of the checkpoint once in total. Nothing of a checkpoint
reaches a state object before every file it is made of checked out, and nothing is ever unpickled.

Every method but :meth:`~CheckpointLoader.list` and :meth:`~CheckpointLoader.release` is collective.
Each first waits for the save in flight (``wait_for_save``): that save's collectives run on the
same gloo group in a background thread, and two rounds of collectives on one group must not
interleave.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from elastic_ddp.checkpoint import index as ix
from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.catalog import CheckpointInfo, list_checkpoints, read_checkpoint, read_index, step_dir_name
from elastic_ddp.checkpoint.errors import CheckpointError, CheckpointVerificationError
from elastic_ddp.checkpoint.exchange import distribute
from elastic_ddp.checkpoint.group import CheckpointGroup, state_dicts
from elastic_ddp.checkpoint.layout import assign_holders
from elastic_ddp.checkpoint.sharded import (
    describe_per_rank,
    destinations,
    files_to_read,
    read_files,
    restore_rank_values,
    restore_tree,
)
from elastic_ddp.checkpoint.storage import join, normalize_url
from elastic_ddp.checkpoint.tree import TreeError
from elastic_ddp.state import Stateful

log = logging.getLogger("elastic_ddp.checkpoint")


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
class _Held:
    """A checkpoint read and verified by :meth:`CheckpointLoader.latest`/``resolve``, kept for ``load``.

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


class CheckpointLoader:
    """Finds, verifies and loads the checkpoints of ``group`` (see the module docstring).

    ``wait_for_save``: blocks until the save in flight (if any) is done; called before every
    collective. What a resume learns, the save pipeline acts on: :attr:`failed_verification` (URLs
    of checkpoints that failed verification; a new save of the same step replaces them) and
    :attr:`resumed_step` (the step last loaded, which retention keeps while it is newer than the
    step saved).
    """

    def __init__(self, group: CheckpointGroup, *, wait_for_save: Callable[[], bool]) -> None:
        self._group = group
        self._wait_for_save = wait_for_save
        self._held: _Held | None = None
        self.failed_verification: set[str] = set()
        self.resumed_step: int | None = None
        self.last_load: LoadStats | None = None

    def release(self) -> None:
        """Drop the checkpoint read for a resume and its buffers (training goes on, or the manager closes)."""
        self._held = None

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints under the URL, oldest first (not verified; local, not collective)."""
        return list_checkpoints(self._group.storage)

    def list_collective(self) -> list[CheckpointInfo]:
        """:meth:`list` read once by rank 0 and given to every rank (collective).

        Raises :class:`CheckpointError` on every rank when listing fails.
        """
        self._wait_for_save()
        listed = self._group.coll.attempt(self.list)
        if listed.error is not None:
            error = listed.error
            raise CheckpointError(f"Listing checkpoints under {self._group.url!r} failed: {error}") from error
        return listed.value

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint that verifies, held for :meth:`load`; older ones are tried in
        turn, each one that fails recorded in :attr:`failed_verification`. None if none verifies."""
        for info in reversed(self.list_collective()):
            try:
                self._hold(info)
                return info
            except CheckpointVerificationError as exc:
                self.failed_verification.add(info.url)
                log.warning(
                    "[%d/-] Skipping checkpoint %s: file %r failed verification (%s); trying the previous one.",
                    self._group.rank, info.url, exc.bad_file, exc.reason,
                )
        return None

    def resolve(self, resume: str) -> CheckpointInfo | None:
        """The checkpoint ``resume`` (``'auto'``, ``'never'``, a step or a URL) selects, verified and held for
        :meth:`load`; None for ``'never'`` or where ``'auto'`` finds none. A named checkpoint that is
        missing or fails verification raises CheckpointError."""
        resume = resume.strip()
        if resume == "never":
            return None
        if resume == "auto":
            return self.latest()
        ckpt_url = join(self._group.url, step_dir_name(int(resume))) if resume.isdigit() else normalize_url(resume)
        self._wait_for_save()
        read = self._group.coll.attempt(read_checkpoint, self._group.storage_for(ckpt_url), ckpt_url)
        if read.error is not None:
            raise CheckpointError(f"checkpoint.resume={resume!r}: {read.error}")
        info = read.value
        try:
            self._hold(info)
        except CheckpointVerificationError as exc:
            raise CheckpointError(
                f"checkpoint.resume={resume!r}: file {exc.bad_file!r} of {ckpt_url!r} failed verification "
                f"({exc.reason})."
            ) from None
        return info

    def _hold(self, info: CheckpointInfo) -> _Held:
        """Read and verify ``info`` collectively, keeping this rank's share; raises
        :class:`CheckpointVerificationError` (the same on every rank) if any file fails."""
        if self._held is not None and self._held.key == info.key:
            return self._held
        self._held = None
        group = self._group
        storage = group.storage_for(info.url)
        start = time.perf_counter()
        before = storage.bytes_read
        read = group.coll.attempt(read_index, storage, info)
        if isinstance(read.error, CheckpointVerificationError):
            raise read.error
        if read.error is not None:
            raise CheckpointVerificationError(str(read.error), ix.INDEX_NAME, f"reading failed: {read.error}")
        index = read.value
        same_size = info.world_size == group.world_size
        try:
            if same_size and index.has_per_rank and index.ranks() != list(range(group.world_size)):
                raise ix.IndexFormatError(
                    f"it holds per-rank entries of ranks {index.ranks()}, not of all {group.world_size}"
                )
            view = index if same_size else index.as_shared(0)
        except ix.IndexFormatError as exc:
            raise CheckpointVerificationError(f"{info.url}: {exc}", ix.INDEX_NAME, str(exc)) from None
        # At the saving world size every file goes back to its writer (each rank finds its own
        # per-rank values among them); at another, files that hold only other ranks' are skipped.
        files = [(f.name, f.writer, f.size) for f in view.files if same_size or f.pieces]
        holders = assign_holders(files, range(group.world_size), by_writer=same_size)
        problem: CheckpointVerificationError | None = None
        buffers: dict[str, torch.Tensor] = {}
        try:
            buffers = read_files(
                storage, info.url, files_to_read(index, holders, group.rank), mf.file_records(info.manifest), group.io
            )
        except CheckpointVerificationError as exc:
            problem = exc
        failed = group.coll.first_failure(problem is not None)
        if failed is not None:
            mine = (problem.bad_file, problem.reason, str(problem)) if problem else None
            verdict = group.coll.broadcast_from(failed, mine)
            raise CheckpointVerificationError(verdict[2], verdict[0], verdict[1])
        self._held = _Held(info.key, index, view, same_size, holders, buffers, storage.bytes_read - before,
                           time.perf_counter() - start)  # fmt: skip
        return self._held

    def load(self, info: CheckpointInfo, state: Mapping[str, Stateful]) -> bool:
        """Load ``info`` (the held one, else read and verified now) into ``state`` and record it as
        :attr:`resumed_step`; whether every rank got its own per-rank values back. Every object of
        ``state`` must be in the checkpoint; any failure raises CheckpointError naming it."""
        self._wait_for_save()
        rank = self._group.rank
        try:
            held = self._hold(info)
        except CheckpointVerificationError as exc:
            raise CheckpointError(
                f"Checkpoint {info.url!r} cannot be loaded: file {exc.bad_file!r} failed verification ({exc.reason})."
            ) from None
        self._held = None  # the buffers go once this load is done, whatever happens
        index, view = held.index, held.view
        templates = state_dicts(state)
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
        self._group.coll.agree(problem, f"Checkpoint {info.url!r} does not fit this run's state")
        received = distribute(view, held.holders, held.buffers, dests, rank, self._group.transport())
        own: dict[str, Any] = {}
        if held.same_size and index.has_per_rank:
            # This rank's own values: in the file it wrote, which it read itself (no collective).
            file = index.rank_file(rank)
            section = held.buffers[file.name][file.pieces_bytes(index.tensors) :]
            try:
                own = restore_rank_values(section, index.per_rank, index.tensors, dests, file.rank_state.state,
                                          file.rank_state.tensors, templates, "index.json")  # fmt: skip
            except TreeError as exc:
                raise CheckpointError(
                    f"Checkpoint {info.url!r}: this rank's own state cannot be restored: {exc}"
                ) from None
        finish()
        for name, obj in state.items():
            try:
                obj.load_state_dict(restore_tree(view, name, dests) if name in view.state else own[name])
            except Exception as exc:  # the object's own check (shapes, keys) failed: name it
                raise CheckpointError(
                    f"Loading {name!r} from checkpoint {info.url!r} failed: {type(exc).__name__}: {exc}"
                ) from exc
        exact = held.same_size or not index.has_per_rank
        if not exact and rank == 0:
            log.warning(
                "[%d/%d] %s was saved at world size %d and this run has %d: what differed across its ranks (%s) "
                "is restored from rank 0's values on every rank, so it is not per-rank exact.",
                rank, info.step, info.url, info.world_size, self._group.world_size, describe_per_rank(index),
            )  # fmt: skip
        self.resumed_step = info.step
        self.last_load = LoadStats(info.step, held.bytes_read, held.read_s, time.perf_counter() - start, received)
        log.info("[%d/%d] Resumed from %s (saved at world size %d).", rank, info.step, info.url, info.world_size)
        return exact
