"""The memory tier's format, commit rule, verification, slots, clean-up, space check and policy.

One process, no process group: a tier of local rank 0 reads every part itself, so a node's save
by several local ranks (several tier objects on one directory) and its restore are exercised
without torchrun. The collectives are covered by tests/chaos/test_memory_tier_e2e.py.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import gc
import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from elastic_ddp.memory import store as store_module
from elastic_ddp.memory import survey as survey_module
from elastic_ddp.memory import tier as tier_module
from elastic_ddp.memory.copies import optimizer_storages
from elastic_ddp.memory.policy import MAX_INTERVAL, MIN_SAVES, Candidate, background_cost, choose_resume, interval
from elastic_ddp.memory.store import MemoryFormatError, NodeMemory, PartRecord, read_part, run_dir_name, write_part
from elastic_ddp.memory.tier import MemoryTier, MemoryTierError, NodeOffer, NodeShape, Survey, node_shape
from elastic_ddp.state import ModelState, OptimizerState


class Counter:
    """A user's own stateful object with plain values only."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen, "tag": ("a", 1)}

    def load_state_dict(self, state: dict) -> None:
        assert state["tag"] == ("a", 1)
        self.seen = state["seen"]


def make_state(seed: int) -> tuple[dict, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 7)).sum().backward()
    optimizer.step()
    counter = Counter()
    counter.seen = seed
    return {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer), "count": counter}, model


def tier(memory_dir, *, local_rank=0, local_world_size=1, overhead=0.02, every=1, device="cpu", **shape) -> MemoryTier:
    """A tier of node 0; ``shape``: forced :class:`~elastic_ddp.memory.tier.NodeShape` values."""
    return MemoryTier(
        memory_dir=str(memory_dir), overhead=overhead, every_steps=every, timeout_s=5.0, run_name="job",
        identity_digest="0123456789abcdef", rank=local_rank, local_rank=local_rank, local_world_size=local_world_size,
        node=0, device=torch.device(device), control_group=None, world_size=local_world_size, **shape,
    )  # fmt: skip


def restore_newest(reader: MemoryTier, target: dict) -> bool:
    """Survey node 0 and restore its newest state into ``target``."""
    survey = reader.survey(target, fresh=False)
    return reader.restore(survey, 0, survey.candidates()[0].step, target)


def flat(state: dict) -> dict:
    return {k: v.clone() for k, v in state["model"].state_dict().items()} | {
        f"opt.{k}": v.clone() for k, v in _tensors(state["optimizer"].state_dict()).items()
    }


def _tensors(tree, prefix="") -> dict:
    out = {}
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_tensors(v, f"{prefix}.{k}"))
    return out


def save_node(memory_dir, state, step, local_world_size=2) -> list[MemoryTier]:
    """Every local rank of one node saves ``state`` after ``step``; returns the tiers (writes done)."""
    tiers = [tier(memory_dir, local_rank=r, local_world_size=local_world_size) for r in range(local_world_size)]
    for t in tiers:
        t.survey(state, fresh=False)
    for t in tiers:
        t.save(step, state)
    for t in tiers:
        t.close()
    return tiers


# --- format ----------------------------------------------------------------------------------


def test_run_dir_name_is_file_name_safe_and_carries_the_identity():
    assert run_dir_name("my run/../x", "abc") == "my_run_.._x-abc"
    assert run_dir_name("", "abc") == "run-abc"


def test_a_part_reads_back_verified_and_a_damaged_byte_is_caught(tmp_path):
    data = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    path = tmp_path / "part.bin"
    size, sha = write_part(path, [memoryview(data.numpy()).cast("B")])
    record = PartRecord(3, 0, 1, size, sha, "d")
    assert torch.equal(read_part(path, record), data)
    raw = bytearray(path.read_bytes())
    raw[1234] ^= 1
    path.write_bytes(raw)
    with pytest.raises(MemoryFormatError, match="does not match its checksum"):
        read_part(path, record)
    path.write_bytes(raw[:-1])
    with pytest.raises(MemoryFormatError, match="holds 3999 bytes; its record says 4000"):
        read_part(path, record)
    path.unlink()
    with pytest.raises(MemoryFormatError, match="is missing"):
        read_part(path, record)


def test_a_part_hashed_beside_its_write_has_the_same_bytes_and_checksum_and_reads_back_with_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "CHUNK", 1000)  # several writes per buffer
    buffers = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (4500, 1, 0, 2999)]
    views = [memoryview(b.numpy()).cast("B") for b in buffers]
    one, three = tmp_path / "one.bin", tmp_path / "three.bin"
    with pytest.raises(ValueError, match="needs a helper executor"):
        write_part(three, views, threads=3)  # the caller owns the thread that hashes beside the write
    with concurrent.futures.ThreadPoolExecutor(1) as helper:
        assert write_part(one, views) == write_part(three, views, threads=3, helper=helper)
        assert one.read_bytes() == three.read_bytes() == b"".join(b.numpy().tobytes() for b in buffers)
        size, checksum = write_part(three, views, threads=3, helper=helper)
    assert torch.equal(read_part(three, PartRecord(1, 0, 1, size, checksum, "d"), threads=2), torch.cat(buffers))
    raw = bytearray(three.read_bytes())
    raw[-1] ^= 1
    three.write_bytes(raw)
    with pytest.raises(MemoryFormatError, match="does not match its checksum"):
        read_part(three, PartRecord(1, 0, 1, size, checksum, "d"), threads=2)


def test_a_part_is_read_as_a_mapping_that_outlives_its_file_and_an_empty_part_reads_empty(tmp_path):
    path = tmp_path / "part.bin"
    data = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    size, checksum = write_part(path, [memoryview(data.numpy()).cast("B")])
    held = read_part(path, PartRecord(1, 0, 1, size, checksum, "d"))
    path.unlink()  # a node's directory may be cleared while a restore still sends what it read
    gc.collect()
    assert torch.equal(held, data)
    size, checksum = write_part(path, [memoryview(b"")])
    assert size == 0 and read_part(path, PartRecord(1, 0, 1, 0, checksum, "d")).numel() == 0


def test_a_part_rewritten_with_fewer_bytes_holds_exactly_the_new_ones(tmp_path):
    # Parts are overwritten in place (no truncation first, see write_part): the old tail must go.
    path = tmp_path / "part.bin"
    write_part(path, [memoryview(bytes(range(256)) * 40)])
    data = torch.arange(100, dtype=torch.int16).view(torch.uint8)
    size, checksum = write_part(path, [memoryview(data.numpy()).cast("B"), memoryview(b"tail")])
    assert size == 204 and path.read_bytes() == data.numpy().tobytes() + b"tail"
    assert torch.equal(read_part(path, PartRecord(1, 0, 1, size, checksum, "d"))[:200], data)


def test_polling_a_slot_parses_each_commit_record_once_until_it_changes(tmp_path, monkeypatch):
    # A save polls the other slot until the node's ranks finished it; part 0's record holds the
    # whole index, so re-parsing it every poll would cost each save far more than the poll itself.
    state, _ = make_state(1)
    save_node(tmp_path, state, step=5)
    node = NodeMemory(tmp_path, "job", "0123456789abcdef")
    parsed = []
    from_json = PartRecord.from_json.__func__
    monkeypatch.setattr(PartRecord, "from_json", classmethod(lambda cls, data, where: parsed.append(where) or from_json(cls, data, where)))
    slot = node.newest().slot
    for _ in range(5):
        assert node.wait_complete(slot, 5, timeout_s=1.0)
    assert len(parsed) == 2  # the two parts' records, read once
    record = node.complete(slot).records[1]
    node.commit(slot, PartRecord(6, record.part, record.parts, record.size, record.checksum, record.digest))
    assert node.complete(slot) is None and len(parsed) == 3  # the re-committed record is read again


def test_a_record_of_another_format_is_refused():
    with pytest.raises(MemoryFormatError, match="format 3"):
        PartRecord.from_json({"format": 2, "step": 1, "part": 0, "parts": 1, "size": 0, "blake3": "", "digest": ""}, "x.json")
    good = {"format": 3, "step": 1, "part": 0, "parts": 1, "size": 0, "blake3": "", "digest": "", "rank": 0, "world_size": 1}
    assert PartRecord.from_json(good, "x").world_size == 1
    with pytest.raises(MemoryFormatError, match="non-negative integers"):
        PartRecord.from_json({**good, "step": -1}, "x")
    with pytest.raises(MemoryFormatError, match="non-negative integers"):
        PartRecord.from_json({k: v for k, v in good.items() if k != "rank"}, "x")


# --- commit rule and slots ---------------------------------------------------------------------


def test_a_state_is_complete_only_when_every_part_is_committed_for_one_step(tmp_path):
    state, _ = make_state(1)
    save_node(tmp_path, state, step=5)
    node = NodeMemory(tmp_path, "job", "0123456789abcdef")
    newest = node.newest()
    assert newest is not None and newest.step == 5 and len(newest.records) == 2
    # One local rank's part missing: incomplete.
    node.uncommit(newest.slot, 1)
    assert node.complete(newest.slot) is None
    # Its record back, but naming another step: still incomplete.
    other = newest.records[1]
    node.commit(newest.slot, PartRecord(6, other.part, other.parts, other.size, other.checksum, other.digest))
    assert node.complete(newest.slot) is None
    # A part file of another size than recorded: incomplete.
    node.commit(newest.slot, newest.records[1])
    assert node.complete(newest.slot) is not None
    (node.slot_path(newest.slot) / "part-00001.bin").write_bytes(b"short")
    assert node.complete(newest.slot) is None


def test_saves_alternate_slots_and_a_save_cut_short_leaves_the_previous_state(tmp_path):
    state, model = make_state(1)
    t = [tier(tmp_path, local_rank=r, local_world_size=2) for r in range(2)]
    for x in t:
        x.survey(state, fresh=False)
    for step in (1, 2, 3):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        for x in t:
            x.save(step, state)
        for x in t:
            assert x._wait_writer()
    node = NodeMemory(tmp_path, "job", "0123456789abcdef")
    states = sorted((node.complete(s) for s in (0, 1)), key=lambda s: s.step)
    assert [s.step for s in states] == [2, 3] and {s.slot for s in states} == {0, 1}
    # Step 4 starts on rank 0 only (the node dies before rank 1 writes): step 3 is still there.
    with torch.no_grad():
        model[0].weight.add_(1.0)
    t[0].save(4, state)
    assert t[0]._wait_writer()
    assert node.newest().step == 3
    for x in t:
        x.close()


def test_a_save_waits_for_the_nodes_other_ranks_before_overwriting_their_last_complete_state(tmp_path):
    state, _ = make_state(1)
    t = [tier(tmp_path, local_rank=r, local_world_size=2) for r in range(2)]
    for x in t:
        x.survey(state, fresh=False)
        x._saver.writer.timeout_s = 0.3
    t[0].save(1, state)
    t[1].save(1, state)
    assert t[0]._wait_writer() and t[1]._wait_writer()
    t[0].save(2, state)
    assert t[0]._wait_writer()
    # Rank 1 never saved step 2, so rank 0 must not overwrite the slot of step 1 with step 3.
    t[0].save(3, state)
    assert not t[0]._wait_writer()
    assert "did not finish the memory-tier save of step 2" in t[0]._saver.local_failure
    assert t[0].report()[4] == 1.0  # said on the agreement; the tier stops where every rank reads it
    t[0].after_step(4, state, t[0].report())
    assert "did not finish the memory-tier save of step 2" in t[0].failed
    node = NodeMemory(tmp_path, "job", "0123456789abcdef")
    assert node.newest().step == 1
    for x in t:
        x.close()


# --- copies on a GPU ---------------------------------------------------------------------------


def test_only_parameters_and_optimizer_state_count_as_changed_by_the_optimizer_alone():
    # What is copied while the next step computes: exactly what only optimizer.step() changes.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    owned = optimizer_storages([optimizer])
    storages = lambda tensors: {t.untyped_storage().data_ptr() for t in tensors}  # noqa: E731
    assert storages(model.parameters()) <= owned
    assert storages(v for st in optimizer.state.values() for v in st.values()) <= owned
    assert not storages(model.buffers()) & owned  # BatchNorm's running statistics change in forward


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the side-stream copies exist only on GPUs (.ci/device-check runs these)")


def cuda_state(seed: int) -> tuple[dict, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    # Large enough (~64 MB of parameters, ~190 MB with AdamW's state) that the copies are still in
    # flight when the next optimizer step is queued, so a missing wait would tear the saved state.
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)], torch.nn.BatchNorm1d(2048)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}, model, optimizer


def train_step(model, optimizer) -> None:
    model(torch.randn(64, 2048, device="cuda")).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def trained_on_cuda(tmp_path) -> tuple[dict, torch.nn.Module, torch.optim.Optimizer, MemoryTier]:
    """A CUDA state after one step, and a fresh tier on the GPU ready to save it."""
    state, model, optimizer = cuda_state(0)
    train_step(model, optimizer)
    saver = tier(tmp_path, device="cuda")
    saver.survey(state, fresh=True)
    return state, model, optimizer, saver


@cuda
def test_on_a_gpu_the_saved_state_is_the_one_after_its_step_although_the_next_steps_run_during_the_copies(tmp_path):
    state, model, optimizer, saver = trained_on_cuda(tmp_path)
    expected = {k: v.cpu() for k, v in flat(state).items()}
    saver.save(1, state)
    # The next steps are queued at once: their optimizer steps must wait for the parameter and
    # optimizer-state copies, and their forwards change BatchNorm's statistics, copied at the save.
    for _ in range(3):
        train_step(model, optimizer)
    saver.close()
    assert not all(torch.equal(expected[k], v.cpu()) for k, v in flat(state).items())
    target, _, _ = cuda_state(1)
    reader = tier(tmp_path, device="cuda")
    assert restore_newest(reader, target)
    got = flat(target)
    assert all(torch.equal(got[k].cpu(), expected[k]) for k in expected)
    reader.close()


@cuda
def test_on_a_gpu_a_saves_cost_counts_the_copies_the_training_stream_waited_for(tmp_path):
    state, _, optimizer, saver = trained_on_cuda(tmp_path)
    saver.save(1, state)
    optimizer.step()  # at once: the training stream waits for nearly all of the side copies
    torch.cuda.synchronize()
    saver.save(2, state)  # reads what the first save's copies cost the training stream (CUDA events)
    saver.close()
    # ~190 MB over PCIe takes milliseconds, nearly all of which the optimizer step waited for.
    assert saver.copies_s > 0.001
    assert saver.cost_s >= saver.stall_s + saver.copies_s


# --- restore -----------------------------------------------------------------------------------


def test_a_node_state_restores_bitwise_into_fresh_objects(tmp_path):
    saved, _ = make_state(1)
    expected = flat(saved)
    save_node(tmp_path, saved, step=7, local_world_size=3)
    target, _ = make_state(2)
    assert not all(torch.equal(expected[k], v) for k, v in flat(target).items())
    reader = tier(tmp_path)
    survey = reader.survey(target, fresh=False)
    assert [(c.node, c.step) for c in survey.candidates()] == [(0, 7)]
    assert reader.restore(survey, 0, survey.candidates()[0].step, target)
    got = flat(target)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert target["count"].seen == 1
    reader.close()


def test_a_stops_commit_holds_its_step_whether_the_tier_saved_it_already_or_not(tmp_path, monkeypatch):
    saved, _ = make_state(1)
    writer = tier(tmp_path, every=5)
    writer.survey(saved, fresh=False)
    writer.after_step(1, saved, None)  # due: saved, its write in flight
    assert writer.commit(1, saved)
    saves = writer.saves
    assert writer.commit(1, saved) and writer.saves == saves  # already there: not saved twice
    writer.after_step(2, saved, None)  # not due
    assert writer.commit(2, saved) and writer.saves == saves + 1
    assert sorted(writer.store.own_parts(0, 1)) == [1, 2]
    # A write that fails: the commit says so (the stop then goes to storage).
    monkeypatch.setattr(writer.store, "write", lambda *a, **k: (_ for _ in ()).throw(OSError("tmpfs full")))
    assert not writer.commit(3, saved)
    writer.close()
    target, _ = make_state(2)
    assert restore_newest(tier(tmp_path), target)
    assert all(torch.equal(a, b) for a, b in zip(flat(target).values(), flat(saved).values()))


def test_a_restore_in_slices_smaller_than_its_parts_and_tensors_is_still_bitwise(tmp_path, monkeypatch):
    # A large state is sent in slices that cut through parts and tensors alike.
    monkeypatch.setattr(survey_module, "BROADCAST_BYTES", 64)
    saved, _ = make_state(1)
    expected = flat(saved)
    save_node(tmp_path, saved, step=7, local_world_size=2)
    target, _ = make_state(2)
    reader = tier(tmp_path)
    assert reader._resume.slice_bytes() == 64
    assert restore_newest(reader, target)
    got = flat(target)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    reader.close()


class Table:
    """A user's object whose state dict holds a non-contiguous view and, each call, a fresh tensor."""

    def __init__(self) -> None:
        self.table = torch.arange(12.0).reshape(3, 4)

    def state_dict(self) -> dict:
        return {"columns": self.table.t(), "total": self.table.sum().reshape(1)}

    def load_state_dict(self, state: dict) -> None:
        self.table.copy_(state["columns"].t())


def test_each_save_takes_the_states_bytes_as_they_are_in_place_changed_replaced_or_new(tmp_path):
    # A save reuses its views of tensors that stay at the same address (see MemoryTier._pieces):
    # bytes changed in place, a parameter given new storage, a non-contiguous view and a tensor
    # made fresh by each state_dict() must all be saved as they are at that save.
    state, model = make_state(1)
    state["table"] = Table()
    saver = tier(tmp_path)
    saver.survey(state, fresh=True)
    for step in range(1, 5):
        with torch.no_grad():
            if step == 3:
                model[0].weight.data = model[0].weight.data + 1  # new storage, same shape
            else:
                model[0].weight.add_(1)
            state["table"].table.mul_(2)
        saver.save(step, state)
        assert saver._wait_writer()
        expected = flat(state) | {"table": state["table"].table.clone()}
        target, _ = make_state(2)
        target["table"] = Table()
        reader = tier(tmp_path)
        survey = reader.survey(target, fresh=False)
        assert (survey.candidates()[0].node, survey.candidates()[0].step) == (0, step)
        assert reader.restore(survey, 0, survey.candidates()[0].step, target)
        got = flat(target) | {"table": target["table"].table}
        assert all(torch.equal(got[k], expected[k]) for k in expected), step
        reader.close()
    saver.close()


def test_a_damaged_part_is_refused_before_anything_is_loaded(tmp_path):
    saved, _ = make_state(1)
    save_node(tmp_path, saved, step=7)
    node = NodeMemory(tmp_path, "job", "0123456789abcdef")
    path = node.slot_path(node.newest().slot) / "part-00001.bin"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(raw)
    target, _ = make_state(2)
    before = flat(target)
    reader = tier(tmp_path)
    survey = reader.survey(target, fresh=False)
    assert reader.restore(survey, 0, survey.candidates()[0].step, target) is False
    assert all(torch.equal(v, before[k]) for k, v in flat(target).items())
    reader.close()


def test_a_fresh_start_forgets_the_nodes_states(tmp_path):
    saved, _ = make_state(1)
    save_node(tmp_path, saved, step=7)
    reader = tier(tmp_path)
    survey = reader.survey(saved, fresh=True)
    assert survey.candidates() == []
    reader.close()


def test_a_state_that_does_not_fit_the_registered_objects_is_a_clear_error(tmp_path):
    saved, _ = make_state(1)
    save_node(tmp_path, saved, step=7)
    model = torch.nn.Linear(2, 2)
    target = {"model": ModelState(model), "optimizer": OptimizerState(model, torch.optim.SGD(model.parameters(), lr=1)),
              "count": Counter()}  # fmt: skip
    reader = tier(tmp_path)
    survey = reader.survey(target, fresh=False)
    with pytest.raises(MemoryTierError, match="does not fit this run's registered objects") as info:
        reader.restore(survey, 0, survey.candidates()[0].step, target)
    assert "'model'" in str(info.value) and "memory_overhead=0" in str(info.value)
    reader.close()


# --- space, clean-up, interval -------------------------------------------------------------------


def test_too_little_room_is_one_clear_error_naming_the_setting_and_the_ways_out(tmp_path, monkeypatch):
    state, _ = make_state(1)
    monkeypatch.setattr(NodeMemory, "free_bytes", lambda self: 1000)
    with pytest.raises(MemoryTierError) as info:
        tier(tmp_path).survey(state, fresh=False)
    text = str(info.value)
    for needle in ("checkpoint.memory_dir", "only 0.00 MiB (1,000 bytes) is free", "--shm-size", "checkpoint.memory_overhead=0"):
        assert needle in text


def test_two_nodes_sharing_one_directory_turn_the_tier_off_instead_of_mixing_their_parts(tmp_path):
    t = tier(tmp_path)
    t.store.open()
    offers = (NodeOffer(0, 0, 0, 42, (-1, 9), (0, 0), (-1, -1), 9, 10, 10**9),
              NodeOffer(1, 1, 0, 42, (-1, 9), (0, 0), (-1, -1), 9, 10, 10**9))
    survey = t._check(Survey(offers), "")
    assert not t.enabled and "give each agent its own --checkpoint.memory_dir" in t.disabled
    # No saves this attempt; the complete, checksummed state already there is still offered to read.
    assert [(c.node, c.step) for c in survey.candidates()] == [(0, 9), (1, 9)]
    t.after_step(10, make_state(1)[0], None)
    assert t.saves == 0
    t.close()


def test_an_ended_runs_directory_is_removed_and_a_live_ones_is_kept(tmp_path):
    live = NodeMemory(tmp_path, "other", "1111111111111111")
    live.open()
    ended = NodeMemory(tmp_path, "ended", "2222222222222222")
    ended.open()
    ended.close()
    unrelated = tmp_path / "not-ours"
    unrelated.mkdir()
    state, _ = make_state(1)
    t = tier(tmp_path)
    t.survey(state, fresh=False)
    assert live.path.exists() and not ended.path.exists() and unrelated.exists()
    # The live run's lock is held: an exclusive attempt fails (what the clean-up relies on).
    fd = os.open(live.path / "lock", os.O_RDWR)
    with pytest.raises(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)
    live.close()
    t.close()
    t.remove()
    assert not t.store.path.exists()


def test_the_default_directories_of_other_working_directories_are_cleaned_up_too(tmp_path):
    # The default memory dirs share a parent, one per working directory: a run killed in one must
    # not hold node memory until a run is started from that same directory again.
    mine, other = tmp_path / "cwd-a", tmp_path / "cwd-b"
    ended = NodeMemory(other, "ended", "2222222222222222")
    ended.open()
    ended.close()
    live = NodeMemory(other, "live", "3333333333333333")
    live.open()
    assert NodeMemory(mine, "job", "0123456789abcdef").remove_stale_runs() == []  # its own directory only
    assert NodeMemory(mine, "job", "0123456789abcdef").remove_stale_runs(siblings=True) == [ended.path]
    assert live.path.exists()
    live.close()


def test_the_interval_follows_the_agreed_cost_and_step_time(tmp_path):
    state, _ = make_state(1)
    t = tier(tmp_path, every=0, overhead=0.02)
    t.survey(state, fresh=False)
    t.after_step(1, state, None)
    assert t.saves == 1 and t.interval == 1
    # Agreed: a save costs 8 ms, a step takes 100 ms: aiming at 80 % of 2 % of 100 ms, 1.6 ms a
    # step -> every 5 steps.
    t.after_step(2, state, (0.008, 0.100, 0.0, 0.0, 0.0))
    assert t.interval == 5 and t.saves == 2
    for step in range(3, 7):
        t.after_step(step, state, (0.008, 0.100, 0.0, 0.0, 0.0))
    assert t.saves == 2
    t.after_step(7, state, (0.008, 0.100, 0.0, 0.0, 0.0))
    assert t.saves == 3
    assert NodeMemory(tmp_path, "job", "0123456789abcdef").last_step() == 7
    t.close()


def test_a_save_that_waits_for_a_slow_write_does_not_count_the_wait_and_the_interval_outlasts_the_write(tmp_path, monkeypatch):
    state, _ = make_state(1)
    t = tier(tmp_path, every=0, overhead=0.02)
    t.survey(state, fresh=False)
    write = NodeMemory.write

    def slow_write(self, *args):
        time.sleep(0.3)
        return write(self, *args)

    monkeypatch.setattr(NodeMemory, "write", slow_write)
    t.after_step(1, state, None)
    t.after_step(2, state, None)  # nothing measured yet: due again, and the first write still runs
    assert t.saves == 2 and t.waited_s > 0.2
    # The wait is a one-off, not what a save costs: counted, it would space saves out for good.
    assert t.stall_s < 0.2 and 0 < t.report()[0] < 0.2
    t.close()
    assert t.write_s > 0.3 and t.report()[2] > 0.3
    # Agreed: a cheap save, 100 ms steps, a 350 ms write -> every 4 steps, so no save waits again.
    t.after_step(3, state, (0.001, 0.100, 0.350, 0.0, 0.0))
    assert t.interval == 4 and "write takes 350 ms" in t.interval_why
    t.close()


def test_a_saves_cost_counts_its_background_write_only_when_training_runs_on_the_cpu(tmp_path):
    state, _ = make_state(1)
    t = tier(tmp_path, every=0, overhead=0.02)
    t.survey(state, fresh=False)
    t.after_step(1, state, None)
    assert t.report()[0] == 0.0  # a save's cost is known once its write is done
    t.close()  # the background write is done
    assert t.stall_s > 0 and t.write_cpu_s > 0
    # On the CPU the write takes cores from the step: the agreement and the interval see it.
    assert t.report()[0] == pytest.approx(t.stall_s + t.write_cpu_s)
    # On a GPU it runs on host cores the step does not use: only the stall counts (and the copies,
    # none without CUDA) -- forced here, on CPUs, as a GPU node derives it.
    gpu = tier(tmp_path / "gpu", every=0, overhead=0.02, direct_cost="copies")
    gpu.survey(state, fresh=False)
    gpu.after_step(1, state, None)
    gpu.close()
    assert gpu.write_cpu_s > 0 and gpu.cost_s == gpu.stall_s


def test_where_ranks_share_cores_a_saves_write_costs_its_cpu_time_times_the_ranks_per_core(tmp_path, monkeypatch):
    # 3 ranks on 2 cores: each rank's write takes its CPU time from cores that are all stepping, and
    # the node's three writes delay every rank's step by 1.5x one write's CPU time.
    monkeypatch.setattr(tier_module, "_cores_per_rank", lambda local_world_size: 2 / local_world_size)
    state, _ = make_state(1)
    t = tier(tmp_path, every=0, overhead=0.02, local_world_size=3)
    assert t.shape.cpu_weight == 1.5
    t.survey(state, fresh=False)
    t.after_step(1, state, None)
    t.close()
    assert t.write_cpu_s > 0
    assert t.cost_s == pytest.approx(t.stall_s + 1.5 * t.write_cpu_s)
    assert t.report()[0] == pytest.approx(t.cost_s)


class _Clock:
    """``time`` for the tier, with a ``perf_counter`` the test moves (the write thread's CPU time is real)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    @staticmethod
    def thread_time() -> float:
        return time.thread_time()


def test_the_interval_follows_recent_medians_not_one_slow_step_or_save(tmp_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(tier_module, "time", clock)
    state, _ = make_state(1)
    t = tier(tmp_path, every=0, overhead=0.02)
    t.survey(state, fresh=False)
    for step in range(1, 41):
        clock.now += 2.0 if step == 20 else 0.1  # one step 20x slower: a neighbour's burst, a GC pause
        t.after_step(step, state, None)
        assert t.report()[1] in (0.0, pytest.approx(0.1))
    assert t.step_s == pytest.approx(0.1)
    # Saves of 1 ms, then one of 3 s: the costs the agreement carries stay at the median.
    costs = iter([0.001] * 5 + [3.0] + [0.001] * 100)
    monkeypatch.setattr(MemoryTier, "cost_s", property(lambda self: next(costs)))
    for _ in range(11):
        t._wait_writer()
        t._saver.writer.pending = t._saver.writer.pool.submit(lambda: None)
    assert t.report()[0] == pytest.approx(0.001)
    t.after_step(41, state, t.report()[:3] + (0.0, 0.0))
    assert t.interval == 1, t.interval_why  # 1 ms of 100 ms fits 2 %: the 3 s save did not space saves out
    t.close()


def test_a_saves_cost_counts_what_its_write_takes_from_the_steps_it_overlaps(tmp_path, monkeypatch):
    """What the write's CPU time misses (caches, memory bandwidth, a rank waiting for a slower one)
    shows in the steps the write overlaps: here 20 ms more in each step right after a save."""
    clock = _Clock()
    monkeypatch.setattr(tier_module, "time", clock)
    state, _ = make_state(1)
    t = tier(tmp_path, every=0, overhead=0.02)
    t.survey(state, fresh=False)
    intervals = []
    saved_before = False
    for step in range(1, 401):
        clock.now += 0.100 + (0.020 if saved_before else 0.0)
        saves = t.saves
        t.after_step(step, state, t.report())  # one rank: the agreement is its own report
        saved_before = t.saves > saves
        intervals.append(t.interval)
    t.close()
    # The write's CPU time alone (well under 2 ms against 100 ms steps) would save every step; the
    # steps say 20 ms a save, so every 10 steps or more (2 % of 100 ms is 2 ms a step).
    assert t.write_cpu_s < 0.002
    assert t.background_s == pytest.approx(0.020, abs=1e-6)
    assert t.cost_s == pytest.approx(0.020, abs=1e-6)  # the stall is 0 on this clock
    assert t.report()[0] == pytest.approx(0.020, abs=1e-6) and t.report()[3] == 0.0
    assert intervals[-1] >= 10, t.interval_why
    # Before the steps could tell, every 2nd step rather than every step: steps between saves to weigh.
    assert 2 in intervals[:40] and 1 not in intervals[5:40]


def test_background_cost_from_the_steps_a_write_touches_against_the_rest():
    rng = random.Random(0)
    # A save every 5 steps (phases 1..5), its write slowing the next step by 6 ms, 10 ms of noise.
    steps = [(p, 0.100 + (0.006 if p == 1 else 0.0) + rng.gauss(0, 0.010)) for _ in range(60) for p in range(1, 6)]
    assert background_cost(steps, 1) == pytest.approx(0.006, abs=0.003)
    # One step 20x slower (a neighbour's burst) does not move it.
    assert background_cost(steps + [(1, 2.0)], 1) == pytest.approx(background_cost(steps, 1), abs=0.001)
    # A write over two steps: both count.
    two = [(p, 0.100 + (0.004 if p <= 2 else 0.0)) for _ in range(40) for p in range(1, 6)]
    assert background_cost(two, 2) == pytest.approx(0.008)
    # Not told: saves every step (no step untouched), too few saves, too few untouched steps.
    assert background_cost([(1, 0.1)] * 100, 1) is None
    assert background_cost(steps[: 5 * (MIN_SAVES - 1)], 1) is None
    assert background_cost([(1, 0.1)] * 40 + [(2, 0.1)] * 10, 1) is None


def test_interval_policy():
    assert interval(0.0, 0.1, 0.02) == (1, "no measurement yet: every step")
    assert interval(0.001, 0.1, 0.02)[0] == 1
    assert interval(0.0021, 0.1, 0.02)[0] == 2
    # The budget is a ceiling: 1.9 ms of a 100 ms step is under 2 % but over the 1.6 % aimed at.
    steps, why = interval(0.0019, 0.1, 0.02)
    assert steps == 2 and "budget 2.0% (aiming at 1.6%)" in why
    steps, why = interval(100.0, 0.001, 0.02)
    assert steps == MAX_INTERVAL and "capped" in why
    # No more often than the background write keeps up with: 250 ms of writing, 100 ms steps.
    steps, why = interval(0.001, 0.1, 0.02, write_s=0.25)
    assert steps == 3 and "background write takes 250 ms: every 3 steps" in why
    assert interval(0.008, 0.1, 0.02, write_s=0.25)[0] == 5  # the cost binds
    with pytest.raises(ValueError, match="must be positive"):
        interval(1.0, 1.0, 0.0)


def test_resume_choice_takes_the_newest_state_anywhere():
    assert choose_resume([Candidate(1, 57), Candidate(0, 56)], 50).tier == "memory"
    choice = choose_resume([Candidate(1, 57), Candidate(0, 57)], 50)
    assert (choice.tier, choice.node, choice.step) == ("memory", 0, 57)
    assert choose_resume([Candidate(0, 50)], 50).tier == "memory"  # memory wins a tie
    assert choose_resume([Candidate(0, 49)], 50).tier == "durable"
    assert (choose_resume([], 50).tier, choose_resume([], None).tier) == ("durable", "none")


def test_the_settings_are_validated_with_the_field_named():
    from elastic_ddp.config import ConfigError, load_config

    cfg = load_config([])  # on by default, in a directory of this working directory's own
    assert (cfg.checkpoint.memory_overhead, cfg.checkpoint.memory_every_steps, cfg.checkpoint.memory_asked) == (0.02, 0, False)
    assert cfg.checkpoint.memory_path.startswith("/dev/shm/elastic_ddp/")
    for flag in ("--checkpoint.memory_overhead=1.5", "--checkpoint.memory_overhead=-0.1", "--checkpoint.memory_every_steps=-1"):
        with pytest.raises(ConfigError, match=flag.split("=")[0].removeprefix("--")):
            load_config([flag])
    assert load_config(["--checkpoint.memory_every_steps=1"]).checkpoint.memory_asked
    # No setting is silently a no-op: what the tier's switch turns off is named.
    for flag in ("--checkpoint.memory_every_steps=1", "--checkpoint.memory_dir=/dev/shm/x"):
        with pytest.raises(ConfigError, match=f"{flag.split('=')[0].removeprefix('--')}.*has no effect: checkpoint.memory_overhead=0"):
            load_config([flag, "--checkpoint.memory_overhead=0"])


def test_the_node_shape_is_derived_from_the_device_and_the_cores_and_each_value_can_be_forced():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 3)  # a device object needs no GPU
    assert node_shape(cpu, 8) == NodeShape(write_threads=1, read_threads=8, direct_cost="write_cpu")
    # A GPU node: half the rank's share of the cores hash a save (1 to 4), the copies are its direct cost.
    assert [node_shape(cuda, cores).write_threads for cores in (1, 2, 3, 4, 8, 9, 64)] == [1, 1, 1, 2, 4, 4, 4]
    assert node_shape(cuda, 2) == NodeShape(write_threads=1, read_threads=2, direct_cost="copies")  # 16 cores, 8 ranks
    # Forced: a GPU node's shape on a 1-core CPU rank, and a CPU's on a GPU.
    assert node_shape(cpu, 1, write_threads=4, read_threads=3, direct_cost="copies") == NodeShape(4, 3, "copies")
    assert node_shape(cuda, 8, write_threads=1, direct_cost="write_cpu") == NodeShape(1, 8, "write_cpu")
    # Ranks sharing cores (3 ranks on 2 cores, 12 on 8): one thread each, and the write's CPU time
    # weighs as much more as there are ranks per core; a core or more per rank: weight 1.
    assert node_shape(cpu, 2 / 3) == NodeShape(1, 1, "write_cpu", cpu_weight=1.5)
    assert node_shape(cuda, 2 / 3).cpu_weight == 1.5 and node_shape(cpu, 1.5).cpu_weight == 1.0


def test_a_gpu_nodes_threads_run_on_cpus_and_every_thread_of_the_tier_ends_with_it(tmp_path, monkeypatch):
    def tier_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("memory-tier")]

    monkeypatch.setattr(tier_module, "_cores_per_rank", lambda local_world_size: 1)  # this CPU's derived values
    derived = tier(tmp_path)
    assert derived.shape == NodeShape(1, 1, "write_cpu") and (derived.write_threads, derived.read_threads) == (1, 1)
    derived.close()
    saved, _ = make_state(1)
    expected = flat(saved)
    writer = tier(tmp_path, write_threads=4, read_threads=3, direct_cost="copies")
    assert (writer.write_threads, writer.read_threads, writer.shape.direct_cost) == (4, 3, "copies")
    writer.survey(saved, fresh=False)
    for step in (1, 2, 3):  # each part hashed beside its write, on the node memory's own helper thread
        writer.after_step(step, saved, None)
    writer.commit(3, saved)
    assert "memory-tier-hash_0" in tier_threads()
    writer.close()
    assert tier_threads() == []  # the writer's and the hashing pool's threads end with the tier
    target, _ = make_state(2)
    reader = tier(tmp_path, read_threads=3)
    assert restore_newest(reader, target)
    assert all(torch.equal(v, expected[k]) for k, v in flat(target).items())
    reader.close()
    assert tier_threads() == []


def test_an_overhead_of_zero_turns_the_tier_off(tmp_path):
    state, _ = make_state(1)
    t = tier(tmp_path, overhead=0.0)
    assert t.survey(state, fresh=False) is None
    t.after_step(1, state, None)
    assert t.saves == 0 and list(tmp_path.iterdir()) == []


def test_on_by_default_a_node_without_room_turns_the_tier_off_in_one_line_instead_of_failing(tmp_path, monkeypatch, caplog):
    state, _ = make_state(1)
    monkeypatch.setattr(NodeMemory, "free_bytes", lambda self: 1000)
    t = tier(tmp_path)
    t.required = False  # no memory-tier setting was given: the tier is merely on by default
    survey = t.survey(state, fresh=False)
    assert not t.enabled and survey.candidates() == []
    assert "only 0.00 MiB (1,000 bytes) is free" in t.disabled and "memory tier is off" in t.disabled
    assert "--shm-size" in t.disabled and "memory_overhead=0" in t.disabled
    assert [r.message for r in caplog.records if "memory tier is off" in r.message] == [f"[0/-] {t.disabled}"]


def test_a_run_whose_agent_restarts_its_workers_is_not_taken_for_ended(tmp_path, monkeypatch):
    # Between a worker's death and its restart no worker of the run holds the lock: another run
    # started on the host meanwhile must not delete the state the restart is about to resume.
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
        monkeypatch.setattr(os, "getppid", lambda: agent.pid)
        restarting = NodeMemory(tmp_path, "restarting", "4444444444444444")
        restarting.open()
        restarting.close()  # its workers are gone; their agent lives
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
        other = NodeMemory(tmp_path, "other", "0123456789abcdef")
        assert other.remove_stale_runs() == [] and restarting.path.exists()
    finally:
        agent.kill()
        agent.wait()
    assert other.remove_stale_runs() == [restarting.path]
