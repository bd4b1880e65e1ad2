"""Host copies of exactly the bytes this rank writes, in buffers kept from one save to the next.

A rank's files are given as lists of *sources*: element ranges of tensors (its pieces of the
replicated state, then its own per-rank tensors). :meth:`ShareStager.stage` returns, per file, the
byte buffers to write:

* ``copy=False`` and every source on the CPU (a blocking save: training waits): views of the
  tensors themselves, no copy at all.
* otherwise (an async save, or a source on a GPU): one host buffer per file, reused by the next
  save of the same layout, filled with a copy of each source. A buffer that receives GPU data is
  pinned and filled with non-blocking copies; instead of synchronizing, the stager records a CUDA
  event after the copies on each device's current stream and the writer waits for it
  (:meth:`Staged.wait_ready`) -- so ``save()`` returns without a host sync, and the training step
  enqueued after it runs behind the copies on the same stream, which keeps the staged values
  those of the saved step.

Memory: the buffers hold this rank's share (``state / writers`` plus its per-rank state), not a
replica. Copies never alias a tensor that training mutates (pytorch/pytorch#144657).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Source = tuple[torch.Tensor, int, int]  # (tensor, first element, one past the last)


def byte_view(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of ``tensor`` flattened, as a 1-D uint8 tensor (a view when contiguous)."""
    return tensor.detach().reshape(-1)[start:stop].view(torch.uint8)


def as_buffer(tensor: torch.Tensor) -> memoryview:
    """A CPU uint8 tensor as a writable memoryview of its bytes."""
    return memoryview(tensor.numpy()).cast("B")


@dataclass
class Staged:
    """What one save writes: ``{file name: [buffers]}``, ready once :meth:`wait_ready` returns."""

    files: dict[str, list[Any]]
    staged_bytes: int
    pinned_bytes: int
    events: list[Any] = field(default_factory=list)

    def wait_ready(self) -> None:
        for event in self.events:
            event.synchronize()
        self.events.clear()


class ShareStager:
    """Stages a rank's files into host memory; see the module docstring."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def held_bytes(self) -> int:
        """Host memory this stager keeps between saves."""
        return sum(b.numel() for b in self._buffers.values())

    def release(self) -> None:
        self._buffers.clear()

    def stage(self, files: dict[str, Sequence[Source]], *, copy: bool) -> Staged:
        on_gpu = any(t.device.type != "cpu" for sources in files.values() for t, _, _ in sources)
        if not copy and not on_gpu:
            views = {name: [as_buffer(byte_view(t, a, b)) for t, a, b in sources] for name, sources in files.items()}
            return Staged(views, 0, 0)
        # Buffers of files this save does not write (the layout changed) are dropped, not hoarded.
        self._buffers = {name: buf for name, buf in self._buffers.items() if name in files}
        out: dict[str, list[Any]] = {}
        devices: set[torch.device] = set()
        pinned = 0
        for name, sources in files.items():
            nbytes = sum((b - a) * t.element_size() for t, a, b in sources)
            pin = any(t.is_cuda for t, _, _ in sources)
            buf = self._buffers.get(name)
            if buf is None or buf.numel() != nbytes or buf.is_pinned() != pin:
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
                self._buffers[name] = buf
            pos = 0
            for tensor, a, b in sources:
                view = byte_view(tensor, a, b)
                buf[pos : pos + view.numel()].copy_(view, non_blocking=tensor.is_cuda)
                pos += view.numel()
                if tensor.is_cuda:
                    devices.add(tensor.device)
            pinned += nbytes if pin else 0
            out[name] = [as_buffer(buf)]
        events = []
        for device in devices:
            with torch.cuda.device(device):
                event = torch.cuda.Event()
                event.record()
                events.append(event)
        return Staged(out, sum(self._buffers[name].numel() for name in out), pinned, events)
