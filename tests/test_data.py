"""The data pipeline's promises: deterministic order, every sample once per epoch, the same samples
per step at any world size and across resumes, exact loss weighting, loaders that never move the
cursor, and corpora read the same way from local folders and fsspec URLs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import uuid

import fsspec
import pytest
import torch

from elastic_ddp.config import DataConfig, ModelConfig
from elastic_ddp.data import (
    ByteWindows,
    DataCursor,
    ElasticSampler,
    StepBatches,
    corpus_fingerprint,
    glob_match,
    load_corpus,
    make_step_batch,
    micro_batches,
    rank_loss_scale,
    rank_slice,
    sample_seeds,
)
from elastic_ddp.model import ByteGPT, per_sample_loss


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny tensors: on shared CI cores, intra-op threads cost more in contention than they gain.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def random_windows(num_samples: int, block_size: int = 8, seed: int = 0) -> ByteWindows:
    generator = torch.Generator().manual_seed(seed)
    corpus = torch.randint(0, 256, (num_samples * block_size + 1,), generator=generator, dtype=torch.uint8)
    return ByteWindows(corpus, block_size)


# --- samples ---------------------------------------------------------------------------------


def test_byte_windows_are_shifted_next_byte_pairs():
    corpus = torch.arange(23, dtype=torch.uint8)
    windows = ByteWindows(corpus, 5)
    assert len(windows) == 4  # (23 - 1) // 5: the 5th window would need byte 25
    x, y = windows[2]
    assert x.dtype == torch.int64 and x.tolist() == [10, 11, 12, 13, 14]
    assert y.tolist() == [11, 12, 13, 14, 15]
    with pytest.raises(IndexError, match="outside 0..3"):
        windows.gather([4])
    with pytest.raises(ValueError, match="shorter than one sample"):
        ByteWindows(corpus[:5], 5)


# --- cursor and order ------------------------------------------------------------------------

_SUBPROCESS = """
import json
from elastic_ddp.config import DataConfig
from elastic_ddp.data import ElasticSampler, corpus_fingerprint, load_corpus, sample_seeds
sampler = ElasticSampler(1000, 8, seed=1234)
print(json.dumps({
    "order": sampler.permutation(3),
    "seeds": sample_seeds(1234, 17, [0, 5, 999]).tolist(),
    "fingerprint": corpus_fingerprint(load_corpus(DataConfig())),
}))
"""


def test_order_seeds_and_default_corpus_are_the_same_in_another_process():
    # The child gets another PYTHONHASHSEED, so this also catches any use of the salted hash().
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS], capture_output=True, text=True, check=True, timeout=120
    )
    child = json.loads(out.stdout)
    sampler = ElasticSampler(1000, 8, seed=1234)
    assert child["order"] == sampler.permutation(3)
    assert child["seeds"] == sample_seeds(1234, 17, [0, 5, 999]).tolist()
    assert child["fingerprint"] == corpus_fingerprint(load_corpus(DataConfig()))
    assert sampler.permutation(3) != sampler.permutation(4)
    assert sorted(sampler.permutation(3)) == list(range(1000))
    assert ElasticSampler(1000, 8, seed=1235).permutation(3) != sampler.permutation(3)


def test_every_sample_once_per_epoch_also_when_a_batch_crosses_the_boundary():
    sampler = ElasticSampler(num_samples=23, global_batch_size=5, seed=7)
    cursor, seen = DataCursor(), []
    for _ in range(14):  # 70 samples: three epochs and a bit; batches 5 and 10 straddle epochs
        indices, cursor = sampler.batch_at(cursor)
        assert len(indices) == 5
        seen += indices
    for epoch in range(3):
        assert seen[23 * epoch : 23 * (epoch + 1)] == sampler.permutation(epoch)
    assert seen[69:] == sampler.permutation(3)[:1]
    assert cursor == DataCursor(epoch=3, consumed=1)
    assert sampler.advance(DataCursor(), 14) == cursor


def test_batch_larger_than_an_epoch_spans_several_epochs():
    sampler = ElasticSampler(num_samples=3, global_batch_size=8, seed=0)
    indices, cursor = sampler.batch_at(DataCursor())
    assert indices == sampler.permutation(0) + sampler.permutation(1) + sampler.permutation(2)[:2]
    assert cursor == DataCursor(2, 2) == sampler.advance(DataCursor(), 1)


def test_finished_epoch_is_stored_as_start_of_next():
    sampler = ElasticSampler(num_samples=10, global_batch_size=5, seed=0)
    _, cursor = sampler.batch_at(DataCursor(0, 5))
    assert cursor == DataCursor(1, 0) == sampler.advance(DataCursor(), 2)


def test_cursor_state_round_trips_through_json_and_rejects_bad_values():
    cursor = DataCursor(epoch=2, consumed=17)
    assert DataCursor.from_state_dict(json.loads(json.dumps(cursor.state_dict()))) == cursor
    with pytest.raises(ValueError, match="keys \\['consumed'\\]"):
        DataCursor.from_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="DataCursor.consumed"):
        DataCursor(0, -1)
    with pytest.raises(ValueError, match="corpus or block_size changed"):
        ElasticSampler(10, 2, 0).batch_at(DataCursor(0, 11))


def test_changing_the_global_batch_size_on_resume_still_visits_each_sample_once():
    seen, cursor = [], DataCursor()
    for batch_size, steps in ((4, 3), (7, 2), (3, 2)):  # 12 + 14 + 6 = 32 = one epoch
        sampler = ElasticSampler(32, batch_size, seed=3)
        for _ in range(steps):
            indices, cursor = sampler.batch_at(cursor)
            seen += indices
    assert seen == ElasticSampler(32, 1, seed=3).permutation(0)
    assert cursor == DataCursor(1, 0)


# --- splitting a global batch ----------------------------------------------------------------


@pytest.mark.parametrize("batch_size,world_size", [(10, 3), (12, 4), (3, 5), (1, 1), (7, 7)])
def test_rank_slices_are_contiguous_and_uneven_by_at_most_one(batch_size, world_size):
    indices = list(range(100, 100 + batch_size))
    slices = [rank_slice(indices, rank, world_size) for rank in range(world_size)]
    assert sum(slices, []) == indices
    sizes = [len(s) for s in slices]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
    with pytest.raises(ValueError, match="rank \\(5\\)"):
        rank_slice(indices, 5, 5)


def test_micro_batches_split_in_order():
    assert micro_batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert micro_batches([1, 2, 3], 0) == [[1, 2, 3]]
    assert micro_batches([1, 2, 3], 8) == [[1, 2, 3]]
    assert micro_batches([], 2) == []


SEGMENTS = {
    "4->2": [(4, 5), (2, 7)],
    "2->3": [(2, 4), (3, 8)],
    "1->5": [(1, 6), (5, 6)],
    "4->2->3->1->5": [(4, 3), (2, 3), (3, 2), (1, 1), (5, 3)],
}


@pytest.mark.parametrize("name", SEGMENTS)
def test_world_size_changes_keep_the_samples_of_every_step(name):
    windows = random_windows(37)  # 37 samples, 10 per step: epochs end inside steps 3, 7 and 11
    sampler = ElasticSampler(len(windows), global_batch_size=10, seed=11)
    reference = list(StepBatches(windows, sampler, DataCursor(), rank=0, world_size=1, num_steps=12))

    cursor, step = DataCursor(), 0
    for world_size, steps in SEGMENTS[name]:
        per_rank = [
            list(StepBatches(windows, sampler, cursor, rank=rank, world_size=world_size,
                             num_steps=steps, start_step=step, micro_batch_size=2))
            for rank in range(world_size)
        ]
        for offset in range(steps):
            expected = reference[step + offset]
            batches = [per_rank[rank][offset] for rank in range(world_size)]
            assert all(b.global_indices == expected.global_indices for b in batches)
            assert sum((b.rank_indices for b in batches), []) == expected.global_indices
            # The samples' bytes and dropout seeds do not depend on the split either.
            mbs = [mb for b in batches for mb in b.micro_batches]
            assert torch.equal(torch.cat([mb.x for mb in mbs]), expected.micro_batches[0].x)
            assert torch.equal(torch.cat([mb.seeds for mb in mbs]), expected.micro_batches[0].seeds)
            assert len({b.cursor_after for b in batches}) == 1
        # Carry the cursor over as a checkpoint would: through JSON.
        state = json.dumps(per_rank[0][-1].cursor_after.state_dict())
        cursor, step = DataCursor.from_state_dict(json.loads(state)), step + steps
    assert cursor == reference[-1].cursor_after


def test_more_ranks_than_samples_gives_zero_weight_dummies():
    windows = random_windows(20)
    sampler = ElasticSampler(len(windows), global_batch_size=3, seed=0)
    batches = [make_step_batch(windows, sampler, DataCursor(), 0, rank, 5) for rank in range(5)]
    assert [len(b.rank_indices) for b in batches] == [1, 1, 1, 0, 0]
    for batch in batches[3:]:
        (mb,) = batch.micro_batches
        assert mb.dummy and mb.x.shape == (1, 8) and mb.weight.tolist() == [0.0]
    assert all(not b.micro_batches[0].dummy for b in batches[:3])


# --- loss weighting and accumulation: exact global-batch gradients ---------------------------


def _tiny_model(dropout: float) -> ByteGPT:
    torch.manual_seed(0)
    cfg = ModelConfig(block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=dropout)
    return ByteGPT(cfg).double()


def _ddp_gradient(model, windows, sampler, world_size, micro_batch_size):
    """What DDP computes: each rank accumulates over its micro-batches; ranks are averaged."""
    grads = []
    for rank in range(world_size):
        replica = copy.deepcopy(model)
        batch = make_step_batch(windows, sampler, DataCursor(0, 3), 5, rank, world_size, micro_batch_size)
        for mb in batch.micro_batches:
            loss = (per_sample_loss(replica(mb.x, mb.seeds), mb.y) * mb.weight.double()).sum()
            loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in replica.parameters()]))
    return torch.stack(grads).mean(dim=0)


@pytest.mark.parametrize("world_size,micro_batch_size", [(3, 0), (4, 1), (2, 2), (7, 0), (9, 0)])
def test_weighted_rank_losses_average_to_the_global_batch_mean_gradient(world_size, micro_batch_size):
    windows = random_windows(30)
    sampler = ElasticSampler(len(windows), global_batch_size=7, seed=0)
    model = _tiny_model(dropout=0.2)  # dropout too: masks follow samples, not ranks
    model.train()

    indices, _ = sampler.batch_at(DataCursor(0, 3))
    x, y = windows.gather(indices)
    reference = copy.deepcopy(model)
    per_sample_loss(reference(x, sample_seeds(sampler.seed, 5, indices)), y).mean().backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()])

    actual = _ddp_gradient(model, windows, sampler, world_size, micro_batch_size)
    # Double precision throughout, except the float32 weights (3/7 is off by ~1e-8 relative).
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-9)


def test_rank_loss_scale_is_world_over_global_batch():
    assert rank_loss_scale(3, 10) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="world_size \\(0\\)"):
        rank_loss_scale(0, 10)


# --- loader workers and prefetching ----------------------------------------------------------


def _batches_equal(a, b):
    assert (a.step, a.global_indices, a.rank_indices, a.cursor_after) == (
        b.step, b.global_indices, b.rank_indices, b.cursor_after)
    assert len(a.micro_batches) == len(b.micro_batches)
    for ma, mb in zip(a.micro_batches, b.micro_batches):
        assert ma.indices == mb.indices and ma.dummy == mb.dummy
        for name in ("x", "y", "seeds", "weight"):
            assert torch.equal(getattr(ma, name), getattr(mb, name)), name


def test_loader_workers_and_prefetch_neither_change_batches_nor_move_the_cursor():
    windows = random_windows(50)
    sampler = ElasticSampler(len(windows), global_batch_size=6, seed=5)
    start = DataCursor(epoch=1, consumed=44)
    kwargs = dict(rank=1, world_size=4, num_steps=12, start_step=30, micro_batch_size=1)
    plain = list(StepBatches(windows, sampler, start, **kwargs))
    prefetching = StepBatches(windows, sampler, start, num_workers=2, prefetch_batches=4, **kwargs)

    completed = []
    for batch in prefetching:  # workers run up to 8 steps ahead of this loop
        completed.append(batch)
        if len(completed) == 4:
            break
    for a, b in zip(completed, plain):
        _batches_equal(a, b)
    assert completed[-1].cursor_after == sampler.advance(start, 4) == plain[3].cursor_after

    for a, b in zip(prefetching, plain, strict=True):  # a fresh pass yields all 12 steps again
        _batches_equal(a, b)
    assert plain[0].step == 30 and plain[0].global_indices == sampler.batch_at(start)[0]


# --- corpus ----------------------------------------------------------------------------------


def test_glob_double_star_spans_zero_or_more_folders():
    assert glob_match("a.py", "**/*.py") and glob_match("x/y/a.py", "**/*.py")
    assert not glob_match("x/a.txt", "**/*.py")
    assert glob_match("src/a.py", "src/*.py") and not glob_match("src/x/a.py", "src/*.py")


def test_default_corpus_is_the_stdlib_without_installed_packages():
    corpus = load_corpus(DataConfig(max_bytes=300_000))
    assert corpus.dtype == torch.uint8 and corpus.shape == (300_000,)
    text = bytes(corpus[:100_000].tolist()).decode("utf-8", errors="replace")
    assert "import" in text and "def " in text
    assert torch.equal(corpus, load_corpus(DataConfig(max_bytes=300_000)))


def test_local_folder_reads_matching_files_in_sorted_relative_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "b" / "z.py").write_bytes(b"BZ")
    (tmp_path / "a.py").write_bytes(b"A")
    (tmp_path / "c.txt").write_bytes(b"C")
    (tmp_path / "__pycache__" / "x.py").write_bytes(b"X")
    assert bytes(load_corpus(DataConfig(path=str(tmp_path))).tolist()) == b"ABZ"
    assert bytes(load_corpus(DataConfig(path=str(tmp_path), glob="*.txt")).tolist()) == b"C"
    assert bytes(load_corpus(DataConfig(path=str(tmp_path), max_bytes=2)).tolist()) == b"AB"
    assert bytes(load_corpus(DataConfig(path=str(tmp_path / "b" / "z.py"))).tolist()) == b"BZ"


def test_fsspec_url_reads_the_same_way():
    root = f"memory://corpus-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    fs.pipe({f"{root}/b/z.py": b"BZ", f"{root}/a.py": b"A", f"{root}/c.txt": b"C"})
    try:
        corpus = load_corpus(DataConfig(path=root))
        assert bytes(corpus.tolist()) == b"ABZ"
        assert bytes(load_corpus(DataConfig(path=f"{root}/c.txt")).tolist()) == b"C"
        expected = torch.frombuffer(bytearray(b"ABZ"), dtype=torch.uint8)
        assert corpus_fingerprint(corpus) == corpus_fingerprint(expected)
        with pytest.raises(FileNotFoundError, match="memory://nowhere"):
            load_corpus(DataConfig(path="memory://nowhere/at-all"))
    finally:
        fs.rm(root, recursive=True)


def test_missing_or_empty_paths_are_named_in_the_error(tmp_path):
    missing = tmp_path / "no-such-dir"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_corpus(DataConfig(path=str(missing)))
    (tmp_path / "notes.txt").write_bytes(b"hello")
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}.*\*\*/\*\.py"):
        load_corpus(DataConfig(path=str(tmp_path)))
