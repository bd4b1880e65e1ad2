"""elastic_ddp.checkpoint.divergence: what a save finds replicated and what it finds per rank.

The checksums, the plan checks (:func:`stale`, :func:`split_as`) and the one-process case are
tested in this process; :func:`classify` over real collectives runs once as three gloo ranks
(``_RANKS``), each scenario in that one launch, and the tests below read its verdicts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elastic_ddp.checkpoint.divergence import (
    LARGE_BYTES,
    ROW_WORDS,
    Plan,
    classify,
    describe,
    plan_of,
    split_as,
    stale,
    tensor_checksums,
    values,
)
from elastic_ddp.checkpoint.tree import TensorSpec, TreeError
from tests.helpers.ranks import run_ranks

REPO = str(Path(__file__).resolve().parents[2])
LARGE_FLOATS = LARGE_BYTES // 4 + 5  # float32 elements of a tensor summed on its device, with a partial row


def checksums(*tensors: torch.Tensor) -> list[list[int]]:
    return tensor_checksums(list(tensors)).tolist()


# --- tensor_checksums ------------------------------------------------------------------------


def test_checksums_are_two_int64_per_tensor_equal_for_equal_bytes():
    small, large = torch.arange(12, dtype=torch.float32), torch.linspace(0, 1, LARGE_FLOATS)
    out = tensor_checksums([small, large, torch.zeros(0)])
    assert out.dtype == torch.int64 and out.shape == (3, 2) and out.device.type == "cpu"
    assert checksums(small.clone(), large.clone()) == out[:2].tolist()
    # A fresh empty tensor hashes alike (and like any other empty tensor): no bytes, nothing to differ.
    assert checksums(torch.zeros(0, dtype=torch.int64)) == out[2:].tolist()


@pytest.mark.parametrize("numel", [7, LARGE_FLOATS], ids=["host-hash", "column-sum"])
def test_one_changed_element_changes_the_checksums(numel):
    base = torch.linspace(-3, 3, numel)
    changed = base.clone()
    changed[numel // 2] = torch.nextafter(changed[numel // 2], torch.tensor(10.0))  # one ulp: a few bits
    assert checksums(base) != checksums(changed)


def test_words_reordered_within_a_row_change_the_column_weighted_checksum():
    base = torch.arange(LARGE_BYTES // 8 + ROW_WORDS, dtype=torch.int64)
    swapped = base.clone()
    swapped[[3, 700]] = swapped[[700, 3]]  # the same words, the same total: only their columns moved
    a, b = checksums(base)[0], checksums(swapped)[0]
    assert a[0] == b[0] and a[1] != b[1]


def test_the_last_bytes_past_whole_words_are_covered():
    base = torch.zeros(LARGE_BYTES + 3, dtype=torch.uint8)
    changed = base.clone()
    changed[-1] = 1
    assert checksums(base) != checksums(changed)


def test_only_the_c_order_bytes_count_not_strides_or_alignment():
    small = torch.arange(12.0).reshape(3, 4)
    large = torch.linspace(0, 1, 1024 * (LARGE_FLOATS // 1024 + 1)).reshape(1024, -1)
    strided = [t.t().contiguous().t() for t in (small, large)]  # same values, transposed strides
    assert not any(t.is_contiguous() for t in strided)
    assert checksums(*strided) == checksums(small, large)
    # A uint8 view at an odd offset into a larger buffer: its int64 words are not 8-byte aligned.
    buffer = torch.randint(0, 256, (LARGE_BYTES + 64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    view = buffer[3 : 3 + LARGE_BYTES + 9]
    assert view.data_ptr() % 8 and checksums(view) == checksums(view.clone())


# --- describe --------------------------------------------------------------------------------


def test_describe_names_per_rank_tensors_and_objects():
    assert describe([], []) == ""
    assert describe(["ema.bn.running_mean"], []) == "ema.bn.running_mean (1 tensor)"
    names = [f"t{i}" for i in range(8)]
    assert describe(names, ["counter"]) == "t0, t1, t2, t3, t4, t5, ... (8 tensors); object 'counter'"
    assert describe(names[:2], ["a", "b"], limit=2) == "t0, t1 (2 tensors); objects 'a', 'b'"


# --- classify in one process -----------------------------------------------------------------


def test_without_a_collective_nothing_differs_and_the_state_is_encoded_in_order():
    trees = {"model": {"w": torch.ones(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, "run": {"step": 4}}
    split = classify(trees)
    assert not split.has_per_rank and split.per_rank == frozenset() and split.own == {} and split.own_tensors == ()
    assert split.paths == (("model", "w"), ("model", "b"))
    assert all(a is b for a, b in zip(split.tensors, (trees["model"]["w"], trees["model"]["b"]), strict=True))
    assert split.specs == (TensorSpec(torch.float32, (2, 3)), TensorSpec(torch.bfloat16, (3,)))
    assert split.shared["run"] == {"dict": [["step", 4]]}
    empty = classify({})
    assert (empty.shared, empty.tensors, empty.specs, empty.has_per_rank) == ({}, (), (), False)


def test_a_value_a_checkpoint_cannot_hold_is_refused_with_its_path():
    # Raised while encoding, before any collective: all_max must not be called.
    def no_collective(_values):
        raise AssertionError("classify reached a collective with a state it cannot encode")

    with pytest.raises(TreeError, match=r"'opt\.state\.0\.hook'"):
        classify({"opt": {"state": {0: {"hook": object()}}}}, all_max=no_collective)


# --- plans: split_as, values, stale ----------------------------------------------------------


def _trees(w: torch.Tensor | None = None, step: int = 1) -> dict:
    return {"model": {"w": torch.ones(4) if w is None else w, "v": torch.arange(3.0)}, "run": {"step": step}}


def test_split_as_keeps_the_plans_split_while_the_structure_is_the_plans():
    trees = _trees()
    plan = plan_of(classify(trees), trees, None)
    again = split_as(plan, _trees(w=torch.full((4,), 9.0), step=2), None)  # new values, same structure
    assert again is not None and again.paths == (("model", "w"), ("model", "v"))
    assert again.shared["run"]["dict"] == [["step", 2]]
    assert split_as(plan, _trees(w=torch.ones(4, dtype=torch.float64)), None) is None  # a dtype
    assert split_as(plan, _trees(w=torch.ones(2, 2)), None) is None  # a shape
    assert split_as(plan, {**_trees(), "extra": {"t": torch.ones(1)}}, None) is None  # a tensor more
    # What is compared is part of the structure: a plan made with a tensor synced does not fit without.
    synced = plan_of(classify(trees), trees, lambda path: path == ("model", "w"))
    assert split_as(synced, trees, lambda path: path == ("model", "w")) is not None
    assert split_as(synced, trees, None) is None


def test_values_of_another_structure_is_the_flag_alone():
    trees = _trees()
    plan = plan_of(classify(trees), trees, None)
    assert plan.size == 1 + 2 + 2 * 2  # flag, two objects, two checksums per tensor
    out = values(plan, trees, None, torch.device("cpu"))
    assert out.tolist() == [1] + [0] * (plan.size - 1)
    mine = values(plan, trees, split_as(plan, trees, None), torch.device("cpu"))
    assert mine[0] == 0 and mine.dtype == torch.int64 and mine.shape == (plan.size,)
    assert mine[3:].tolist() == tensor_checksums([trees["model"]["w"], trees["model"]["v"]]).reshape(-1).tolist()


def test_stale_names_what_no_longer_holds_and_accepts_what_may_still_differ():
    plan = Plan(own=("counter",), per_rank=frozenset({1}), compared=("model", "counter"), checked=(0, 1), structure=())
    same = [0, 5, 6, 10, 11, 20, 21]
    assert stale(plan, same, same) is None
    assert "another structure" in stale(plan, [1, *same[1:]], same)
    assert stale(plan, same, [0, 4, *same[2:]]) == "the plain values of 'model' now differ across ranks"
    assert stale(plan, same, [0, 5, 7, *same[3:]]) is None  # a per-rank object may differ
    assert stale(plan, same, [0, 5, 6, 10, 12, 20, 21]) == "tensor 0 of the shared state now differs across ranks"
    assert stale(plan, same, [0, 5, 6, 10, 11, 20, 0]) is None  # a per-rank tensor may differ


# --- classify over three ranks ---------------------------------------------------------------

_RANKS = """
import json, sys
sys.path.insert(0, sys.argv[3])  # the repository under test
import torch
import torch.distributed as dist
from elastic_ddp.checkpoint import divergence
from elastic_ddp.checkpoint.divergence import LARGE_BYTES, all_max_over, classify, plan_of, split_as, stale, values

rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store, 3), rank=rank, world_size=3)
cpu = torch.device("cpu")
all_max = all_max_over(None, cpu)
calls = []
def counting(vector):
    calls.append(vector.numel())
    return all_max(vector)

def base():
    g = torch.Generator().manual_seed(7)  # the same values on every rank
    return {
        "model": {"w": torch.randn(5, 3, generator=g), "b": torch.zeros(3, dtype=torch.bfloat16),
                  "big": torch.randn(LARGE_BYTES // 4 + 5, generator=g), "none": torch.zeros(0)},
        "opt": {"step": 5, "lr": 0.1, "betas": (0.9, 0.99), "tag": None, "groups": [{"ids": [0, 1]}],
                "m": torch.randn(5, 3, generator=g)},
    }

def verdict(trees, synced=None):
    calls.clear()
    split = classify(trees, synced=synced, all_max=counting)
    return {"per_rank": sorted(".".join(map(str, split.paths[i])) for i in split.per_rank),
            "own": list(split.own), "shared": list(split.shared), "has_per_rank": split.has_per_rank,
            "paths": [".".join(map(str, p)) for p in split.paths],
            "own_specs": [[str(t.dtype), list(t.shape)] for t in split.own_tensors], "calls": list(calls)}

out = {}
out["identical"] = verdict(base())

s = base()
if rank == 2:
    s["model"]["w"][1, 2] += 1  # one element of a small tensor, on one rank
out["small_on_rank_2"] = verdict(s)

s = base()
if rank == 1:
    s["model"]["big"][LARGE_BYTES // 8] += 1  # one element of a large tensor (column sums), on one rank
out["large_on_rank_1"] = verdict(s)

s = base()
if rank == 2:
    big = s["model"]["big"]
    big[[10, 11, 20, 21]] = big[[20, 21, 10, 11]]  # two int64 words swapped within one row: same total
out["large_swap_on_rank_2"] = verdict(s)

s = base()
if rank == 0:
    wide = torch.zeros(2 * s["model"]["big"].numel())
    wide[::2] = s["model"]["big"]
    s["model"]["big"] = wide[::2]  # a strided view of another buffer, same values
    s["opt"]["m"] = s["opt"]["m"].t().contiguous().t()  # same values, other strides
out["same_bytes_other_layout"] = verdict(s)

s = base()
s["ema"] = {"w": torch.ones(4, dtype=torch.float64 if rank == 2 else torch.float32)}
out["dtype_on_rank_2"] = verdict(s)

s = base()
s["ema"] = {"w": torch.ones(2, 2) if rank == 1 else torch.ones(4)}  # the same bytes, another shape
out["shape_on_rank_1"] = verdict(s)

s = base()
s["counter"] = {"seen": 10 + rank, "t": torch.ones(2)}
out["plain_value"] = verdict(s)

s = base()
s["opt"]["betas"] = (0.9, 0.999 if rank == 0 else 0.99)
out["float_in_tuple_on_rank_0"] = verdict(s)

# An object with more tensors on some ranks, before others: the references of what follows it are
# numbered differently on those ranks, which must not make the later objects differ.
s = {"first": {"t": [torch.ones(1)] * (2 if rank else 1)}, **base()}
out["structure_earlier"] = verdict(s)

s = base()
s["model"]["w"] += rank  # differs, but declared the same by construction: not hashed
s["model"]["b"] += rank  # differs, not declared
s["opt"]["step"] = rank  # the object is declared synced: its plain values are not compared
out["synced"] = verdict(s, synced=lambda path: path in {("model", "w"), ("opt",)})

out["empty"] = verdict({})
out["plain_only"] = verdict({"cfg": {"a": 1}, "run": {}})
out["plain_only_differs"] = verdict({"cfg": {"a": rank}, "run": {}})

# A plan made once, then checked at later saves with one all-reduce.
def check(plan, trees, synced=None):
    mine = values(plan, trees, split_as(plan, trees, synced), cpu)
    both = all_max(torch.cat([mine, ~mine]))
    return stale(plan, both[: plan.size].tolist(), (~both[plan.size :]).tolist())

s = base()
s["counter"] = {"seen": rank}
if rank == 1:
    s["model"]["w"][0, 0] = -1.0
split = classify(s, all_max=all_max)
plan = plan_of(split, s, None)
checks = {"unchanged": check(plan, s)}
if rank == 2:
    s["model"]["b"][0] = 1.0
checks["shared_tensor_on_rank_2"] = check(plan, s)
s["model"]["b"][0] = 0.0
s["model"]["w"][0, 0] = 3.0
checks["per_rank_tensor_now_equal"] = check(plan, s)
s["counter"]["seen"] = 100 + rank
checks["per_rank_object_still_differs"] = check(plan, s)
s["opt"]["lr"] = 0.2 if rank == 0 else 0.1
checks["shared_plain_on_rank_0"] = check(plan, s)
s["opt"]["lr"] = 0.1
if rank == 1:
    s["model"]["extra"] = torch.ones(1)
checks["structure_on_rank_1"] = check(plan, s)
out["plan"] = {"per_rank": sorted(".".join(map(str, split.paths[i])) for i in split.per_rank),
               "own": list(split.own), "checks": checks}

# A Classifier over a sequence of saves: one collective while its last decision holds.
classifier = divergence.Classifier()
def saved(trees):
    calls.clear()
    split = classifier(trees, all_max=counting)
    return {"per_rank": sorted(".".join(map(str, split.paths[i])) for i in split.per_rank), "own": list(split.own),
            "calls": list(calls)}

s = base()
s["counter"] = {"seen": rank}
saves = {"first": saved(s), "unchanged": saved(s)}
if rank == 2:
    s["model"]["b"][0] = 1.0
saves["shared_tensor_on_rank_2"] = saved(s)
saves["then_unchanged"] = saved(s)
s["model"]["b"][0] = 0.0
saves["per_rank_tensor_now_equal"] = saved(s)
if rank == 1:
    s["model"]["extra"] = torch.ones(1)
saves["structure_on_rank_1"] = saved(s)
out["classifier"] = {"own": saves["first"]["own"], "saves": saves}

print(json.dumps(out))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict:
    """Every scenario's result on each of three ranks, after checking the ranks agree on all of them."""
    ranks = [json.loads(r.stdout) for r in run_ranks(tmp_path_factory.mktemp("divergence"), _RANKS, 3, REPO)]
    for name in ranks[0]:
        assert ranks[1][name]["own"] == ranks[2][name]["own"] == ranks[0][name]["own"], name
        if "per_rank" in ranks[0][name]:
            assert ranks[1][name]["per_rank"] == ranks[2][name]["per_rank"] == ranks[0][name]["per_rank"], name
    return {"ranks": ranks, **ranks[0]}


def test_identical_state_on_every_rank_is_all_replicated_with_two_all_reduces(verdicts):
    v = verdicts["identical"]
    assert v["per_rank"] == [] and v["own"] == [] and not v["has_per_rank"]
    assert v["paths"] == ["model.w", "model.b", "model.big", "model.none", "opt.m"]
    # One all-reduce of [digest, ~digest] per object, one of [2 checksums, ~them] per tensor.
    assert v["calls"] == [2 * 2, 2 * 2 * 5]


def test_a_tensor_that_differs_on_one_rank_is_per_rank_on_every_rank(verdicts):
    assert verdicts["small_on_rank_2"]["per_rank"] == ["model.w"]
    assert verdicts["large_on_rank_1"]["per_rank"] == ["model.big"]
    assert verdicts["large_swap_on_rank_2"]["per_rank"] == ["model.big"]
    for name in ("small_on_rank_2", "large_on_rank_1", "large_swap_on_rank_2"):
        assert verdicts[name]["own"] == [] and verdicts[name]["has_per_rank"], name


def test_only_the_bytes_count_not_the_tensor_object_or_its_strides(verdicts):
    v = verdicts["same_bytes_other_layout"]
    assert v["per_rank"] == [] and v["own"] == []


@pytest.mark.parametrize("name", ["dtype_on_rank_2", "shape_on_rank_1"])
def test_a_dtype_or_shape_that_differs_makes_its_object_per_rank_whole(verdicts, name):
    ranks = [r[name] for r in verdicts["ranks"]]
    assert ranks[0]["own"] == ["ema"] and ranks[0]["per_rank"] == []
    assert ranks[0]["shared"] == ["model", "opt"] and not any(p.startswith("ema") for p in ranks[0]["paths"])
    # Each rank keeps its own version of the object, as it holds it.
    expected = {"dtype_on_rank_2": [["torch.float32", [4]], ["torch.float32", [4]], ["torch.float64", [4]]],
                "shape_on_rank_1": [["torch.float32", [4]], ["torch.float32", [2, 2]], ["torch.float32", [4]]]}[name]
    assert [r["own_specs"][0] for r in ranks] == expected


def test_plain_values_that_differ_make_their_object_per_rank_and_no_other(verdicts):
    assert verdicts["plain_value"]["own"] == ["counter"] and verdicts["plain_value"]["per_rank"] == []
    assert verdicts["float_in_tuple_on_rank_0"]["own"] == ["opt"]
    assert "opt.m" not in verdicts["float_in_tuple_on_rank_0"]["paths"]
    assert verdicts["plain_only_differs"]["own"] == ["cfg"] and verdicts["plain_only_differs"]["shared"] == ["run"]
    assert verdicts["plain_only"]["own"] == [] and verdicts["plain_only"]["calls"] == [2 * 2]


def test_an_object_with_more_tensors_on_some_ranks_does_not_make_later_objects_differ(verdicts):
    v = verdicts["structure_earlier"]
    assert v["own"] == ["first"] and v["shared"] == ["model", "opt"] and v["per_rank"] == []


def test_what_is_declared_synced_is_neither_hashed_nor_compared(verdicts):
    v = verdicts["synced"]
    assert v["own"] == [] and v["per_rank"] == ["model.b"]
    # Two objects, one declared synced: one digest; five tensors, one declared synced: four compared.
    assert v["calls"] == [2 * 1, 2 * 2 * 4]


def test_an_empty_state_needs_no_collective(verdicts):
    v = verdicts["empty"]
    assert v["calls"] == [] and v["shared"] == [] and not v["has_per_rank"]


def test_a_plan_is_stale_exactly_when_what_it_stores_once_starts_to_differ(verdicts):
    plan = verdicts["plan"]
    assert plan["per_rank"] == ["model.w"] and plan["own"] == ["counter"]
    assert all(r["plan"]["checks"] == plan["checks"] for r in verdicts["ranks"])  # one verdict everywhere
    assert plan["checks"] == {
        "unchanged": None,
        "shared_tensor_on_rank_2": "tensor 1 of the shared state now differs across ranks",
        "per_rank_tensor_now_equal": None,
        "per_rank_object_still_differs": None,
        "shared_plain_on_rank_0": "the plain values of 'opt' now differ across ranks",
        "structure_on_rank_1": "a rank's state has another structure than at the last comparison",
    }


def test_a_classifier_checks_its_last_decision_in_one_collective_and_decides_anew_where_it_no_longer_holds(verdicts):
    saves = verdicts["classifier"]["saves"]
    assert all(r["classifier"]["saves"] == saves for r in verdicts["ranks"])  # one decision everywhere
    # Three objects (model, opt, counter), five tensors: a decision is two all-reduces, a check one
    # of [structure flag, 3 digests, 2 x 5 checksums] and its complement.
    decide, check = [2 * 3, 2 * 2 * 5], [2 * (1 + 3 + 2 * 5)]
    assert saves["first"] == {"per_rank": [], "own": ["counter"], "calls": decide}
    assert saves["unchanged"] == {"per_rank": [], "own": ["counter"], "calls": check}
    # A tensor stored once now differs: the check finds it, and the decision that follows stores it per rank.
    assert saves["shared_tensor_on_rank_2"] == {"per_rank": ["model.b"], "own": ["counter"], "calls": check + decide}
    assert saves["then_unchanged"]["calls"] == check
    # Per rank, now the same everywhere: still stored per rank (each rank's own values), no new decision.
    assert saves["per_rank_tensor_now_equal"] == {"per_rank": ["model.b"], "own": ["counter"], "calls": check}
    # Another structure on one rank: every rank decides anew -- the model, with the rank's extra tensor,
    # is per rank as a whole, and of the rest only opt's one tensor is compared.
    assert saves["structure_on_rank_1"]["calls"] == check + [2 * 3, 2 * 2 * 1]
    assert saves["structure_on_rank_1"]["own"] == ["model", "counter"]
