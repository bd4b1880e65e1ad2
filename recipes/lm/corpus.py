"""The byte-level text corpus of the language-model recipe: which files, in which order, how many
bytes, and the next-byte samples cut from it.

Every rank loads the corpus itself, so the bytes (and therefore every sample index) must be a pure
function of the configuration: files are always taken in sorted order of their path relative to the
root, and the corpus stops at ``data.max_bytes``. :func:`corpus_fingerprint` lets a checkpoint notice
when a resumed job reads different bytes than the one that wrote it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import sysconfig
from collections.abc import Iterable
from typing import Annotated, Any

import torch
from pydantic import Field
from torch.utils.data import Dataset

from elastic_ddp.config import IDENTITY, DataConfig

# Directories of the standard library that are left out of the default corpus: installed packages
# differ between machines, and distributions ship or strip the test suites at will.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "lib-dynload"}
)
# Generated at build time with the build machine's paths and flags: differs for the same version.
_STDLIB_SKIP_PREFIXES = ("_sysconfigdata",)
# Never part of any corpus: byte-compiled caches and VCS internals are not text the user wrote.
_ALWAYS_SKIP_DIRS = frozenset({"__pycache__", ".git"})


class CorpusConfig(DataConfig):
    """The ``data`` section of the language-model recipe: the loader settings plus the corpus.

    The corpus fields are part of the run's identity: sample ``i`` means the same bytes only if they
    are the same."""

    path: Annotated[str, IDENTITY] = Field(
        default="",
        description=(
            "Text files to train on: a file, a directory (read recursively) or an fsspec URL "
            "(s3://bucket/prefix). Empty: the Python standard library's own source files."
        ),
    )
    glob: Annotated[str, IDENTITY] = Field(default="**/*.py", description="Which files of a directory data.path to read.")
    max_bytes: Annotated[int, IDENTITY] = Field(
        default=8_000_000, gt=0, description="Read at most this many bytes of text (files in sorted order)."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options for a remote data.path."
    )


class ByteWindows(Dataset):
    """Next-byte prediction samples cut from a 1-D ``uint8`` corpus.

    Sample ``i`` is the window ``corpus[i*block_size : i*block_size + block_size + 1]``: ``x`` is its
    first ``block_size`` bytes, ``y`` the same shifted by one (both ``int64``). Windows do not overlap,
    so an epoch reads every byte once; ``len`` is the number of full windows.
    """

    def __init__(self, corpus: torch.Tensor, block_size: int) -> None:
        if corpus.dim() != 1 or corpus.dtype != torch.uint8:
            raise ValueError(
                f"The corpus must be a 1-D uint8 tensor, not {corpus.dtype} of shape {tuple(corpus.shape)}."
            )
        if block_size <= 0:
            raise ValueError(f"block_size ({block_size}) must be positive.")
        if corpus.numel() < block_size + 1:
            raise ValueError(
                f"The corpus ({corpus.numel()} bytes) is shorter than one sample "
                f"(block_size + 1 = {block_size + 1} bytes)."
            )
        self.corpus = corpus
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.corpus.numel() - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"Sample index {index} is outside 0..{len(self) - 1}.")
        start = index * self.block_size
        window = self.corpus[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


def glob_match(relative_path: str, pattern: str) -> bool:
    """Whether a '/'-separated relative path matches a glob where ``**`` spans zero or more folders.

    ``**/*.py`` matches ``a.py`` and ``x/y/a.py``; ``*`` never crosses a ``/``. The same rule is used
    for local folders and fsspec URLs, so a corpus does not change when it moves to object storage.
    """
    return _match_parts(relative_path.split("/"), pattern.split("/"))


def _match_parts(parts: list[str], pattern: list[str]) -> bool:
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match_parts(parts[skip:], rest) for skip in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], head) and _match_parts(parts[1:], rest)


def stdlib_root() -> str:
    """Folder of the running interpreter's standard library (the default corpus)."""
    return sysconfig.get_paths()["stdlib"]


def load_corpus(cfg: CorpusConfig) -> torch.Tensor:
    """The training bytes named by ``cfg`` as a 1-D ``uint8`` tensor of at most ``cfg.max_bytes``.

    ``cfg.path``:
      * empty: the standard library's source files matching ``cfg.glob`` (without installed packages,
        test suites and build-generated files). The same bytes on every machine with the same Python
        version; compare :func:`corpus_fingerprint` to be sure;
      * a local file: its bytes; a local folder: its files matching ``cfg.glob``, recursively;
      * an fsspec URL (``s3://bucket/prefix``, ``memory://...``): a file or a prefix, read with
        ``cfg.storage_options``.
    Files are concatenated in sorted order of their path relative to the root; the last one read may
    be cut at ``cfg.max_bytes``. Raises ``FileNotFoundError`` naming the path when it does not exist
    or holds no matching, non-empty file.
    """
    if not cfg.path:
        root = stdlib_root()
        files = _local_files(root, cfg.glob, _STDLIB_SKIP_DIRS, _STDLIB_SKIP_PREFIXES)
        data = _concat(files, open, cfg.max_bytes)
        where = f"the standard library at {root!r}"
    elif "://" in cfg.path:
        data = _load_url(cfg)
        where = f"data.path {cfg.path!r}"
    else:
        if os.path.isfile(cfg.path):
            files = [cfg.path]
        elif os.path.isdir(cfg.path):
            files = _local_files(cfg.path, cfg.glob, _ALWAYS_SKIP_DIRS, ())
        else:
            raise FileNotFoundError(f"data.path {cfg.path!r} does not exist (neither a file nor a folder).")
        data = _concat(files, open, cfg.max_bytes)
        where = f"data.path {cfg.path!r}"
    if not data:
        raise FileNotFoundError(
            f"No text found in {where}: no non-empty file matches data.glob {cfg.glob!r}."
        )
    # frombuffer shares memory with the bytearray; the tensor keeps it alive.
    return torch.frombuffer(data, dtype=torch.uint8)


def corpus_fingerprint(corpus: torch.Tensor) -> str:
    """First 16 hex digits of the SHA-256 of the corpus bytes: store it with a checkpoint and compare
    on resume, since sample ``i`` only means the same window if the bytes are the same."""
    array = corpus.contiguous().cpu().numpy()
    return hashlib.sha256(memoryview(array)).hexdigest()[:16]


def _local_files(
    root: str, pattern: str, skip_dirs: frozenset[str], skip_prefixes: tuple[str, ...]
) -> list[str]:
    found = []
    for folder, dirs, names in os.walk(root):
        # Pruning here keeps os.walk out of site-packages, which can hold far more than the stdlib.
        dirs[:] = [d for d in dirs if d not in skip_dirs]
        rel_folder = os.path.relpath(folder, root).replace(os.sep, "/")
        for name in names:
            if name.startswith(skip_prefixes):
                continue
            rel = name if rel_folder == "." else f"{rel_folder}/{name}"
            if glob_match(rel, pattern):
                found.append(rel)
    return [os.path.join(root, rel) for rel in sorted(found)]


def _load_url(cfg: CorpusConfig) -> bytearray:
    import fsspec  # imported here: only remote corpora need it

    try:
        fs, root = fsspec.core.url_to_fs(cfg.path, **cfg.storage_options)
        if fs.isfile(root):
            files = [root]
        elif fs.isdir(root):
            root = root.rstrip("/")
            rels = (path[len(root) :].lstrip("/") for path in fs.find(root))
            files = [f"{root}/{rel}" for rel in sorted(rels) if rel and glob_match(rel, cfg.glob)]
        else:
            files = None
        data = _concat(files or [], fs.open, cfg.max_bytes)
    except Exception as exc:  # each fsspec backend raises its own types; name the path for the user
        raise OSError(f"Reading data.path {cfg.path!r} failed: {exc}") from exc
    if files is None:
        raise FileNotFoundError(f"data.path {cfg.path!r} does not exist (neither a file nor a prefix).")
    return data


def _concat(files: Iterable[str], opener, max_bytes: int) -> bytearray:
    data = bytearray()
    for path in files:
        if len(data) >= max_bytes:
            break
        with opener(path, "rb") as handle:
            data += handle.read(max_bytes - len(data))
    return data
