"""Exactly-once sample order and exact resume, end to end: recipes/train.py under torchrun.

Every job records what each step consumed (``--data.ledger=true``: each rank's sample indices and
the step's loss, see ``elastic_ddp/data/ledger.py``) and saves a final checkpoint, whose model
weights ``elastic-ddp ckpt export`` reads back. A 2-rank run to step 40 is the reference; the
interrupted runs are configured for the same 40 steps (the LR schedule depends on
``train.max_steps``) and compared with it:

* 2 ranks to step 20 (``train.exit_at_step=20``: a checkpoint, exit 0; or a kill -9 after the
  step-20 checkpoint committed), then resumed at 2 ranks to step 40: every step's loss equal and
  final parameters bitwise equal;
* 4 ranks to step 20 resumed at 2, and 2 resumed at 3 (uneven 3/3/2 slices of the global batch of
  8): every step's samples equal, final parameters equal up to float32 reduction order (relative
  L2 difference, printed and bounded);
* a real scale-down through the etcd rendezvous (two agents, one killed with its worker): the
  job's history has every step once, each consuming the next samples of the data order;
* a node joining after the other's worker crashed, so that the agents' restart counts differ: every
  step of the history still holds every rank's samples (the ledger names a worker group by its round).
* a relaunch over another corpus is refused, naming both sizes and the override; with
  ``--data.on_change=next_epoch`` it warns once and trains from the start of the next epoch of the new
  corpus, to the end (exit 0).

The corpus is cut to 103 samples of 32 bytes, so steps of 8 run through many epochs and cross
epoch boundaries; dropout is on, so the per-sample dropout seeds are exercised too.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import torch
from lm import ByteWindows, CorpusConfig, load_corpus

from elastic_ddp.tools import checkpoint as ckpt_cli
from elastic_ddp.data import DataCursor, ElasticSampler, LedgerStep, exactly_once_problems, read_ledger
from tests.helpers.data import data_order
from tests.helpers.job import Job, one_node_job, resumed_steps, steps

pytestmark = pytest.mark.slow

BLOCK, BATCH, SEED, MAX_BYTES = 32, 8, 1337, 3300
MAX_STEPS, HALF = 40, 20
CHANGED_BYTES = 2500  # another corpus for the relaunch: 78 samples of other bytes
FLAGS = [
    f"--data.max_bytes={MAX_BYTES}", "--data.ledger=true", "--model.dropout=0.1", "--checkpoint.every_steps=10",
    "--checkpoint.keep_last=10", "--train.warmup_steps=5",
]  # fmt: skip
# Float32 sums in another order (other rank splits, other all-reduce shapes) differ in the last bits;
# the parameters of the two runs stay far closer than this (the measured figure is printed).
REL_L2_BOUND = 1e-4


def samples_per_epoch(max_bytes: int = MAX_BYTES) -> int:
    return len(ByteWindows(load_corpus(CorpusConfig(max_bytes=max_bytes)), BLOCK))


def run(
    endpoint: str, root: Path, run_id: str, *, nproc: int, attempt: str, exit_at: int = 0, env=None, flags=()
) -> Job:
    """Start one agent with ``nproc`` workers on the run ``run_id`` (its own rendezvous per attempt)."""
    return one_node_job(
        endpoint, root, run_id, nproc=nproc, attempt=attempt, extra_env=env,
        flags=[*FLAGS, f"--train.max_steps={MAX_STEPS}", f"--train.exit_at_step={exit_at}", *flags],
    )  # fmt: skip


def final_weights(job: Job, step: int, tmp_path: Path) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{job.rdzv_id}-weights.pt"
    assert ckpt_cli.main(["ckpt", "export", str(job.run_dir / "checkpoints" / f"step-{step:09d}"), str(out)]) == 0
    return torch.load(out, weights_only=True)


def rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    norm = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (diff / norm) ** 0.5


def assert_each_sample_once_per_epoch(history: dict[int, LedgerStep], per_epoch: int) -> None:
    problems = exactly_once_problems(history, per_epoch)
    assert not problems, problems


def expected_order(num_steps: int, per_epoch: int) -> list[list[int]]:
    """The global batch of each step of an uninterrupted run, from the data order itself."""
    return data_order(per_epoch, BATCH, SEED, num_steps)


@pytest.fixture(scope="module")
def reference(etcd_server, tmp_path_factory):
    """The uninterrupted 2-rank run: its ledger history and final weights."""
    root = tmp_path_factory.mktemp("reference")
    job = run(etcd_server.endpoint, root, "reference", nproc=2, attempt="only")
    job.finish()
    history = read_ledger(job.run_dir)
    assert len(history) == MAX_STEPS and all(entry.world_size == 2 for entry in history.values())
    assert_each_sample_once_per_epoch(history, samples_per_epoch())
    assert [entry.all_indices for entry in history.values()] == expected_order(MAX_STEPS, samples_per_epoch())
    return history, final_weights(job, MAX_STEPS, root)


def test_resume_at_the_same_world_size_is_bitwise_identical(reference, etcd_endpoint, tmp_path):
    ref_history, ref_weights = reference
    first = run(etcd_endpoint, tmp_path, "same", nproc=2, attempt="first", exit_at=HALF).finish()
    assert f"Exiting after step {HALF} (train.exit_at_step)" in first, first[-4000:]
    again = run(etcd_endpoint, tmp_path, "same", nproc=2, attempt="again")
    output = again.finish()
    assert resumed_steps(output) == [HALF], output[-4000:]
    history = read_ledger(again.run_dir)
    assert {s: e.loss for s, e in history.items()} == {s: e.loss for s, e in ref_history.items()}
    assert {s: e.indices for s, e in history.items()} == {s: e.indices for s, e in ref_history.items()}
    weights = final_weights(again, MAX_STEPS, tmp_path)
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


def test_resume_after_kill_9_past_the_committed_checkpoint_is_bitwise_identical(reference, etcd_endpoint, tmp_path):
    ref_history, ref_weights = reference
    # Rank 0 stalls at the start of step 25, so the kill finds steps 21-24 trained but not saved.
    # The memory tier off: this is the durable tier's resume (tests/chaos/test_memory_tier_e2e.py has the other).
    durable_only = ["--checkpoint.memory_overhead=0"]
    first = run(etcd_endpoint, tmp_path, "killed", nproc=2, attempt="first", flags=durable_only,
                env={"ELASTIC_DDP_FAULT": "hang@25:rank=0:restart=0"})  # fmt: skip
    first.wait_for_commit(HALF, timeout=180)
    first.wait_for_step(24)
    first.nodes[0].kill()  # kill -9 of the agent and both workers
    first.cleanup()
    again = run(etcd_endpoint, tmp_path, "killed", nproc=2, attempt="again", flags=durable_only)
    output = again.finish()
    assert resumed_steps(output) == [HALF], output[-4000:]
    history = read_ledger(again.run_dir)  # the killed attempt's steps 21-24 are superseded
    assert {s: e.loss for s, e in history.items()} == {s: e.loss for s, e in ref_history.items()}
    weights = final_weights(again, MAX_STEPS, tmp_path)
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 3)])
def test_resume_at_another_world_size_consumes_the_same_samples_per_step(before, after, reference, etcd_endpoint, tmp_path):
    ref_history, ref_weights = reference
    run_id = f"resize-{before}-{after}"
    run(etcd_endpoint, tmp_path, run_id, nproc=before, attempt="first", exit_at=HALF).finish()
    again = run(etcd_endpoint, tmp_path, run_id, nproc=after, attempt="again")
    output = again.finish()
    assert resumed_steps(output) == [HALF], output[-4000:]
    history = read_ledger(again.run_dir)
    assert [history[s].world_size for s in history] == [before] * HALF + [after] * (MAX_STEPS - HALF)
    assert {s: e.all_indices for s, e in history.items()} == {s: e.all_indices for s, e in ref_history.items()}
    assert_each_sample_once_per_epoch(history, samples_per_epoch())
    if after == 3:
        assert [len(history[MAX_STEPS].indices[r]) for r in range(3)] == [3, 3, 2]  # an uneven split, weighted
    difference = rel_l2(final_weights(again, MAX_STEPS, tmp_path), ref_weights)
    loss_gap = max(abs(history[s].loss - ref_history[s].loss) / ref_history[s].loss for s in history)
    print(f"{before} -> {after} ranks at step {HALF}: final parameters rel. L2 difference {difference:.2e}, "
          f"largest relative loss difference {loss_gap:.2e}")  # fmt: skip
    assert difference < REL_L2_BOUND


def test_a_resume_over_changed_data_is_refused_and_next_epoch_continues_at_the_new_datas_next_epoch(
    etcd_endpoint, tmp_path
):
    per_epoch, changed_per_epoch = samples_per_epoch(), samples_per_epoch(CHANGED_BYTES)
    saved = ElasticSampler(per_epoch, BATCH, SEED).advance(DataCursor(), HALF)
    assert saved.consumed > 0  # the checkpoint is inside an epoch, with samples of it left
    run(etcd_endpoint, tmp_path, "changed", nproc=2, attempt="first", exit_at=HALF).finish()
    # The corpus is also the recipe's identity, allowed to change here: what is tested is the data position.
    changed = [f"--data.max_bytes={CHANGED_BYTES}", "--checkpoint.allow_identity_change=true"]
    refused = Job(
        etcd_endpoint, tmp_path, nnodes="1", run_id="changed", rdzv_id=f"changed-refused-{uuid.uuid4().hex[:6]}",
        flags=[*FLAGS, f"--train.max_steps={MAX_STEPS}", *changed],
        torchrun_flags=["--nproc-per-node=2", "--max-restarts=0"],  # no restart can fix it
    )  # fmt: skip
    try:
        code = refused.add_node().wait(timeout=180)
    finally:
        refused.cleanup()
    output = refused.output()
    assert code != 0, output[-4000:]
    assert "cannot continue over this dataset" in output, output[-4000:]
    assert f"it was written for a dataset of {per_epoch} samples, this one has {changed_per_epoch}" in output
    assert "--data.on_change=next_epoch" in output
    assert steps(output) == []  # nothing trained over the other data

    again = run(etcd_endpoint, tmp_path, "changed", nproc=2, attempt="next-epoch",
                flags=[*changed, "--data.on_change=next_epoch"])  # fmt: skip
    output = again.finish()
    assert resumed_steps(output) == [HALF], output[-4000:]
    [warning] = [line for line in output.splitlines() if "does not match this dataset" in line]  # rank 0's, once
    assert f" WARNING [0/{HALF}] Checkpoint " in warning, warning
    assert f"it was written for a dataset of {per_epoch} samples, this one has {changed_per_epoch}" in warning
    assert f"continues at the start of epoch {saved.epoch + 1} of this data; the rest of epoch {saved.epoch} -- " \
           f"{per_epoch - saved.consumed} samples not yet consumed -- is not trained" in warning, warning  # fmt: skip
    history = read_ledger(again.run_dir)
    assert list(history) == list(range(1, MAX_STEPS + 1))
    consumed = [entry.all_indices for entry in history.values()]
    assert consumed[:HALF] == expected_order(HALF, per_epoch)
    # Step HALF + 1 trained on the first samples of the next epoch of the new corpus, and on from there.
    next_epoch = DataCursor(saved.epoch + 1, 0)
    assert consumed[HALF:] == data_order(changed_per_epoch, BATCH, SEED, MAX_STEPS - HALF, next_epoch)


def test_a_real_scale_down_neither_repeats_nor_skips_a_sample(etcd_endpoint, tmp_path):
    job = Job(
        etcd_endpoint, tmp_path, nnodes="1:2",
        flags=[*FLAGS, "--train.max_steps=100000", "--checkpoint.every_steps=5"],
    )  # fmt: skip
    try:
        job.add_node()
        victim = job.add_node()
        job.wait_for_commit(10, timeout=180)
        job.wait_for_step(12)
        mark, t0 = job.mark(), time.monotonic()
        victim.kill()  # the node and its worker: the steps since the last commit are redone
        job.wait_for_training_since(mark, t0, world_size=1)
        resumed = resumed_steps(job.output_since(mark))[-1]
        job.wait_until(lambda: any(s >= resumed + 8 and w == 1 for s, w in steps(job.output_since(mark))), 180,
                       "8 steps of the survivor")  # fmt: skip
        survivor = job.nodes[0]
        survivor.terminate()  # a stop checkpoint at a step boundary, then exit
        survivor.wait(timeout=120)
    finally:
        job.cleanup()
    history = read_ledger(job.run_dir)
    per_epoch = samples_per_epoch()
    assert_each_sample_once_per_epoch(history, per_epoch)
    assert [e.all_indices for e in history.values()] == expected_order(len(history), per_epoch)
    assert {e.world_size for s, e in history.items() if s <= resumed} == {2}
    assert {e.world_size for s, e in history.items() if s > resumed} == {1}
    # The kill left steps after the checkpoint on record; those were trained again, with the same samples.
    assert resumed >= 10 and len(history) >= resumed + 8




def test_a_node_joining_after_a_crash_with_a_lower_restart_count_loses_no_ranks_samples(etcd_endpoint, tmp_path):
    # Node A's worker crashes once (A's agent counts a restart); node B then joins with a count of 0,
    # so the ranks of the two-node group carry different restart counts. B is killed later.
    job = Job(
        etcd_endpoint, tmp_path, nnodes="1:2", flags=[*FLAGS, "--train.max_steps=100000", "--checkpoint.every_steps=5"],
        extra_env={"ELASTIC_DDP_FAULT": "raise@7:rank=0:restart=0"},
    )  # fmt: skip
    try:
        survivor = job.add_node()
        job.wait_until(lambda: any(start["restart"] == 1 for start in job.worker_starts()), 180, "the restart after the crash")
        job.wait_for_step(9)
        mark, t0 = job.mark(), time.monotonic()
        victim = job.add_node()
        job.wait_for_training_since(mark, t0, world_size=2)
        joined = max(s for s, w in steps(job.output_since(mark)) if w == 2)
        job.wait_until(lambda: any(s >= joined + 6 and w == 2 for s, w in steps(job.output_since(mark))), 180,
                       "6 steps of both nodes")  # fmt: skip
        mark, t0 = job.mark(), time.monotonic()
        victim.kill()
        job.wait_for_training_since(mark, t0, world_size=1)
        resumed = resumed_steps(job.output_since(mark))[-1]
        job.wait_until(lambda: any(s >= resumed + 4 and w == 1 for s, w in steps(job.output_since(mark))), 180,
                       "4 steps of the survivor")  # fmt: skip
        survivor.terminate()
        survivor.wait(timeout=120)
    finally:
        job.cleanup()
    counts: dict[str, set[int]] = {}
    for start in job.worker_starts():
        if start["world_size"] == 2:
            counts.setdefault(start["attempt"], set()).add(start["restart"])
    assert {1, 0} in counts.values(), counts  # a two-node group whose agents' counts differed
    history = read_ledger(job.run_dir)
    per_epoch = samples_per_epoch()
    assert_each_sample_once_per_epoch(history, per_epoch)
    assert [e.all_indices for e in history.values()] == expected_order(len(history), per_epoch)
    assert all(sorted(e.indices) == list(range(e.world_size)) for e in history.values())
    assert 2 in {e.world_size for e in history.values()}
