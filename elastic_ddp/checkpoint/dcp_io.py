"""Adapters between torch.distributed.checkpoint (DCP) and this package's storage rules.

* :class:`HashingWriter` is DCP's fsspec writer whose streams hash every byte as it is written, so a
  rank knows the size and SHA-256 of each file it wrote without reading it back.
* :class:`VerifiedReader` is DCP's fsspec reader that refuses to unpickle ``.metadata`` unless the
  exact bytes it read match the manifest (closing the gap between "verified" and "read").
* :class:`HostStager` copies a state dict to host memory (real copies, reused between saves) so an
  async save writes the values of the step it was taken at while training mutates the originals.

DCP's fsspec classes live in a private module (``torch.distributed.checkpoint._fsspec_filesystem``);
this file is the one place that imports it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import pickle
import signal
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.storage import basename

# Test-only fault injection: "POINT:RANK" makes that rank SIGKILL itself at POINT of a save;
# "POINT:RANK:wait=PATH" holds it there until PATH exists (a writer delayed across a failure).
# Points: before_write, mid_write (after the first bytes of a data file), after_write,
# before_manifest (rank 0 only, all shards durable). Unset in normal runs: a no-op lookup.
ENV_FAULT_POINT = "ELASTIC_DDP_CHECKPOINT_FAULT_POINT"

log = logging.getLogger(__name__)

METADATA_NAME = ".metadata"


# DCP's CheckpointException derives from BaseException, not Exception: catch both where a save or
# load failure must be handled rather than propagated.
DCP_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)


def describe_error(exc: BaseException) -> str:
    """One line per failing rank for DCP's exception (its str() is every rank's full traceback)."""
    if isinstance(exc, CheckpointException):
        parts = [f"rank {rank}: {type(err[0]).__name__}: {err[0]}" for rank, err in sorted(exc.failures.items())]
        return "; ".join(parts) or "DCP reported a failure without details"
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, (RuntimeError, OSError)) else str(exc)


def fault_point(name: str, rank: int) -> None:
    """Act on :data:`ENV_FAULT_POINT` if it names ``name`` for ``rank`` (tests only)."""
    text = os.environ.get(ENV_FAULT_POINT)
    if not text:
        return
    point, _, wait = text.partition(":wait=")
    if point != f"{name}:{rank}":
        return
    if not wait:
        os.kill(os.getpid(), signal.SIGKILL)
    if not os.path.exists(wait):
        log.warning("Fault point %s: holding this save until %s exists.", point, wait)
        while not os.path.exists(wait):
            time.sleep(0.1)


class CheckpointVerificationError(RuntimeError):
    """A checkpoint file does not match its manifest. The message names the checkpoint and the file."""


class _HashingStream:
    """Forwards to a writable stream, hashing every byte written.

    DCP writes sequentially (``tell`` for offsets, never seeking back); should anything seek, the
    running hash is no longer the file's, so it is marked invalid and the caller re-reads the file.
    """

    def __init__(self, raw: Any, fault_rank: int | None) -> None:
        self._raw = raw
        self._hasher = mf.new_hasher()
        self._size = 0
        self._valid = True
        self._fault_rank = fault_rank

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        written = len(view) if written is None else written
        self._hasher.update(view[:written])
        self._size += written
        if self._fault_rank is not None:
            fault_point("mid_write", self._fault_rank)
        return written

    def seek(self, *args: Any) -> int:
        self._valid = False
        return self._raw.seek(*args)

    def record(self) -> tuple[int, str] | None:
        return (self._size, self._hasher.hexdigest()) if self._valid else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _HashingFileSystem(_FsspecFileSystem):
    def __init__(self, fs: Any, rank: int) -> None:
        super().__init__()
        self.fs = fs
        self.rank = rank
        # file name -> (size, sha256), or None when the running hash was invalidated by a seek.
        self.records: dict[str, tuple[int, str] | None] = {}

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if not any(ch in mode for ch in "wa+"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = basename(os.fspath(path))
        is_data = name.endswith(".distcp")
        with super().create_stream(path, mode) as stream:
            wrapped = _HashingStream(stream, self.rank if is_data else None)
            yield wrapped
        # Reached only when the stream closed cleanly (the parent deletes the file on error).
        self.records[name] = wrapped.record()

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        old, new = basename(os.fspath(path)), basename(os.fspath(new_path))
        if old in self.records:
            self.records[new] = self.records.pop(old)


class HashingWriter(FsspecWriter):
    """DCP's fsspec writer that records the size and SHA-256 of every file this rank writes.

    ``records`` maps each written file's name to ``(size, sha256)`` (None: re-read to hash).
    ``sync_files`` should be True on local disk (fsync before the commit) and False on object stores
    (where there is no fsync and DCP would fall back to a machine-wide ``os.sync()``).
    """

    def __init__(
        self, url: str, storage_options: dict[str, Any], *, rank: int, sync_files: bool, threads: int = 1
    ) -> None:
        super().__init__(url, sync_files=sync_files, thread_count=threads, overwrite=True, **storage_options)
        self.fs = _HashingFileSystem(self.fs.fs, rank)

    @property
    def records(self) -> dict[str, tuple[int, str] | None]:
        return self.fs.records


class VerifiedReader(FsspecReader):
    """DCP's fsspec reader that unpickles ``.metadata`` only if its bytes match ``expected``."""

    def __init__(self, url: str, storage_options: dict[str, Any], expected: dict[str, Any]) -> None:
        super().__init__(url, **storage_options)
        self._url = url
        self._expected = expected

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        name = basename(os.fspath(path))
        record = self._expected.get(name)
        with self.fs.create_stream(path, "rb") as stream:
            data = stream.read()
        if record is None or len(data) != record["size"] or mf.hash_bytes(data) != record["sha256"]:
            raise CheckpointVerificationError(
                f"The file {name!r} of checkpoint {self._url!r} does not match its manifest; "
                "refusing to unpickle it."
            )
        # The bytes were just checked against the (signed, when a key is set) manifest.
        metadata = pickle.loads(data)  # noqa: S301
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class HostStager:
    """Copies a (nested) state dict into host buffers kept between saves.

    Tensors are copied, never aliased (training keeps mutating the originals; see
    pytorch/pytorch#144657). CUDA tensors go to pinned buffers with a non-blocking copy and one
    synchronize at the end. A buffer is reused when the next save's tensor at the same place has
    the same shape and dtype. Callers must not stage again while a previous staged copy is still
    being written (the manager waits for the pending save first).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def stage(self, state: Any) -> Any:
        saw_cuda = [False]
        staged = self._copy(state, (), saw_cuda)
        if saw_cuda[0]:
            torch.cuda.synchronize()
        return staged

    def _copy(self, obj: Any, path: tuple[Any, ...], saw_cuda: list[bool]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj, path, saw_cuda)
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k), saw_cuda) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, (*path, i), saw_cuda) for i, v in enumerate(obj)]
            return type(obj)(items) if isinstance(obj, list) else tuple(items)
        return copy.deepcopy(obj)

    def _copy_tensor(self, tensor: torch.Tensor, path: tuple[Any, ...], saw_cuda: list[bool]) -> torch.Tensor:
        tensor = tensor.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            pin = tensor.is_cuda
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        if tensor.is_cuda:
            saw_cuda[0] = True
            buf.copy_(tensor, non_blocking=True)
        else:
            buf.copy_(tensor)
        return buf


def load_model_only(url: str, storage_options: dict[str, Any], expected: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The ``model`` part of a verified checkpoint as a plain state dict (no process group, no model).

    Only the model's items are read: the optimizer state, often twice the model's size, is skipped.
    """
    reader = VerifiedReader(url, storage_options, expected)
    planner = _EmptyStateDictLoadPlanner(keys={"model"})
    dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
    # dcp.load hands the planner a dict of its own; the planner rebuilt the nested dict from metadata.
    return dict(planner.original_state_dict.get("model", {}))
