"""Objects of a checkpoint written in formats other tools read: ``torch.save``, safetensors, DCP.

:func:`read_objects` reads the state dicts of some objects with one copy of their tensors in
memory, every byte checked against the manifest as it streams in; :func:`write` writes one of them
in a format of :data:`FORMATS`:

* ``torch``: one ``torch.save`` file of the state dict as saved (``torch.load(path, weights_only=True)``).
* ``safetensors``: one ``.safetensors`` file of the state dict's tensors, keyed by their paths joined
  with ``.`` (a model's keys are its ``state_dict()`` keys); plain values cannot go in and are
  listed in :attr:`Written.left_out`.
* ``dcp``: a ``torch.distributed.checkpoint`` directory (one process, no process group), which
  ``dcp_to_torch_save`` converts to a ``torch.save`` file. DCP names values by string paths: int
  dict keys come back as strings and empty dicts are dropped.

Each write goes to ``PATH.partial`` first and is renamed into place, so an interrupted export
leaves no partial output under the name asked for.
"""

from __future__ import annotations

import concurrent.futures
import hmac
import os
import shutil
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.errors import CheckpointVerificationError
from elastic_ddp.checkpoint.index import Index, IndexFile
from elastic_ddp.checkpoint.sharded import destinations, restore_tree, tensor_paths
from elastic_ddp.checkpoint.staging import as_buffer, byte_view
from elastic_ddp.checkpoint.storage import Storage, StorageError, join
from elastic_ddp.checkpoint.tree import Path, path_text

FORMATS = ("torch", "safetensors", "dcp")
# What one object's output is called inside a directory of several (a DCP export is a directory).
SUFFIXES = {"torch": ".pt", "safetensors": ".safetensors", "dcp": ""}
# Bytes read (and hashed) per call: large enough that per-call overhead vanishes, small enough that
# the bounce buffer for bytes no exported object needs stays negligible.
_CHUNK = 16 << 20


class ExportError(ValueError):
    """An object cannot be written in the format asked for; the message names the object and why."""


@dataclass(frozen=True)
class Written:
    """What :func:`write` wrote of one object: its tensors and their bytes, and the paths of the
    plain values the format could not hold (safetensors only)."""

    tensors: int
    bytes: int
    left_out: tuple[str, ...] = ()


def object_tensors(index: Index, name: str) -> int:
    """How many tensors the object ``name`` holds (``index`` from :meth:`Index.as_shared`)."""
    return len(tensor_paths(index, [name]))


def read_objects(
    storage: Storage,
    dir_url: str,
    index: Index,
    expected: Mapping[str, mf.FileRecord],
    names: Iterable[str],
    pool: concurrent.futures.Executor,
) -> dict[str, Any]:
    """The state dicts ``names`` with new CPU tensors, each tensor its own storage.

    ``index``: the checkpoint's index as one rank sees it (:meth:`Index.as_shared`); ``expected``:
    the manifest's records. Each file holding a piece of those objects is read once, straight into
    the tensors it fills (bytes of other objects pass through a small buffer), and hashed as it
    streams: the state is held once, never a file buffer beside it. Raises
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
    record = expected.get(file.name)
    if record is None:
        raise CheckpointVerificationError(f"The manifest does not list {file.name!r}.", file.name, "the manifest does not list it")
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
    try:
        with storage.open_read(url, sequential=True) as stream:
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
    except FileNotFoundError:
        raise CheckpointVerificationError(f"The file {url!r} is missing.", file.name, "the file is missing") from None
    except StorageError as exc:
        raise CheckpointVerificationError(str(exc), file.name, f"reading failed: {exc}") from exc
    if pos != record.size or extra:
        reason = (
            f"{pos} bytes were read, the manifest says {record.size}" if pos != record.size
            else f"it is longer than the {record.size} bytes the manifest says"
        )  # fmt: skip
    elif not hmac.compare_digest(hasher.hexdigest(), record.digest):
        reason = f"its {record.algorithm.upper()} checksum does not match the manifest"
    else:
        return
    raise CheckpointVerificationError(f"The file {file.name!r} at {url!r} does not match its manifest: {reason}.", file.name, reason)


def write(fmt: str, name: str, tree: Any, path: str, *, metadata: Mapping[str, str]) -> Written:
    """Write the object ``name``'s state dict ``tree`` (from :func:`read_objects`) to ``path`` in
    the format ``fmt``; ``metadata`` goes into the safetensors header (other formats ignore it).

    Raises :class:`ExportError` when the object cannot be written in that format (safetensors: it
    holds no tensors, two of its paths join to the same key, or a dtype safetensors lacks; dcp: its
    state dict is not a dict), ``OSError`` when writing fails.
    """
    if fmt not in FORMATS:
        raise ExportError(f"The export format {fmt!r} is not one of {', '.join(FORMATS)}.")
    tensors, plain = _leaves(tree)
    written = Written(len(tensors), sum(t.numel() * t.element_size() for _, t in tensors))
    partial = f"{path}.partial"
    try:
        if fmt == "torch":
            torch.save(tree, partial)
        elif fmt == "safetensors":
            written = Written(written.tensors, written.bytes, tuple(path_text(p) for p in plain))
            _save_safetensors(name, tensors, partial, metadata)
        else:
            _save_dcp(name, tree, partial)
        if fmt == "dcp" and os.path.isdir(path):
            os.rmdir(path)  # an empty directory (the caller refuses a non-empty one): replaced by the export
        os.replace(partial, path)
    finally:
        if os.path.isdir(partial):
            shutil.rmtree(partial)
        elif os.path.exists(partial):
            os.remove(partial)
    return written


def _leaves(tree: Any) -> tuple[list[tuple[Path, torch.Tensor]], list[Path]]:
    """``(tensors, plain)``: every tensor with its path, and the paths of the other leaves (plain
    values, and empty containers, which hold no value but would vanish from a tensors-only format)."""
    tensors: list[tuple[Path, torch.Tensor]] = []
    plain: list[Path] = []

    def walk(node: Any, at: Path) -> None:
        if isinstance(node, torch.Tensor):
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


def _save_safetensors(name: str, tensors: list[tuple[Path, torch.Tensor]], path: str, metadata: Mapping[str, str]) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    if not tensors:
        raise ExportError(
            f"The object {name!r} holds no tensors, and a safetensors file holds nothing else: export it with "
            "--format torch or --format dcp."
        )
    by_key: dict[str, torch.Tensor] = {}
    first_path: dict[str, Path] = {}
    for at, tensor in tensors:
        key = path_text(at)
        if key in by_key:
            raise ExportError(
                f"In {name!r}, the paths {first_path[key]!r} and {at!r} both join to the safetensors key "
                f"{key!r}: export it with --format torch or --format dcp."
            )
        by_key[key], first_path[key] = tensor, at
    # Tensors from read_objects never share storage (a model's tied weights are stored and read once per
    # path), so safetensors' refusal of shared storage cannot trigger and nothing is cloned here.
    try:
        save_file(by_key, path, metadata=dict(metadata))
    except KeyError as exc:  # safetensors' dtype table lacks this one (complex128, complex32)
        key = next((k for k, t in by_key.items() if t.dtype == exc.args[0]), "?")
        raise ExportError(
            f"safetensors cannot hold {key!r} of {name!r}: it has no {exc.args[0]} dtype. Export it with --format "
            "torch or --format dcp."
        ) from None
    except (SafetensorError, ValueError, TypeError) as exc:
        raise ExportError(f"safetensors cannot hold the object {name!r}: {exc}") from exc


def _save_dcp(name: str, tree: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    if not isinstance(tree, Mapping):
        raise ExportError(
            f"The state of {name!r} is a {type(tree).__name__}, but a DCP checkpoint holds a dict: export it with "
            "--format torch."
        )
    with warnings.catch_warnings():
        # no_dist=True is the point (one process, no process group); DCP warns about it regardless.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(dict(tree), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
