"""Checkpoints on a real S3 API (moto's server over HTTP), including an outage mid-save."""

from __future__ import annotations

import torch

from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.tools import checkpoint as ckpt_cli
from elastic_ddp.config import CheckpointConfig
from elastic_ddp.state import ModelState, OptimizerState


def build(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def objects(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": ModelState(model), "optim": OptimizerState(model, opt)}


def test_save_list_verify_load_on_s3(s3_url: str, capsys) -> None:
    model, opt = build(16)
    mgr = CheckpointManager(CheckpointConfig(url=s3_url), identity={"run": "s3"})
    mgr.save(5, objects(model, opt))
    assert mgr.close(), mgr.last_error
    expected = model.weight.detach().clone()

    fresh, fresh_opt = build(16)
    mgr2 = CheckpointManager(CheckpointConfig(url=s3_url), identity={"run": "s3"})
    info = mgr2.resolve("auto")
    assert info.url == f"{s3_url}/step-000000005"
    mgr2.load(info, objects(fresh, fresh_opt))
    assert torch.equal(fresh.weight, expected)
    assert ckpt_cli.main(["ckpt", "verify", info.url]) == 0
    assert ckpt_cli.main(["ckpt", "list", s3_url]) == 0
    assert "step-000000005" in capsys.readouterr().out


def test_s3_outage_mid_async_save_fails_cleanly_and_a_later_save_succeeds(s3_server, s3_url: str) -> None:
    # 1024x1024 fp32 weights + AdamW moments: ~12 MB, so the upload is still running when S3 goes away.
    model, opt = build(1024)
    mgr = CheckpointManager(CheckpointConfig(url=s3_url, async_save=True), identity={"run": "s3"})
    mgr.save(1, objects(model, opt))
    assert mgr.wait(), mgr.last_error
    try:
        mgr.save(2, objects(model, opt))
        s3_server.stop()
        assert not mgr.wait()
    finally:
        s3_server.start()
    assert mgr.failed_saves == 1
    assert "step-000000002" in mgr.last_error
    assert [i.step for i in mgr.list()] == [1]
    assert mgr.latest().step == 1

    mgr.save(3, objects(model, opt))
    assert mgr.close(), mgr.last_error
    assert [i.step for i in mgr.list()] == [1, 3]
    assert mgr.failed_saves == 1
    # Whatever the failed save left in the bucket was removed after the next commit.
    assert mgr.storage.list_dirs(s3_url) == ["step-000000001", "step-000000003"]
