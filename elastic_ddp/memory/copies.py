"""A memory-tier save's device-to-host copies on a GPU, overlapped with the next step where safe.

A save must copy the state after step S before step S+1 changes it. Parameters and optimizer
state change only inside ``optimizer.step()``, so their copies run on a side stream while step
S+1's forward and backward run, and a step pre-hook on each registered optimizer makes the
training stream wait for them -- a wait queued on the GPU, no host sync -- before the first
``step()`` after the save. Everything else (buffers such as BatchNorm's running statistics, which
a forward changes; tensors of the user's own objects) is copied on the training stream at the
save, where the next step's kernels queue behind it.

The contract this relies on, and the one the docs state: between two steps, parameters and
optimizer state are changed only by the registered optimizers' ``step()``.

What the copies cost training is measured on the GPU with events: the training stream's copies,
plus how long the training stream waited at the pre-hook (0 when the side copies finished
first). It is read at the next save without a host sync; a round whose events have not all
completed by then leaves the previous figure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["DeviceCopies", "optimizer_storages"]


def optimizer_storages(optimizers: Iterable[torch.optim.Optimizer]) -> set[int]:
    """Storage addresses of every parameter and optimizer-state tensor of ``optimizers``: what only
    their ``step()`` changes."""
    out = set()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            out.update(p.untyped_storage().data_ptr() for p in group["params"])
        for state in optimizer.state.values():
            out.update(v.untyped_storage().data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
    return out


@dataclass
class _Round:
    """One save's copies: events on the training stream and the side stream."""

    start: torch.cuda.Event
    main_done: torch.cuda.Event
    side_done: torch.cuda.Event
    reached: torch.cuda.Event | None = None  # the training stream at the first optimizer step after the save
    waited: set[int] = field(default_factory=set)  # optimizers whose next step already waits

    def cost_ms(self) -> float | None:
        """The training stream's time spent on this round, or None while its events are pending."""
        events = [self.start, self.main_done, self.side_done, *([self.reached] if self.reached else [])]
        if not all(e.query() for e in events):
            return None
        cost = self.start.elapsed_time(self.main_done)
        if self.reached is not None:
            cost += max(0.0, self.reached.elapsed_time(self.side_done))
        return cost

    def wait(self) -> None:
        """Block the calling (writer) thread until every copy of this round landed in host memory."""
        self.main_done.synchronize()
        self.side_done.synchronize()


class DeviceCopies:
    """Copies pieces of GPU tensors into a pinned host buffer for one rank's memory-tier saves."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side = torch.cuda.Stream(device)
        self._hooks: dict[int, RemovableHandle] = {}
        self._round: _Round | None = None
        self.cost_s = 0.0  # what the last measured round cost the training stream (GPU time)

    def copy(self, pieces: Sequence[tuple[torch.Tensor, torch.Tensor]], optimizers: Sequence[torch.optim.Optimizer]) -> _Round:
        """Queue ``target.copy_(source)`` for each ``(source, target)``; returns the round to wait on.

        Sources whose storage belongs to a parameter or optimizer state of ``optimizers`` go on the
        side stream, the rest on the training stream.
        """
        self._measure()
        for optimizer in optimizers:
            if id(optimizer) not in self._hooks:
                self._hooks[id(optimizer)] = optimizer.register_step_pre_hook(self._before_step)
        deferred = optimizer_storages(optimizers)
        stream = torch.cuda.current_stream(self.device)
        timing = {"enable_timing": True}
        r = _Round(torch.cuda.Event(**timing), torch.cuda.Event(**timing), torch.cuda.Event(**timing))
        r.start.record(stream)
        self._side.wait_stream(stream)  # the side copies read the state as this step left it
        for source, target in pieces:
            # Optimizer state can live on the CPU too (AdamW's step counts): copied at once.
            if source.is_cuda and source.untyped_storage().data_ptr() in deferred:
                # No record_stream: the sources are live parameters and state, and the training
                # stream waits for these copies before the step that could replace or free them.
                with torch.cuda.stream(self._side):
                    target.copy_(source, non_blocking=True)
            else:
                target.copy_(source, non_blocking=True)
        r.main_done.record(stream)
        r.side_done.record(self._side)
        self._round = r
        return r

    def _before_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        r = self._round
        if r is None or id(optimizer) in r.waited:
            return
        r.waited.add(id(optimizer))
        stream = torch.cuda.current_stream(self.device)
        if r.reached is None:
            r.reached = torch.cuda.Event(enable_timing=True)
            r.reached.record(stream)
        stream.wait_event(r.side_done)

    def _measure(self) -> None:
        if self._round is not None and (cost := self._round.cost_ms()) is not None:
            self.cost_s = cost / 1000.0

    def close(self) -> None:
        """Remove the optimizers' hooks (a later step then never waits on this object)."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._round = None
