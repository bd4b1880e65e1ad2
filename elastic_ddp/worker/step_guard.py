"""Whether a failed step left the registered state exactly as the last completed step left it.

A step that fails -- a peer died during the gradient all-reduce, the script raised -- has usually
changed only what a forward pass changes: the model's buffers (BatchNorm's running statistics,
DDP's broadcast of rank 0's buffers). Parameters, optimizer state, an EMA, the scheduler change at
``optimizer.step()`` and after it. :class:`StepGuard` copies the model's buffers at the start of
each step, notes the version of every other tensor of the registered state (torch counts each
in-place change of a tensor) and keeps the plain values of the objects that are not modules. After
a failure, :meth:`StepGuard.changed` says what else changed, if anything, and :meth:`StepGuard.restore`
puts the buffers back: the state is then that after the last completed step, bit for bit, and the
memory tier may keep it (:meth:`elastic_ddp.memory.tier.MemoryTier.keep`).

Per step this costs one device-to-device copy of the model's persistent buffers (a few kilobytes
for BatchNorm; no host sync) and a read of each watched tensor's version counter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from elastic_ddp.state import ModelState, Stateful

__all__ = ["StepGuard"]

# A non-module object's tensor up to this many elements is compared by value (its state_dict may
# build it anew at each call); a larger one by identity and version.
_BY_VALUE = 4096


class StepGuard:
    """The state at the start of the step in flight, as far as a failure needs it.

    ``model``: the module DDP wraps (its persistent buffers are copied, its parameters watched);
    ``others``: the other registered objects but the optimizer and the data position (the optimizer
    changes nothing without changing the parameters; the data position moves only once a step
    completed) -- modules (an EMA, a teacher) have their tensors watched, the rest their state_dict's
    values compared.
    """

    def __init__(self, model: torch.nn.Module, others: Mapping[str, Stateful]) -> None:
        params = {id(p) for p in model.parameters()}
        # keep_vars: the live tensors; persistent buffers only, since a non-persistent one is never saved.
        self._buffers = [t for t in model.state_dict(keep_vars=True).values() if id(t) not in params]
        self._copies = [torch.empty_like(b) for b in self._buffers]
        self._watched: list[torch.Tensor] = list(model.parameters())
        self._plain: dict[str, Stateful] = {}
        for name, obj in others.items():
            if isinstance(obj, ModelState):  # a registered module (an EMA, a teacher)
                self._watched += [*obj.model.parameters(), *obj.model.buffers()]
            else:
                self._plain[name] = obj
        self._versions: list[int] = []
        self._values: dict[str, Any] = {}
        self.open = False  # True from a step's start until it completed

    def begin(self) -> None:
        """A step starts now."""
        if self._buffers:
            torch._foreach_copy_(self._copies, self._buffers)
        self._versions = [t._version for t in self._watched]
        self._values = {name: _snapshot(obj.state_dict()) for name, obj in self._plain.items()}
        self.open = True

    def end(self) -> None:
        """The step completed: the state is now that of this step."""
        self.open = False

    def changed(self) -> str | None:
        """What the step in flight changed besides the model's buffers; None when nothing did, or when no
        step is in flight (the state is then that of the last completed step as it is)."""
        if not self.open:
            return None
        for tensor, version in zip(self._watched, self._versions):
            if tensor._version != version:
                return f"a tensor of shape {tuple(tensor.shape)} (a parameter, or a module's) changed in place"
        for name, obj in self._plain.items():
            if not _same(_snapshot(obj.state_dict()), self._values[name]):
                return f"{name!r} changed"
        return None

    def restore(self) -> None:
        """Put the model's buffers back as they were at the start of the step in flight (if one is)."""
        if self.open and self._buffers:
            torch._foreach_copy_(self._buffers, self._copies)


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() <= _BY_VALUE:
            return value.detach().clone()
        return ("tensor", value.data_ptr(), value._version)
    if isinstance(value, Mapping):
        return {key: _snapshot(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_snapshot(item) for item in value]
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return isinstance(a, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value that cannot say whether it is equal counts as changed
        return False
