"""One node's memory tier on disk: a run's directory under ``checkpoint.memory_dir`` (tmpfs).

Layout (``<memory_dir>/<run name>-<identity digest>/``)::

    run.json                 which run this is (name, identity digest, owner uid)
    lock                     every live worker of the run on this node holds a shared flock on it
    agents/<pid>-<start>     the torchrun agents whose workers used it: between a worker's death and
                             its restart no worker holds the lock, and the agent's mark keeps another
                             run started on this host meanwhile from taking the directory for stale
    last-step                8 bytes: the last step this node's local rank 0 completed
    slot-0/part-00000.bin    local rank 0's share of a state: raw tensor bytes, back to back, then
                             that rank's own values of what differs across ranks (per-rank tensors,
                             per-rank objects; see elastic_ddp/checkpoint/divergence.py)
    slot-0/part-00000.json   its commit record: step, part, parts, size, BLAKE3, state digest, the
                             global rank and world size that saved it, its per-rank objects' trees
                             (part 0's record also holds the index: trees, tensor specs, pieces)
    slot-1/...               the other slot: the previous state

Each local rank writes one part of a state, so a node's parts add up to one state, not one per
rank. A part is committed when its record exists (written to a temporary name, then renamed);
a state of step S in a slot is *complete* only when every part's record names step S and the same
state digest and every part file has the recorded size. Contents are verified against their
BLAKE3 checksum as they are read (:func:`read_part`), so a damaged byte is caught before it is used
(BLAKE3, as in durable checkpoints: less CPU than SHA-256 beside training; docs/checkpoints.md).

Two slots: a save goes to the slot that does not hold the newest complete state, and a rank
starts overwriting a slot only after the other slot is complete (every local rank finished the
previous save), so a kill at any moment leaves at least one complete state once one was saved.

No collective is needed: the ranks of a node agree on slots because they save the same steps.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch

from elastic_ddp.processes import agent_pid, marks_a_live_process, process_mark

__all__ = [
    "FORMAT", "MemoryFormatError", "NodeMemory", "PartRecord", "StateOnNode", "read_part", "run_dir_name",
    "write_part",
]  # fmt: skip

log = logging.getLogger(__name__)

# 3: per-rank values in each part (2: BLAKE3 checksums; 1: SHA-256). States of another format are not
# read, so a restart after an upgrade resumes from the durable tier.
FORMAT = 3
SLOTS = 2
RUN_FILE = "run.json"
LOCK_FILE = "lock"
AGENTS_DIR = "agents"
LAST_STEP_FILE = "last-step"
# Bytes read or written per system call: large enough for memory speed, small enough to hash
# in cache-friendly pieces.
CHUNK = 16 << 20
# Map a part's pages in at once (Linux): one call instead of a page fault per 4 KiB while hashing.
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class MemoryFormatError(ValueError):
    """A part file or record does not verify: the message names the file and what differs."""


def run_dir_name(run_name: str, identity_digest: str) -> str:
    """The run's directory name: its name (made file-name safe) and its identity digest, so a run
    with other identity settings never reads this run's states."""
    safe = _UNSAFE.sub("_", run_name).strip("._") or "run"
    return f"{safe[:80]}-{identity_digest}"


def part_name(part: int) -> str:
    return f"part-{part:05d}"


@dataclass(frozen=True)
class PartRecord:
    """A committed part: ``size`` bytes with BLAKE3 ``checksum``, part ``part`` of ``parts`` of step ``step``.

    ``rank``/``world_size``: the global rank that saved it and its world size (whose per-rank values it
    holds); ``own``: the trees and tensor specs of that rank's per-rank objects, or None.
    """

    step: int
    part: int
    parts: int
    size: int
    checksum: str
    digest: str
    index: dict[str, Any] | None = None
    rank: int = 0
    world_size: int = 1
    own: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": FORMAT, "step": self.step, "part": self.part, "parts": self.parts, "size": self.size,
            "blake3": self.checksum, "digest": self.digest, "rank": self.rank, "world_size": self.world_size,
        }  # fmt: skip
        if self.index is not None:
            out["index"] = self.index
        if self.own is not None:
            out["own"] = self.own
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> PartRecord:
        fields = ("step", "part", "parts", "size", "rank", "world_size")
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise MemoryFormatError(f"{where} is not a memory-tier commit record of format {FORMAT}.")
        if not all(isinstance(data.get(k), int) and data[k] >= 0 for k in fields) or data["parts"] < 1:
            raise MemoryFormatError(f"{where}: {', '.join(fields)} must be non-negative integers (parts >= 1).")
        if not isinstance(data.get("blake3"), str) or not isinstance(data.get("digest"), str):
            raise MemoryFormatError(f"{where}: blake3 and digest must be strings.")
        index, own = data.get("index"), data.get("own")
        if (index is not None and not isinstance(index, dict)) or (own is not None and not isinstance(own, dict)):
            raise MemoryFormatError(f"{where}: the index and the per-rank objects must be objects.")
        return cls(data["step"], data["part"], data["parts"], data["size"], data["blake3"], data["digest"], index,
                   data["rank"], data["world_size"], own)  # fmt: skip


@dataclass(frozen=True)
class StateOnNode:
    """A complete state in a slot: its step and every part's record (``records[i]`` is part i)."""

    slot: int
    step: int
    records: tuple[PartRecord, ...]

    @property
    def index(self) -> dict[str, Any]:
        index = self.records[0].index
        if index is None:
            raise MemoryFormatError(f"Part 0 of the state of step {self.step} (slot {self.slot}) holds no index.")
        return index

    @property
    def nbytes(self) -> int:
        return sum(r.size for r in self.records)


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")
    os.replace(tmp, path)


def write_part(
    path: Path, buffers: Iterable[memoryview], threads: int = 1, helper: concurrent.futures.Executor | None = None
) -> tuple[int, str]:
    """Write ``buffers`` back to back into ``path`` (replacing its contents); its size and BLAKE3 checksum.

    ``threads`` 1: hashing runs on the same bytes as they are written, one pass over the data (blake3
    and file writes release the GIL on large buffers, so this runs beside training in a thread).
    More: ``helper`` (required then; its owner shuts it down) hashes the bytes with ``threads - 1``
    threads while this one writes them, so a part takes about as long as its write instead of
    write + hash (for spare cores: a GPU node's, or a restore's). Same checksum either way.

    The file is overwritten in place and cut to the new size at the end, not truncated first: on
    tmpfs a truncation frees the file's pages and the next write allocates and zeroes them again,
    which was ~40 % of a save's write time here. The caller uncommits the part before writing, so
    no reader trusts the bytes while they change.
    """
    if threads > 1 and helper is None:
        raise ValueError(f"write_part with threads={threads} hashes beside the write: it needs a helper executor.")
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    hasher = blake3.blake3(max_threads=max(1, threads - 1))
    hashing: concurrent.futures.Future | None = None
    if threads > 1:

        def hash_all() -> None:
            for view in views:
                hasher.update(view)

        hashing = helper.submit(hash_all)
    size = 0
    try:
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as file:
            for view in views:
                for lo in range(0, len(view), CHUNK):
                    chunk = view[lo : lo + CHUNK]
                    if hashing is None:
                        hasher.update(chunk)
                    file.write(chunk)
                    size += len(chunk)
            file.truncate(size)
    finally:
        if hashing is not None:
            hashing.result()  # the buffers must outlive the hash even when the write failed
    return size, hasher.hexdigest()


def read_part(path: Path, record: PartRecord, threads: int = 1) -> torch.Tensor:
    """The bytes of ``path`` as a read-only uint8 tensor, verified against ``record`` before it is returned.

    The file is mapped, not copied: a restore needs no second copy of the state in anonymous memory
    (at 2 GB a rank, 16 GB a node less) and none of its page faults, which cost more than the read
    itself; the checksum is computed over the mapping with ``threads`` threads. Writing into the
    tensor faults (the mapping is read-only), so nothing can change the saved state through it. The
    caller must consume it before its node's ranks save into that slot again (a restore does: it
    runs before training).

    Raises :class:`MemoryFormatError` naming the file when it is missing, of another size, or its
    checksum differs.
    """
    try:
        with open(path, "rb") as file:
            got = os.fstat(file.fileno()).st_size
            mapped = None
            if got == record.size and got:
                mapped = mmap.mmap(file.fileno(), got, mmap.MAP_SHARED | MAP_POPULATE, mmap.PROT_READ)
    except FileNotFoundError:
        raise MemoryFormatError(f"The memory-tier part {path} is missing.") from None
    except OSError as exc:
        raise MemoryFormatError(f"The memory-tier part {path} cannot be read: {exc}.") from exc
    if got != record.size:
        raise MemoryFormatError(f"The memory-tier part {path} holds {got} bytes; its record says {record.size}.")
    hasher = blake3.blake3(max_threads=max(1, threads))
    if mapped is not None:
        hasher.update(mapped)
    if hasher.hexdigest() != record.checksum:
        raise MemoryFormatError(
            f"The memory-tier part {path} does not match its checksum (BLAKE3 {hasher.hexdigest()[:16]}..., "
            f"recorded {record.checksum[:16]}...): its bytes were damaged."
        )
    if mapped is None:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # torch warns that a read-only buffer is not protected; the mapping is, by the kernel.
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        return torch.frombuffer(mapped, dtype=torch.uint8)


class NodeMemory:
    """This run's directory in node memory, as seen by one local rank (see the module docstring)."""

    def __init__(self, memory_dir: str | os.PathLike, run_name: str, identity_digest: str) -> None:
        self.root = Path(memory_dir)
        self.run_name = run_name
        self.identity_digest = identity_digest
        self.path = self.root / run_dir_name(run_name, identity_digest)
        self._lock_fd: int | None = None
        self._last_step_fd: int | None = None
        # Parsed commit records by path, with the stat they were read at: a writer polls the other
        # slot every save, and part 0's record holds the whole index, so it is parsed once, not per poll.
        self._parsed: dict[Path, tuple[tuple[int, int, int], PartRecord]] = {}
        # The thread that hashes a part while another writes it (write_part with threads > 1): made at
        # the first such write, shut down by close(), so no pool of the tier outlives its owner.
        self._hashing: concurrent.futures.ThreadPoolExecutor | None = None

    # -------------------------------------------------------------------------------- lifecycle

    def open(self) -> None:
        """Create the run's directory (if needed) and hold its lock while this process lives."""
        for slot in range(SLOTS):
            (self.path / f"slot-{slot}").mkdir(parents=True, exist_ok=True)
        run_file = self.path / RUN_FILE
        if not run_file.exists():
            _write_json_atomic(run_file, {"run": self.run_name, "identity_digest": self.identity_digest,
                                          "uid": os.getuid(), "format": FORMAT})  # fmt: skip
        if self._lock_fd is None:
            self._lock_fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_SH)
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # started by a torchrun agent: its parent
            agent = process_mark(agent_pid())
            if agent:
                (self.path / AGENTS_DIR).mkdir(exist_ok=True)
                (self.path / AGENTS_DIR / agent).touch()

    def close(self) -> None:
        """Release the lock, the files and the hashing thread (no write may be in flight: the writes
        are the caller's, and it waits for them first)."""
        if self._hashing is not None:
            self._hashing.shutdown(wait=True)
            self._hashing = None
        for fd in (self._last_step_fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._last_step_fd = self._lock_fd = None

    def remove(self) -> None:
        """Delete the run's directory (after a normal finish: nothing in it is needed any more)."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)

    def remove_stale_runs(self, siblings: bool = False) -> list[Path]:
        """Delete other runs' directories under the memory dir that no live worker holds.

        The rule: a directory with a ``run.json`` of this format, owned by this user, whose lock no
        process holds (every worker that used it is gone) and whose torchrun agents are all gone
        too (an agent restarting its workers holds no lock for a few seconds) is stale -- its run
        ended without a normal finish, or was replaced by a run with other identity settings -- and
        takes node memory that this run needs. A directory another user owns, or one a live run
        holds, stays.
        ``siblings``: look in the memory dir's sibling directories too (the default memory dirs, one
        per working directory, share a parent: a run killed in one directory is cleaned up by the
        next run started from any).
        """
        removed = []
        roots = [self.root]
        if siblings:
            try:
                roots += [p for p in self.root.parent.iterdir() if p != self.root and p.is_dir()]
            except OSError:
                pass
        entries = []
        for root in roots:
            try:
                entries += list(root.iterdir())
            except OSError:
                continue
        for entry in entries:
            if entry == self.path or not (entry / RUN_FILE).is_file() or _agent_alive(entry):
                continue
            try:
                if entry.stat().st_uid != os.getuid():
                    continue
                fd = os.open(entry / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue
                raise
            try:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
            finally:
                os.close(fd)
        return removed

    # ------------------------------------------------------------------------------------ space

    def used_bytes(self) -> int:
        """Bytes this run's directory takes now (reused by the next saves)."""
        total = 0
        for dirpath, _, files in os.walk(self.path):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.stat(os.path.join(dirpath, name)).st_size
        return total

    def free_bytes(self) -> int:
        """Bytes free under the memory dir plus what this run's own states take (they are overwritten)."""
        return shutil.disk_usage(self.root).free + self.used_bytes()

    # ------------------------------------------------------------------------------- last step

    def note_step(self, step: int) -> None:
        """Record the last step this node completed (8 bytes into tmpfs: about a microsecond)."""
        if self._last_step_fd is None:
            self._last_step_fd = os.open(self.path / LAST_STEP_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        os.pwrite(self._last_step_fd, int(step).to_bytes(8, "little"), 0)

    def last_step(self) -> int | None:
        try:
            data = (self.path / LAST_STEP_FILE).read_bytes()
        except OSError:
            return None
        return int.from_bytes(data[:8], "little") if len(data) >= 8 else None

    # ------------------------------------------------------------------------------ the states

    def slot_path(self, slot: int) -> Path:
        return self.path / f"slot-{slot}"

    def records(self, slot: int) -> dict[int, PartRecord]:
        """The commit records found in ``slot``, by part (unreadable ones are left out)."""
        out = {}
        for path in self.slot_path(slot).glob("part-*.json"):
            try:
                record = self._record(path)
            except (OSError, ValueError):
                continue
            if path.stem == part_name(record.part):
                out[record.part] = record
        return out

    def _record(self, path: Path) -> PartRecord:
        """The record in ``path``, parsed again only when the file changed (a commit renames a new
        file over it: a new inode and change time)."""
        st = os.stat(path)
        key = (st.st_ino, st.st_ctime_ns, st.st_size)
        cached = self._parsed.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        record = PartRecord.from_json(json.loads(path.read_text(encoding="utf-8")), str(path))
        self._parsed[path] = (key, record)
        return record

    def complete(self, slot: int) -> StateOnNode | None:
        """The complete state in ``slot`` (every part committed for one step and digest), or None."""
        records = self.records(slot)
        first = records.get(0)
        if first is None:
            return None
        parts = []
        for part in range(first.parts):
            record = records.get(part)
            if record is None or (record.step, record.parts, record.digest) != (first.step, first.parts, first.digest):
                return None
            try:
                if os.stat(self.slot_path(slot) / f"{part_name(part)}.bin").st_size != record.size:
                    return None
            except OSError:
                return None
            parts.append(record)
        return StateOnNode(slot, first.step, tuple(parts))

    def newest(self) -> StateOnNode | None:
        """The newest complete state on this node, or None."""
        return max(self.states(), key=lambda s: s.step, default=None)

    def states(self) -> list[StateOnNode]:
        """The complete states on this node (one per slot at most)."""
        return [s for s in (self.complete(slot) for slot in range(SLOTS)) if s is not None]

    def own_parts(self, rank: int, world_size: int) -> dict[int, tuple[int, PartRecord]]:
        """``{step: (slot, record)}`` of the committed parts that global rank ``rank`` saved at world size
        ``world_size`` (whose per-rank values are that rank's), whole on disk."""
        out = {}
        for slot in range(SLOTS):
            for record in self.records(slot).values():
                if (record.rank, record.world_size) != (rank, world_size):
                    continue
                try:
                    if os.stat(self.slot_path(slot) / f"{part_name(record.part)}.bin").st_size == record.size:
                        out[record.step] = (slot, record)
                except OSError:
                    continue
        return out

    def wait_complete(self, slot: int, step: int, timeout_s: float) -> bool:
        """Wait until ``slot`` holds a complete state of ``step``; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        delay = 0.0005
        while True:
            state = self.complete(slot)
            if state is not None and state.step == step:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def uncommit(self, slot: int, part: int) -> None:
        """Remove ``part``'s record in ``slot``: from now on the slot's state is incomplete."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.slot_path(slot) / f"{part_name(part)}.json")

    def commit(self, slot: int, record: PartRecord) -> None:
        _write_json_atomic(self.slot_path(slot) / f"{part_name(record.part)}.json", record.to_json())

    def write(self, slot: int, part: int, buffers: Iterable[memoryview], threads: int = 1) -> tuple[int, str]:
        if threads > 1 and self._hashing is None:
            self._hashing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="memory-tier-hash")
        return write_part(self.slot_path(slot) / f"{part_name(part)}.bin", buffers, threads, self._hashing)

    def read(self, state: StateOnNode, part: int, threads: int = 1) -> torch.Tensor:
        return self.read_record(state.slot, state.records[part], threads)

    def read_record(self, slot: int, record: PartRecord, threads: int = 1) -> torch.Tensor:
        return read_part(self.slot_path(slot) / f"{part_name(record.part)}.bin", record, threads)

    def clear(self) -> None:
        """Forget every state (a run that starts over must not resume what an earlier start left)."""
        for slot in range(SLOTS):
            for path in self.slot_path(slot).glob("part-*"):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        with contextlib.suppress(FileNotFoundError):
            (self.path / LAST_STEP_FILE).unlink()


def _agent_alive(run_path: Path) -> bool:
    """Whether a torchrun agent whose workers used ``run_path`` still runs (it may restart them)."""
    try:
        marks = [entry.name for entry in (run_path / AGENTS_DIR).iterdir()]
    except OSError:
        return False
    return any(marks_a_live_process(mark) for mark in marks)
