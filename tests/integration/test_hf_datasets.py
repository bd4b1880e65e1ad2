"""Hugging Face ``datasets.Dataset`` through the data pipeline and ``run.steps()``.

Unit tests: a torch-formatted dataset batches as a dict of tensors with exactly the rows the order
asks for, read in one ``__getitems__`` call per micro-batch and bitwise equal to row-by-row reads,
also in loader workers and from a resumed cursor; the checkpoint's fingerprint is the dataset's own;
what is not a dataset of rows (a ``DatasetDict``, a streaming dataset) is refused; ranks whose
datasets differ (a random fingerprint) are refused.

End to end (slow): ``tests/workers/hf_dataset.py`` (1,000 rows) on 2 ranks through etcd, its agent
killed with kill -9, resumed on 3 ranks: the ledger's history holds every row once per epoch, for
more than one epoch; and a run stopped and resumed at the same world size trains the same losses
bit for bit as an uninterrupted one.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from elastic_ddp.data import (
    DataCursor, ElasticSampler, StepBatches, check_dataset, check_same_dataset, dataset_fingerprint,
    exactly_once_problems, read_ledger, read_samples,
)  # fmt: skip
from tests.helpers.data import data_order
from tests.helpers.job import REPO, Job, env, one_node_job, resumed_steps

datasets = pytest.importorskip("datasets")

WORKER = REPO / "tests" / "workers" / "hf_dataset.py"


def table(rows: int = 40) -> datasets.Dataset:
    return datasets.Dataset.from_dict({
        "id": list(range(rows)),
        "x": [[i / 7, -i / 3] for i in range(rows)],
        "label": [i % 3 for i in range(rows)],
        "text": [f"row {i}" for i in range(rows)],
    }).with_format("torch")  # fmt: skip


def assert_same_data(a, b) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# --- batches -----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_torch_formatted_dataset_batches_as_a_dict_of_tensors_of_the_rows_asked_for(num_workers):
    rows = table()
    sampler = ElasticSampler(len(rows), global_batch_size=14, seed=3)  # steps cross epochs of 40
    batches = StepBatches(rows, sampler, DataCursor(), rank=1, world_size=3, num_steps=7, micro_batch_size=3,
                          num_workers=num_workers)  # fmt: skip
    for batch in batches:
        for micro in batch.micro_batches:
            assert micro.data["id"].tolist() == micro.indices
            assert micro.data["x"].dtype == torch.float32 and micro.data["x"].shape == (len(micro.indices), 2)
            assert micro.data["text"] == [f"row {i}" for i in micro.indices]
            # One batched read gives bit for bit what reading the rows one by one gives.
            assert_same_data(micro.data, default_collate([rows[i] for i in micro.indices]))


def test_a_resumed_loader_gives_the_uninterrupted_batches_bit_for_bit():
    rows = table()
    sampler = ElasticSampler(len(rows), global_batch_size=6, seed=8)
    uninterrupted = list(StepBatches(rows, sampler, DataCursor(), rank=0, world_size=2, num_steps=12))
    cut = uninterrupted[6].cursor_after  # what a checkpoint after step 7 stores
    resumed = list(StepBatches(rows, sampler, cut, rank=0, world_size=2, num_steps=5, start_step=7))
    for a, b in zip(uninterrupted[7:], resumed, strict=True):
        assert (a.step, a.rank_indices, a.cursor_after) == (b.step, b.rank_indices, b.cursor_after)
        assert_same_data(a.micro_batches[0].data, b.micro_batches[0].data)


class Counted:
    """A map-style dataset with a batched read that counts its calls."""

    def __init__(self, size: int, short: bool = False) -> None:
        self.size, self.short, self.calls = size, short, []

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> int:
        return i * 10

    def __getitems__(self, indices: list[int]) -> list[int]:
        self.calls.append(indices)
        return [i * 10 for i in indices[: -1 if self.short else None]]


def test_read_samples_reads_with_one_getitems_call_in_order_and_refuses_a_short_answer():
    counted = Counted(10)
    assert read_samples(counted, [4, 1, 4]) == [40, 10, 40]
    assert counted.calls == [[4, 1, 4]]
    assert read_samples([5, 6, 7], [2, 0]) == [7, 5]  # no __getitems__: one read per index
    with pytest.raises(ValueError, match=r"Counted.__getitems__ returned 1 samples for 2 indices"):
        read_samples(Counted(10, short=True), [1, 2])


# --- fingerprint -------------------------------------------------------------------------------


def test_the_fingerprint_is_the_datasets_own_unless_one_is_given():
    rows = table()
    assert dataset_fingerprint(rows) == rows._fingerprint
    assert dataset_fingerprint(rows, "corpus-v2") == "corpus-v2"
    assert dataset_fingerprint([1, 2, 3]) == ""  # no fingerprint of its own: the resume checks the size
    # The fingerprint covers the transforms, the format included.
    assert len({dataset_fingerprint(d) for d in (rows, rows.with_format(None), rows.select(range(40)))}) == 3


def test_the_same_dataset_built_in_another_process_has_the_same_fingerprint():
    script = "from tests.integration.test_hf_datasets import table; print(table()._fingerprint)"
    other = subprocess.run([sys.executable, "-c", script], env=env(), capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr[-3000:]
    assert other.stdout.strip() == dataset_fingerprint(table())


class Unfingerprinted:
    _fingerprint = None

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> int:
        return i


def test_a_fingerprint_that_cannot_be_read_is_an_error_not_no_fingerprint():
    with pytest.raises(TypeError, match=r"Unfingerprinted._fingerprint is None, not a non-empty string"):
        dataset_fingerprint(Unfingerprinted())
    assert dataset_fingerprint(Unfingerprinted(), "mine") == "mine"


# --- what is not a dataset of rows ---------------------------------------------------------------


def test_a_dataset_dict_is_refused_naming_its_splits():
    splits = datasets.DatasetDict({"train": table(), "test": table(5)})
    with pytest.raises(TypeError, match=r"DatasetDict is a mapping \(keys \['test', 'train'\]\).*dataset\['train'\]"):
        check_dataset(splits)
    assert check_dataset(splits["train"]) == 40


def test_a_streaming_dataset_is_refused_as_an_iterable_dataset():
    with pytest.raises(TypeError, match=r"IterableDataset is an IterableDataset.*without streaming=True"):
        check_dataset(table().to_iterable_dataset())


# --- every rank the same dataset -----------------------------------------------------------------

_RANK = """
import sys
import torch.distributed as dist
from elastic_ddp.data import check_same_dataset
rank, store, fingerprint = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store, 3), rank=rank, world_size=3)
try:
    check_same_dataset(1000, fingerprint, dist.new_group(backend="gloo"))
    print("agreed")
except ValueError as exc:
    print(exc)
"""


def test_ranks_with_different_fingerprints_are_refused_on_every_rank(tmp_path):
    # Rank 2's transform could not be hashed by `datasets`: its fingerprint is random.
    store = str(tmp_path / "store")
    fingerprints = ["5f18a2627aaf2507", "5f18a2627aaf2507", "0dfc7f341494a039"]
    ranks = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(_RANK), str(r), store, fp], env=env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for r, fp in enumerate(fingerprints)
    ]
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    for output in outputs:
        assert "The ranks were given different datasets (rank 0: 1000 samples, fingerprint '5f18a2627aaf2507'; " \
               "rank 2: 1000 samples, fingerprint '0dfc7f341494a039')" in output, output[-3000:]  # fmt: skip
    check_same_dataset(1000, "anything")  # no process group: nothing to compare


# --- end to end --------------------------------------------------------------------------------

ROWS, BATCH, SEED = 1000, 32, 1337  # 32 rows split 11/11/10 over 3 ranks; steps cross the epoch ends
MAX_STEPS = 50  # 1,600 rows: one epoch and more than half the next


def hf_job(endpoint: str, root: Path, run_id: str, *, nproc: int, attempt: str, flags=(), env_=None) -> Job:
    return one_node_job(
        endpoint, root, run_id, nproc=nproc, attempt=attempt, recipe=WORKER, extra_env=env_,
        flags=[f"--train.global_batch_size={BATCH}", f"--train.max_steps={MAX_STEPS}", "--data.ledger=true",
               "--checkpoint.every_steps=10", *flags],
    )  # fmt: skip


def expected_order(num_steps: int) -> list[list[int]]:
    return data_order(ROWS, BATCH, SEED, num_steps)


@pytest.mark.slow
def test_killed_on_2_ranks_and_resumed_on_3_every_row_is_trained_once_per_epoch(etcd_endpoint, tmp_path):
    # Rank 0 stalls at the start of step 25, so the kill -9 of the agent and both workers finds
    # steps after the step-20 checkpoint trained but not saved durably.
    first = hf_job(etcd_endpoint, tmp_path, "hf", nproc=2, attempt="first",
                   env_={"ELASTIC_DDP_FAULT": "hang@25:rank=0:restart=0"})  # fmt: skip
    try:
        first.wait_for_commit(20, timeout=150)
        first.wait_for_step(24)
        first.nodes[0].kill()
    finally:
        first.cleanup()
    output = hf_job(etcd_endpoint, tmp_path, "hf", nproc=3, attempt="again").finish(timeout=180)
    (resumed,) = resumed_steps(output)
    assert 20 <= resumed <= 24, output[-4000:]  # the durable checkpoint, or the memory tier's newer state
    history = read_ledger(tmp_path / "hf")
    assert not exactly_once_problems(history, ROWS), exactly_once_problems(history, ROWS)
    assert [entry.all_indices for entry in history.values()] == expected_order(MAX_STEPS)
    assert len({i for entry in history.values() for i in entry.all_indices}) == ROWS  # the first epoch: every row
    assert [entry.world_size for entry in history.values()] == [2] * resumed + [3] * (MAX_STEPS - resumed)
    assert [len(history[MAX_STEPS].indices[r]) for r in range(3)] == [11, 11, 10]


@pytest.mark.slow
def test_stopped_and_resumed_at_the_same_world_size_trains_the_same_losses_bit_for_bit(etcd_endpoint, tmp_path):
    hf_job(etcd_endpoint, tmp_path, "ref", nproc=2, attempt="only").finish(timeout=180)
    reference = read_ledger(tmp_path / "ref")
    hf_job(etcd_endpoint, tmp_path, "cut", nproc=2, attempt="first", flags=["--train.exit_at_step=23"]).finish(timeout=180)
    output = hf_job(etcd_endpoint, tmp_path, "cut", nproc=2, attempt="again").finish(timeout=180)
    assert resumed_steps(output) == [23], output[-4000:]
    history = read_ledger(tmp_path / "cut")
    assert {s: e.loss for s, e in history.items()} == {s: e.loss for s, e in reference.items()}
    assert {s: e.indices for s, e in history.items()} == {s: e.indices for s, e in reference.items()}
