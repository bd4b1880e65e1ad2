"""The objects of a checkpoint read straight from its data files, each byte hashed as it passes.

:func:`open_objects` names some objects of a checkpoint without reading them (the export's writers
stream them through :class:`Spans`); :func:`load_objects` reads objects into CPU tensors
(``checkpoint.init_from`` of a checkpoint), each file straight into the tensors it fills, in
parallel. Either way every file is read front to back, hashed as it streams, and checked against
the manifest's record once its last byte has passed: a file that differs raises
:class:`~elastic_ddp.checkpoint.errors.CheckpointVerificationError` naming it.

Memory: :class:`Spans` holds :data:`BUFFERS` read buffers of :data:`CHUNK` bytes and no tensor;
:func:`load_objects` holds the state it returns and a bounce buffer per file for the bytes of other
objects, never a file buffer beside the state.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.index import Index, IndexFile
from elastic_ddp.checkpoint.sharded import destinations, restore_tree, tensor_paths
from elastic_ddp.checkpoint.shards import check_read, file_record, open_checked
from elastic_ddp.checkpoint.staging import as_buffer, byte_view
from elastic_ddp.checkpoint.storage import Storage, join
from elastic_ddp.checkpoint.tree import Path, TensorSpec, unflatten

# Bytes read (and hashed) per call: large enough that per-call overhead vanishes, small enough that
# the read buffers stay small beside any tensor worth streaming.
CHUNK = 8 << 20
# Read buffers: one being filled and hashed while the writer empties the others.
BUFFERS = 3


@dataclass(frozen=True)
class StoredObject:
    """One object of a checkpoint, not read yet (from :func:`open_objects`).

    ``tensors``: ``{tensor number in index: path}`` of its tensors, in the order its state dict
    holds them (depth first); each path starts with ``name``.
    """

    name: str
    storage: Storage
    url: str
    index: Index
    expected: Mapping[str, mf.FileRecord]
    tensors: dict[int, Path]

    def spec(self, tensor: int) -> TensorSpec:
        return self.index.tensors[tensor]

    @property
    def nbytes(self) -> int:
        return sum(self.spec(t).nbytes for t in self.tensors)

    def tree(self, leaf: Callable[[int], Any]) -> Any:
        """The state dict as saved, with ``leaf(tensor number)`` in place of each tensor."""
        return unflatten(self.index.state[self.name], lambda i, _: leaf(i), (self.name,), where="index.json")

    def files(self) -> list[IndexFile]:
        """The data files holding pieces of this object, in the index's order."""
        return [f for f in self.index.files if any(p.tensor in self.tensors for p in f.pieces)]


def object_tensors(index: Index, name: str) -> int:
    """How many tensors the object ``name`` holds (``index`` from :meth:`Index.as_shared`)."""
    return len(tensor_paths(index, [name]))


def open_objects(
    storage: Storage, dir_url: str, index: Index, expected: Mapping[str, mf.FileRecord], names: Iterable[str]
) -> dict[str, StoredObject]:
    """The objects ``names`` of the checkpoint at ``dir_url``, to stream (:class:`Spans`) or export
    (:func:`elastic_ddp.checkpoint.export.write`); nothing is read yet.

    ``index``: the checkpoint's index as one rank sees it (:meth:`Index.as_shared`); ``expected``:
    the manifest's records. Raises :class:`~elastic_ddp.checkpoint.tree.TreeError` when the index
    is inconsistent and :class:`CheckpointVerificationError` when the manifest does not list a file
    an object needs.
    """
    out = {}
    for name in names:
        stored = StoredObject(name, storage, dir_url, index, expected, tensor_paths(index, [name]))
        for file in stored.files():
            file_record(expected, file.name)
        out[name] = stored
    return out


def load_objects(
    storage: Storage,
    dir_url: str,
    index: Index,
    expected: Mapping[str, mf.FileRecord],
    names: Iterable[str],
    pool: concurrent.futures.Executor,
) -> dict[str, Any]:
    """The state dicts ``names`` with new CPU tensors, each tensor its own storage.

    Arguments as for :func:`open_objects`. Each file holding a piece of those objects is read once,
    straight into the tensors it fills (bytes of other objects pass through a small buffer), and
    hashed as it streams: the state is held once, never a file buffer beside it. Raises
    :class:`CheckpointVerificationError` naming a file that is missing, unreadable, or differs from
    its record in size or checksum (once every read has ended).
    """
    names = list(names)
    dests, _ = destinations(index, names, {name: None for name in names})
    needed = [f for f in index.files if any(p.tensor in dests for p in f.pieces)]
    futures = [pool.submit(_read_file_into, storage, dir_url, f, index, dests, expected) for f in needed]
    concurrent.futures.wait(futures)
    for future in futures:
        future.result()
    return {name: restore_tree(index, name, dests) for name in names}


def _read_file_into(
    storage: Storage, dir_url: str, file: IndexFile, index: Index, dests: Mapping[int, torch.Tensor],
    expected: Mapping[str, mf.FileRecord],
) -> None:  # fmt: skip
    """Read ``file`` front to back: its pieces of tensors in ``dests`` into them, everything else
    (pieces of other tensors, other ranks' values after the pieces) through a bounce buffer; all of
    it hashed and checked against the manifest's record."""
    record = file_record(expected, file.name)
    url = join(dir_url, file.name)
    targets: list[memoryview | int] = []  # where each span of the file goes: a tensor's bytes, or a count to skip
    for piece in file.pieces:
        if piece.tensor in dests:
            targets.append(as_buffer(byte_view(dests[piece.tensor], piece.start, piece.stop)))
        else:
            targets.append((piece.stop - piece.start) * index.tensors[piece.tensor].itemsize)
    targets.append(record.size - file.pieces_bytes(index.tensors))
    hasher = mf.new_hasher(record.algorithm)
    bounce = memoryview(bytearray(min(CHUNK, max((t for t in targets if isinstance(t, int)), default=0))))
    pos = 0
    with open_checked(storage, url, file.name) as stream:
        for target in targets:
            into = target if isinstance(target, memoryview) else None
            size = len(target) if into is not None else target
            done = 0
            while done < size:
                part = into[done : done + CHUNK] if into is not None else bounce[: min(CHUNK, size - done)]
                n = stream.readinto(part)
                if not n:
                    break
                hasher.update(part[:n])
                done += n
            pos += done
            if done < size:
                break
        extra = len(stream.read(1)) if pos == record.size else 0
    check_read(file.name, url, record, pos, extra, hasher.hexdigest())


class Spans:
    """The bytes of a stored object's tensors as the checkpoint's files hold them, while a thread reads
    ahead: iterating yields ``(tensor, byte offset in the tensor, bytes)``, each view valid until the
    next is taken.

    The thread reads the object's files one after another, front to back, into :data:`BUFFERS`
    buffers of :data:`CHUNK` bytes, hashing every byte (other objects' bytes in a file included);
    after a file's last byte its size and checksum are checked, and a mismatch is raised from the
    iteration in place of the next span. Use as a context manager: leaving it stops the thread.
    """

    _DONE = object()

    def __init__(self, stored: StoredObject) -> None:
        self._stored = stored
        self._ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._free: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        for _ in range(BUFFERS):
            self._free.put(memoryview(bytearray(CHUNK)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read_all, name="object-read", daemon=True)

    def __enter__(self) -> Spans:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._free.put(None)  # wakes the thread if it waits for a buffer
        self._thread.join()

    def __iter__(self) -> Iterator[tuple[int, int, memoryview]]:
        while (item := self._ready.get()) is not self._DONE:
            if isinstance(item, BaseException):
                raise item
            buffer, spans = item
            yield from spans
            self._free.put(buffer)

    def _read_all(self) -> None:
        try:
            for file in self._stored.files():
                if not self._read_file(file):
                    return
            self._ready.put(self._DONE)
        except BaseException as exc:  # handed to the iterating thread, which raises it
            self._ready.put(exc)

    def _read_file(self, file: IndexFile) -> bool:
        """Read, hash and hand over one file; False when told to stop."""
        stored = self._stored
        record = file_record(stored.expected, file.name)
        url = join(stored.url, file.name)
        # (offset in the file, tensor, offset in the tensor, bytes) of this object's pieces, in file order.
        wanted = []
        for piece, off in zip(file.pieces, file.piece_offsets(stored.index.tensors)):
            if piece.tensor in stored.tensors:
                size = stored.spec(piece.tensor).itemsize
                wanted.append((off, piece.tensor, piece.start * size, (piece.stop - piece.start) * size))
        hasher = mf.new_hasher(record.algorithm)
        pos = extra = 0
        k = 0  # the first wanted piece not yet handed over in full
        with open_checked(stored.storage, url, file.name) as stream:
            while pos < record.size:
                buffer = self._free.get()
                if buffer is None or self._stop.is_set():
                    return False
                want = min(CHUNK, record.size - pos)
                n = 0
                while n < want and (got := stream.readinto(buffer[n:want])):
                    n += got
                hasher.update(buffer[:n])
                spans = []
                while k < len(wanted) and wanted[k][0] < pos + n:
                    start, tensor, at, size = wanted[k]
                    lo, hi = max(start, pos), min(start + size, pos + n)
                    spans.append((tensor, at + lo - start, buffer[lo - pos : hi - pos]))
                    if hi < start + size:
                        break  # the piece goes on in the next chunk
                    k += 1
                self._ready.put((buffer, spans))
                pos += n
                if n < want:
                    break
            extra = len(stream.read(1)) if pos == record.size else 0
        check_read(file.name, url, record, pos, extra, hasher.hexdigest())
        return True
