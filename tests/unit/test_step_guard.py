"""StepGuard: after a failed step, whether the state is still that of the last completed step.

An ordinary model (BatchNorm, dropout), AdamW, an EMA of weights and buffers registered as a module,
a scheduler and a counter of plain values and a tensor: the guard must put the BatchNorm statistics a
failed forward changed back bit for bit, and must name anything else the step changed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from elastic_ddp.state import as_stateful
from elastic_ddp.worker.step_guard import StepGuard

pytestmark = pytest.mark.usefixtures("one_thread")


class Counter:
    def __init__(self) -> None:
        self.samples = 0
        self.per_class = torch.zeros(10, dtype=torch.int64)

    def state_dict(self) -> dict:
        return {"samples": self.samples, "per_class": self.per_class}

    def load_state_dict(self, state: dict) -> None:
        self.samples = state["samples"]
        self.per_class.copy_(state["per_class"])


def setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    counter = Counter()
    others = {"scheduler": scheduler, "ema": as_stateful("ema", ema), "counter": counter}
    return model, optimizer, scheduler, ema, counter, StepGuard(model, others)


def train_step(model, optimizer, scheduler, ema, counter) -> None:
    model(torch.randn(5, 6)).sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    ema.update_parameters(model)
    counter.samples += 5


def buffers(model) -> dict[str, torch.Tensor]:
    return {name: b.clone() for name, b in model.named_buffers()}


def test_a_step_that_failed_after_its_forward_is_put_back_to_the_last_completed_one_bit_for_bit():
    model, optimizer, scheduler, ema, counter, guard = setup()
    train_step(model, optimizer, scheduler, ema, counter)  # a completed step: optimizer and EMA state exist
    before = buffers(model)
    params = [p.clone() for p in model.parameters()]
    guard.begin()
    model(torch.randn(5, 6)).sum().backward()  # the step fails in its gradient all-reduce, say
    assert not all(torch.equal(b, before[n]) for n, b in model.named_buffers())  # BatchNorm moved
    assert guard.changed() is None
    guard.restore()
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))


@pytest.mark.parametrize(
    ("late", "named"),
    [
        (lambda m, o, s, e, c: o.step(), "a parameter"),
        (lambda m, o, s, e, c: e.update_parameters(m), "a parameter"),
        (lambda m, o, s, e, c: s.step(), "'scheduler' changed"),
        (lambda m, o, s, e, c: setattr(c, "samples", c.samples + 5), "'counter' changed"),
        (lambda m, o, s, e, c: c.per_class.add_(1), "'counter' changed"),
    ],
    ids=["optimizer.step", "ema.update", "scheduler.step", "a counter's int", "a counter's tensor"],
)
def test_anything_a_failed_step_changed_besides_the_buffers_is_named(late, named):
    model, optimizer, scheduler, ema, counter, guard = setup()
    train_step(model, optimizer, scheduler, ema, counter)
    guard.begin()
    model(torch.randn(5, 6)).sum().backward()
    late(model, optimizer, scheduler, ema, counter)
    why = guard.changed()
    assert why is not None and named in why, why


def test_between_steps_the_state_is_the_completed_steps_and_restore_leaves_it_alone():
    model, optimizer, scheduler, ema, counter, guard = setup()
    guard.begin()
    train_step(model, optimizer, scheduler, ema, counter)
    guard.end()
    after = buffers(model)
    assert guard.changed() is None
    guard.restore()
    assert all(torch.equal(b, after[n]) for n, b in model.named_buffers())
