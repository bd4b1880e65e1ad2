"""What a checkpoint holds: objects with ``state_dict()`` / ``load_state_dict()``, and adapters for the rest.

A checkpoint is a mapping of names to *stateful* objects (torch's ``Stateful`` protocol): anything
with ``state_dict() -> dict`` and ``load_state_dict(dict)`` -- an LR scheduler, a
``torch.amp.GradScaler``, an ``nn.Module`` (an EMA ``AveragedModel``, a teacher), another optimizer,
a user's own counters. Their state dicts may hold tensors (any device) and plain values (None, bool,
int, float, str, lists, tuples and dicts of these). :func:`as_stateful` takes any of them as is.

Models and optimizers get adapters (:class:`ModelState`, :class:`OptimizerState`) that go through
``torch.distributed.checkpoint.state_dict``: keys are parameter names (not optimizer-internal
integer ids), a ``DistributedDataParallel`` or ``torch.compile`` wrapper is seen through (the names are
the plain module's, so compiled and eager runs share checkpoints), and an optimizer that has not
stepped yet gets its state tensors allocated, so a checkpoint loads *into* them in place. Made with
``replicated=True`` (the run does so for the model it wraps in DDP and its optimizer), they declare
the tensors DDP keeps the same on every rank -- trainable parameters and the optimizer's state --
through ``synced(path)``, so a save does not compare those across ranks
(:mod:`elastic_ddp.checkpoint.divergence`). Everything else is compared, and stored per rank where
it differs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
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

__all__ = ["ModelState", "OptimizerState", "Stateful", "as_stateful", "check_stateful", "is_compiled", "synced_paths", "unwrap_model"]

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
    if not isinstance(obj, Stateful):
        raise TypeError(
            f"State {name!r} ({type(obj).__module__}.{type(obj).__qualname__}) has no state_dict() and "
            "load_state_dict(); only such objects can be checkpointed (the protocol elastic_ddp.state.Stateful; "
            "an nn.Module is taken as elastic_ddp.state.ModelState). Give it those two methods (returning and "
            "taking a dict of tensors and plain values), or wrap it in an object that has them."
        )


def as_stateful(name: str, obj: object) -> Stateful:
    """``obj`` as a checkpointable object under ``name``: an ``nn.Module`` (an EMA ``AveragedModel``, a
    teacher) as a :class:`ModelState` (keys are its parameter and buffer names, a DDP or ``torch.compile``
    wrapper seen through), anything else with ``state_dict()``/``load_state_dict()`` as is (an optimizer, a
    scheduler, a ``GradScaler``, a user's counters). Raises like :func:`check_stateful`."""
    if isinstance(obj, torch.nn.Module):
        obj = ModelState(obj)
    check_stateful(name, obj)
    return obj


def synced_paths(state: Mapping[str, Stateful]) -> Callable[[tuple[Any, ...]], bool]:
    """For one save: whether the tensor at a path (object name first) is the same on every rank by
    construction, as its object declares with an optional ``synced()`` method returning a predicate
    over its own paths (the DDP model's and optimizer's adapters do); such tensors are not compared
    across ranks."""
    declared = {name: obj.synced() for name, obj in state.items() if callable(getattr(obj, "synced", None))}

    def synced(path: tuple[Any, ...]) -> bool:
        check = declared.get(path[0])
        return bool(check is not None and check(path[1:]))

    return synced


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's own module inside ``model``: through a ``DistributedDataParallel`` wrapper (``.module``)
    and a ``torch.compile`` wrapper (``OptimizedModule._orig_mod``), in either order or both.

    A checkpoint names the module's state by the plain module's names -- never ``module.`` or
    ``_orig_mod.`` -- so that checkpoints of compiled and eager runs, with or without DDP, are one format.
    """
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif is_compiled(model):
            model = model._orig_mod
        else:
            return model


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a ``torch.compile`` wrapper (an ``OptimizedModule``)."""
    # Only torch.compile creates an OptimizedModule, and it imports torch._dynamo first: while that is
    # not imported, no module is one -- and importing it here would cost every worker a second.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


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
    """A model's parameters and buffers, keyed by the plain module's names (:func:`unwrap_model`).

    ``replicated``: DDP keeps this model's trainable parameters the same on every rank (see the
    module docstring); its buffers are compared at each save whatever this says.
    """

    def __init__(self, model: torch.nn.Module, *, replicated: bool = False) -> None:
        self.model = unwrap_model(model)
        self._options = _Options(self.model, ())
        self._replicated = replicated

    def synced(self) -> Callable[[tuple[Any, ...]], bool]:
        """For one save: whether the tensor at a path of :meth:`state_dict` is the same on every rank by
        construction (a trainable parameter of a replicated model); for the empty path, whether the
        state's structure is (the same module on every rank: names, dtypes and shapes)."""
        if not self._replicated:
            return lambda path: False
        # Taken at each save: a model may gain or freeze parameters between saves.
        names = frozenset(name for name, p in self.model.named_parameters(remove_duplicate=False) if p.requires_grad)
        return lambda path: not path or (len(path) == 1 and path[0] in names)

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

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, replicated: bool = False) -> None:
        self.model = unwrap_model(model)
        self.optimizer = optimizer
        self._options = _Options(self.model, (optimizer,))
        self._replicated = replicated

    def synced(self) -> Callable[[tuple[Any, ...]], bool]:
        """For one save: whether the tensor at a path (and, for the empty path, the structure and
        plain values) is the same on every rank by construction -- all of it when the model is DDP's
        (the same parameters and all-reduced gradients give the same update everywhere)."""
        replicated = self._replicated
        return lambda path: replicated

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
