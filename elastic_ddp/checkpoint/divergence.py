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

Objects may declare what of theirs is the same on every rank by construction (the DDP model's and
optimizer's adapters in :mod:`elastic_ddp.state` do): ``synced(path)`` of a tensor's path -- that
tensor is not hashed -- and of the object's own path -- its structure and plain values are not
compared.

Cost per save: each rank reads the tensors it must compare once, on the device where they live (a
column sum over their int64 words, at memory speed; tensors under :data:`LARGE_BYTES` are hashed
on the host, GPU ones after one batched copy), then two all-reduces (``MAX``) of two int64 per
object and per compared tensor: O(number of tensors) on the network, whatever their size. One host
sync reads the result.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import blake3
import torch

from elastic_ddp.checkpoint.tree import Path, TensorSpec, flatten_named, path_text

__all__ = ["AllMax", "Split", "classify", "describe", "tensor_checksums"]

# Tensors smaller than this are hashed on the host (BLAKE3, ~2 GB/s, ~1 us a call): a device column
# sum is a few kernel launches per tensor (~0.1 ms on a CPU), which costs more below ~0.3 MB.
LARGE_BYTES = 1 << 20
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
    every rank by construction, and for ``(name,)`` whether the object's structure and plain values
    are; ``all_max``: the collective (None: one process, nothing differs).
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
    compared = [name for name in names if synced is None or not synced((name,))]
    digests = [_object_digest(encoded[name], specs_of[name]) for name in compared]
    own_names = [name for name, differs in zip(compared, _differ(digests, all_max)) if differs]
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

    Equal bytes give equal checksums on every rank. Tensors of at least :data:`LARGE_BYTES` are
    summed on their own device -- the column sums of their int64 words laid out in rows of
    :data:`ROW_WORDS`, then the total and the column-weighted total of those sums (integer
    arithmetic, wrapping, in a fixed order): one read at memory speed. Smaller ones are hashed with
    BLAKE3 on the host, CPU tensors in place and GPU tensors after one batched copy per device: a
    device sum costs a few kernel launches per tensor, more than hashing a small tensor's bytes.
    """
    out = torch.zeros(len(tensors), 2, dtype=torch.int64)
    small = [i for i, t in enumerate(tensors) if t.numel() * t.element_size() < LARGE_BYTES]
    large = [i for i, t in enumerate(tensors) if t.numel() * t.element_size() >= LARGE_BYTES]
    if small:
        for i, digest in zip(small, _host_digests([tensors[i] for i in small])):
            out[i, 0], out[i, 1] = digest
    if large:
        weights: dict[torch.device, torch.Tensor] = {}
        sums = []
        for i in large:
            device = tensors[i].device
            if device not in weights:
                weights[device] = torch.arange(1, ROW_WORDS + 1, dtype=torch.int64, device=device)
            sums.append(_column_checksum(tensors[i], weights[device]))
        out[large] = torch.stack([s.cpu() for s in sums])  # the one host sync (per device)
    return out


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _host_digests(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    flat = [_bytes(t) for t in tensors]
    host: list[torch.Tensor] = list(flat)
    on_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(flat):
        if f.device.type != "cpu":
            on_device.setdefault(f.device, []).append(i)
    for members in on_device.values():
        joined = torch.cat([flat[i] for i in members]).cpu()  # one copy per device, not one per tensor
        pos = 0
        for i in members:
            host[i] = joined[pos : pos + flat[i].numel()]
            pos += flat[i].numel()
    out = []
    for data in host:
        digest = blake3.blake3(memoryview(data.numpy()).cast("B")).digest(16)
        out.append((int.from_bytes(digest[:8], "little", signed=True), int.from_bytes(digest[8:], "little", signed=True)))
    return out


def _column_checksum(tensor: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    flat = _bytes(tensor)
    if flat.data_ptr() % 8:
        flat = flat.clone()  # an int64 view needs 8-byte alignment; a view into a larger tensor may lack it
    nwords = flat.numel() // 8
    words = flat[: nwords * 8].view(torch.int64)
    rows, rest = divmod(nwords, ROW_WORDS)
    columns = words[: rows * ROW_WORDS].view(rows, ROW_WORDS).sum(0)  # rows >= 1: the tensor is large
    if rest:
        columns[:rest] += words[rows * ROW_WORDS :]
    tail = flat[nwords * 8 :]
    if tail.numel():
        columns[: tail.numel()] += tail.to(torch.int64) * 257  # the last < 8 bytes, apart from the words they share columns with
    return torch.stack([columns.sum(), (columns * weights).sum()])
