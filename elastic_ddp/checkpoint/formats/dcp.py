"""A stored object as a ``torch.distributed.checkpoint`` directory, written by one process (no process group).

``dcp_to_torch_save`` converts it to a ``torch.save`` file. DCP names values by string paths: int
dict keys come back as strings and empty dicts are dropped. DCP plans over meta tensors and asks
for each tensor when it writes it; each is then read whole, and DCP is handed the tensors in the
order the files hold them, a few at a time (:data:`_GROUP_BYTES`; one ``.distcp`` file per group),
so it holds one group's tensors at a time (a tensor larger than :data:`_GROUP_BYTES` alone), and
any tensor whose bytes the files have begun but not ended.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from elastic_ddp.checkpoint.errors import CheckpointError, ExportError
from elastic_ddp.checkpoint.objects import Spans, StoredObject
from elastic_ddp.checkpoint.staging import as_buffer, byte_view
from elastic_ddp.checkpoint.tree import path_text

# DCP is handed its tensors in groups of at most this many bytes (one .distcp file each); DCP holds
# a file's tensors until the file is written, so this bounds what it holds beside the largest tensor.
_GROUP_BYTES = 32 << 20


def _completion_order(stored: StoredObject) -> list[int]:
    """The object's tensors in the order their last bytes arrive when its files are read in turn
    (tensors without bytes first)."""
    left = {t: stored.spec(t).nbytes for t in stored.tensors}
    order = [t for t, size in left.items() if not size]
    for file in stored.files():
        for piece in file.pieces:
            if piece.tensor in left:
                left[piece.tensor] -= (piece.stop - piece.start) * stored.spec(piece.tensor).itemsize
                if not left[piece.tensor]:
                    order.append(piece.tensor)
    return order


class _WholeTensors:
    """Each of a stored object's tensors, whole, as its last bytes arrive; :meth:`get` gives the
    one asked for, keeping any that complete before it (none, when asked in
    :func:`_completion_order`)."""

    def __init__(self, stored: StoredObject, spans: Spans) -> None:
        self._stored = stored
        self._done: dict[int, torch.Tensor] = {}
        self._stream = self._assemble(iter(spans))

    def _assemble(self, spans: Iterator[tuple[int, int, memoryview]]) -> Iterator[tuple[int, torch.Tensor]]:
        filling: dict[int, tuple[torch.Tensor, memoryview, list[int]]] = {}
        for t in self._stored.tensors:
            if not self._stored.spec(t).nbytes:
                yield t, torch.empty(self._stored.spec(t).shape, dtype=self._stored.spec(t).dtype)
        for t, at, view in spans:
            if t not in filling:
                spec = self._stored.spec(t)
                tensor = torch.empty(spec.shape, dtype=spec.dtype)
                filling[t] = (tensor, as_buffer(byte_view(tensor, 0, spec.numel)), [spec.nbytes])
            tensor, into, left = filling[t]
            into[at : at + len(view)] = view
            left[0] -= len(view)
            if not left[0]:
                del filling[t]
                yield t, tensor

    def get(self, tensor: int) -> torch.Tensor:
        while tensor not in self._done:
            arrived = next(self._stream, None)
            if arrived is None:  # not with an index that parsed: its pieces cover every tensor
                raise ExportError(f"The files of {self._stored.name!r} end before its tensor {tensor} is whole.")
            self._done[arrived[0]] = arrived[1]
        return self._done.pop(tensor)

    def finish(self) -> None:
        """Read to the end of the last file (raising if it fails its check); every tensor was taken."""
        for t, value in self._stream:
            self._done[t] = value
        if self._done:
            paths = ", ".join(repr(path_text(self._stored.tensors[t][1:])) for t in self._done)
            raise ExportError(f"DCP did not ask for the tensors {paths} of {self._stored.name!r}.")


def write(name: str, stored: StoredObject, path: str) -> None:
    """Write the object ``name`` to the directory ``path`` (DCP creates it). Raises :class:`ExportError`
    when its state dict is not a dict, ``OSError`` when DCP fails to write."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    metas = {t: torch.empty(stored.spec(t).shape, dtype=stored.spec(t).dtype, device="meta") for t in stored.tensors}
    tree = stored.tree(metas.__getitem__)
    if not isinstance(tree, Mapping):
        raise ExportError(
            f"The state of {name!r} is a {type(tree).__name__}, but a DCP checkpoint holds a dict: export it with "
            "--format torch."
        )
    planner_type, writer_type = _dcp_types()
    with Spans(stored) as spans:
        whole = _WholeTensors(stored, spans)
        planner = planner_type(stored, {id(meta): t for t, meta in metas.items()}, whole)
        try:
            with warnings.catch_warnings():
                # no_dist=True is the point (one process, no process group); DCP warns about it regardless.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(dict(tree), storage_writer=writer_type(path), planner=planner, no_dist=True)
        except CheckpointException as exc:  # DCP wraps what its steps raise
            if planner.read_error is not None:
                raise planner.read_error from None
            raise OSError(f"DCP failed to write {path}: {exc}") from exc
        # The last file's check comes after its last byte, which may follow the last tensor's.
        whole.finish()


@functools.cache
def _dcp_types() -> tuple[type, type]:
    """The planner and storage writer of a DCP export (defined on first use: importing DCP is slow)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class StreamingPlanner(DefaultSavePlanner):
        """DCP's default planner over a state dict of meta tensors, which hands DCP each real tensor,
        read whole from the checkpoint, when DCP writes it (:meth:`resolve_data`)."""

        def __init__(self, stored: StoredObject, ids: dict[int, int], whole: _WholeTensors) -> None:
            super().__init__()
            self.stored = stored
            self._ids = ids  # id of a meta tensor -> tensor number
            self._rank = {t: k for k, t in enumerate(_completion_order(stored))}
            self._whole = whole
            self.read_error: CheckpointError | None = None

        def tensors_of(self, item: Any) -> list[int]:
            """The numbers of the tensors a write item holds: its own, or those inside a plain value (DCP
            pickles a tuple whole, tensors and all)."""
            found: list[int] = []

            def walk(node: Any) -> None:
                if isinstance(node, torch.Tensor):
                    found.append(self._ids[id(node)])
                elif isinstance(node, Mapping):
                    for value in node.values():
                        walk(value)
                elif isinstance(node, (list, tuple)):
                    for value in node:
                        walk(value)

            walk(self.lookup_object(item.index))
            return found

        def rank_of(self, item: Any) -> int:
            """When the item's last bytes come in the checkpoint's files (-1: it holds no tensor)."""
            return max((self._rank[t] for t in self.tensors_of(item)), default=-1)

        def nbytes_of(self, item: Any) -> int:
            return sum(self.stored.spec(t).nbytes for t in self.tensors_of(item))

        def resolve_data(self, write_item: Any) -> Any:
            try:
                obj = self.lookup_object(write_item.index)
                if write_item.type != WriteItemType.BYTE_IO:
                    return self._whole.get(self._ids[id(obj)])
                return self.transform_object(write_item, self._real(obj))
            except CheckpointError as exc:  # kept: DCP wraps it, the export reports it as it is
                self.read_error = exc
                raise

        def _real(self, node: Any) -> Any:
            """A plain value with each meta tensor inside replaced by the real one."""
            if isinstance(node, torch.Tensor):
                return self._whole.get(self._ids[id(node)])
            if isinstance(node, Mapping):
                return {key: self._real(value) for key, value in node.items()}
            if isinstance(node, (list, tuple)):
                return type(node)(self._real(value) for value in node)
            return node

    class GroupedWriter(dcp.FileSystemWriter):
        """DCP's file system writer, given the plan's items in the order the checkpoint's files
        complete them, a group of at most :data:`_GROUP_BYTES` (or one larger tensor) per
        ``.distcp`` file: DCP keeps every tensor of a file until the file is written, so it holds one
        group at a time."""

        def __init__(self, path: str) -> None:
            # One thread and no copy-ahead: the items are asked for one at a time, in the plan's order.
            # No fsync, like the torch and safetensors exports: the output is renamed into place whole.
            super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=1, per_thread_copy_ahead=0)

        def write_data(self, plan: Any, planner: Any) -> Any:
            groups: list[list[Any]] = []
            size = _GROUP_BYTES
            for item in sorted(plan.items, key=planner.rank_of):
                nbytes = planner.nbytes_of(item)
                if not groups or size + nbytes > _GROUP_BYTES:
                    groups.append([])
                    size = 0
                groups[-1].append(item)
                size += nbytes
            results = []
            for k, group in enumerate(groups):
                # Each call writes one file, named from the plan's prefix: a prefix of its own per group.
                prefix = dataclasses.replace(plan.storage_data, prefix=f"{plan.storage_data.prefix}{k}_")
                part = dataclasses.replace(plan, items=group, storage_data=prefix)
                results += super().write_data(part, planner).wait()
            done: torch.futures.Future[list[Any]] = torch.futures.Future()
            done.set_result(results)
            return done

    return StreamingPlanner, GroupedWriter
