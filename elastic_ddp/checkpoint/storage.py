"""The storage seam: every byte the checkpoint code reads or writes goes through :class:`Storage`.

URLs are plain ``str`` everywhere (a ``pathlib.Path`` would collapse ``s3://b/k`` into ``s3:/b/k``).
A URL is a local path, ``file://...``, ``s3://bucket/prefix``, ``memory://...`` or anything else
fsspec knows. S3 credentials and endpoint come the standard AWS way (environment, profile,
``AWS_ENDPOINT_URL``) unless ``storage_options`` says otherwise.

Client exceptions (OSError, botocore errors, ...) never leave this module bare: they are wrapped
in :class:`StorageError`, whose message names the operation and the URL.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec.core import url_to_fs


class StorageError(OSError):
    """A storage operation failed. The message names the operation and the URL; the cause is chained."""


def normalize_url(url: str) -> str:
    """Return ``url`` with no trailing slash; a bare local path becomes an absolute path."""
    if not isinstance(url, str):
        raise TypeError(f"A checkpoint URL must be a str, not {type(url).__name__} ({url!r}).")
    if not url:
        raise ValueError("A checkpoint URL must not be empty.")
    if "://" not in url:
        url = os.path.abspath(os.path.expanduser(url))
    elif url.startswith("file://"):
        url = "file://" + os.path.abspath(url[len("file://") :])
    return url.rstrip("/") if url.rstrip("/") else url


def join(url: str, *parts: str) -> str:
    """Join URL parts with '/' (never ``os.path.join``: a URL is not a local path)."""
    out = url.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def basename(url: str) -> str:
    """The last component of ``url``."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def _wrap(op: str, url: str):
    """Context manager turning any client exception into a StorageError naming op and URL."""

    @contextlib.contextmanager
    def ctx() -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except FileNotFoundError:
            raise
        except Exception as exc:  # client libraries raise many unrelated types (botocore, aiohttp, OSError)
            raise StorageError(f"Storage operation {op} on {url!r} failed: {exc}") from exc

    return ctx()


class Storage:
    """One fsspec filesystem rooted at a URL, with the few operations checkpoints need.

    ``storage_options`` go to fsspec (e.g. ``endpoint_url``, ``profile``, ``key``/``secret``).
    Missing files raise ``FileNotFoundError``; every other failure raises :class:`StorageError`.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = normalize_url(url)
        self.storage_options = dict(storage_options or {})
        with _wrap("connect", self.url):
            self.fs, _ = url_to_fs(self.url, **self.storage_options)
        self.is_local = "file" in _protocols(self.fs)
        # Bytes every read through this object returned (the resume benchmarks' "bytes read").
        self.bytes_read = 0
        self._count_lock = threading.Lock()

    def _count(self, n: int) -> None:
        with self._count_lock:
            self.bytes_read += n

    def _path(self, url: str) -> str:
        # fsspec wants paths without protocol for its own methods; strip_protocol is per-filesystem.
        return self.fs._strip_protocol(url)

    def exists(self, url: str) -> bool:
        with _wrap("exists", url):
            return bool(self.fs.exists(self._path(url)))

    def list_dirs(self, url: str) -> list[str]:
        """Names (not URLs) of the sub-directories of ``url``; empty if ``url`` does not exist."""
        with _wrap("list", url):
            path = self._path(url)
            # Other processes (other ranks) write here; a cached listing would hide their files.
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=True)
            except FileNotFoundError:
                return []
        return sorted(basename(e["name"]) for e in entries if e.get("type") == "directory")

    def list_files(self, url: str) -> dict[str, int]:
        """``{name: size}`` of the plain files directly under ``url`` (empty if it does not exist)."""
        with _wrap("list", url):
            path = self._path(url)
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=True)
            except FileNotFoundError:
                return {}
        return {basename(e["name"]): int(e.get("size") or 0) for e in entries if e.get("type") == "file"}

    def size(self, url: str) -> int:
        with _wrap("size", url):
            path = self._path(url)
            self.fs.invalidate_cache(path)
            return int(self.fs.size(path))

    def read_bytes(self, url: str) -> bytes:
        with _wrap("read", url):
            data = self.fs.cat_file(self._path(url))
        self._count(len(data))
        return data

    @contextlib.contextmanager
    def open_read(self, url: str, *, sequential: bool = False) -> Iterator[IO[bytes]]:
        """A binary stream of ``url`` (``read``/``readinto``).

        ``sequential``: the caller reads the file front to back in large chunks; a local file is
        then opened unbuffered (``readinto`` lands straight in the caller's buffer) and a remote one
        without fsspec's read-ahead cache (each read is one ranged request of the size asked for).
        """
        with _wrap("read", url):
            if sequential and self.is_local:
                stream: Any = open(self._path(url), "rb", buffering=0)  # noqa: SIM115 - closed below
            elif sequential:
                stream = self.fs.open(self._path(url), "rb", cache_type="none")
            else:
                stream = self.fs.open(self._path(url), "rb")
            with stream:
                yield _CountingReader(stream, self._count)

    @contextlib.contextmanager
    def open_write(self, url: str, *, sync: bool) -> Iterator[IO[bytes]]:
        """A binary stream that creates ``url``; parent directories are created as needed.

        Local disk: an unbuffered file (large writes go straight to the kernel), fsync'd before it
        is closed when ``sync``. Elsewhere: fsspec's writer (on S3 a multipart upload, complete
        and visible when the stream closes).
        """
        with _wrap("write", url):
            path = self._path(url)
            if self.is_local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb", buffering=0) as stream:
                    yield stream
                    if sync:
                        os.fsync(stream.fileno())
            else:
                with self.fs.open(path, "wb") as stream:
                    yield stream

    def sync_dir(self, url: str) -> None:
        """Make the entries of the local directory ``url`` durable (no-op elsewhere)."""
        if self.is_local:
            _fsync_dir(self._path(url))

    def write_bytes_atomic(self, url: str, data: bytes) -> None:
        """Write ``data`` so that readers see either nothing or all of it.

        Local disk: a temp file in the same directory, fsync, rename, fsync of the directory.
        Object stores: a single PUT, which S3 makes visible atomically. Other filesystems: a temp
        name, then a move.
        """
        with _wrap("write", url):
            if self.is_local:
                path = self._path(url)
                tmp = f"{path}.tmp-{uuid.uuid4().hex}"
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, path)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
                _fsync_dir(os.path.dirname(path))
            elif _protocols(self.fs) & {"s3", "s3a", "gs", "gcs", "abfs", "az"}:
                self.fs.pipe_file(self._path(url), data)
            else:
                tmp = f"{url}.tmp-{uuid.uuid4().hex}"
                self.fs.pipe_file(self._path(tmp), data)
                self.fs.mv(self._path(tmp), self._path(url))

    def remove_file(self, url: str) -> None:
        with _wrap("remove", url):
            try:
                self.fs.rm_file(self._path(url))
            except FileNotFoundError:
                pass

    def remove_tree(self, url: str) -> None:
        """Delete ``url`` and everything under it; a missing ``url`` is not an error."""
        with _wrap("remove", url):
            path = self._path(url)
            try:
                self.fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
            self.fs.invalidate_cache(path)

    def makedirs(self, url: str) -> None:
        with _wrap("makedirs", url):
            self.fs.makedirs(self._path(url), exist_ok=True)


class _CountingReader:
    """A read stream that reports how many bytes each ``read``/``readinto`` returned."""

    def __init__(self, stream: Any, count: Any) -> None:
        self._stream = stream
        self._count = count

    def read(self, *args: Any) -> bytes:
        data = self._stream.read(*args)
        self._count(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        n = self._stream.readinto(buffer) or 0
        self._count(n)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _protocols(fs: fsspec.AbstractFileSystem) -> set[str]:
    proto = fs.protocol
    return set(proto) if isinstance(proto, (tuple, list)) else {proto}


def _fsync_dir(path: str) -> None:
    # A rename is durable only once its directory entry is; not every OS lets us open a directory.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
