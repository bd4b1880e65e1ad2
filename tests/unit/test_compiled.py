"""A ``torch.compile``d model's state goes by the plain module's names: saved, loaded, started from
pretrained weights and exported like an eager one's, so compiled and eager runs share checkpoints.

The compiled models here use ``backend="eager"``: the wrapper (``OptimizedModule``, whose own
``state_dict()`` keys start with ``_orig_mod.``) is what the state adapters see, whatever the backend,
and inductor would spend seconds per test compiling. The end-to-end run (inductor, 3 ranks, a killed
worker) is tests/integration/test_compiled_e2e.py.
"""

from __future__ import annotations

import torch

from elastic_ddp.tools import checkpoint as ckpt_cli
from elastic_ddp.checkpoint import pretrained as pt
from elastic_ddp.state import ModelState, OptimizerState, as_stateful, unwrap_model
from tests.helpers.checkpoint import assert_same, clone_state, manager, objects, tiny


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    return torch.compile(model, backend="eager")


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """One optimizer step on a fixed batch (``tests.helpers.checkpoint.train`` indexes the plain module)."""
    opt.zero_grad()
    model(torch.linspace(-1, 1, 24).view(3, 8)).pow(2).mean().backward()
    opt.step()


def test_the_state_of_a_compiled_model_has_the_plain_models_names() -> None:
    model, opt = tiny()
    wrapped = compiled(model)
    assert all(key.startswith("_orig_mod.") for key in wrapped.state_dict())  # the premise
    assert unwrap_model(wrapped) is model
    assert list(ModelState(wrapped).state_dict()) == list(model.state_dict())
    assert list(OptimizerState(wrapped, opt).state_dict()["state"]) == [name for name, _ in model.named_parameters()]
    # The trainable parameters are declared replicated under the names they are saved by.
    synced = ModelState(wrapped, replicated=True).synced()
    assert all(synced((name,)) for name, _ in model.named_parameters())


def test_a_registered_compiled_module_is_saved_under_its_plain_names() -> None:
    model, _ = tiny()
    ema = torch.optim.swa_utils.AveragedModel(model)
    assert list(as_stateful("ema", compiled(ema)).state_dict()) == list(ema.state_dict())


def test_an_eager_checkpoint_loads_into_a_compiled_model_bitwise_and_trains_on(tmp_path) -> None:
    model, opt = tiny(seed=0)
    saved = clone_state(model, opt)
    mgr = manager(str(tmp_path))
    assert mgr.save(1, objects(model, opt), blocking=True)
    fresh, fresh_opt = tiny(seed=1)
    wrapped = compiled(fresh)
    mgr.load(mgr.latest(), objects(wrapped, fresh_opt))
    assert_same(fresh, fresh_opt, saved)
    # Trained on, compiled, it takes the same step as the eager model it came from.
    step(wrapped, fresh_opt)
    step(model, opt)
    assert_same(fresh, fresh_opt, clone_state(model, opt))
    assert mgr.close()


def test_a_compiled_checkpoint_loads_into_an_eager_model_bitwise(tmp_path) -> None:
    model, opt = tiny(seed=0)
    wrapped = compiled(model)
    step(wrapped, opt)  # a step of the compiled model, as a compiled run saves after one
    saved = clone_state(model, opt)
    mgr = manager(str(tmp_path))
    assert mgr.save(2, objects(wrapped, opt), blocking=True)
    fresh, fresh_opt = tiny(seed=1)
    mgr.load(mgr.latest(), objects(fresh, fresh_opt))
    assert_same(fresh, fresh_opt, saved)
    assert mgr.close()


def test_init_from_and_export_carry_the_plain_names(tmp_path) -> None:
    model, opt = tiny(seed=0)
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    torch.save(weights, source := tmp_path / "w.pt")
    fresh, _ = tiny(seed=1)
    loaded = pt.load_pretrained(str(source), ModelState(compiled(fresh)))
    assert loaded.tensors == len(weights)
    assert all(torch.equal(fresh.state_dict()[key], value) for key, value in weights.items())

    mgr = manager(str(tmp_path / "ckpts"))
    assert mgr.save(3, objects(compiled(model), opt), blocking=True) and mgr.close()
    assert ckpt_cli.main(["ckpt", "export", str(tmp_path / "ckpts" / "step-000000003"), str(out := tmp_path / "w-out.pt")]) == 0
    exported = torch.load(out, weights_only=True)
    assert list(exported) == list(weights)
    assert all(torch.equal(exported[key], value) for key, value in weights.items())
