"""MemoryTier.keep: after a failed step, the last completed step into node memory with no collective.

One process in a gloo group of one (the split plan needs a process group to be decided), a node of
one local rank: what is kept reads back bit for bit, and nothing is kept when a value the plan stores
once for every rank changed since the last comparison that held -- one rank cannot tell whether it
still is the same everywhere. The keep under real agents, with a node or a worker SIGKILLed, is
tests/chaos/test_memory_tier_e2e.py's.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic_ddp.memory.interval import Report
from elastic_ddp.memory import tier as tier_module
from elastic_ddp.memory.tier import MemoryTier
from elastic_ddp.state import ModelState, OptimizerState, as_stateful

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", autouse=True)
def group_of_one(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("keep") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def tier(memory_dir, group) -> MemoryTier:
    return MemoryTier(
        memory_dir=str(memory_dir), overhead=0.02, every_steps=1000, timeout_s=5.0, run_name="job",
        identity_digest="0123456789abcdef", rank=0, local_rank=0, local_world_size=1, node=0,
        device=torch.device("cpu"), control_group=group, world_size=1,
    )  # fmt: skip


def job(batch_norm: bool = False):
    """A replicated model (DDP keeps its parameters and optimizer state the same on every rank), a
    scheduler and a teacher module. BatchNorm statistics are stored once here -- one rank has no
    other's to differ from -- and change at every step."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(6) if batch_norm else nn.Identity()
    model = nn.Sequential(nn.Linear(4, 6), norm, nn.Linear(6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    teacher = nn.Linear(4, 2)
    state = {
        "model": ModelState(model, replicated=True), "optimizer": OptimizerState(model, optimizer, replicated=True),
        "scheduler": scheduler, "teacher": as_stateful("teacher", teacher),
    }  # fmt: skip
    return model, optimizer, scheduler, teacher, state


def step(model, optimizer, scheduler) -> None:
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def snapshot(state) -> dict:
    out = {}
    for name in ("model", "teacher"):
        out.update({f"{name}.{k}": v.clone() for k, v in state[name].state_dict().items()})
    out["lr"] = state["scheduler"].get_last_lr()
    return out


def test_the_kept_step_is_the_newest_state_in_node_memory_and_reads_back_bit_for_bit(tmp_path, group_of_one):
    model, optimizer, scheduler, _, state = job()
    writer = tier(tmp_path, group_of_one)
    writer.survey(state, fresh=False)
    step(model, optimizer, scheduler)
    writer.after_step(1, state, None)  # the first save decides the plan
    for number in range(2, 41):  # saves are 1,000 steps apart: none of these is saved
        step(model, optimizer, scheduler)
        writer.after_step(number, state, None)
    # Step 41's update is done; the loop failed before its bookkeeping (a peer gone in the agreement).
    step(model, optimizer, scheduler)
    want = snapshot(state)
    assert writer.keep(41, state, frozenset({"scheduler"})) is None
    assert writer.store.last_step() == 41  # the restart counts no step redone, not -1
    writer.close()

    model, optimizer, scheduler, _, target = job()
    reader = tier(tmp_path, group_of_one)
    survey = reader.survey(target, fresh=False)
    assert [c.step for c in survey.candidates()][:1] == [41]
    assert reader.restore(survey, 0, 41, target)
    got = snapshot(target)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k] for k in want)
    reader.close()


@pytest.mark.parametrize(
    ("lockstep", "batch_norm", "change", "named"),
    [
        (frozenset(), False, lambda teacher: None, "'scheduler'"),  # a scheduler not declared in lockstep
        (frozenset({"scheduler"}), False, lambda teacher: teacher.weight.data.add_(1.0), "'teacher'"),
        (frozenset({"scheduler"}), True, lambda teacher: None, "running_mean"),
    ],
    ids=["scheduler-not-lockstep", "teacher-changed", "shared-batchnorm-statistics"],
)
def test_nothing_is_kept_when_a_value_stored_once_for_every_rank_changed_since_it_was_compared(
    lockstep, batch_norm, change, named, tmp_path, group_of_one
):
    model, optimizer, scheduler, teacher, state = job(batch_norm)
    writer = tier(tmp_path, group_of_one)
    writer.survey(state, fresh=False)
    step(model, optimizer, scheduler)
    writer.after_step(1, state, None)
    step(model, optimizer, scheduler)
    writer.after_step(2, state, None)
    change(teacher)
    why = writer.keep(2, state, lockstep)
    assert why is not None and named in why, why
    writer.close()
    # The node's memory still holds the save of step 1 only.
    reader = tier(tmp_path, group_of_one)
    assert [c.step for c in reader.survey(job()[4], fresh=False).candidates()][:1] == [1]
    reader.close()


def test_nothing_is_kept_where_redoing_the_steps_since_the_last_save_is_quicker_than_writing_them(tmp_path, group_of_one):
    model, optimizer, scheduler, _, state = job()
    writer = tier(tmp_path, group_of_one)
    writer.survey(state, fresh=False)
    for number in (1, 2, 3):
        step(model, optimizer, scheduler)
        writer.after_step(number, state, None)
    # Steps of 10 ms, a write of 50 ms: two steps to redo are quicker.
    writer._interval.report = lambda failed: Report(cost_s=0.0, step_s=0.01, write_s=0.05, untold=0.0, failed=0.0)
    why = writer.keep(3, state, frozenset({"scheduler"}))
    assert why == "redoing 2 step(s) (10 ms each) costs less than writing them (50 ms)", why
    writer.close()


def test_a_save_in_flight_that_never_ends_is_waited_for_only_briefly_and_nothing_is_kept(tmp_path, group_of_one, monkeypatch):
    # A save's comparison can wait on an all-reduce whose peer lives on but left the collective (up to the
    # group's timeout): the keep after a failed step must not hold the restart for that long.
    monkeypatch.setattr(tier_module, "KEEP_WAIT_S", 0.2)
    model, optimizer, scheduler, _, state = job()
    writer = tier(tmp_path, group_of_one)
    writer.survey(state, fresh=False)
    for number in (1, 2, 3):
        step(model, optimizer, scheduler)
        writer.after_step(number, state, None)  # saves step 1 only (every_steps=1000)
    writer._saver.wait()
    stuck: concurrent.futures.Future = concurrent.futures.Future()
    writer._saver.writer.pending = stuck  # a save in flight whose comparison never returns
    started = time.monotonic()
    why = writer.keep(3, state, frozenset({"scheduler"}))
    assert time.monotonic() - started < 5.0
    assert why == "the save in flight is still running after 0.2 s (its comparison waits for a lost peer)", why
    assert writer._saver.writer.pending is stuck  # still the save in flight: its slot is not reused
    stuck.set_result(None)
    writer.close()

    reader = tier(tmp_path, group_of_one)
    survey = reader.survey(job()[4], fresh=False)
    assert [c.step for c in survey.candidates()][:1] == [1]  # what the node held before
    reader.close()
