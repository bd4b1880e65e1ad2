"""Small states for checkpoint tests: a manager on a URL, a user's own object, a stepped model and
its optimizer, the comparison of a restore with what was saved, and a record of the storages built."""

from __future__ import annotations

import torch

from elastic_ddp.checkpoint import CheckpointManager, Storage
from elastic_ddp.config import CheckpointConfig
from elastic_ddp.state import ModelState, OptimizerState

IDENTITY = {"model.n_layer": 2, "model.n_embd": 8}


def manager(url: str, identity: dict | None = None, rdzv_round: int | None = None, **cfg) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(url=url, **cfg), identity=identity or IDENTITY, rdzv_round=rdzv_round)


class Box:
    """A user's own stateful object: any picklable-free values."""

    def __init__(self, **values) -> None:
        self.values = dict(values)

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state: dict) -> None:
        self.values = dict(state)


def objects(model: torch.nn.Module, opt: torch.optim.Optimizer, **more) -> dict:
    return {"model": ModelState(model), "optim": OptimizerState(model, opt), **more}


def tiny(seed: int = 0, width: int = 8) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt)
    return model, opt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(3, model[0].in_features)).pow(2).mean().backward()
    opt.step()


def clone_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    msd = {k: v.clone() for k, v in model.state_dict().items()}
    osd = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    return msd, osd


def assert_same(model: torch.nn.Module, opt: torch.optim.Optimizer, expected: tuple[dict, dict]) -> None:
    msd, osd = expected
    for key, value in model.state_dict().items():
        assert torch.equal(value, msd[key]), key
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(value, osd[index][key]), (index, key)


def storages_built(monkeypatch) -> list[str]:
    """The URLs of the :class:`Storage` objects built from now on, in order."""
    built: list[str] = []
    build = Storage.__init__

    def counted(self, url, *args, **kwargs) -> None:
        built.append(url)
        build(self, url, *args, **kwargs)

    monkeypatch.setattr(Storage, "__init__", counted)
    return built
