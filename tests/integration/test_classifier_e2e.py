"""recipes/train_classifier.py under torchrun: an ordinary model with nn.Dropout, SGD with momentum
and a StepLR schedule resumes exactly.

Every job records what each step consumed (``--data.ledger=true``: each rank's sample indices and the
step's loss) and ends with a checkpoint whose model ``elastic-ddp ckpt export`` reads back. All runs
are configured for 40 steps of 64 samples (1,797 images: the steps cross an epoch boundary), with the
learning rate halving every 15 steps:

* dropout 0.1, 2 ranks killed with ``kill -9`` after the step-20 checkpoint committed and resumed at
  2 ranks: every step's loss and the final parameters are bitwise those of the uninterrupted run --
  plain ``nn.Dropout`` included, because each rank's random generators are part of the checkpoint;
* dropout 0, 2 ranks to step 20 and resumed at 1 and at 3 ranks: every step's samples are the
  uninterrupted run's, and the loss curve and final parameters agree up to float32 reduction order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic_ddp.tools import checkpoint as ckpt_cli
from elastic_ddp.data import read_ledger
from tests.helpers.job import CLASSIFIER, Job, one_node_job, resumed_steps

pytestmark = pytest.mark.slow

MAX_STEPS, HALF = 40, 20
FLAGS = [
    f"--train.max_steps={MAX_STEPS}", "--train.global_batch_size=64", "--data.ledger=true",
    "--checkpoint.every_steps=10", "--checkpoint.keep_last=10", "--optim.step_size=15",
]  # fmt: skip
# Float32 sums in another order (other rank splits, other all-reduce shapes) differ in the last bits.
REL_L2_BOUND = 1e-4


def run(endpoint: str, root: Path, run_id: str, *, nproc: int, attempt: str, dropout: float, flags=(), env=None) -> Job:
    return one_node_job(endpoint, root, run_id, nproc=nproc, attempt=attempt, recipe=CLASSIFIER,
                        flags=[*FLAGS, f"--model.dropout={dropout}", *flags], extra_env=env)  # fmt: skip


def final_weights(job: Job, tmp_path: Path) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{job.rdzv_id}-weights.pt"
    ckpt = job.run_dir / "checkpoints" / f"step-{MAX_STEPS:09d}"
    assert ckpt_cli.main(["ckpt", "verify", str(ckpt)]) == 0
    assert ckpt_cli.main(["ckpt", "export", str(ckpt), str(out)]) == 0
    return torch.load(out, weights_only=True)


def rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    return (diff / sum(float(b[k].double().pow(2).sum()) for k in b)) ** 0.5


@pytest.fixture(scope="module")
def references(etcd_server, tmp_path_factory):
    """The uninterrupted 2-rank runs with dropout 0.1 and 0: ledger histories and final weights."""
    out = {}
    for dropout in (0.1, 0.0):
        root = tmp_path_factory.mktemp(f"reference-{dropout}")
        job = run(etcd_server.endpoint, root, "reference", nproc=2, attempt=f"only-{dropout}", dropout=dropout)
        job.finish()
        history = read_ledger(job.run_dir)
        assert list(history) == list(range(1, MAX_STEPS + 1))
        out[dropout] = history, final_weights(job, root)
        out[f"checkpoint-{dropout}"] = job.run_dir / "checkpoints" / f"step-{MAX_STEPS:09d}"
    return out


def test_the_step_40_checkpoint_exports_in_every_format_and_reads_back_without_this_package(references, tmp_path):
    from tests.unit.test_checkpoint_export import read_back_without_elastic_ddp

    url = str(references["checkpoint-0.1"])
    for fmt in ("torch", "dcp", "safetensors"):
        assert ckpt_cli.main(["ckpt", "export", url, str(tmp_path / fmt), "--all", "--format", fmt]) == 0
    names = sorted(path.stem for path in (tmp_path / "torch").iterdir())
    assert "model" in names
    report = read_back_without_elastic_ddp(tmp_path, names)
    assert report["importable"] is False
    for name, entry in report["objects"].items():
        assert entry["dcp_load_equal"] and entry["dcp_converted_equal"], name
        if entry["tensors"]:
            assert entry["safetensors_equal"], name
            assert entry["safetensors_metadata"]["step"] == str(MAX_STEPS), entry["safetensors_metadata"]
    assert report["objects"]["model"]["safetensors_keys"] == sorted(references[0.1][1])


def test_kill_9_and_resume_with_nn_dropout_is_bitwise_identical(references, etcd_endpoint, tmp_path):
    ref_history, ref_weights = references[0.1]
    # Rank 0 stalls at the start of step 25, so the kill finds steps 21-24 trained but not saved.
    # The memory tier off: this is the durable tier's resume (tests/chaos/test_memory_tier_e2e.py has the other).
    durable_only = ["--checkpoint.memory_overhead=0"]
    first = run(etcd_endpoint, tmp_path, "killed", nproc=2, attempt="first", dropout=0.1, flags=durable_only,
                env={"ELASTIC_DDP_FAULT": "hang@25:rank=0:restart=0"})  # fmt: skip
    first.wait_for_commit(HALF, timeout=180)
    first.wait_for_step(24)
    first.nodes[0].kill()  # kill -9 of the agent and both workers
    first.cleanup()
    again = run(etcd_endpoint, tmp_path, "killed", nproc=2, attempt="again", dropout=0.1, flags=durable_only)
    output = again.finish()
    assert resumed_steps(output) == [HALF], output[-4000:]
    history = read_ledger(again.run_dir)  # the killed attempt's steps 21-24 are superseded
    assert {s: e.indices for s, e in history.items()} == {s: e.indices for s, e in ref_history.items()}
    assert {s: e.loss for s, e in history.items()} == {s: e.loss for s, e in ref_history.items()}
    weights = final_weights(again, tmp_path)
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


@pytest.mark.parametrize("after", [1, 3])
def test_resume_at_another_world_size_trains_the_same_samples_within_reduction_noise(after, references, etcd_endpoint, tmp_path):
    ref_history, ref_weights = references[0.0]
    run_id = f"resize-2-{after}"
    run(etcd_endpoint, tmp_path, run_id, nproc=2, attempt="first", dropout=0.0, flags=[f"--train.exit_at_step={HALF}"]).finish()
    again = run(etcd_endpoint, tmp_path, run_id, nproc=after, attempt="again", dropout=0.0)
    output = again.finish()
    assert resumed_steps(output) == [HALF], output[-4000:]
    history = read_ledger(again.run_dir)
    assert [history[s].world_size for s in history] == [2] * HALF + [after] * (MAX_STEPS - HALF)
    assert {s: e.all_indices for s, e in history.items()} == {s: e.all_indices for s, e in ref_history.items()}
    if after == 3:
        assert [len(history[MAX_STEPS].indices[r]) for r in range(3)] == [22, 21, 21]  # uneven, weighted
    loss_gap = max(abs(history[s].loss - ref_history[s].loss) / ref_history[s].loss for s in history)
    difference = rel_l2(final_weights(again, tmp_path), ref_weights)
    print(f"2 -> {after} ranks at step {HALF}: final parameters rel. L2 {difference:.2e}, "
          f"largest relative loss difference {loss_gap:.2e}")  # fmt: skip
    assert difference < REL_L2_BOUND and loss_gap < REL_L2_BOUND
