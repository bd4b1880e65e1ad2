"""What a checkpoint holds: objects with ``state_dict()`` / ``load_state_dict()``, and adapters for the rest.

A checkpoint is a mapping of names to *stateful* objects (torch's ``Stateful`` protocol): anything
with ``state_dict() -> dict`` and ``load_state_dict(dict)`` -- an LR scheduler, a
``torch.amp.GradScaler``, a user's own counters. Their state dicts may hold tensors (any device) and
plain values (None, bool, int, float, str, lists, tuples and dicts of these).

Models and optimizers get adapters (:class:`ModelState`, :class:`OptimizerState`) that go through
``torch.distributed.checkpoint.state_dict``: keys are parameter names (not optimizer-internal
integer ids), a ``DistributedDataParallel`` wrapper is seen through, and an optimizer that has not
stepped yet gets its state tensors allocated, so a checkpoint loads *into* them in place.

:class:`RNGState` is this process's random number generators (torch CPU and CUDA, Python's
``random``, NumPy's legacy global generator when NumPy is installed). It differs per rank, so it is
saved as per-rank state: restored exactly at the same world size, not at another.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

try:  # the steps of get_model_state_dict / get_optimizer_state_dict, to check their options once (below)
    from torch.distributed.checkpoint.state_dict import (
        _gc_context,
        _get_model_state_dict,
        _get_optim_state_dict,
        _verify_options,
        _verify_state_dict,
    )
except ImportError:  # another torch: the public functions, which check them every call
    _verify_options = None

__all__ = ["ModelState", "OptimizerState", "RNGState", "Stateful", "check_stateful"]

# Names a user may not give to state: the checkpoint format keeps per-rank state under this prefix.
RESERVED_PREFIX = "_rank_"


@runtime_checkable
class Stateful(Protocol):
    """An object a checkpoint can save and restore."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def check_stateful(name: str, obj: object) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``obj`` can be checkpointed under it."""
    if not isinstance(name, str) or not name or "." in name or "/" in name or name.startswith(RESERVED_PREFIX):
        raise ValueError(
            f"State name {name!r} is not allowed: use a non-empty name without '.' or '/' that does not "
            f"start with {RESERVED_PREFIX!r}."
        )
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        raise TypeError(
            f"State {name!r} is a {type(obj).__name__}; wrap it as ModelState(model) or "
            "OptimizerState(model, optimizer) so its keys are parameter names and DDP is seen through."
        )
    if not isinstance(obj, Stateful):
        raise TypeError(
            f"State {name!r} ({type(obj).__name__}) has no state_dict() and load_state_dict(); only such "
            "objects can be checkpointed."
        )


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # DDP keeps the user's module as .module; its state dict keys would otherwise carry "module.".
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


class _Options:
    """torch's checked options for one model (and optimizers), kept while its parameters stay the same.

    ``get_model_state_dict`` and ``get_optimizer_state_dict`` check their options on every call by
    walking every module and parameter -- two thirds of their time, ~45 ms per call pair at 288
    parameters, and growing faster than the parameter count. The memory tier takes these state
    dicts every few steps inside the training loop, so the check is done once and redone only when
    the model's parameters change.
    """

    def __init__(self, model: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
        self.model = model
        self.optimizers = optimizers
        self._params: list[torch.Tensor] = []
        self._info: Any = None

    def get(self) -> Any:
        params = list(self.model.parameters())
        if self._info is None or len(params) != len(self._params) or any(a is not b for a, b in zip(params, self._params)):
            self._info = _verify_options(self.model, self.optimizers, optim_only=bool(self.optimizers))
            self._params = params
        return self._info


class ModelState:
    """A model's parameters and buffers, keyed by their names (a DDP wrapper is seen through)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = _unwrap(model)
        self._options = _Options(self.model, ())

    def state_dict(self) -> dict[str, Any]:
        if _verify_options is None:
            return get_model_state_dict(self.model)
        with _gc_context():  # what get_model_state_dict does, with its options checked once
            info = self._options.get()
            state = _get_model_state_dict(self.model, info)
            _verify_state_dict(state, {}, info)
            return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        set_model_state_dict(self.model, dict(state_dict), options=StateDictOptions(strict=True))


class OptimizerState:
    """An optimizer's state and parameter groups, keyed by parameter names of ``model``.

    ``state_dict()`` allocates the state of an optimizer that has not stepped yet (torch does so
    with a step on zero gradients that changes nothing), so a checkpoint can be loaded into it.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = _unwrap(model)
        self.optimizer = optimizer
        self._options = _Options(self.model, (optimizer,))

    def state_dict(self) -> dict[str, Any]:
        if _verify_options is None:
            return get_optimizer_state_dict(self.model, self.optimizer)
        with _gc_context():  # what get_optimizer_state_dict does, with its options checked once
            info = self._options.get()
            state = _get_optim_state_dict(self.model, (self.optimizer,), info)
            _verify_state_dict({}, state, info)
            return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, dict(state_dict))


def _numpy_random() -> Any:
    try:
        import numpy.random
    except ImportError:  # NumPy is optional; without it there is no NumPy stream to keep
        return None
    return numpy.random


class RNGState:
    """The random number generators of this process, as a state dict of tensors and ints.

    ``device`` is this rank's CUDA device (its generator is saved too); None on CPU-only ranks.
    The saved and the restoring process must agree on which generators exist (CUDA or not, NumPy
    or not); :meth:`load_state_dict` raises ``ValueError`` naming the difference otherwise.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None and device.type == "cuda" else None

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": {
                "version": version,
                "internal": torch.tensor(internal, dtype=torch.int64),
                "gauss": gauss,
            },
        }
        if self.device is not None:
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        np_random = _numpy_random()
        if np_random is not None:
            kind, keys, pos, has_gauss, cached = np_random.get_state(legacy=True)
            state["numpy"] = {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "gauss": float(cached),
            }
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        expected = set(self.state_dict())
        if set(state_dict) != expected:
            raise ValueError(
                f"The saved random generators {sorted(state_dict)} are not this process's {sorted(expected)} "
                "(CUDA or NumPy present on one side only)."
            )
        torch.set_rng_state(state_dict["torch"].cpu())
        python = state_dict["python"]
        random.setstate((int(python["version"]), tuple(int(v) for v in python["internal"].tolist()), python["gauss"]))
        if self.device is not None:
            torch.cuda.set_rng_state(state_dict["cuda"].cpu(), self.device)
        if "numpy" in state_dict:
            saved = state_dict["numpy"]
            keys = saved["keys"].cpu().numpy().astype("uint32")
            _numpy_random().set_state((saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["gauss"]))
