"""The data pipeline's promises: a deterministic order that is a permutation of every epoch, every
sample once per epoch, the same samples per step at any world size and across resumes, micro-batch
weights that give the exact global-batch mean gradient, loaders that never move the cursor, and any
map-style dataset batched by its own collate function."""

from __future__ import annotations

import collections
import copy
import json
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset, default_collate

from elastic_ddp.data import (
    DataCursor,
    ElasticSampler,
    StepBatches,
    check_dataset,
    derive_seed,
    make_step_batch,
    micro_batches,
    micro_weight,
    rank_bounds,
    rank_slice,
    sample_seeds,
    to_device,
)
from elastic_ddp.worker.nn import SampleDropout


pytestmark = pytest.mark.usefixtures("one_thread")


# Datasets live at module level so that loader workers could also receive them by pickling.


class Points(Dataset):
    """Sample ``i``: ``(x, label)``, ``x`` four float64 numbers that depend on ``i`` only."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        x = torch.randn(4, generator=torch.Generator().manual_seed(index), dtype=torch.float64)
        return x, index % 3


class Records(Dataset):
    """Sample ``i``: a dict of a tensor, an int and a string."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict:
        return {"features": torch.full((2,), float(index)), "label": index, "name": f"record-{index}"}


class Tensors(Dataset):
    """Sample ``i``: a plain tensor."""

    def __len__(self) -> int:
        return 9

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, -index])


class Sequences(Dataset):
    """Sample ``i``: ``1 + i % 4`` tokens, so samples cannot be stacked without padding."""

    def __len__(self) -> int:
        return 15

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.arange(1 + index % 4) + 10 * index


def pad_collate(samples: list[torch.Tensor]) -> dict:
    """A collate_fn of the kind sequence models use: pad to the longest, keep the lengths."""
    return {
        "tokens": nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=-1),
        "lengths": [len(sample) for sample in samples],
    }


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


class NoLength:
    def __getitem__(self, index: int) -> int:
        return index


class Empty(Dataset):
    def __len__(self) -> int:
        return 0

    def __getitem__(self, index: int) -> int:
        raise IndexError(index)


def assert_same_data(a, b) -> None:
    """Equal nested structures of tensors (same dtype and values) and plain values."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_data(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_data(x, y)
    else:
        assert a == b


def assert_same_batch(a, b) -> None:
    assert (a.step, a.rank_indices, a.cursor_after) == (b.step, b.rank_indices, b.cursor_after)
    assert len(a.micro_batches) == len(b.micro_batches)
    for ma, mb in zip(a.micro_batches, b.micro_batches):
        for name in ("indices", "weight", "step", "seed", "dummy", "sample_seeds"):
            assert getattr(ma, name) == getattr(mb, name), name
        assert_same_data(ma.data, mb.data)


# --- the order of an epoch -------------------------------------------------------------------

# 1, 2, 3; every power of 2 (so every power of 4, the size of the permutation's domain) up to 2**14
# with its neighbours; primes, whose epochs never fill a power-of-4 domain.
_SIZES = sorted(
    {1, 2, 3}
    | {size for k in range(2, 15) for size in (2**k - 1, 2**k, 2**k + 1)}
    | {5, 7, 11, 13, 97, 101, 997, 7919, 65537}
)


@pytest.mark.parametrize("num_samples", _SIZES)
def test_every_epoch_order_is_a_permutation_of_all_samples(num_samples):
    sampler = ElasticSampler(num_samples, global_batch_size=1, seed=42)
    for epoch in (0, 7):
        order = sampler.permutation(epoch)
        assert len(order) == num_samples
        assert sorted(order) == list(range(num_samples))
    if num_samples >= 8:
        assert sampler.permutation(0) != list(range(num_samples))  # shuffled, not the identity
        assert sampler.permutation(0) != sampler.permutation(1)  # each epoch its own order


def test_indices_at_any_positions_agree_with_the_whole_permutation():
    sampler = ElasticSampler(1000, global_batch_size=8, seed=3)
    order = sampler.permutation(2)
    positions = [999, 0, 500, 17, 17, 998]
    assert sampler.indices(2, positions).tolist() == [order[p] for p in positions]
    with pytest.raises(IndexError, match=r"below num_samples \(1000\); got 1000"):
        sampler.indices(2, [3, 1000])


_SUBPROCESS = """
import json
from elastic_ddp.data import ElasticSampler, derive_seed, sample_seeds
sampler = ElasticSampler(1000, 8, seed=1234)
print(json.dumps({
    "order": sampler.permutation(3),
    "seeds": sample_seeds(1234, 17, [0, 5, 999]),
    "derived": derive_seed("order", 1234, 3, 0),
}))
"""


def test_order_and_seeds_are_the_same_in_another_process():
    # The child gets another PYTHONHASHSEED, so this also catches any use of the salted hash().
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS], capture_output=True, text=True, check=True, timeout=120
    )
    child = json.loads(out.stdout)
    sampler = ElasticSampler(1000, 8, seed=1234)
    assert child["order"] == sampler.permutation(3)
    assert child["seeds"] == sample_seeds(1234, 17, [0, 5, 999])
    assert child["derived"] == derive_seed("order", 1234, 3, 0)
    assert sampler.permutation(3) != sampler.permutation(4)
    assert ElasticSampler(1000, 8, seed=1235).permutation(3) != sampler.permutation(3)


def test_sample_seeds_are_one_int_per_index_and_differ_by_step_and_index():
    seeds = sample_seeds(9, 2, [4, 5, 4])
    assert isinstance(seeds, list) and all(type(seed) is int for seed in seeds)
    assert seeds[0] == seeds[2] != seeds[1]
    assert seeds[0] == derive_seed("dropout", 9, 2, 4)
    assert sample_seeds(9, 3, [4]) != seeds[:1]
    with pytest.raises(TypeError, match="ints and strs, not float"):
        derive_seed("order", 1.5)


# --- the cursor ------------------------------------------------------------------------------


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


@pytest.mark.parametrize("num_samples,batch_size", [(23, 10), (3, 8), (10, 10)])
def test_slice_at_equals_slicing_the_whole_global_batch(num_samples, batch_size):
    sampler = ElasticSampler(num_samples, batch_size, seed=5)
    for cursor in (DataCursor(), DataCursor(0, num_samples - 1), DataCursor(4, num_samples // 2)):
        whole, _ = sampler.batch_at(cursor)
        for start in range(batch_size + 1):
            for stop in range(start, batch_size + 1):
                assert sampler.slice_at(cursor, start, stop) == whole[start:stop], (cursor, start, stop)
    with pytest.raises(ValueError, match=f"slice 2:{batch_size + 1} of a global batch of {batch_size}"):
        sampler.slice_at(DataCursor(), 2, batch_size + 1)



@pytest.mark.parametrize("num_samples,batch_size", [(23, 10), (3, 8), (1000, 30)])
def test_shares_of_many_steps_at_once_are_each_steps_slice(num_samples, batch_size):
    sampler = ElasticSampler(num_samples, batch_size, seed=5)
    for cursor in (DataCursor(), DataCursor(2, num_samples - 1)):
        for start, stop in ((0, batch_size), (1, batch_size // 2 + 1), (3, 3)):
            expected, at = [], cursor
            for _ in range(70):  # across epochs (every one of them for the small datasets)
                whole, at = sampler.batch_at(at)
                expected.append(whole[start:stop])
            assert sampler.shares(cursor, start, stop, 70) == expected
    assert sampler.shares(DataCursor(), 0, 1, 0) == []


@pytest.mark.parametrize("start_step", [0, 5, 63])
def test_step_batches_computed_ahead_are_the_pure_function_of_each_step(start_step):
    dataset = list(range(37))
    sampler = ElasticSampler(len(dataset), 8, seed=3)
    start = sampler.advance(DataCursor(), start_step)
    batches = StepBatches(dataset, sampler, start, rank=1, world_size=3, num_steps=150, start_step=start_step)
    for offset, batch in enumerate(batches):
        alone = make_step_batch(dataset, sampler, sampler.advance(start, offset), start_step + offset + 1, 1, 3)
        assert batch.rank_indices == alone.rank_indices and batch.cursor_after == alone.cursor_after, offset


def test_cursor_state_round_trips_through_json_and_rejects_bad_values():
    cursor = DataCursor(epoch=2, consumed=17)
    assert DataCursor.from_state_dict(json.loads(json.dumps(cursor.state_dict()))) == cursor
    with pytest.raises(ValueError, match="keys \\['consumed'\\]"):
        DataCursor.from_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="DataCursor.consumed"):
        DataCursor(0, -1)
    with pytest.raises(ValueError, match="DataCursor.epoch"):
        DataCursor(True, 0)


def test_a_resumed_cursor_beyond_the_datasets_epoch_is_refused_naming_both():
    # Written over 30 samples, resumed over 20: position 25 does not exist in an epoch of 20. (A
    # position that does exist is refused by the run's data state, which records the size.)
    cursor = DataCursor(epoch=1, consumed=25)
    sampler = ElasticSampler(20, 4, seed=0)
    message = r"sample 25 of epoch 1, but an epoch has only 20 samples: the dataset changed"
    for call in (
        lambda: sampler.batch_at(cursor),
        lambda: sampler.slice_at(cursor, 0, 1),
        lambda: sampler.advance(cursor, 0),
        lambda: StepBatches(Points(20), sampler, cursor, rank=0, world_size=1, num_steps=1),
    ):
        with pytest.raises(ValueError, match=message):
            call()


def test_a_loader_over_a_dataset_of_another_size_than_the_sampler_is_refused():
    with pytest.raises(ValueError, match="dataset has 21 samples but the sampler orders 20"):
        StepBatches(Points(21), ElasticSampler(20, 4, seed=0), DataCursor(), rank=0, world_size=1, num_steps=1)


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
    bounds = [rank_bounds(batch_size, rank, world_size) for rank in range(world_size)]
    assert [indices[start:stop] for start, stop in bounds] == slices
    assert bounds[0][0] == 0 and bounds[-1][1] == batch_size
    assert all(bounds[rank][1] == bounds[rank + 1][0] for rank in range(world_size - 1))
    sizes = [len(s) for s in slices]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
    with pytest.raises(ValueError, match="rank \\(5\\)"):
        rank_slice(indices, 5, 5)


def test_micro_batches_split_in_order_into_the_fewest_balanced_chunks():
    assert micro_batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert micro_batches([1, 2, 3], 0) == [[1, 2, 3]]  # 0: no limit
    assert micro_batches(list(range(50)), 0) == [list(range(50))]
    assert micro_batches([1, 2, 3], 8) == [[1, 2, 3]]  # a share below the limit stays whole
    assert micro_batches([4, 5], 2) == [[4, 5]]
    assert micro_batches([], 2) == []
    assert micro_batches([], 0) == []
    with pytest.raises(ValueError, match=r"micro_batch_size \(-1\)"):
        micro_batches([1], -1)


def test_micro_batches_never_leave_a_lone_remainder():
    # Greedy cuts gave 10 + 1 and 10 + 10 + 5; the 1-sample micro-batch crashed BatchNorm.
    eleven = list(range(100, 111))
    assert micro_batches(eleven, 10) == [eleven[:6], eleven[6:]]
    assert [len(mb) for mb in micro_batches(list(range(25)), 10)] == [9, 8, 8]
    assert [len(mb) for mb in micro_batches(list(range(21)), 10)] == [7, 7, 7]
    assert [len(mb) for mb in micro_batches(list(range(10)), 3)] == [3, 3, 2, 2]


def test_micro_batch_sizes_are_balanced_for_every_share_and_limit():
    for share in range(0, 70):
        items = [(37 * i) % 71 for i in range(share)]  # not sorted: the order must be kept, not restored
        for limit in range(0, 30):
            chunks = micro_batches(items, limit)
            sizes = [len(chunk) for chunk in chunks]
            assert sum(chunks, []) == items, (share, limit)
            if share == 0:
                assert chunks == []
                continue
            assert len(chunks) == (-(-share // limit) if limit else 1), (share, limit)
            assert limit == 0 or max(sizes) <= limit, (share, limit, sizes)
            assert max(sizes) - min(sizes) <= 1, (share, limit, sizes)
            assert sizes == sorted(sizes, reverse=True), (share, limit, sizes)  # larger ones first


SEGMENTS = {
    "4->2": [(4, 5), (2, 7)],
    "2->3": [(2, 4), (3, 8)],
    "1->5": [(1, 6), (5, 6)],
    "4->2->3->1->5": [(4, 3), (2, 3), (3, 2), (1, 1), (5, 3)],
}


@pytest.mark.parametrize("name", SEGMENTS)
def test_world_size_changes_keep_the_samples_of_every_step(name):
    points = Points(37)  # 37 samples, 10 per step: epochs end inside steps 3, 7 and 11
    sampler = ElasticSampler(len(points), global_batch_size=10, seed=11)
    reference = list(StepBatches(points, sampler, DataCursor(), rank=0, world_size=1, num_steps=12))

    cursor, step = DataCursor(), 0
    for world_size, steps in SEGMENTS[name]:
        per_rank = [
            list(StepBatches(points, sampler, cursor, rank=rank, world_size=world_size,
                             num_steps=steps, start_step=step, micro_batch_size=2))
            for rank in range(world_size)
        ]  # fmt: skip
        for offset in range(steps):
            expected = reference[step + offset]
            (whole,) = expected.micro_batches
            batches = [per_rank[rank][offset] for rank in range(world_size)]
            assert all(b.step == expected.step for b in batches)
            assert sum((b.rank_indices for b in batches), []) == expected.rank_indices
            # The samples' data and dropout seeds do not depend on the split either.
            micros = [mb for b in batches for mb in b.micro_batches]
            assert torch.equal(torch.cat([mb.data[0] for mb in micros]), whole.data[0])
            assert torch.equal(torch.cat([mb.data[1] for mb in micros]), whole.data[1])
            assert sum((mb.sample_seeds for mb in micros), []) == whole.sample_seeds
            assert len({b.cursor_after for b in batches}) == 1
        # Carry the cursor over as a checkpoint would: through JSON.
        state = json.dumps(per_rank[0][-1].cursor_after.state_dict())
        cursor, step = DataCursor.from_state_dict(json.loads(state)), step + steps
    assert cursor == reference[-1].cursor_after
    expected = [sampler.batch_at(sampler.advance(DataCursor(), k))[0] for k in range(12)]
    assert [b.rank_indices for b in reference] == expected


def test_more_ranks_than_samples_gives_zero_weight_dummies_of_a_real_sample():
    points = Points(20)
    sampler = ElasticSampler(len(points), global_batch_size=3, seed=0)
    batches = [make_step_batch(points, sampler, DataCursor(), 1, rank, 5) for rank in range(5)]
    global_batch, _ = sampler.batch_at(DataCursor())
    assert [len(b.rank_indices) for b in batches] == [1, 1, 1, 0, 0]
    for batch in batches[3:]:
        (mb,) = batch.micro_batches
        assert mb.dummy and mb.weight == 0.0 and mb.samples == 0
        assert mb.indices == global_batch[:1]
        assert mb.data[0].shape == (1, 4)  # a real sample, so the forward pass is an ordinary one
    for batch in batches[:3]:
        (mb,) = batch.micro_batches
        assert not mb.dummy and mb.samples == 1 and mb.weight == pytest.approx(5 / 3)


# --- weighting: exact global-batch mean gradients --------------------------------------------


def test_micro_weight_is_samples_times_world_size_over_global_batch():
    assert micro_weight(4, 3, 10) == 4 * 3 / 10
    assert micro_weight(1, 1, 1) == 1.0
    assert micro_weight(0, 8, 64) == 0.0


@pytest.mark.parametrize("batch_size", [1, 7, 10, 16])
@pytest.mark.parametrize("world_size", [1, 3, 4, 9])
@pytest.mark.parametrize("micro_batch_size", [0, 1, 3])
def test_weighted_micro_batch_means_average_over_ranks_to_the_global_mean(batch_size, world_size, micro_batch_size):
    # DDP averages over ranks what each rank summed over its micro-batches.
    points = Points(23)
    sampler = ElasticSampler(len(points), batch_size, seed=1)
    cursor = DataCursor(0, 20)  # crosses into the next epoch
    losses = {index: float(index) ** 1.5 + 0.25 for index in range(len(points))}  # any per-sample values
    per_rank = []
    for rank in range(world_size):
        batch = make_step_batch(points, sampler, cursor, 1, rank, world_size, micro_batch_size)
        means = [sum(losses[i] for i in mb.indices) / len(mb.indices) for mb in batch.micro_batches]
        per_rank.append(sum(mb.weight * mean for mb, mean in zip(batch.micro_batches, means)))
    global_batch, _ = sampler.batch_at(cursor)
    assert sum(per_rank) / world_size == pytest.approx(sum(losses[i] for i in global_batch) / batch_size, rel=1e-12)


# B = 32, limit 10, W = 1..8: shares 32, 16, 11/10, 8, 7/6, 6/5, 5/4, 4 (docs/data.md gives this table).
SMALLEST_MICRO_BATCH_32_BY_10 = {1: 8, 2: 8, 3: 5, 4: 8, 5: 6, 6: 5, 7: 4, 8: 4}


@pytest.mark.parametrize("world_size", [*SMALLEST_MICRO_BATCH_32_BY_10, 11, 40])
def test_micro_batch_weights_of_all_ranks_sum_to_the_world_size(world_size):
    # sum over ranks and micro-batches of weight == W is what makes DDP's average over ranks of the
    # weighted micro-batch means the global-batch mean, however the shares are cut.
    points = Points(45)
    sampler = ElasticSampler(len(points), global_batch_size=32, seed=3)
    cursor = DataCursor(0, 30)
    batches = [make_step_batch(points, sampler, cursor, 1, rank, world_size, 10) for rank in range(world_size)]
    micros = [mb for batch in batches for mb in batch.micro_batches]
    assert sum(mb.weight for mb in micros) == pytest.approx(world_size, rel=1e-12)
    assert [i for mb in micros if not mb.dummy for i in mb.indices] == sampler.batch_at(cursor)[0]
    real = [mb.samples for mb in micros if not mb.dummy]
    assert max(real) <= 10
    if world_size in SMALLEST_MICRO_BATCH_32_BY_10:
        assert min(real) == SMALLEST_MICRO_BATCH_32_BY_10[world_size]


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 16])
def test_batchnorm_trains_on_every_micro_batch_after_a_resize(world_size):
    # 32 over 2 ranks is 16 = 10 + 6 either way; over 3 ranks the greedy split gave 11 = 10 + 1.
    points = Points(40)
    sampler = ElasticSampler(len(points), global_batch_size=32, seed=0)
    norm = nn.BatchNorm1d(4, dtype=torch.float64).train()
    for rank in range(world_size):
        for mb in make_step_batch(points, sampler, DataCursor(), 1, rank, world_size, 10).micro_batches:
            norm(mb.data[0])  # raises "Expected more than 1 value per channel" on a 1-sample batch


class TinyNet(nn.Module):
    """A two-layer classifier with per-sample dropout, in float64 so sums compare exactly."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 16, dtype=torch.float64)
        self.drop = SampleDropout(0.3, site=0)
        self.fc2 = nn.Linear(16, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x)), seeds))


def _gradient(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("world_size,micro_batch_size", [(1, 0), (3, 0), (4, 1), (2, 2), (7, 0), (9, 0)])
def test_weighted_micro_batch_losses_give_the_global_batch_mean_gradient(world_size, micro_batch_size):
    points = Points(30)
    sampler = ElasticSampler(len(points), global_batch_size=7, seed=0)
    model = TinyNet().train()  # dropout too: masks follow samples, not ranks or micro-batches
    cursor = DataCursor(0, 3)

    indices, _ = sampler.batch_at(cursor)
    x, y = default_collate([points[i] for i in indices])
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x, sample_seeds(sampler.seed, 5, indices)), y).backward()
    expected = _gradient(reference)

    # What DDP computes: each rank sums its weighted micro-batch mean losses; ranks are averaged.
    grads = []
    for rank in range(world_size):
        replica = copy.deepcopy(model)
        batch = make_step_batch(points, sampler, cursor, 5, rank, world_size, micro_batch_size)
        for mb in batch.micro_batches:
            x, y = mb.data
            (F.cross_entropy(replica(x, mb.sample_seeds), y) * mb.weight).backward()
        grads.append(_gradient(replica))
    torch.testing.assert_close(torch.stack(grads).mean(dim=0), expected, rtol=1e-10, atol=1e-12)


# --- any map-style dataset -------------------------------------------------------------------


@pytest.mark.parametrize("dataset", [Points(11), Records(), Tensors()], ids=["tuples", "dicts", "tensors"])
def test_micro_batches_are_the_default_collation_of_their_samples(dataset):
    sampler = ElasticSampler(len(dataset), global_batch_size=5, seed=2)
    batches = StepBatches(dataset, sampler, DataCursor(), rank=1, world_size=2, num_steps=4, micro_batch_size=1)
    seen = []
    for batch in batches:
        for mb in batch.micro_batches:
            assert_same_data(mb.data, default_collate([dataset[i] for i in mb.indices]))
            seen += mb.indices
    cursor, expected = DataCursor(), []
    for _ in range(4):
        indices, cursor = sampler.batch_at(cursor)
        expected += indices[3:]  # rank 1 of 2 holds positions 3..4 of 5
    assert seen == expected


def test_default_collation_keeps_the_sample_structure():
    sampler = ElasticSampler(12, global_batch_size=4, seed=0)
    (mb,) = make_step_batch(Records(), sampler, DataCursor(), 1, 0, 1).micro_batches
    assert mb.data["features"].shape == (4, 2)
    assert mb.data["label"].tolist() == mb.indices
    assert mb.data["name"] == [f"record-{i}" for i in mb.indices]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_custom_collate_fn_batches_each_micro_batch(num_workers):
    dataset = Sequences()
    sampler = ElasticSampler(len(dataset), global_batch_size=6, seed=4)
    batches = StepBatches(dataset, sampler, DataCursor(), rank=0, world_size=2, num_steps=3, micro_batch_size=2,
                          num_workers=num_workers, collate_fn=pad_collate)  # fmt: skip
    steps = list(batches)
    assert len(steps) == 3
    for batch in steps:
        for mb in batch.micro_batches:
            samples = [dataset[i] for i in mb.indices]
            assert mb.data["lengths"] == [len(s) for s in samples]
            assert torch.equal(mb.data["tokens"], pad_collate(samples)["tokens"])


@pytest.mark.parametrize(
    "dataset,why",
    [(Stream(), "Stream is an IterableDataset. Exactly-once data order needs a map-style dataset"),
     (NoLength(), "NoLength is not a map-style dataset: it needs __len__ and __getitem__"),
     (iter(range(3)), "is not a map-style dataset")],
    ids=["iterable-dataset", "no-len", "iterator"],
)  # fmt: skip
def test_a_dataset_that_is_not_map_style_is_a_type_error_saying_why(dataset, why):
    with pytest.raises(TypeError, match=why):
        check_dataset(dataset)
    with pytest.raises(TypeError, match=why):
        StepBatches(dataset, ElasticSampler(3, 1, seed=0), DataCursor(), rank=0, world_size=1, num_steps=1)


def test_check_dataset_returns_the_size_and_refuses_an_empty_dataset():
    assert check_dataset(Points(13)) == 13
    assert check_dataset([10, 20, 30]) == 3  # a list is a map-style dataset too
    with pytest.raises(ValueError, match=r"The dataset \(Empty\) is empty"):
        check_dataset(Empty())


# --- loader workers and prefetching ----------------------------------------------------------


def test_loader_workers_and_prefetch_neither_change_batches_nor_move_the_cursor():
    points = Points(50)
    sampler = ElasticSampler(len(points), global_batch_size=6, seed=5)
    start = DataCursor(epoch=1, consumed=44)
    kwargs = dict(rank=1, world_size=4, num_steps=12, start_step=30, micro_batch_size=1)
    plain = list(StepBatches(points, sampler, start, **kwargs))
    prefetching = StepBatches(points, sampler, start, num_workers=2, prefetch_batches=4, **kwargs)

    rng_before = torch.get_rng_state()
    completed = []
    for batch in prefetching:  # workers run up to 8 steps ahead of this loop
        completed.append(batch)
        if len(completed) == 4:
            break
    assert len(completed) == 4
    for a, b in zip(completed, plain):
        assert_same_batch(a, b)
    assert completed[-1].cursor_after == sampler.advance(start, 4) == plain[3].cursor_after
    assert prefetching.start == start  # what the workers prepared ahead is not counted anywhere

    for a, b in zip(prefetching, plain, strict=True):  # a fresh pass yields all 12 steps again
        assert_same_batch(a, b)
    # The loader's own generator, not the process's (which a checkpoint restores).
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert plain[0].step == 31
    assert plain[0].rank_indices == sampler.batch_at(start)[0][2:4]  # rank 1 of 4 holds 2 of 6
    assert prefetching.batch(3).cursor_after == plain[3].cursor_after
    with pytest.raises(IndexError, match=r"outside 0..11"):
        prefetching.batch(12)


def test_micro_batch_seeds_follow_the_sample_at_any_world_size():
    points = Points(40)
    sampler = ElasticSampler(len(points), global_batch_size=8, seed=6)
    one = make_step_batch(points, sampler, DataCursor(), 4, 0, 1)
    (whole,) = one.micro_batches
    for world_size in (2, 3):
        for rank in range(world_size):
            for mb in make_step_batch(points, sampler, DataCursor(), 4, rank, world_size, 1).micro_batches:
                (index,) = mb.indices
                assert mb.sample_seeds == [whole.sample_seeds[whole.indices.index(index)]]
    assert whole.sample_seeds == sample_seeds(6, 4, whole.indices)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_pinned_batches_hold_the_same_data_in_page_locked_memory(num_workers):
    points = Points(20)
    sampler = ElasticSampler(len(points), global_batch_size=4, seed=0)
    kwargs = dict(rank=0, world_size=2, num_steps=3, micro_batch_size=1, num_workers=num_workers)
    pinned = list(StepBatches(points, sampler, DataCursor(), pin_memory=True, **kwargs))
    plain = list(StepBatches(points, sampler, DataCursor(), pin_memory=False, **kwargs))
    for a, b in zip(pinned, plain, strict=True):
        assert_same_batch(a, b)
        assert all(mb.data[0].is_pinned() for mb in a.micro_batches)


# --- to_device -------------------------------------------------------------------------------


class Pair(NamedTuple):
    inputs: torch.Tensor
    target: torch.Tensor


class Movable:
    """An object with its own ``.to`` (as tokenizer outputs have)."""

    def __init__(self) -> None:
        self.moved_to = None

    def to(self, device):
        self.moved_to = device
        return self


def test_to_device_moves_every_tensor_of_nested_structures_and_keeps_their_types():
    meta = torch.device("meta")  # a device every build has; tensors there hold no data
    movable = Movable()
    data = {
        "pair": Pair(torch.ones(2), torch.zeros(2)),
        "list": [torch.ones(1), (torch.ones(1), "text", 3)],
        "ordered": collections.OrderedDict(b=torch.ones(1), a=torch.ones(1)),
        "defaults": collections.defaultdict(list, x=torch.ones(1)),
        "movable": movable,
        "label": 7,
    }
    moved = to_device(data, meta)
    assert type(moved) is dict and list(moved) == list(data)
    assert type(moved["pair"]) is Pair and moved["pair"].inputs.device == meta and moved["pair"].target.device == meta
    assert type(moved["list"]) is list and moved["list"][0].device == meta
    assert type(moved["list"][1]) is tuple and moved["list"][1][0].device == meta
    assert moved["list"][1][1:] == ("text", 3)
    assert type(moved["ordered"]) is collections.OrderedDict and list(moved["ordered"]) == ["b", "a"]
    assert moved["ordered"]["a"].device == meta
    assert type(moved["defaults"]) is collections.defaultdict and moved["defaults"]["x"].device == meta
    assert moved["defaults"].default_factory is list
    assert moved["movable"] is movable and movable.moved_to == meta
    assert moved["label"] == 7
    assert data["pair"].inputs.device.type == "cpu"  # the input is left as it was
    assert to_device(torch.ones(1), meta).device == meta
