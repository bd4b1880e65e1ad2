"""The checkpoint format's pure parts: the write plan, the read assignment, state trees, the index."""

from __future__ import annotations

import math
import random

import pytest
import torch

from elastic_ddp.checkpoint import index as ix
from elastic_ddp.checkpoint.layout import assign_holders, plan
from elastic_ddp.checkpoint.tree import TensorSpec, TreeError, flatten, unflatten

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float64]


def random_specs(n: int, seed: int = 0) -> list[TensorSpec]:
    rng = random.Random(seed)
    return [TensorSpec(rng.choice(DTYPES), tuple(rng.randint(0, 40) for _ in range(rng.randint(0, 3)))) for _ in range(n)]


def covered_exactly_once(layout, specs) -> bool:
    seen = {i: [] for i in range(len(specs))}
    for f in layout.files:
        for p in f.pieces:
            seen[p.tensor].append((p.start, p.stop))
    for i, spec in enumerate(specs):
        end = 0
        for start, stop in sorted(seen[i]):
            if start != end:
                return False
            end = stop
        if end != spec.numel:
            return False
    return True


@pytest.mark.parametrize("writers", [1, 3, 4, 8])
def test_each_writer_gets_an_equal_share_cut_on_element_boundaries(writers: int) -> None:
    specs = random_specs(300)
    total = sum(s.nbytes for s in specs)
    layout = plan(specs, list(range(writers)), files_per_writer=2, min_file_bytes=0)
    assert covered_exactly_once(layout, specs)
    assert sum(f.nbytes for f in layout.files) == total
    for f in layout.files:
        assert f.nbytes == sum((p.stop - p.start) * specs[p.tensor].itemsize for p in f.pieces)
    for w in range(writers):  # within a few elements of total / writers: nobody stages a replica
        assert abs(layout.share_bytes(w) - total / writers) <= 2 * 8, (w, layout.share_bytes(w), total / writers)
    assert len({f.name for f in layout.files}) == len(layout.files)


def test_a_tensor_larger_than_a_share_is_split_between_writers() -> None:
    specs = [TensorSpec(torch.float32, (1000,)), TensorSpec(torch.float32, (10,))]
    layout = plan(specs, [0, 1, 2, 3], files_per_writer=1, min_file_bytes=0)
    assert {f.writer for f in layout.files if any(p.tensor == 0 for p in f.pieces)} == {0, 1, 2, 3}
    shares = [layout.share_bytes(w) for w in range(4)]
    assert sum(shares) == 4040 and all(abs(s - 1010) < 4 for s in shares), shares  # cut between float32 elements


def test_small_states_on_many_ranks_use_fewer_larger_files_spread_over_the_ranks() -> None:
    specs = [TensorSpec(torch.float32, (25 << 20,))]  # 100 MiB
    layout = plan(specs, list(range(64)), files_per_writer=2, min_file_bytes=16 << 20)
    assert len(layout.files) == math.ceil(100 / 16)
    writers = sorted({f.writer for f in layout.files})
    assert len(writers) == 4 and writers[0] == 0 and writers[-1] >= 32  # spread, not packed onto ranks 0-3
    assert plan([], [0, 1], files_per_writer=2, min_file_bytes=0).files == ()


def test_readers_get_files_back_by_writer_or_balanced_by_size() -> None:
    files = [(f"f{i}", i % 4, size) for i, size in enumerate([90, 10, 50, 50, 30, 30, 20, 20])]
    assert assign_holders(files, [0, 1, 2, 3], by_writer=True) == {name: w for name, w, _ in files}
    holders = assign_holders(files, [0, 1], by_writer=False)
    assert set(holders) == {name for name, _, _ in files}
    loads = [sum(size for name, _, size in files if holders[name] == r) for r in (0, 1)]
    assert max(loads) - min(loads) <= 90 and sum(loads) == 300
    with pytest.raises(ValueError, match="not among the readers"):
        assign_holders(files, [0, 1], by_writer=True)


def test_state_trees_keep_tuples_int_keys_and_plain_values_and_name_what_they_cannot_hold() -> None:
    tree = {"a": (1, 2.5, None, "x", True), 3: [torch.ones(2), {"n": float("inf")}], (1, "k"): {}}
    encoded, tensors, paths = flatten(tree)
    assert len(tensors) == 1 and paths == [(3, 0)]
    back = unflatten(encoded, lambda i, path: tensors[i])
    assert back["a"] == (1, 2.5, None, "x", True) and isinstance(back["a"], tuple)
    assert back[3][1] == {"n": float("inf")} and back[(1, "k")] == {}
    with pytest.raises(TreeError, match=r"'opt\.s\.lr'.*builtins\.set"):
        flatten({"s": {"lr": {1, 2}}}, ("opt",))
    with pytest.raises(TreeError, match="dict keys"):
        flatten({frozenset(): 1})


def test_an_index_whose_pieces_overlap_or_miss_bytes_is_refused() -> None:
    specs = [TensorSpec(torch.float32, (8,))]
    layout = plan(specs, [0, 1], files_per_writer=1, min_file_bytes=0)
    index = ix.build(specs, {"m": {"dict": [["w", {"tensor": 0}]]}}, layout.files, {})
    assert ix.parse(index.to_bytes(), "i").files == index.files
    import json

    data = json.loads(index.to_bytes())
    data["files"][1]["pieces"] = [[0, 3, 8]]  # overlaps the first file's [0, 4)
    data["files"][1]["size"] = 20
    with pytest.raises(ix.IndexFormatError, match="exactly once"):
        ix.parse(json.dumps(data).encode(), "i")
    data["files"][1]["pieces"] = [[0, 4, 9]]
    with pytest.raises(ix.IndexFormatError, match="does not fit tensor 0"):
        ix.parse(json.dumps(data).encode(), "i")
