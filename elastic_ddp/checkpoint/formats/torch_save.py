"""A stored object as one ``torch.save`` file of its state dict as saved.

The file loads with ``torch.load(path, weights_only=True)`` (``mmap=True`` too). torch writes the
archive itself, each storage's record reserved but left empty (``torch.serialization.skip_data``);
then the bytes go straight from the read buffers into their records and each record's CRC-32 into
the archive: record for record what ``torch.save`` of the same tensors writes, and the writer holds
no tensor at all.
"""

from __future__ import annotations

import collections
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from elastic_ddp.checkpoint.errors import ExportError
from elastic_ddp.checkpoint.formats import pwrite_all
from elastic_ddp.checkpoint.objects import CHUNK, Spans, StoredObject
from elastic_ddp.checkpoint.tree import TensorSpec


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


def write(stored: StoredObject, path: str) -> None:
    """Write ``stored`` to ``path``: ``torch.save`` of the state dict with its data skipped (torch writes
    the pickle and the archive, each storage's record reserved), then the bytes into the records and
    each record's CRC-32 into the archive's directory. Raises :class:`ExportError` when torch laid the
    archive out in a way this writer does not know."""
    with torch.serialization.skip_data():
        torch.save(stored.tree(lambda t: _Reserved(stored.spec(t))), path)
    records = _storage_records(path)
    # torch.save numbers storages in the order its pickler first meets them: the tree's tensors depth
    # first, one storage each -- the order of stored.tensors.
    keys = {t: str(k) for k, t in enumerate(stored.tensors)}
    sizes = {t: records[keys[t]].size if keys[t] in records else None for t in stored.tensors}
    if len(records) != len(keys) or any(sizes[t] != stored.spec(t).nbytes for t in stored.tensors):
        raise ExportError(
            f"torch.save laid out {path} in a way this export does not know (storage records {sorted(records)})."
        )
    crcs = {t: [0, 0] for t in stored.tensors}  # running CRC-32, and the bytes it covers from the start
    with open(path, "r+b") as out:
        fd = out.fileno()
        with Spans(stored) as spans:
            for tensor, at, view in spans:
                pwrite_all(fd, view, records[keys[tensor]].offset + at)
                crc = crcs[tensor]
                if crc[1] == at:
                    crc[0], crc[1] = zlib.crc32(view, crc[0]), at + len(view)
        for t in stored.tensors:
            record = records[keys[t]]
            crc, covered = crcs[t]
            if covered != record.size:  # its pieces came out of order: the CRC from the record as written
                crc = 0
                for lo in range(0, record.size, CHUNK):
                    crc = zlib.crc32(os.pread(fd, min(CHUNK, record.size - lo), record.offset + lo), crc)
            for at in record.crc_at:
                pwrite_all(fd, memoryview(struct.pack("<I", crc)), at)


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
                raise ExportError(
                    f"torch.save compressed the record {info.filename} of {path}; the export fills stored ones."
                )
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
