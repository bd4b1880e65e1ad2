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
import torch.distributed as dist

from elastic_ddp.checkpoint.tree import Path, TensorSpec, flatten_named

__all__ = ["AllMax", "Classifier", "Plan", "all_max_over", "Split", "classify", "describe", "plan_of", "split_as", "stale", "tensor_checksums", "values"]

# Tensors smaller than this are hashed on the host (BLAKE3, ~2 GB/s, ~1 us a call): a device column
# sum is a few kernel launches per tensor (~0.1 ms on a CPU), which costs more below ~0.3 MB.
LARGE_BYTES = 1 << 20
# Words per row of the column sum: a difference in one row is weighted by its column, so two ranks
# holding the same words in another order within a row still disagree.
ROW_WORDS = 2048

AllMax = Callable[[torch.Tensor], torch.Tensor]
"""Element-wise maximum of an int64 CPU vector over every rank (a collective); returns a CPU vector."""

def all_max_over(group: Any, device: torch.device) -> AllMax:
    """:data:`AllMax` as a MAX all-reduce on ``group`` (None: the default group) with the vector on
    ``device`` (where the group's backend wants it: the GPU for NCCL)."""

    def all_max(values: torch.Tensor) -> torch.Tensor:
        box = values.to(device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
        return box.cpu()

    return all_max


_REF = re.compile(r'\{"tensor":\s*\d+\}')


@dataclass(frozen=True)
class Split:
    """A state cut into what every rank holds alike and what each rank holds for itself.

    ``shared``: the encoded trees of the objects that are alike in structure and plain values, their
    tensor references indexing ``tensors`` (whose paths are ``paths``); ``per_rank``: the indices of
    those tensors whose values differ across ranks. ``own``: the encoded trees of the per-rank
    objects, their references indexing ``own_tensors``. ``specs``: the dtype and shape of each of
    ``tensors`` (taken once per save: every user of a split needs them).
    """

    shared: dict[str, Any]
    tensors: tuple[torch.Tensor, ...]
    paths: tuple[Path, ...]
    per_rank: frozenset[int]
    own: dict[str, Any]
    own_tensors: tuple[torch.Tensor, ...]
    specs: tuple[TensorSpec, ...] = ()

    @property
    def has_per_rank(self) -> bool:
        return bool(self.per_rank or self.own)


def describe(tensors: list[str], objects: list[str], limit: int = 6) -> str:
    """Per-rank parts in words: ``"ema.bn.running_mean, ... (12 tensors); object 'counter'"`` ("" for none)."""
    parts = []
    if tensors:
        shown = ", ".join(tensors[:limit]) + (", ..." if len(tensors) > limit else "")
        parts.append(f"{shown} ({len(tensors)} tensor{'s' if len(tensors) != 1 else ''})")
    if objects:
        parts.append("object" + ("s " if len(objects) > 1 else " ") + ", ".join(repr(n) for n in objects))
    return "; ".join(parts)


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
        return Split(encoded, tuple(tensors), tuple(paths), frozenset(), {}, (), tuple(TensorSpec.of(t) for t in tensors))
    names = list(encoded)
    specs = [TensorSpec.of(t) for t in tensors]
    specs_of: dict[str, list[TensorSpec]] = {name: [] for name in names}
    for spec, path in zip(specs, paths):
        specs_of[path[0]].append(spec)
    compared = [name for name in names if synced is None or not synced((name,))]
    digests = [_object_digest(encoded[name], specs_of[name]) for name in compared]
    own_names = [name for name, differs in zip(compared, _differ(digests, all_max)) if differs]
    own: dict[str, Any] = {}
    own_tensors: list[torch.Tensor] = []
    if own_names:
        own, own_tensors, _ = flatten_named({name: trees[name] for name in own_names})
        encoded, tensors, paths = flatten_named({name: trees[name] for name in names if name not in own})
        specs = [TensorSpec.of(t) for t in tensors]
    checked = [i for i, path in enumerate(paths) if synced is None or not synced(path)]
    per_rank: frozenset[int] = frozenset()
    if checked:
        sums = tensor_checksums([tensors[i] for i in checked])
        differs = _differ(sums.reshape(-1).tolist(), all_max)
        per_rank = frozenset(i for k, i in enumerate(checked) if differs[2 * k] or differs[2 * k + 1])
    return Split(encoded, tuple(tensors), tuple(paths), per_rank, own, tuple(own_tensors), tuple(specs))


class Classifier:
    """:func:`classify` for a sequence of saves: in one collective where the last classification still
    holds, not two.

    The first call classifies (two all-reduces: whether each object differs decides which tensors
    are compared next). Later calls split the state as that classification did (:func:`split_as`)
    and check it with one all-reduce (:func:`values`, :func:`stale`); only where it no longer holds
    -- a rank's state has another structure, or something stored once now differs -- do they
    classify anew. What a classification stored per rank may become the same on every rank and stay
    stored per rank: each rank then stores the same values, which is still every rank's state. Every
    rank calls it alike, as :func:`classify`.
    """

    def __init__(self) -> None:
        self._plan: Plan | None = None

    def __call__(
        self, trees: Mapping[str, Any], *, synced: Callable[[Path], bool] | None = None, all_max: AllMax | None = None
    ) -> Split:
        plan = self._plan
        if plan is not None and all_max is not None:
            split = split_as(plan, trees, synced)
            mine = values(plan, trees, split, torch.device("cpu"))
            both = all_max(torch.cat([mine, ~mine]))
            # Every rank reads the same maxima, so every rank takes the same branch (a rank without the
            # plan's structure, split None, set the flag that makes the plan stale everywhere).
            if stale(plan, both[: plan.size].tolist(), (~both[plan.size :]).tolist()) is None and split is not None:
                return split
        split = classify(trees, synced=synced, all_max=all_max)
        self._plan = plan_of(split, trees, synced) if all_max is not None else None
        return split


@dataclass(frozen=True)
class Plan:
    """One classification, applied to later saves without a blocking collective (the memory tier's).

    ``own``: the per-rank objects; ``per_rank``: the per-rank tensors (indices into the shared
    tensors); ``compared``: the objects whose digests a check compares; ``checked``: the shared
    tensors whose checksums it compares; ``structure``: the shared objects' paths and specs (and
    what is compared) the plan was made for. A plan stays right while every rank's state has that
    structure and no tensor or object it stores once starts to differ: :func:`values` and
    :func:`stale` check exactly that, with one all-reduce that need not block the save.
    """

    own: tuple[str, ...]
    per_rank: frozenset[int]
    compared: tuple[str, ...]
    checked: tuple[int, ...]
    structure: tuple[Any, ...]

    @property
    def size(self) -> int:
        """Length of :func:`values`: a structure flag, a digest per compared object, two checksums per checked tensor."""
        return 1 + len(self.compared) + 2 * len(self.checked)


def plan_of(split: Split, trees: Mapping[str, Any], synced: Callable[[Path], bool] | None) -> Plan:
    """The plan ``split`` (of ``trees``, by :func:`classify`) stands for."""
    compared = tuple(name for name in trees if synced is None or not synced((name,)))
    checked = tuple(i for i, path in enumerate(split.paths) if synced is None or not synced(path))
    return Plan(tuple(split.own), split.per_rank, compared, checked, _structure(split, checked))


def _structure(split: Split, checked: tuple[int, ...]) -> tuple[Any, ...]:
    return split.paths, split.specs, tuple(split.own), checked


def split_as(plan: Plan, trees: Mapping[str, Any], synced: Callable[[Path], bool] | None) -> Split | None:
    """``trees`` split as ``plan`` decided (no collective), or None where this rank's state no longer
    has the structure the plan was made for."""
    shared = {name: tree for name, tree in trees.items() if name not in plan.own}
    encoded, tensors, paths = flatten_named(shared)
    own, own_tensors = {}, []
    if plan.own:
        own, own_tensors, _ = flatten_named({name: trees[name] for name in plan.own if name in trees})
    split = Split(encoded, tuple(tensors), tuple(paths), plan.per_rank, own, tuple(own_tensors),
                  tuple(TensorSpec.of(t) for t in tensors))  # fmt: skip
    checked = tuple(i for i, path in enumerate(split.paths) if synced is None or not synced(path))
    return split if _structure(split, checked) == plan.structure else None


def values(plan: Plan, trees: Mapping[str, Any], split: Split | None, device: torch.device) -> torch.Tensor:
    """This rank's side of a check of ``plan`` (``plan.size`` int64 on ``device``, without a host sync):
    a flag set when ``split`` is None (another structure), the digests of the compared objects and
    the checksums of the checked tensors. All-reduce ``[v, ~v]`` with MAX, then ask :func:`stale`."""
    out = torch.zeros(plan.size, dtype=torch.int64, device=device)
    if split is None:
        out[0] = 1
        return out
    compared = set(plan.compared)
    specs_of: dict[str, list[TensorSpec]] = {}
    for spec, path in zip(split.specs, split.paths):
        if path[0] in compared:
            specs_of.setdefault(path[0], []).append(spec)
    if split.own:
        _, own_tensors, own_paths = flatten_named({name: trees[name] for name in split.own})
        for tensor, path in zip(own_tensors, own_paths):
            specs_of.setdefault(path[0], []).append(TensorSpec.of(tensor))
    encoded = {**split.shared, **split.own}
    digests = torch.tensor([_object_digest(encoded[name], specs_of.get(name, [])) for name in plan.compared],
                           dtype=torch.int64)  # fmt: skip
    _to(out[1 : 1 + len(plan.compared)], digests)
    if plan.checked:
        sums = device_checksums([split.tensors[i] for i in plan.checked], device)
        out[1 + len(plan.compared) :] = sums.reshape(-1)
    return out


def stale(plan: Plan, high: list[int], low: list[int]) -> str | None:
    """From a check's maxima ``high`` and minima ``low`` over the ranks: why ``plan`` no longer holds
    -- a rank's state has another structure, or an object or tensor it stores once now differs
    across ranks -- or None. (What it stores per rank may have become the same: that is still right.)"""
    if high[0]:
        return "a rank's state has another structure than at the last comparison"
    for k, name in enumerate(plan.compared, start=1):
        if high[k] != low[k] and name not in plan.own:
            return f"the plain values of {name!r} now differ across ranks"
    base = 1 + len(plan.compared)
    for k, i in enumerate(plan.checked):
        a = base + 2 * k
        if (high[a] != low[a] or high[a + 1] != low[a + 1]) and i not in plan.per_rank:
            return f"tensor {i} of the shared state now differs across ranks"
    return None


def _to(target: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a CPU tensor into ``target`` without making the host wait for the device's queue."""
    if target.device.type == "cpu":
        target.copy_(host)
    else:
        target.copy_(host.pin_memory(), non_blocking=True)


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


def device_checksums(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """:func:`tensor_checksums`' checksums as a ``[len(tensors), 2]`` tensor on ``device``, computed
    without a host sync: tensors on ``device`` are summed there whatever their size, tensors on the
    host are hashed there and copied over asynchronously. (The checksums of a GPU tensor differ from
    a CPU one's; every rank computes them alike.)"""
    if device.type == "cpu":
        return tensor_checksums(tensors)
    out = torch.zeros(len(tensors), 2, dtype=torch.int64, device=device)
    on_host = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
    if on_host:
        out[on_host] = tensor_checksums([tensors[i] for i in on_host]).pin_memory().to(device, non_blocking=True)
    here = [i for i, t in enumerate(tensors) if t.device.type != "cpu"]
    if here:
        weights = torch.arange(1, ROW_WORDS + 1, dtype=torch.int64, device=device)
        out[here] = torch.stack([_column_checksum(tensors[i].to(device), weights) for i in here])
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
    columns = words[: rows * ROW_WORDS].view(rows, ROW_WORDS).sum(0)  # zeros when the tensor is under a row
    if rest:
        columns[:rest] += words[rows * ROW_WORDS :]
    tail = flat[nwords * 8 :]
    if tail.numel():
        columns[: tail.numel()] += tail.to(torch.int64) * 257  # the last < 8 bytes, apart from the words they share columns with
    return torch.stack([columns.sum(), (columns * weights).sum()])
