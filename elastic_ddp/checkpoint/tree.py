"""State trees as JSON plus a list of tensors: the checkpoint format's only serialization.

A state dict is a tree of dicts, lists and tuples whose leaves are tensors or plain values (None,
bool, int, float, str). :func:`flatten` turns it into a JSON-able tree in which every tensor is
replaced by ``{"tensor": i}`` (``i`` indexing the returned tensor list, in traversal order) and
containers keep their kind (a tuple stays a tuple, a dict may have int keys). :func:`unflatten`
rebuilds the tree from that JSON, asking a callback for each tensor. Nothing is ever pickled, so
reading a checkpoint can never execute code.

Encoding: a scalar is itself; a list is a JSON array; every other node is a one-key object:
``{"tensor": i}``, ``{"tuple": [...]}``, ``{"dict": [[key, value], ...]}`` (keys are scalars or
tuples of scalars, encoded the same way).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

Path = tuple[Any, ...]

# Dtypes whose bytes a checkpoint stores verbatim (quantized and sub-byte types are not supported).
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.complex128, torch.complex64, torch.complex32,
        torch.int64, torch.int32, torch.int16, torch.int8,
        torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool,
        torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
    )
}  # fmt: skip


class TreeError(ValueError):
    """A state dict holds something a checkpoint cannot store, or stored JSON is malformed."""


@dataclass(frozen=True)
class TensorSpec:
    """What a stored tensor is: its dtype and shape (its bytes are C-contiguous, in this order)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tensor.dtype, tuple(tensor.shape))

    def to_json(self) -> dict[str, Any]:
        return {"dtype": dtype_name(self.dtype), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: Any, where: str) -> TensorSpec:
        if not isinstance(data, dict) or not isinstance(data.get("shape"), list):
            raise TreeError(f"{where}: a tensor entry must be an object with 'dtype' and 'shape'.")
        shape = data["shape"]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise TreeError(f"{where}: the shape {shape!r} must be a list of non-negative integers.")
        return cls(dtype_from_name(data.get("dtype"), where), tuple(shape))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any, where: str) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise TreeError(f"{where}: {name!r} is not a dtype a checkpoint can hold ({', '.join(sorted(_DTYPES))}).")
    return _DTYPES[name]


def path_text(path: Path) -> str:
    """``("optim", "state", "w", "exp_avg")`` -> ``optim.state.w.exp_avg`` (for messages)."""
    return ".".join(str(p) for p in path) or "<root>"


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _encode_key(key: Any, path: Path) -> Any:
    if _scalar(key):
        return key
    if isinstance(key, tuple):
        return {"tuple": [_encode_key(k, path) for k in key]}
    raise TreeError(
        f"The key {key!r} ({type(key).__name__}) at {path_text(path)!r} cannot be checkpointed: dict keys must be "
        "None, bool, int, float, str or tuples of these."
    )


def flatten(tree: Any, path: Path = ()) -> tuple[Any, list[torch.Tensor], list[Path]]:
    """``(encoded, tensors, paths)``: ``tree`` as JSON with tensors replaced by their index.

    ``paths[i]`` is where ``tensors[i]`` sits. Raises :class:`TreeError` naming the path of a value
    that is neither a container, a tensor nor a plain value.
    """
    tensors: list[torch.Tensor] = []
    paths: list[Path] = []
    return _flatten_into(tree, path, tensors, paths), tensors, paths


def _flatten_into(tree: Any, path: Path, tensors: list[torch.Tensor], paths: list[Path]) -> Any:
    """:func:`flatten`, appending to ``tensors`` and ``paths``: references number on from what they hold."""

    def walk(node: Any, where: Path) -> Any:
        if isinstance(node, torch.Tensor):
            if node.layout != torch.strided or node.is_quantized or dtype_name(node.dtype) not in _DTYPES:
                raise TreeError(
                    f"The tensor at {path_text(where)!r} ({node.dtype}, {node.layout}) cannot be checkpointed: only "
                    "dense tensors of plain numeric or bool dtypes can."
                )
            tensors.append(node)
            paths.append(where)
            return {"tensor": len(tensors) - 1}
        if _scalar(node):
            return node
        if isinstance(node, Mapping):
            return {"dict": [[_encode_key(k, where), walk(v, (*where, k))] for k, v in node.items()]}
        if isinstance(node, list):
            return [walk(v, (*where, i)) for i, v in enumerate(node)]
        if isinstance(node, tuple):
            return {"tuple": [walk(v, (*where, i)) for i, v in enumerate(node)]}
        raise TreeError(
            f"The value at {path_text(where)!r} is a {type(node).__module__}.{type(node).__qualname__}; a checkpoint "
            "holds tensors and plain values (None, bool, int, float, str, and lists, tuples and dicts of these)."
        )

    return walk(tree, path)


def flatten_named(trees: Mapping[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor], list[Path]]:
    """:func:`flatten` of each named tree, tensor references numbered across all of them.

    ``(encoded, tensors, paths)``: ``encoded[name]`` is that tree's encoding; its references index
    the shared ``tensors``, and ``paths[i]`` (starting with the name) is where ``tensors[i]`` sits.
    """
    encoded: dict[str, Any] = {}
    tensors: list[torch.Tensor] = []
    paths: list[Path] = []
    for name, tree in trees.items():
        encoded[name] = _flatten_into(tree, (name,), tensors, paths)
    return encoded, tensors, paths


def _decode_key(data: Any, where: str) -> Any:
    if _scalar(data):
        return data
    if isinstance(data, dict) and set(data) == {"tuple"} and isinstance(data["tuple"], list):
        return tuple(_decode_key(k, where) for k in data["tuple"])
    raise TreeError(f"{where}: {data!r} is not a valid dict key encoding.")


def unflatten(encoded: Any, tensor: Callable[[int, Path], Any], path: Path = (), where: str = "the state") -> Any:
    """Rebuild a tree from :func:`flatten`'s JSON; ``tensor(i, path)`` supplies each tensor leaf."""

    def walk(node: Any, at: Path) -> Any:
        if _scalar(node):
            return node
        if isinstance(node, list):
            return [walk(v, (*at, i)) for i, v in enumerate(node)]
        if isinstance(node, dict) and len(node) == 1:
            [(kind, value)] = node.items()
            if kind == "tensor" and isinstance(value, int) and not isinstance(value, bool):
                return tensor(value, at)
            if kind == "tuple" and isinstance(value, list):
                return tuple(walk(v, (*at, i)) for i, v in enumerate(value))
            if kind == "dict" and isinstance(value, list):
                out = {}
                for item in value:
                    if not isinstance(item, list) or len(item) != 2:
                        raise TreeError(f"{where}: a dict entry at {path_text(at)!r} is not a [key, value] pair.")
                    key = _decode_key(item[0], where)
                    out[key] = walk(item[1], (*at, key))
                return out
        raise TreeError(f"{where}: the node at {path_text(at)!r} is not a valid encoding ({str(node)[:80]}).")

    return walk(encoded, path)


def leaf(tree: Any, path: Path) -> Any:
    """The value at ``path`` in a plain (decoded) tree, or None where the path does not exist."""
    node = tree
    for key in path:
        if isinstance(node, Mapping):
            if key not in node:
                return None
            node = node[key]
        elif isinstance(node, (list, tuple)) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
        else:
            return None
    return node


def rebase(encoded: Any, offset: int) -> Any:
    """``encoded`` (from :func:`flatten`) with every tensor reference moved by ``offset``."""
    if offset == 0 or _scalar(encoded):
        return encoded
    if isinstance(encoded, list):
        return [rebase(v, offset) for v in encoded]
    [(kind, value)] = encoded.items()
    if kind == "tensor":
        return {"tensor": value + offset}
    if kind == "tuple":
        return {"tuple": [rebase(v, offset) for v in value]}
    return {"dict": [[key, rebase(v, offset)] for key, v in value]}
