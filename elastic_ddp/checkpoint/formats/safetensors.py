"""A stored object as one ``.safetensors`` file: its tensors, keyed by their paths joined with ``.``.

A model's keys are its ``state_dict()`` keys. Plain values cannot go in: :func:`write` returns their
paths. The header (every dtype, shape and offset is known from the index) is written first, then
the bytes go straight from the read buffers to their offsets: the writer holds no tensor at all.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from elastic_ddp.checkpoint.errors import ExportError
from elastic_ddp.checkpoint.formats import pwrite_all
from elastic_ddp.checkpoint.objects import Spans, StoredObject
from elastic_ddp.checkpoint.tree import Path, path_text

# safetensors' names of the dtypes it holds (its spec; safetensors.torch reads them back to these).
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.complex64: "C64",
}  # fmt: skip
# A safetensors header is padded with spaces to a multiple of this (its spec), so that the data that
# follows, sorted by alignment, keeps every tensor aligned to its element size.
_ALIGN = 8


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


def write(name: str, stored: StoredObject, path: str, metadata: Mapping[str, str]) -> tuple[str, ...]:
    """Write the object ``name`` to ``path`` with ``metadata`` in its header; the paths of the plain
    values it could not hold. Raises :class:`ExportError` when the object holds no tensors, two of
    its paths join to the same key, or it holds a dtype safetensors lacks."""
    tensors, plain = _leaves(stored.tree(_Slot))
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
        if dtype not in _DTYPES:
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
        header[key] = {
            "dtype": _DTYPES[spec.dtype], "shape": list(spec.shape), "data_offsets": [end, end + spec.nbytes]
        }
        offsets[by_key[key]] = end
        end += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _ALIGN)
    base = 8 + len(text)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        out.flush()
        out.truncate(base + end)
        with Spans(stored) as spans:
            for tensor, at, view in spans:
                pwrite_all(out.fileno(), view, base + offsets[tensor] + at)
    return tuple(path_text(p) for p in plain)
