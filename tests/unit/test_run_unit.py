"""The public API's protocol pieces on their own -- a Step's weighting and its misuse errors, the data
state's refusal to resume over other data, the generators' seeding -- then launch() itself, as a
one-rank job in a process of its own: it trains, resumes exactly, and refuses to end before its
steps are saved."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import default_collate

from elastic_ddp.data import ORDER_VERSION, DataCursor, ElasticSampler, make_step_batch, sample_seeds
from elastic_ddp.worker.run import RunError
from elastic_ddp.worker.seeding import StepSeeder, seed_everything
from elastic_ddp.worker.step import DataState, Step


pytestmark = pytest.mark.usefixtures("one_thread")


class Points(torch.utils.data.Dataset):
    """Sample ``i``: ``(x, target)``, float64 values that depend on ``i`` only."""

    def __init__(self, size: int = 20) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(3, generator=torch.Generator().manual_seed(index), dtype=torch.float64)
        return x, x.sum(dim=0, keepdim=True) * 0.5


class SyncRecorder:
    """Stands in for DDP, whose only part a Step uses is ``no_sync()``; records when it is active."""

    def __init__(self) -> None:
        self.unsynced = False

    @contextlib.contextmanager
    def no_sync(self):
        self.unsynced = True
        try:
            yield
        finally:
            self.unsynced = False


def make_step(rank: int = 0, world_size: int = 1, batch_size: int = 10, micro_batch_size: int = 2,
              dataset: Points | None = None) -> tuple[Step, SyncRecorder]:  # fmt: skip
    dataset = dataset or Points()
    sampler = ElasticSampler(len(dataset), batch_size, seed=0)
    batch = make_step_batch(dataset, sampler, DataCursor(0, 5), 7, rank, world_size, micro_batch_size)
    recorder = SyncRecorder()
    return Step(batch, recorder, torch.device("cpu")), recorder


def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 1, dtype=torch.float64)


def gradient(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# --- Step ------------------------------------------------------------------------------------


def test_uneven_splits_are_weighted_to_the_global_batch_mean_gradient_and_loss():
    dataset, model = Points(), linear()
    # 10 samples over 3 ranks (4, 3, 3), micro-batches of at most 2: (2, 2), (2, 1), (2, 1).
    grads, totals, sizes = [], torch.zeros(2, dtype=torch.float64), []
    for rank in range(3):
        replica = copy.deepcopy(model)
        step, _ = make_step(rank, 3, dataset=dataset)
        sizes.append([])
        for x, target in step:
            sizes[-1].append(len(step.micro.indices))
            step.backward(F.mse_loss(replica(x), target))  # the micro-batch's mean loss
        step._check_complete()
        grads.append(gradient(replica))
        totals += step._loss_and_samples()  # what the run all-reduces at a logged step
    assert sizes == [[2, 2], [2, 1], [2, 1]]

    sampler = ElasticSampler(len(dataset), 10, seed=0)
    x, target = default_collate([dataset[i] for i in sampler.batch_at(DataCursor(0, 5))[0]])
    reference = copy.deepcopy(model)
    loss = F.mse_loss(reference(x), target)
    loss.backward()
    # DDP averages the ranks' gradients.
    torch.testing.assert_close(torch.stack(grads).mean(dim=0), gradient(reference), rtol=1e-12, atol=1e-14)
    # The logged loss is summed in float32 on the device: the global mean to float32 precision.
    assert totals[1].item() == 10 and (totals[0] / totals[1]).item() == pytest.approx(loss.item(), rel=1e-6)


def test_ddp_synchronises_gradients_only_on_the_last_micro_batch():
    step, recorder = make_step(micro_batch_size=3)
    unsynced = []
    for x, target in step:
        unsynced.append(recorder.unsynced)
        step.backward((x.sum() * 0).requires_grad_())
    assert unsynced == [True, True, True, False]  # 10 samples in micro-batches of 3, 3, 3, 1
    assert recorder.unsynced is False
    step._check_complete()


def test_a_rank_without_samples_backpropagates_a_zero_weight_dummy():
    model = linear()
    step, _ = make_step(rank=4, world_size=5, batch_size=3)
    assert step.indices == []
    for x, target in step:
        assert step.micro.dummy and x.shape == (1, 3)
        step.backward(F.mse_loss(model(x), target))
    step._check_complete()
    assert torch.count_nonzero(gradient(model)) == 0  # in DDP's all-reduce, adding nothing
    assert step._loss_and_samples().tolist() == [0.0, 0.0]


def test_a_micro_batch_that_ends_without_backward_is_an_error():
    step, _ = make_step()
    with pytest.raises(RunError, match=r"Step 7: micro-batch 1 of 5 ended without step.backward\(loss\)"):
        for _ in step:
            pass


def test_the_last_micro_batch_without_backward_is_an_error_too():
    step, _ = make_step(micro_batch_size=0)
    with pytest.raises(RunError, match=r"micro-batch 1 of 1 ended without step.backward"):
        for _ in step:
            pass


def test_backward_twice_for_one_micro_batch_is_an_error():
    model = linear()
    step, _ = make_step()
    with pytest.raises(RunError, match=r"Step 7: step.backward\(\) was called twice for one micro-batch"):
        for x, target in step:
            step.backward(F.mse_loss(model(x), target))
            step.backward(F.mse_loss(model(x), target))


def test_a_loss_that_is_not_a_scalar_is_an_error_naming_its_shape():
    model = linear()
    step, _ = make_step()
    with pytest.raises(RunError, match=r"needs the micro-batch's mean loss \(a scalar\), got shape \(2, 1\)"):
        for x, target in step:
            step.backward(F.mse_loss(model(x), target, reduction="none"))


def test_a_step_that_ends_before_its_last_micro_batch_is_an_error():
    model = linear()
    step, _ = make_step()
    for x, target in step:
        step.backward(F.mse_loss(model(x), target))
        break
    with pytest.raises(RunError, match=r"Step 7: the step ended after 1 of 5 micro-batches"):
        step._check_complete()
    untouched, _ = make_step()
    with pytest.raises(RunError, match=r"ended after 0 of 5 micro-batches"):
        untouched._check_complete()


def test_the_micro_batch_is_only_available_while_iterating():
    step, _ = make_step()
    with pytest.raises(RunError, match=r"step.micro is only available inside `for batch in step:`"):
        step.micro
    with pytest.raises(RunError, match="step.micro is only available"):
        step.backward(torch.tensor(1.0, requires_grad=True))


def test_step_knows_its_samples_and_collects_extra_scalars():
    step, _ = make_step(rank=1, world_size=3)
    sampler = ElasticSampler(20, 10, seed=0)
    assert step.number == 7
    assert step.indices == sampler.slice_at(DataCursor(0, 5), 4, 7)
    model = linear()
    seen = []
    for x, target in step:
        seen += step.micro.indices
        assert step.micro.sample_seeds == sample_seeds(0, 7, step.micro.indices)
        step.backward(F.mse_loss(model(x), target))
    assert seen == step.indices
    norm = torch.tensor(2.5)
    step.log(grad_norm=norm, tokens=12)
    assert step.scalars == {"train/grad_norm": norm, "train/tokens": 12}


# --- DataState -------------------------------------------------------------------------------


def saved_state(num_samples: int = 20, fingerprint: str = "abc", order: str = ORDER_VERSION) -> dict:
    data = DataState()
    data.bind(num_samples, fingerprint, "(none)")
    data.cursor = DataCursor(epoch=2, consumed=7)
    state = json.loads(json.dumps(data.state_dict()))  # as a checkpoint stores it
    state["order"] = order
    return state


def test_data_state_round_trips_the_cursor_and_what_it_points_into():
    state = saved_state()
    assert state == {"epoch": 2, "consumed": 7, "num_samples": 20, "fingerprint": "abc", "order": ORDER_VERSION}
    resumed = DataState()
    resumed.load_state_dict(state)
    resumed.bind(20, "abc", "ckpt/step-5")
    assert resumed.cursor == DataCursor(epoch=2, consumed=7)


@pytest.mark.parametrize(
    "saved,now,problem",
    [
        (dict(num_samples=20), (21, "abc"), "it was written for a dataset of 20 samples, this one has 21"),
        (dict(fingerprint="abc"), (20, "abd"), "its dataset fingerprint is 'abc', this one's is 'abd'"),
        (dict(order="feistel-6r-v0"), (20, "abc"),
         f"its data order is 'feistel-6r-v0', this version uses '{ORDER_VERSION}'"),
    ],
    ids=["size", "fingerprint", "order-version"],
)  # fmt: skip
def test_a_resume_over_other_data_is_refused_naming_the_checkpoint_and_the_difference(saved, now, problem):
    data = DataState()
    data.load_state_dict(saved_state(**saved))
    with pytest.raises(RunError) as raised:
        data.bind(*now, "s3://bucket/run/step-000000005")
    message = str(raised.value)
    assert message.startswith("Checkpoint s3://bucket/run/step-000000005 cannot continue over this dataset: ")
    assert problem in message
    assert "repeating some and skipping others" in message


def test_every_difference_is_named_at_once():
    data = DataState()
    data.load_state_dict(saved_state(num_samples=20, fingerprint="abc", order="other"))
    with pytest.raises(RunError) as raised:
        data.bind(30, "xyz", "ckpt")
    assert str(raised.value).count("; ") >= 2  # order, size and fingerprint in one message


def test_a_fresh_data_state_binds_to_any_dataset():
    data = DataState()
    data.bind(5, "", "(none)")
    assert (data.num_samples, data.fingerprint, data.cursor) == (5, "", DataCursor())


def test_the_refusal_names_the_override():
    data = DataState()
    data.load_state_dict(saved_state(num_samples=20))
    with pytest.raises(RunError, match="pass --data.on_change=next_epoch to continue at the start of the next epoch"):
        data.bind(21, "abc", "ckpt", on_change="refuse")
    assert data.cursor == DataCursor(epoch=2, consumed=7)  # nothing moved


@pytest.mark.parametrize(
    "saved,now,problem",
    [
        (dict(num_samples=20), (24, "abc"), "it was written for a dataset of 20 samples, this one has 24"),
        (dict(fingerprint="abc"), (20, "abd"), "its dataset fingerprint is 'abc', this one's is 'abd'"),
        (dict(order="feistel-6r-v0"), (20, "abc"),
         f"its data order is 'feistel-6r-v0', this version uses '{ORDER_VERSION}'"),
    ],
    ids=["size", "fingerprint", "order-version"],
)  # fmt: skip
def test_with_next_epoch_a_resume_over_other_data_starts_the_next_epoch_and_says_what_is_left(saved, now, problem):
    data = DataState()
    data.load_state_dict(saved_state(**saved))  # 7 of 20 samples of epoch 2 consumed
    note = data.bind(*now, "s3://bucket/run/step-000000005", on_change="next_epoch")
    assert data.cursor == DataCursor(epoch=3, consumed=0)
    assert (data.num_samples, data.fingerprint, data.order) == (*now, ORDER_VERSION)
    assert note.startswith("Checkpoint s3://bucket/run/step-000000005 does not match this dataset: ")
    assert problem in note
    assert "continues at the start of epoch 3 of this data; the rest of epoch 2 -- 13 samples not yet consumed -- " \
           "is not trained." in note  # fmt: skip
    # What the next checkpoint stores: a position in the new data, resumed from exactly.
    again = DataState()
    again.load_state_dict(json.loads(json.dumps(data.state_dict())))
    assert again.bind(*now, "ckpt/step-6", on_change="next_epoch") is None
    assert again.cursor == DataCursor(epoch=3, consumed=0)
    ElasticSampler(now[0], 8, 0).slice_at(again.cursor, 0, 8)  # a valid position of the new data


def test_with_next_epoch_a_checkpoint_at_an_epochs_end_starts_the_epoch_it_had_not_begun():
    state = saved_state()
    state["consumed"] = 0  # a finished epoch is stored as the start of the next
    data = DataState()
    data.load_state_dict(state)
    note = data.bind(30, "abc", "ckpt", on_change="next_epoch")
    assert data.cursor == DataCursor(epoch=2, consumed=0)
    assert "continues at the start of epoch 2 of this data; the checkpoint had not begun that epoch" in note


def test_with_next_epoch_unchanged_data_resumes_exactly_and_warns_of_nothing():
    data = DataState()
    data.load_state_dict(saved_state())
    assert data.bind(20, "abc", "ckpt", on_change="next_epoch") is None
    assert data.cursor == DataCursor(epoch=2, consumed=7)
    fresh = DataState()
    assert fresh.bind(5, "", "(none)", on_change="next_epoch") is None
    assert fresh.cursor == DataCursor()


# --- generators ------------------------------------------------------------------------------


def draws() -> tuple[float, float, float]:
    return torch.rand(1).item(), random.random(), float(np.random.rand())


def test_seed_everything_seeds_torch_python_and_numpy_alike():
    seed_everything(2**40 + 5)  # derived seeds are 63-bit; NumPy takes the low 32 bits
    expected = draws()
    seed_everything(2**40 + 5)
    assert draws() == expected
    seed_everything(2**40 + 6)
    other = draws()
    assert all(a != b for a, b in zip(other, expected))


def test_the_step_seeder_draws_what_seed_everything_draws():
    seeder = StepSeeder()
    for seed in (0, 5, 2**40 + 5, 2**63 - 1):
        seed_everything(seed)
        expected = draws()
        torch.rand(3)  # move every generator on before the step seeder resets them
        random.random()
        np.random.rand()
        seeder(seed)
        assert draws() == expected


def test_the_step_seeder_seeds_through_torch_where_another_accelerator_family_is_available(monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    calls = []
    monkeypatch.setattr(torch, "manual_seed", lambda seed: calls.append(seed))
    StepSeeder()(7)
    assert calls == [7]


# --- launch(): a one-rank job in a process of its own ----------------------------------------

SCRIPT = """
import json, os
import torch
import torch.nn.functional as F
from torch import nn
import elastic_ddp as edp


class Points(torch.utils.data.Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, index):
        return torch.randn(4, generator=torch.Generator().manual_seed(index)), index % 2


def train(run):
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 2)).to(run.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp_model = run.setup(model, optimizer)
    print("START", run.step, run.resumed_from is not None, run.resumed_tier, flush=True)
    for step in run.steps(Points()):
        for x, y in step:
            step.backward(F.cross_entropy(ddp_model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        print("STEP", json.dumps([step.number, step.indices]), flush=True)
        if step.number == int(os.environ.get("BREAK_AFTER_STEP", "0")):
            break
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    print("WEIGHTS", json.dumps(weights.tolist()), flush=True)


if __name__ == "__main__":
    edp.launch(train)
"""

# torchrun's variables: without them a script is a job of one rank on a private rendezvous.
_TORCHRUN_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
)  # fmt: skip


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(SCRIPT)

    def run(root: str, *flags: str, **env: str) -> subprocess.CompletedProcess:
        environ = {key: value for key, value in os.environ.items() if key not in _TORCHRUN_VARS}
        environ.update(OMP_NUM_THREADS="1", **env)
        return subprocess.run(
            [sys.executable, str(path), f"--run.root={tmp_path / root}", f"--checkpoint.url={tmp_path / root / 'ckpt'}",
             "--train.global_batch_size=4", "--checkpoint.every_steps=2", "--logging.console=false", *flags],
            capture_output=True, text=True, env=environ, cwd=tmp_path, timeout=240,
        )  # fmt: skip

    return run


def lines(result: subprocess.CompletedProcess, tag: str) -> list:
    return [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines() if line.startswith(f"{tag} ")]


def test_a_one_rank_launch_trains_then_resumes_exactly_with_more_steps(script, tmp_path):
    first = script("split", "--train.max_steps=3")
    assert first.returncode == 0, first.stderr
    assert "START 0 False None" in first.stdout
    assert [number for number, _ in lines(first, "STEP")] == [1, 2, 3]
    assert (tmp_path / "split" / "ckpt").is_dir()  # the checkpoints went where checkpoint.url says

    second = script("split", "--train.max_steps=5")
    assert second.returncode == 0, second.stderr
    # The first run finished, which freed its node memory: the durable checkpoint serves.
    assert "START 3 True durable" in second.stdout
    assert [number for number, _ in lines(second, "STEP")] == [4, 5]

    straight = script("straight", "--train.max_steps=5")
    assert straight.returncode == 0, straight.stderr
    # The same samples per step, and (same world size, dropout included) the same weights, bit for bit.
    assert lines(first, "STEP") + lines(second, "STEP") == lines(straight, "STEP")
    sampler, cursor, expected = ElasticSampler(20, 4, seed=1337), DataCursor(), []
    for number in range(1, 6):
        indices, cursor = sampler.batch_at(cursor)
        expected.append([number, indices])
    assert lines(straight, "STEP") == expected
    assert lines(second, "WEIGHTS") == lines(straight, "WEIGHTS")
    assert lines(first, "WEIGHTS") != lines(straight, "WEIGHTS")


def test_a_run_killed_mid_way_resumes_from_node_memory_at_the_last_completed_step(script, tmp_path):
    flags = ("--train.max_steps=6", "--checkpoint.every_steps=3", "--checkpoint.memory_overhead=0.02",
             "--checkpoint.memory_every_steps=1", f"--checkpoint.memory_dir={tmp_path / 'shm'}")  # fmt: skip
    killed = script("mem", *flags, ELASTIC_DDP_FAULT="kill@5")  # SIGKILL at the start of step 5
    assert killed.returncode == -9, killed.stderr
    assert [number for number, _ in lines(killed, "STEP")] == [1, 2, 3, 4]

    again = script("mem", *flags)
    assert again.returncode == 0, again.stderr
    # Step 4 from memory -- or step 3 when the kill beat the background write of step 4's state;
    # either way from memory, at most one step redone.
    records = [json.loads(line) for line in (tmp_path / "mem" / "tiny" / "failures.jsonl").read_text().splitlines()]
    [(kind, tier, resumed, redone)] = [(r["kind"], r["tier"], r["step"], r["steps_redone"]) for r in records]
    assert (kind, tier, resumed) in {("resume", "memory", 4), ("resume", "memory", 3)}, records
    assert redone == 4 - resumed, records
    assert f"START {resumed} False memory" in again.stdout
    assert [number for number, _ in lines(again, "STEP")] == list(range(resumed + 1, 7))

    straight = script("straight", "--train.max_steps=6", "--checkpoint.every_steps=3")
    assert lines(killed, "STEP")[:resumed] + lines(again, "STEP") == lines(straight, "STEP")
    assert lines(again, "WEIGHTS") == lines(straight, "WEIGHTS")
    assert [p for p in (tmp_path / "shm").iterdir() if (p / "run.json").exists()] == []  # freed at the end


def test_leaving_the_steps_early_exits_non_zero_saying_the_steps_would_be_lost(script):
    result = script("early", "--train.max_steps=5", BREAK_AFTER_STEP="2")
    assert result.returncode == 1, result.stderr
    assert [number for number, _ in lines(result, "STEP")] == [1, 2]
    assert "The training script returned during step 2" in result.stderr
    assert "before run.steps() reached its end (train.max_steps=5)" in result.stderr
    assert "the steps since the last checkpoint would be lost" in result.stderr
    assert "WEIGHTS" in result.stdout  # the script itself ran to its end; the run refused to


def test_a_bad_setting_exits_2_before_anything_starts(script, tmp_path):
    result = script("bad", "--train.max_steps=0")
    assert result.returncode == 2
    assert "train.max_steps: Input should be greater than 0 (got 0)" in result.stderr
    assert "START" not in result.stdout
    assert not (tmp_path / "bad").exists()


def test_a_start_that_finds_no_checkpoint_of_a_run_that_trained_says_how_many_steps_are_lost(script, tmp_path):
    # The attempt trains to step 4; its checkpoint is lost (here: removed), as when a preempted run's
    # stop outlived checkpoint.grace_s with no earlier save committed.
    flags = ("--train.max_steps=6", "--checkpoint.every_steps=0", "--checkpoint.memory_overhead=0",
             "--logging.every_steps=1")  # fmt: skip
    first = script("lost", *flags, "--train.exit_at_step=4")
    assert first.returncode == 0, first.stderr
    shutil.rmtree(tmp_path / "lost" / "ckpt")
    again = script("lost", *flags)
    assert again.returncode == 0, again.stderr
    assert "START 0 False None" in again.stdout
    assert "an earlier attempt of this run trained to step 4" in again.stderr
    assert "4 step(s) redone" in again.stderr
    records = [json.loads(line) for line in (tmp_path / "lost" / "tiny" / "failures.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["tier"], r["steps_redone"]) for r in records] == [("resume", "none", 4)], records
    # A new run says nothing of the kind.
    fresh = script("new", *flags)
    assert fresh.returncode == 0 and "earlier attempt" not in fresh.stderr, fresh.stderr
