"""A save onto a full disk (a small real tmpfs) fails cleanly; after space is freed, saves work again."""

from __future__ import annotations

import subprocess

import pytest
import torch

from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.config import CheckpointConfig
from elastic_ddp.state import ModelState, OptimizerState


@pytest.fixture
def small_disk(tmp_path):
    mount_dir = tmp_path / "disk"
    mount_dir.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_dir)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"Mounting a size-limited tmpfs is not permitted here: {proc.stderr.strip()}")
    try:
        yield mount_dir
    finally:
        subprocess.run(["umount", "-l", str(mount_dir)], check=False)


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_save_fails_cleanly_keeps_committed_and_recovers(small_disk, async_save: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)  # ~0.26 MB of weights, ~0.8 MB with the AdamW moments
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    mgr = CheckpointManager(CheckpointConfig(url=str(small_disk / "ck"), async_save=async_save), identity={})
    mgr.save(1, {"model": ModelState(model), "optim": OptimizerState(model, opt)})
    assert mgr.wait(), mgr.last_error

    filler = small_disk / "filler"
    free = subprocess.run(["df", "-B1", "--output=avail", str(small_disk)], capture_output=True, text=True)
    filler.write_bytes(b"\0" * max(int(free.stdout.split()[-1]) - 200_000, 0))
    mgr.save(2, {"model": ModelState(model), "optim": OptimizerState(model, opt)})
    assert not mgr.wait()
    assert mgr.failed_saves == 1 and "step-000000002" in mgr.last_error
    assert f"the disk holding {small_disk / 'ck'} is full" in mgr.last_error, mgr.last_error
    assert [i.step for i in mgr.list()] == [1]
    assert mgr.latest().step == 1
    assert not (small_disk / "ck" / "step-000000002" / "manifest.json").exists()

    filler.unlink()
    mgr.save(3, {"model": ModelState(model), "optim": OptimizerState(model, opt)})
    assert mgr.close(), mgr.last_error
    assert [i.step for i in mgr.list()] == [1, 3]
