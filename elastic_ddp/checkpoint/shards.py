"""Writing and reading one data file, hashing its bytes on the way (no second pass over them).

A file is written from a sequence of byte buffers (staged host memory, or views of CPU tensors)
and read back into one host buffer. In both directions the checksum (BLAKE3; SHA-256 for format 3)
runs in a thread of its own over the chunks just written or read, so hashing overlaps the I/O
instead of following it (both hashes and file I/O release the GIL). Chunks are at most
:data:`CHUNK` bytes: large enough that per-call overhead vanishes, and one ranged request each
on object stores.
"""

from __future__ import annotations

import contextlib
import hmac
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, BinaryIO

from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.errors import CheckpointVerificationError
from elastic_ddp.faults import at_point
from elastic_ddp.checkpoint.storage import Storage, StorageError, basename

CHUNK = 16 << 20


class _Hasher:
    """The checksum of the buffers given to :meth:`update`, computed in order by a thread of its own.

    The buffers must not change until :meth:`hexdigest` returns (they are staged or read buffers
    that live longer than that).
    """

    def __init__(self, algorithm: str = mf.CHECKSUM_ALGORITHM) -> None:
        self._hash = mf.new_hasher(algorithm)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ckpt-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (view := self._queue.get()) is not None:
            self._hash.update(view)

    def update(self, view: memoryview) -> None:
        self._queue.put(view)

    def hexdigest(self) -> str:
        self.close()
        return self._hash.hexdigest()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def _write_all(stream: Any, view: memoryview) -> None:
    while view:
        written = stream.write(view)
        if written is None:  # a buffered or remote writer takes everything
            return
        view = view[written:]


def write_file(
    storage: Storage, url: str, buffers: Iterable[Any], *, sync: bool, fault_rank: int | None = None
) -> tuple[int, str]:
    """Write ``buffers`` (objects exposing the buffer protocol) back to back as ``url``.

    Returns ``(size, digest)`` of what was written, in :data:`manifest.CHECKSUM_ALGORITHM`.
    ``sync``: fsync before returning (local disk).
    ``fault_rank``: this rank's number for the ``mid_write`` test fault point.
    """
    hasher = _Hasher()
    size = 0
    try:
        with storage.open_write(url, sync=sync) as stream:
            for buffer in buffers:
                view = memoryview(buffer).cast("B")
                for i in range(0, len(view), CHUNK):
                    part = view[i : i + CHUNK]
                    hasher.update(part)
                    _write_all(stream, part)
                    size += len(part)
                    if fault_rank is not None:
                        at_point("mid_write", fault_rank)
        return size, hasher.hexdigest()
    finally:
        hasher.close()


def file_record(expected: Mapping[str, mf.FileRecord], name: str) -> mf.FileRecord:
    """The manifest's record of the file ``name``; :class:`CheckpointVerificationError` if it lists none."""
    record = expected.get(name)
    if record is None:
        raise CheckpointVerificationError(f"The manifest does not list {name!r}.", name, "the manifest does not list it")
    return record


@contextlib.contextmanager
def open_checked(storage: Storage, url: str, name: str) -> Iterator[BinaryIO]:
    """``url`` open for a sequential read; the file missing, or failing to open or to read within the
    block, raises :class:`CheckpointVerificationError` naming ``name``."""
    try:
        with storage.open_read(url, sequential=True) as stream:
            yield stream
    except FileNotFoundError:
        raise CheckpointVerificationError(f"The file {url!r} is missing.", name, "the file is missing") from None
    except StorageError as exc:
        raise CheckpointVerificationError(str(exc), name, f"reading failed: {exc}") from exc


def check_read(name: str, url: str, record: mf.FileRecord, pos: int, extra: int, digest: str) -> None:
    """Raise :class:`CheckpointVerificationError` unless the file ``name``, read as ``pos`` bytes
    (``extra``: more followed) hashing to ``digest``, is what ``record`` says."""
    if pos != record.size or extra:
        reason = (
            f"{pos} bytes were read, the manifest says {record.size}" if pos != record.size
            else f"it is longer than the {record.size} bytes the manifest says"
        )  # fmt: skip
    elif not hmac.compare_digest(digest, record.digest):
        reason = f"its {record.algorithm.upper()} checksum does not match the manifest"
    else:
        return
    raise CheckpointVerificationError(f"The file {name!r} at {url!r} does not match its manifest: {reason}.", name, reason)


def read_file(storage: Storage, url: str, into: memoryview, *, expected: mf.FileRecord) -> int:
    """Read ``url`` into ``into`` (exactly its expected size), checking its checksum as it streams.

    Returns the number of bytes read. Raises :class:`CheckpointVerificationError` if the file is
    missing or unreadable, shorter or longer than ``into``, or its checksum is not ``expected``'s.
    """
    name = basename(url)
    size = len(into)
    hasher = _Hasher(expected.algorithm)
    pos = 0
    try:
        with open_checked(storage, url, name) as stream:
            while pos < size:
                n = stream.readinto(into[pos : min(pos + CHUNK, size)])
                if not n:
                    break
                hasher.update(into[pos : pos + n])
                pos += n
            extra = len(stream.read(1)) if pos == size else 0
        digest = hasher.hexdigest()
    finally:
        hasher.close()
    check_read(name, url, expected, pos, extra, digest)
    return pos + extra
