"""recipes/train.py end to end: real torchrun agents joined through a real etcd (v2 API off).

A "node" is one torchrun agent with its workers; killing a node kills the agent and every
descendant (torchrun starts workers in a session of their own).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers.job import RECIPE, STEP_LINE, TEST_RDZV_CONF, TINY, env
from tests.helpers.nodes import start_node, wait_for


def torchrun(backend: str, endpoint: str, run_id: str, nnodes: str, root: Path, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", "--nproc-per-node=1", "--max-restarts=3", "--monitor-interval=0.1",
        f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", TEST_RDZV_CONF,
        str(RECIPE), f"--run.root={root}", f"--run.name={run_id}", *TINY, *flags,
    ]  # fmt: skip


def steps(output: str) -> list[tuple[int, float, int]]:
    """(step, loss, world size) of every progress line in a node's output."""
    return [(int(m[1]), float(m[3]), int(m[4])) for m in STEP_LINE.finditer(output)]


def run_id() -> str:
    return f"e2e-{uuid.uuid4().hex[:8]}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["etcd", "etcd-v3"])
def test_two_nodes_join_through_etcd_train_at_world_size_2_and_exit_0(backend, etcd_endpoint, tmp_path):
    rid = run_id()
    cmd = torchrun(backend, etcd_endpoint, rid, "2", tmp_path, "--train.max_steps=20")
    nodes = [start_node(cmd, env(), tmp_path / f"node{i}.log") for i in range(2)]
    try:
        codes = [node.wait(timeout=240) for node in nodes]
        outputs = "\n".join(node.output() for node in nodes)
        assert codes == [0, 0], outputs
        seen = steps(outputs)
        assert seen, outputs
        assert {world for _, _, world in seen} == {2}
        assert max(step for step, _, _ in seen) == 20
    finally:
        for node in nodes:
            node.cleanup()


@pytest.mark.slow
def test_scale_down_survivor_trains_on_at_world_size_1(etcd_endpoint, tmp_path):
    rid = run_id()
    cmd = torchrun("etcd", etcd_endpoint, rid, "1:2", tmp_path, "--train.max_steps=100000")
    nodes = [start_node(cmd, env(), tmp_path / f"node{i}.log") for i in range(2)]
    try:
        wait_for(lambda: any(w == 2 and s >= 5 for s, _, w in steps(nodes[0].output())), 180, what="world size 2")
        nodes[1].kill()
        wait_for(lambda: any(w == 1 for _, _, w in steps(nodes[0].output())), 120, what="world size 1 after the kill")
        last = steps(nodes[0].output())[-1][0]
        wait_for(lambda: steps(nodes[0].output())[-1][0] >= last + 5, 60, what="training to go on")
    finally:
        for node in nodes:
            node.cleanup()


@pytest.mark.slow
def test_scale_up_third_node_joins_and_workers_restart_at_world_size_3(etcd_endpoint, tmp_path):
    rid = run_id()
    cmd = torchrun("etcd", etcd_endpoint, rid, "1:3", tmp_path, "--train.max_steps=100000")
    nodes = [start_node(cmd, env(), tmp_path / f"node{i}.log") for i in range(2)]
    try:
        wait_for(lambda: any(w == 2 for _, _, w in steps(nodes[0].output())), 180, what="world size 2")
        nodes.append(start_node(cmd, env(), tmp_path / "node2.log"))
        wait_for(
            lambda: any(w == 3 for node in nodes for _, _, w in steps(node.output())),
            180,
            what="world size 3 after the third node joined",
        )
    finally:
        for node in nodes:
            node.cleanup()


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--train.max_steps=-3", "train.max_steps"),
        ("--train.no_such_key=1", "train.no_such_key: unknown setting"),
        ("--dist.backend=mpi", "'auto', 'gloo' or 'nccl'"),
    ],
)
def test_bad_config_exits_nonzero_with_a_clear_message_before_any_process_group(flag, message, tmp_path):
    result = subprocess.run(
        [sys.executable, str(RECIPE), f"--run.root={tmp_path}", flag],
        env=env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    # Nothing was started or written: no process group, no run directory.
    assert list(tmp_path.iterdir()) == []
