"""checkpoint.url must be storage every node sees: two torchrun agents in different working
directories with a local (relative) URL -- two machines' local disks -- stop before training."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers.nodes import Node

WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "ckpt_worker.py")


@pytest.mark.slow
def test_two_nodes_with_a_local_url_in_different_directories_stop_with_the_shared_storage_error(etcd_endpoint, tmp_path) -> None:
    run_id = f"shared-{uuid.uuid4().hex[:8]}"
    nodes = []
    try:
        for name in ("node-a", "node-b"):
            cwd = tmp_path / name
            cwd.mkdir()
            log = open(tmp_path / f"{name}.log", "ab")  # noqa: SIM115 - closed by Node
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                "--max-restarts=0", "--monitor-interval=0.1", "--rdzv-backend=etcd",
                f"--rdzv-endpoint={etcd_endpoint}", f"--rdzv-id={run_id}",
                WORKER, "save", "--url", "checkpoints", "--steps", "1", "--save-at", "1",
            ]  # fmt: skip
            process = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            nodes.append(Node(process, tmp_path / f"{name}.log", log))
        codes = [node.wait(timeout=120) for node in nodes]
    finally:
        for node in nodes:
            node.cleanup()
    output = "\n".join(node.output() for node in nodes)
    assert all(code != 0 for code in codes), output[-4000:]
    errors = [line for line in output.splitlines() if "CheckpointError: checkpoint.url must be storage shared by all nodes" in line]
    assert len(errors) == 2, output[-4000:]  # both ranks, one on each node, before any training step
    assert all("rank(s) 1 could not read" in line and "checkpoints'" in line for line in errors), errors
    left = [p.name for name in ("node-a", "node-b") for p in (tmp_path / name).glob("checkpoints/*")]
    assert left == [], left  # no checkpoint was written, and rank 0 removed its probe
