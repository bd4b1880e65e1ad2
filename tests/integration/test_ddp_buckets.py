"""elastic_ddp.worker.ddp_buckets: a resume at the same world size is bitwise identical at 3 and 4 ranks.

The torchrun tests run tests/workers/ddp_buckets_worker.py once per world size (gloo, CPU): every
case trains N steps uninterrupted and N/2 + N/2 steps with a new DDP instance in between, over a
model and optimizer loaded from their state dicts. The in-process tests run DDP at world size 1.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic_ddp.worker.ddp_buckets import NOT_BITWISE, stabilize_buckets
from tests.helpers.job import env
from tests.helpers.nodes import start_node

WORKER = Path(__file__).resolve().parents[1] / "workers" / "ddp_buckets_worker.py"
STEPS = 8

# The worker's cases where DDP rebuilds its buckets: each must resume bitwise, its prediction checked.
REBUILT = [
    "mlp",  # several layers, bucket_cap_mb=1: three buckets
    "cnn",  # BatchNorm2d, dropout re-seeded per step, several buckets
    "accumulation",  # no_sync() for all micro-batches but the last; default caps (1 MiB, then 25 MiB)
    "reordered",  # forward uses parameters in another order than registered
    "cap_list",  # bucket_cap_mb_list: several initial buckets, rebuilt in ready order all the same
    "static_graph",  # two iterations in the initial layout
    "last_bucket_cap",  # DDP_SET_LAST_BUCKET_CAP=1: the rebuild runs in reverse ready order
    "mixed_dtypes",  # float32 and float64 parameters: an initial bucket per dtype
    "bucket_view",  # gradient_as_bucket_view=True: the gradients are views of the buckets
]


def _torchrun(world_size: int, root: Path) -> tuple[dict[str, dict[int, dict]], str]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
        "--max-restarts=0", "--monitor-interval=0.1", str(WORKER), "--steps", str(STEPS),
    ]  # fmt: skip
    node = start_node(cmd, env(), root / "torchrun.log", cwd=root)
    try:
        code = node.wait(timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun at {world_size} ranks did not finish in 240 s:\n{node.output()[-6000:]}")
    finally:
        node.cleanup()  # the agent and every worker, whatever happened
    output = node.output()
    assert code == 0, output[-6000:]
    results: dict[str, dict[int, dict]] = {}
    for line in output.splitlines():
        if line.startswith("CASE "):
            result = json.loads(line[len("CASE ") :])
            results.setdefault(result["case"], {})[result["rank"]] = result
    for case, by_rank in results.items():
        assert sorted(by_rank) == list(range(world_size)), (case, sorted(by_rank))
    return results, output


@pytest.fixture(scope="module")
def torchrun_results(tmp_path_factory):
    """The worker's results at a world size, run once per module and world size."""
    cache: dict[int, tuple[dict[str, dict[int, dict]], str]] = {}

    def results(world_size: int) -> dict[str, dict[int, dict]]:
        if world_size not in cache:
            cache[world_size] = _torchrun(world_size, tmp_path_factory.mktemp(f"ddp-buckets-{world_size}"))
        return cache[world_size][0]

    return results


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 4])
def test_same_world_size_resume_is_bitwise_with_stable_buckets_and_not_without(torchrun_results, world_size) -> None:
    results = torchrun_results(world_size)
    for case in REBUILT:
        for rank, result in results[case].items():
            assert result["equal"], f"{case} at {world_size} ranks, rank {rank}: resumed != uninterrupted"
            assert result["buckets"] >= 2, (case, result)  # the layouts differ: the test can fail
    for rank, result in results["find_unused"].items():  # DDP never rebuilds: its layout never changes
        assert result["equal"] and result["status"] == ["averaging"] * 3, (rank, result)
    # Plain DDP reduces step N/2 + 1 in its initial layout after the resume, in the rebuilt one without.
    assert not any(result["equal"] for result in results["plain_mlp"].values()), results["plain_mlp"]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 4])
def test_the_prediction_is_checked_without_a_warning_and_its_hooks_removed(torchrun_results, world_size) -> None:
    results = torchrun_results(world_size)
    for case in [*REBUILT, "find_unused"]:
        for rank, result in results[case].items():
            expected = ["averaging"] * 3 if case == "find_unused" else ["verified"] * 3
            assert result["status"] == expected, (case, rank, result)
            assert result["warnings"] == 0, (case, rank, result)
            assert result["hooks_left"] == 0, (case, rank, result)  # post-accumulate-grad hooks


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 4])
def test_a_wrong_prediction_or_sparse_gradients_warn_once_and_training_goes_on(torchrun_results, world_size) -> None:
    results = torchrun_results(world_size)
    for case, status in [("mispredicted", "mismatch"), ("sparse", "unsupported")]:
        for rank, result in results[case].items():
            assert result["status"] == [status], (case, rank, result)
            assert result["warnings"] == 1, (case, rank, result)  # one per rank and DDP instance
            assert result["hooks_left"] == 0, (case, rank, result)
            assert result["close_to_plain"], (case, rank, result)  # gradients averaged all the same


# --------------------------------------------------------------------------- in process, world size 1


@pytest.fixture
def process_group():
    # A group left behind by another test would be this test's and the next one's: say so, never skip.
    assert not dist.is_initialized(), "a process group is already initialized in this process (a test leaked it)"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(ddp: DistributedDataParallel, steps: range) -> None:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)  # no state: a new one per call is the same
    for step in steps:
        g = torch.Generator().manual_seed(step)
        ddp(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))


def test_the_hook_verifies_the_rebuild_and_then_only_averages(process_group, caplog) -> None:
    model = _model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)  # ~10 KB buckets: several
    stable = stabilize_buckets(ddp)
    assert stable.status == "predicting" and stable.hooks_left == len(list(model.parameters()))
    _train(ddp, range(1))
    assert stable.status == "predicting" and stable.layout is not None and len(stable.layout) >= 2
    _train(ddp, range(1, 3))
    assert stable.status == "verified" and stable.hooks_left == 0
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    assert NOT_BITWISE not in caplog.text
    reference = _model()
    _train(DistributedDataParallel(reference, bucket_cap_mb=0.01), range(3))
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)  # averaging over one rank: DDP's gradients


def test_where_ddp_never_rebuilds_the_hook_only_averages(process_group) -> None:
    model = _model()
    stable = stabilize_buckets(DistributedDataParallel(model, find_unused_parameters=True))
    assert stable.status == "averaging" and stable.hooks_left == 0
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


def test_the_post_accumulate_grad_hooks_go_with_their_ddp(process_group) -> None:
    model = _model()
    ddp = DistributedDataParallel(model)
    stable = stabilize_buckets(ddp)
    assert stable.hooks_left > 0
    del ddp  # a new attempt builds a new DDP over the same model: the old one's hooks must not stay
    gc.collect()
    assert stable.hooks_left == 0
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
