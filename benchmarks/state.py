"""A training state of a chosen size (ByteGPT + AdamW after one step) and the plain ways to save it.

The checkpoint and resume comparisons save and load *the same* state with every method, so each
helper here takes the model and optimizer and does only its own I/O.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import fsspec
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))  # the LM recipe's recipes/lm/, as `lm`
from lm import ByteGPT, ByteGPTConfig  # noqa: E402


@dataclass
class TrainState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    cfg: ByteGPTConfig

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the model and optimizer state (what any checkpoint has to write)."""
        found = list(self.model.state_dict().values())
        for per_param in self.optimizer.state_dict()["state"].values():
            found.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
        return found

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def objects(self) -> dict:
        """The model and optimizer as a run registers them with its checkpoint manager: DDP's
        replicated parameters and optimizer state, which a save does not compare across ranks."""
        from elastic_ddp.state import ModelState, OptimizerState

        return {
            "model": ModelState(self.model, replicated=True),
            "optim": OptimizerState(self.model, self.optimizer, replicated=True),
        }

    def plain_state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def step(self) -> float:
        """One optimizer step on a tiny batch; returns the loss (the "first step" after a load)."""
        x = torch.randint(0, 256, (2, 8), device=next(self.model.parameters()).device)
        logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), x.flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach().item()


def model_config(megabytes: float) -> ByteGPTConfig:
    """A ByteGPT shape whose parameters plus AdamW's two moments take about ``megabytes``."""
    # AdamW keeps two fp32 moments per fp32 parameter: 12 bytes per parameter in all.
    params = megabytes * (1 << 20) / 12
    width = 1024 if megabytes >= 100 else 128
    layers = max(1, round(params / (12 * width * width)))
    return ByteGPTConfig(n_layer=layers, n_embd=width, n_head=8, block_size=64)


def build_state(megabytes: float, seed: int = 0, device: str | torch.device = "cpu") -> TrainState:
    """A model (on ``device``) and an optimizer that has taken one step (so its moments exist)."""
    torch.manual_seed(seed)
    cfg = model_config(megabytes)
    model = ByteGPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = TrainState(model, optimizer, cfg)
    state.step()
    return state


def fresh_like(state: TrainState, seed: int = 1, device: str | torch.device = "cpu") -> TrainState:
    """A new model + optimizer of the same shape with other weights, to load a checkpoint into."""
    torch.manual_seed(seed)
    model = ByteGPT(state.cfg).to(device)
    return TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-4), state.cfg)


def timed(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def memcpy(tensors: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
    """Copy every tensor into preallocated host buffers: the floor of staging a snapshot."""
    for src, dst in zip(tensors, buffers):
        dst.copy_(src)


def raw_write(tensors: list[torch.Tensor], url: str, storage_options: dict | None = None) -> None:
    """Write the tensors' bytes, one after another, into one file (fsync'd if local): the disk floor."""
    with fsspec.open(url, "wb", **(storage_options or {})) as f:
        for tensor in tensors:
            f.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        _fsync(f)


def torch_save(state: TrainState, url: str, storage_options: dict | None = None) -> None:
    """``torch.save`` of the model and optimizer state dicts (fsync'd if local, as the manager does)."""
    with fsspec.open(url, "wb", **(storage_options or {})) as f:
        torch.save(state.plain_state_dict(), f)
        _fsync(f)


def torch_load(state: TrainState, path: str) -> None:
    loaded = torch.load(path, weights_only=True)
    state.model.load_state_dict(loaded["model"])
    state.optimizer.load_state_dict(loaded["optim"])


def _fsync(f) -> None:
    f.flush()
    try:
        fileno = f.fileno()
    except (AttributeError, OSError, ValueError, NotImplementedError):
        return  # a remote file: durable when close() returns
    os.fsync(fileno)
