"""Objects of a checkpoint written in formats other tools read: ``torch.save``, safetensors, DCP.

:func:`open_objects` names some objects of a checkpoint without reading them; :func:`write` then
streams one of them into a format of :data:`FORMATS`, file by file through the checkpoint's data
files, each byte hashed as it passes and every file checked against the manifest:

* ``torch``: one ``torch.save`` file of the state dict as saved (``torch.load(path, weights_only=True)``,
  ``mmap=True`` too). torch writes the archive itself, each storage's record reserved but left empty
  (``torch.serialization.skip_data``); then the bytes go straight into their records and each
  record's CRC-32 into the archive: record for record what ``torch.save`` of the same tensors writes.
* ``safetensors``: one ``.safetensors`` file of the state dict's tensors, keyed by their paths joined
  with ``.`` (a model's keys are its ``state_dict()`` keys); plain values cannot go in and are
  listed in :attr:`Written.left_out`. The header (every dtype, shape and offset is known from the
  index) is written first, then the bytes go straight to their offsets.
* ``dcp``: a ``torch.distributed.checkpoint`` directory (one process, no process group), which
  ``dcp_to_torch_save`` converts to a ``torch.save`` file. DCP names values by string paths: int
  dict keys come back as strings and empty dicts are dropped. DCP plans over meta tensors and
  asks for each tensor when it writes it; each is then read whole, and DCP is handed the tensors
  in the order the files hold them, a few at a time (:data:`_DCP_GROUP_BYTES`; one ``.distcp``
  file per group), so it holds one group's tensors at a time.

Memory: the torch and safetensors writers hold no tensor at all -- only the read buffers
(:data:`_BUFFERS` of :data:`_CHUNK` bytes); DCP's holds the tensors of one group (a tensor larger
than :data:`_DCP_GROUP_BYTES` alone), and any tensor whose bytes the files have begun but not ended.
``benchmarks/bench_export.py`` measures it.

Verification: a file's checksum is known once the file has been read to its end, and by then some
of its bytes are already in the output. Every output is therefore written to ``PATH.partial`` and
renamed into place only after every file it drew on matched the manifest; a mismatch ends the
export (:class:`ExportError` naming the file) and removes the partial output. An interrupted export
leaves no partial output under the name asked for either.

:func:`load_objects` reads objects into CPU tensors instead (``checkpoint.init_from`` of a
checkpoint), each file straight into the tensors it fills, in parallel.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import json
import os
import queue
import shutil
import struct
import threading
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.errors import CheckpointError
from elastic_ddp.checkpoint.index import Index, IndexFile
from elastic_ddp.checkpoint.sharded import destinations, restore_tree, tensor_paths
from elastic_ddp.checkpoint.shards import check_read, file_record, open_checked
from elastic_ddp.checkpoint.staging import as_buffer, byte_view
from elastic_ddp.checkpoint.storage import Storage, join
from elastic_ddp.checkpoint.tree import Path, TensorSpec, path_text, unflatten

FORMATS = ("torch", "safetensors", "dcp")
# What one object's output is called inside a directory of several (a DCP export is a directory).
SUFFIXES = {"torch": ".pt", "safetensors": ".safetensors", "dcp": ""}
# Bytes read (and hashed) per call: large enough that per-call overhead vanishes, small enough that
# the read buffers stay small beside any tensor worth streaming.
_CHUNK = 8 << 20
# Read buffers: one being filled and hashed while the writer empties the others.
_BUFFERS = 3
# A DCP export hands DCP its tensors in groups of at most this many bytes (one .distcp file each);
# DCP holds a file's tensors until the file is written, so this bounds what it holds beside the
# largest tensor.
_DCP_GROUP_BYTES = 32 << 20
# safetensors' names of the dtypes it holds (its spec; safetensors.torch reads them back to these).
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.complex64: "C64",
}  # fmt: skip
# A safetensors header is padded with spaces to a multiple of this (its spec), so that the data that
# follows, sorted by alignment, keeps every tensor aligned to its element size.
_SAFETENSORS_ALIGN = 8


class ExportError(ValueError):
    """An object cannot be written in the format asked for, or reading it from the checkpoint failed;
    the message names the object and why (a failed read chains the
    :class:`CheckpointVerificationError` naming the file)."""


@dataclass(frozen=True)
class Written:
    """What :func:`write` wrote of one object: its tensors and their bytes, and the paths of the
    plain values the format could not hold (safetensors only)."""

    tensors: int
    bytes: int
    left_out: tuple[str, ...] = ()


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
    """The objects ``names`` of the checkpoint at ``dir_url``, to :func:`write`; nothing is read yet.

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
    bounce = memoryview(bytearray(min(_CHUNK, max((t for t in targets if isinstance(t, int)), default=0))))
    pos = 0
    with open_checked(storage, url, file.name) as stream:
        for target in targets:
            into = target if isinstance(target, memoryview) else None
            size = len(target) if into is not None else target
            done = 0
            while done < size:
                part = into[done : done + _CHUNK] if into is not None else bounce[: min(_CHUNK, size - done)]
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


class _Spans:
    """The bytes of a stored object's tensors as the checkpoint's files hold them, while a thread reads
    ahead: iterating yields ``(tensor, byte offset in the tensor, bytes)``, each view valid until the
    next is taken.

    The thread reads the object's files one after another, front to back, into :data:`_BUFFERS`
    buffers of :data:`_CHUNK` bytes, hashing every byte (other objects' bytes in a file included);
    after a file's last byte its size and checksum are checked, and a mismatch is raised from the
    iteration in place of the next span. Use as a context manager: leaving it stops the thread.
    """

    _DONE = object()

    def __init__(self, stored: StoredObject) -> None:
        self._stored = stored
        self._ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._free: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        for _ in range(_BUFFERS):
            self._free.put(memoryview(bytearray(_CHUNK)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read_all, name="export-read", daemon=True)

    def __enter__(self) -> _Spans:
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
                want = min(_CHUNK, record.size - pos)
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

    def __init__(self, stored: StoredObject, spans: _Spans) -> None:
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


def write(fmt: str, name: str, stored: StoredObject, path: str, *, metadata: Mapping[str, str]) -> Written:
    """Write the object ``name`` (``stored``, from :func:`open_objects`) to ``path`` in the format
    ``fmt``, reading it from the checkpoint as it goes; ``metadata`` goes into the safetensors header
    (other formats ignore it).

    Raises :class:`ExportError` when the object cannot be written in that format (safetensors: it
    holds no tensors, two of its paths join to the same key, or a dtype safetensors lacks; dcp: its
    state dict is not a dict) or a checkpoint file it reads fails verification (nothing is left at
    ``path`` then), ``OSError`` when writing fails.
    """
    if fmt not in FORMATS:
        raise ExportError(f"The export format {fmt!r} is not one of {', '.join(FORMATS)}.")
    written = Written(len(stored.tensors), stored.nbytes)
    partial = f"{path}.partial"
    try:
        if fmt == "torch":
            _save_torch(stored, partial)
        elif fmt == "safetensors":
            plain = _leaves(stored.tree(_Slot))[1]
            written = Written(written.tensors, written.bytes, tuple(path_text(p) for p in plain))
            _save_safetensors(name, stored, partial, metadata)
        else:
            _save_dcp(name, stored, partial)
        if fmt == "dcp" and os.path.isdir(path):
            os.rmdir(path)  # an empty directory (the caller refuses a non-empty one): replaced by the export
        os.replace(partial, path)
    except CheckpointError as exc:  # a file failed verification (or could not be read) mid-export
        raise ExportError(f"Reading {name!r} from {stored.url} failed: {exc}") from exc
    finally:
        if os.path.isdir(partial):
            shutil.rmtree(partial)
        elif os.path.exists(partial):
            os.remove(partial)
    return written


@dataclass(frozen=True)
class _Slot:
    """A tensor of a stored object in a tree built by :meth:`StoredObject.tree`: its number in the index."""

    tensor: int


def _leaves(tree: Any) -> tuple[list[tuple[Path, _Slot]], list[Path]]:
    """``(tensors, plain)``: every tensor (a :class:`_Slot`) with its path, and the paths of the
    other leaves (plain values, and empty containers, which hold no value but would vanish from a
    tensors-only format)."""
    tensors: list[tuple[Path, _Slot]] = []
    plain: list[Path] = []

    def walk(node: Any, at: Path) -> None:
        if isinstance(node, _Slot):
            tensors.append((at, node))
        elif isinstance(node, Mapping) and node:
            for key, value in node.items():
                walk(value, (*at, key))
        elif isinstance(node, (list, tuple)) and node:
            for i, value in enumerate(node):
                walk(value, (*at, i))
        else:
            plain.append(at)

    walk(tree, ())
    return tensors, plain


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _save_safetensors(name: str, stored: StoredObject, path: str, metadata: Mapping[str, str]) -> None:
    """The header (from the index) first, then each span of bytes straight to its tensor's offset."""
    tensors = _leaves(stored.tree(_Slot))[0]
    if not tensors:
        raise ExportError(
            f"The object {name!r} holds no tensors, and a safetensors file holds nothing else: export it with "
            "--format torch or --format dcp."
        )
    by_key: dict[str, int] = {}
    first_path: dict[str, Path] = {}
    for at, slot in tensors:
        key = path_text(at)
        if key in by_key:
            raise ExportError(
                f"In {name!r}, the paths {first_path[key]!r} and {at!r} both join to the safetensors key "
                f"{key!r}: export it with --format torch or --format dcp."
            )
        dtype = stored.spec(slot.tensor).dtype
        if dtype not in _SAFETENSORS_DTYPES:
            raise ExportError(
                f"safetensors cannot hold {key!r} of {name!r}: it has no {dtype} dtype. Export it with --format "
                "torch or --format dcp."
            )
        by_key[key], first_path[key] = slot.tensor, at
    # Larger elements first, then by key (as safetensors' own writer orders them): every tensor starts
    # at a multiple of its element size. Tensors of one object never share bytes: tied weights are
    # stored once per path in a checkpoint, so both names get their own copy.
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offsets: dict[int, int] = {}
    end = 0
    for key in sorted(by_key, key=lambda k: (-stored.spec(by_key[k]).itemsize, k)):
        spec = stored.spec(by_key[key])
        entry = {"dtype": _SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape), "data_offsets": [end, end + spec.nbytes]}
        header[key] = entry
        offsets[by_key[key]] = end
        end += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _SAFETENSORS_ALIGN)
    base = 8 + len(text)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        out.flush()
        out.truncate(base + end)
        with _Spans(stored) as spans:
            for tensor, at, view in spans:
                _pwrite_all(out.fileno(), view, base + offsets[tensor] + at)


class _Reserved:
    """A tensor of a stored object as ``torch.save`` pickles it (``_rebuild_tensor_v2`` over a storage
    with the tensor's dtype, size and contiguous strides), its storage on the meta device: under
    ``torch.serialization.skip_data`` torch.save reserves the storage's record without reading it.

    The storage's ``_fake_device`` (a field of ``TypedStorage`` torch.save reads for fake tensors'
    storages) makes torch.save record it as a CPU storage, as it records a fake CPU tensor's: the
    file then loads as CPU tensors. (FakeTensorMode would do the same through public names, at 0.7 s
    and ~28 MB of imports -- torch._dynamo -- per export.)
    """

    def __init__(self, spec: TensorSpec) -> None:
        self._meta = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        untyped = torch.UntypedStorage(spec.nbytes, device="meta")
        self._storage = torch.TypedStorage(wrap_storage=untyped, dtype=spec.dtype, _internal=True)
        self._storage._fake_device = torch.device("cpu")

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # What Tensor._reduce_ex_internal returns for a contiguous CPU tensor without grad or hooks.
        args = (self._storage, 0, tuple(self._meta.shape), self._meta.stride(), False, collections.OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


def _save_torch(stored: StoredObject, path: str) -> None:
    """``torch.save`` of the state dict with its data skipped (torch writes the pickle and the archive,
    each storage's record reserved), then the bytes into the records and each record's CRC-32 into the
    archive's directory."""
    with torch.serialization.skip_data():
        torch.save(stored.tree(lambda t: _Reserved(stored.spec(t))), path)
    records = _storage_records(path)
    # torch.save numbers storages in the order its pickler first meets them: the tree's tensors depth
    # first, one storage each -- the order of stored.tensors.
    keys = {t: str(k) for k, t in enumerate(stored.tensors)}
    sizes = {t: records[keys[t]].size if keys[t] in records else None for t in stored.tensors}
    if len(records) != len(keys) or any(sizes[t] != stored.spec(t).nbytes for t in stored.tensors):
        raise ExportError(f"torch.save laid out {path} in a way this export does not know (storage records {sorted(records)}).")
    crcs = {t: [0, 0] for t in stored.tensors}  # running CRC-32, and the bytes it covers from the start
    with open(path, "r+b") as out:
        fd = out.fileno()
        with _Spans(stored) as spans:
            for tensor, at, view in spans:
                _pwrite_all(fd, view, records[keys[tensor]].offset + at)
                crc = crcs[tensor]
                if crc[1] == at:
                    crc[0], crc[1] = zlib.crc32(view, crc[0]), at + len(view)
        for t in stored.tensors:
            record = records[keys[t]]
            crc, covered = crcs[t]
            if covered != record.size:  # its pieces came out of order: the CRC from the record as written
                crc = 0
                for lo in range(0, record.size, _CHUNK):
                    crc = zlib.crc32(os.pread(fd, min(_CHUNK, record.size - lo), record.offset + lo), crc)
            for at in record.crc_at:
                _pwrite_all(fd, memoryview(struct.pack("<I", crc)), at)


@dataclass(frozen=True)
class _ZipRecord:
    offset: int  # of its data in the archive
    size: int
    crc_at: tuple[int, ...]  # where its CRC-32 is written: its data descriptor, its central directory entry


def _storage_records(path: str) -> dict[str, _ZipRecord]:
    """``{storage key: record}`` of a ``torch.save`` archive's ``<archive>/data/<key>`` records
    (stored uncompressed), from the zip format (PKWARE APPNOTE 4.3)."""
    out = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
        infos = archive.infolist()
        central = _central_directory_offset(raw)
        for info in infos:
            raw.seek(central)
            entry = raw.read(46)
            if entry[:4] != b"PK\x01\x02":
                raise ExportError(f"torch.save wrote {path} without a zip central directory entry at {central}.")
            name_len, extra_len, comment_len = struct.unpack("<HHH", entry[28:34])
            entry_crc = central + 16
            central += 46 + name_len + extra_len + comment_len
            parts = info.filename.split("/")
            if len(parts) != 3 or parts[1] != "data":
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise ExportError(f"torch.save compressed the record {info.filename} of {path}; the export fills stored ones.")
            raw.seek(info.header_offset)
            local = raw.read(30)
            offset = info.header_offset + 30 + sum(struct.unpack("<HH", local[26:30]))
            crc_at = [entry_crc]
            if info.flag_bits & 0x08:  # a data descriptor follows the data: [signature] CRC-32, sizes
                raw.seek(offset + info.file_size)
                crc_at.append(offset + info.file_size + (4 if raw.read(4) == b"PK\x07\x08" else 0))
            out[parts[2]] = _ZipRecord(offset, info.file_size, tuple(crc_at))
    return out


def _central_directory_offset(raw: Any) -> int:
    """Where a zip file's central directory starts (its end record, or the ZIP64 one it points to)."""
    raw.seek(0, os.SEEK_END)
    size = raw.tell()
    tail_start = max(0, size - (22 + 0xFFFF))
    raw.seek(tail_start)
    tail = raw.read()
    end = tail.rfind(b"PK\x05\x06")
    if end < 0:
        raise ExportError("torch.save wrote no zip end of central directory record.")
    offset = struct.unpack("<I", tail[end + 16 : end + 20])[0]
    if offset == 0xFFFFFFFF:  # ZIP64: the locator just before the end record names the ZIP64 end record
        locator = tail[end - 20 : end]
        if locator[:4] != b"PK\x06\x07":
            raise ExportError("torch.save wrote no ZIP64 end of central directory locator.")
        raw.seek(struct.unpack("<Q", locator[8:16])[0])
        record = raw.read(56)
        offset = struct.unpack("<Q", record[48:56])[0]
    return offset


def _save_dcp(name: str, stored: StoredObject, path: str) -> None:
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
    with _Spans(stored) as spans:
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
        complete them, a group of at most :data:`_DCP_GROUP_BYTES` (or one larger tensor) per
        ``.distcp`` file: DCP keeps every tensor of a file until the file is written, so it holds one
        group at a time."""

        def __init__(self, path: str) -> None:
            # One thread and no copy-ahead: the items are asked for one at a time, in the plan's order.
            # No fsync, like the torch and safetensors exports: the output is renamed into place whole.
            super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=1, per_thread_copy_ahead=0)

        def write_data(self, plan: Any, planner: Any) -> Any:
            groups: list[list[Any]] = []
            size = _DCP_GROUP_BYTES
            for item in sorted(plan.items, key=planner.rank_of):
                nbytes = planner.nbytes_of(item)
                if not groups or size + nbytes > _DCP_GROUP_BYTES:
                    groups.append([])
                    size = 0
                groups[-1].append(item)
                size += nbytes
            results = []
            for k, group in enumerate(groups):
                # Each call writes one file, named from the plan's prefix: a prefix of its own per group.
                prefix = dataclasses.replace(plan.storage_data, prefix=f"{plan.storage_data.prefix}{k}_")
                results += super().write_data(dataclasses.replace(plan, items=group, storage_data=prefix), planner).wait()
            done: torch.futures.Future[list[Any]] = torch.futures.Future()
            done.set_result(results)
            return done

    return StreamingPlanner, GroupedWriter
