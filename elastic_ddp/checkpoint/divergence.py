"""Which parts of a state differ across ranks: decided at every save, so no checkpoint splices them.

Under DDP only the trainable parameters, and the optimizer state computed from them and the
all-reduced gradients, are the same on every rank by construction. Anything else may differ per
rank: BatchNorm running statistics (each rank updates its own in the forward; DDP re-broadcasts
rank 0's only at the start of the next forward), an EMA of a model with such buffers, a per-rank
counter or generator. A save that cut such a tensor into byte ranges written by different ranks
would store a splice of several ranks' values -- no rank's state -- and which bytes came from
which rank would depend on the file plan. :func:`classify` decides instead, collectively:

* an object whose structure or plain values differ across ranks (its encoded tree, or one of its
  tensors' dtype or shape) is stored whole by every rank: a *per-rank object*;
* in every other object, a tensor whose bytes differ across ranks is stored by every rank: a
  *per-rank tensor*. All other tensors are stored once in total, as each rank's share.

Objects may declare which of their tensors are the same by construction with a method
``synced(path) -> bool`` (:class:`elastic_ddp.state.ModelState` and
:class:`~elastic_ddp.state.OptimizerState` of the DDP model do); those are not hashed.

Cost per save: each rank reads the tensors it must compare once, on the device where they live (a
column sum over their int64 words, at memory speed; tensors under :data:`SMALL_BYTES` are copied
to the host in one batch and hashed there), then two all-reduces (``MAX``) of two int64 per object
and per compared tensor: O(number of tensors) on the network, whatever their size. One host sync
reads the result.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from elastic_ddp.checkpoint.tree import Path, TensorSpec, flatten_named, path_text

__all__ = ["AllMax", "Split", "classify", "describe", "tensor_checksums"]

# Tensors smaller than this are hashed on the host in one batch: a device column sum is a few
# kernel launches per tensor, which for thousands of small buffers costs more than their bytes.
SMALL_BYTES = 64 << 10
# Words per row of the column sum: a difference in one row is weighted by its column, so two ranks
# holding the same words in another order within a row still disagree.
ROW_WORDS = 2048

AllMax = Callable[[torch.Tensor], torch.Tensor]
"""Element-wise maximum of an int64 CPU vector over every rank (a collective); returns a CPU vector."""

_REF = re.compile(r'\{"tensor":\s*\d+\}')


@dataclass(frozen=True)
class Split:
    """A state cut into what every rank holds alike and what each rank holds for itself.

    ``shared``: the encoded trees of the objects that are alike in structure and plain values, their
    tensor references indexing ``tensors`` (whose paths are ``paths``); ``per_rank``: the indices of
    those tensors whose values differ across ranks. ``own``: the encoded trees of the per-rank
    objects, their references indexing ``own_tensors``.
    """

    shared: dict[str, Any]
    tensors: tuple[torch.Tensor, ...]
    paths: tuple[Path, ...]
    per_rank: frozenset[int]
    own: dict[str, Any]
    own_tensors: tuple[torch.Tensor, ...]

    @property
    def has_per_rank(self) -> bool:
        return bool(self.per_rank or self.own)

    def describe(self) -> str:
        """The per-rank parts in words, for messages."""
        return describe([path_text(self.paths[i]) for i in sorted(self.per_rank)], list(self.own))


def describe(tensors: list[str], objects: list[str], limit: int = 6) -> str:
    """Per-rank parts in words: ``"ema.bn.running_mean, ... (12 tensors); object 'counter'"``."""
    parts = []
    if tensors:
        shown = ", ".join(tensors[:limit]) + (", ..." if len(tensors) > limit else "")
        parts.append(f"{shown} ({len(tensors)} tensor{'s' if len(tensors) != 1 else ''})")
    if objects:
        parts.append("object" + ("s " if len(objects) > 1 else " ") + ", ".join(repr(n) for n in objects))
    return "; ".join(parts) or "nothing"


def classify(
    trees: Mapping[str, Any], *, synced: Callable[[Path], bool] | None = None, all_max: AllMax | None = None
) -> Split:
    """Encode ``{name: state_dict}`` and decide what of it differs across ranks (see the module docstring).

    ``synced(path)``: whether the tensor at ``path`` (starting with the object's name) is the same on
    every rank by construction; ``all_max``: the collective (None: one process, nothing differs).
    Every rank must call this with the same object names, in the same order. Raises
    :class:`~elastic_ddp.checkpoint.tree.TreeError` naming the path of a value a checkpoint cannot hold.
    """
    encoded, tensors, paths = flatten_named(trees)
    if all_max is None:
        return Split(encoded, tuple(tensors), tuple(paths), frozenset(), {}, ())
    names = list(encoded)
    specs_of: dict[str, list[TensorSpec]] = {name: [] for name in names}
    for tensor, path in zip(tensors, paths):
        specs_of[path[0]].append(TensorSpec.of(tensor))
    digests = [_object_digest(encoded[name], specs_of[name]) for name in names]
    own_names = [name for name, differs in zip(names, _differ(digests, all_max)) if differs]
    own: dict[str, Any] = {}
    own_tensors: list[torch.Tensor] = []
    if own_names:
        own, own_tensors, _ = flatten_named({name: trees[name] for name in own_names})
        encoded, tensors, paths = flatten_named({name: trees[name] for name in names if name not in own})
    checked = [i for i, path in enumerate(paths) if synced is None or not synced(path)]
    per_rank: frozenset[int] = frozenset()
    if checked:
        sums = tensor_checksums([tensors[i] for i in checked])
        differs = _differ(sums.reshape(-1).tolist(), all_max)
        per_rank = frozenset(i for k, i in enumerate(checked) if differs[2 * k] or differs[2 * k + 1])
    return Split(encoded, tuple(tensors), tuple(paths), per_rank, own, tuple(own_tensors))


def _object_digest(encoded: Any, specs: list[TensorSpec]) -> int:
    # Tensor references are numbered across objects; an object's own numbering must not count, or
    # a per-rank object would make every object after it look different too.
    text = _REF.sub('{"tensor":0}', json.dumps(encoded, sort_keys=False, separators=(",", ":")))
    data = json.dumps([text, [s.to_json() for s in specs]]).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _differ(values: list[int], all_max: AllMax) -> list[bool]:
    """Per value: whether some rank holds another value (one collective: the maximum of ``v`` and of
    ``~v``, whose maximum is ``~min``; ``~`` never overflows where a negation would)."""
    if not values:
        return []
    mine = torch.tensor(values, dtype=torch.int64)
    both = all_max(torch.cat([mine, ~mine]))
    high, low = both[: len(values)], ~both[len(values) :]
    return (high != low).tolist()


def tensor_checksums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two int64 checksums of each tensor's bytes, as a ``[len(tensors), 2]`` CPU tensor.

    Equal bytes give equal checksums on every rank (integer arithmetic, wrapping, in a fixed order).
    Large tensors are summed on their own device: the column sums of their int64 words laid out in
    rows of :data:`ROW_WORDS`, then the total and the column-weighted total of those sums; small
    ones are hashed on the host (BLAKE2b) after one batched copy.
    """
    out = torch.zeros(len(tensors), 2, dtype=torch.int64)
    small = [i for i, t in enumerate(tensors) if t.numel() * t.element_size() < SMALL_BYTES]
    large = [i for i, t in enumerate(tensors) if t.numel() * t.element_size() >= SMALL_BYTES]
    if small:
        for i, digest in zip(small, _host_digests([tensors[i] for i in small])):
            out[i, 0], out[i, 1] = digest
    if large:
        device_sums = [_column_checksum(tensors[i]) for i in large]
        out[large] = torch.stack([s.cpu() for s in device_sums])  # the one host sync (per device)
    return out


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _host_digests(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    flat = [_bytes(t) for t in tensors]
    sizes = [f.numel() for f in flat]
    by_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(flat):
        by_device.setdefault(f.device, []).append(i)
    host: list[torch.Tensor | None] = [None] * len(flat)
    for device, members in by_device.items():
        joined = torch.cat([flat[i] for i in members]) if device.type != "cpu" else None
        pos = 0
        if joined is not None:
            joined = joined.cpu()  # one copy per device, not one per tensor
        for i in members:
            host[i] = flat[i] if joined is None else joined[pos : pos + sizes[i]]
            pos += sizes[i]
    out = []
    for data in host:
        digest = hashlib.blake2b(memoryview(data.numpy()), digest_size=16).digest()
        out.append((int.from_bytes(digest[:8], "little", signed=True), int.from_bytes(digest[8:], "little", signed=True)))
    return out


def _column_checksum(tensor: torch.Tensor) -> torch.Tensor:
    flat = _bytes(tensor)
    if flat.data_ptr() % 8:
        flat = flat.clone()  # an int64 view needs 8-byte alignment; a view into a larger tensor may lack it
    nwords = flat.numel() // 8
    words = flat[: nwords * 8].view(torch.int64)
    rows = nwords // ROW_WORDS
    columns = torch.zeros(ROW_WORDS, dtype=torch.int64, device=flat.device)
    if rows:
        columns += words[: rows * ROW_WORDS].view(rows, ROW_WORDS).sum(0)
    rest = words[rows * ROW_WORDS :]
    columns[: rest.numel()] += rest
    tail = flat[nwords * 8 :].to(torch.int64)
    columns[: tail.numel()] += tail * 257  # the last < 8 bytes, kept apart from the words they share columns with
    weights = torch.arange(1, ROW_WORDS + 1, dtype=torch.int64, device=flat.device)
    return torch.stack([columns.sum(), (columns * weights).sum()])
