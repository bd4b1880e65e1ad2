"""``checkpoint.init_from``: pretrained weights in every source format, loaded strictly, broadcast from
rank 0, recorded in the manifests and shown by ``ckpt list``; registered objects that start from the
source too (``checkpoint.init_from_objects``: an EMA copy takes the model's weights, or its own entry
of another run's checkpoint). The end-to-end run (the classifier recipe
started from another run's safetensors export, killed and resumed) is tests/integration/test_init_from_e2e.py."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import save_file

from elastic_ddp.tools import checkpoint as ckpt_cli
from elastic_ddp.checkpoint import pretrained as pt
from elastic_ddp.checkpoint.catalog import list_checkpoints
from elastic_ddp.checkpoint.storage import Storage
from elastic_ddp.config import Config, ConfigError, load_config
from elastic_ddp.state import ModelState, as_stateful
from tests.helpers.checkpoint import Box, manager, storages_built


class Net(torch.nn.Module):
    def __init__(self, head: int = 3) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 5)
        self.norm = torch.nn.BatchNorm1d(5)  # buffers too: running stats and an int64 counter
        self.head = torch.nn.Linear(5, head)


def pretrained(seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    net = Net()
    net.norm.running_mean.uniform_()
    net.norm.num_batches_tracked.fill_(7)
    return {k: v.clone() for k, v in net.state_dict().items()}


def fresh(seed: int = 2, head: int = 3) -> Net:
    torch.manual_seed(seed)
    return Net(head)


def equal(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> bool:
    got = model.state_dict()
    return got.keys() == weights.keys() and all(got[k].dtype == weights[k].dtype and torch.equal(got[k], weights[k]) for k in weights)


def b3(path: Path) -> str:
    return blake3.blake3(path.read_bytes()).hexdigest()


def dcp_dir(weights: dict[str, torch.Tensor], path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(dict(weights), storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return path


def project_checkpoint(weights: dict[str, torch.Tensor], root: Path) -> Path:
    model = fresh()
    model.load_state_dict(weights)
    mgr = manager(str(root))
    assert mgr.save(3, {"model": ModelState(model)}, blocking=True) and mgr.close()
    return root / "step-000000003"


# ------------------------------------------------------------------------------------ each format


@pytest.mark.parametrize("kind", ["torch", "torch-under-model", "safetensors", "dcp", "checkpoint", "checkpoint-root"])
def test_each_format_loads_bitwise_and_records_its_blake3(kind, tmp_path) -> None:
    weights = pretrained()
    if kind == "torch":
        torch.save(weights, source := tmp_path / "w.pt")
    elif kind == "torch-under-model":
        torch.save({"model": weights, "step": 5}, source := tmp_path / "w.pt")
    elif kind == "safetensors":
        save_file(weights, source := tmp_path / "w.safetensors")
    elif kind == "dcp":
        source = dcp_dir(weights, tmp_path / "w-dcp")
    else:
        step_dir = project_checkpoint(weights, tmp_path / "ckpts")
        source = step_dir if kind == "checkpoint" else step_dir.parent
    model = fresh()
    assert not equal(model, weights)
    loaded = pt.load_pretrained(str(source), ModelState(model))
    assert equal(model, weights)
    assert loaded.tensors == len(weights) and loaded.kept == ()
    fmt = {"torch-under-model": "torch", "checkpoint-root": "checkpoint"}.get(kind, kind)
    assert loaded.record["format"] == fmt
    if fmt in ("torch", "safetensors"):
        assert loaded.record == {"url": str(source), "format": fmt, "blake3": b3(source)}
    elif fmt == "checkpoint":  # the step directory (a root resolves to its newest), hashed by its manifest
        assert loaded.record["url"] == str(step_dir) and loaded.record["blake3"] == b3(step_dir / "manifest.json")
    else:  # what `b3sum` prints for the directory's files in name order, hashed
        lines = "".join(f"{b3(f)}  {f.name}\n" for f in sorted(source.iterdir(), key=lambda f: f.name))
        assert loaded.record["blake3"] == blake3.blake3(lines.encode()).hexdigest()
    assert pt.source_record(str(source)) == loaded.record


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_file_at_an_fsspec_url_is_read_through_fsspec(suffix, tmp_path) -> None:
    weights = pretrained()
    local = tmp_path / f"w{suffix}"
    torch.save(weights, local) if suffix == ".pt" else save_file(weights, local)
    url = f"memory://{uuid.uuid4().hex}/w{suffix}"
    Storage(url).write_bytes_atomic(url, local.read_bytes())
    model = fresh()
    loaded = pt.load_pretrained(url, ModelState(model))
    assert equal(model, weights) and loaded.record["url"] == url and loaded.record["blake3"] == b3(local)


def test_a_checkpoint_source_is_verified_as_it_is_read(tmp_path) -> None:
    step_dir = project_checkpoint(pretrained(), tmp_path / "ckpts")
    shard = next(p for p in sorted(step_dir.glob("shard-*.bin")) if p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    model = fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(pt.InitFromError, match=rf"{shard.name}.*(checksum|BLAKE3)"):
        pt.load_pretrained(str(step_dir), ModelState(model))
    assert equal(model, before)


@pytest.mark.parametrize("kind", ["torch", "dcp", "checkpoint", "checkpoint-root"])
def test_a_load_builds_one_storage_for_its_source(kind, tmp_path, monkeypatch) -> None:
    # Its format, a root's newest checkpoint, the manifest, the index and the data files are all read
    # through the one storage built for the source's URL.
    weights = pretrained()
    if kind == "torch":
        torch.save(weights, source := tmp_path / "w.pt")
    elif kind == "dcp":
        source = dcp_dir(weights, tmp_path / "w-dcp")
    else:
        step_dir = project_checkpoint(weights, tmp_path / "ckpts")
        source = step_dir if kind == "checkpoint" else step_dir.parent
    built = storages_built(monkeypatch)
    model = fresh()
    record = pt.load_pretrained(str(source), ModelState(model)).record
    assert equal(model, weights)
    assert built == [str(source)]
    built.clear()
    assert pt.source_record(str(source)) == record
    assert built == [str(source)]


# -------------------------------------------------------------------------------------- strictness


def test_a_shape_mismatch_names_the_parameter_and_both_shapes(tmp_path) -> None:
    save_file(pretrained(), source := tmp_path / "w.safetensors")
    with pytest.raises(pt.InitFromError, match=r"'head.weight' is \(3, 5\) torch.float32 there, \(4, 5\) torch.float32 in the model"):
        pt.load_pretrained(str(source), ModelState(fresh(head=4)))


def test_a_dtype_mismatch_names_the_parameter_and_both_dtypes(tmp_path) -> None:
    weights = pretrained()
    weights["body.bias"] = weights["body.bias"].double()
    torch.save(weights, source := tmp_path / "w.pt")
    with pytest.raises(pt.InitFromError, match=r"'body.bias' is \(5,\) torch.float64 there, \(5,\) torch.float32 in the model"):
        pt.load_pretrained(str(source), ModelState(fresh()))


def test_missing_and_unexpected_keys_are_named(tmp_path) -> None:
    weights = pretrained()
    del weights["head.bias"], weights["norm.running_var"]
    weights["extra.weight"] = torch.zeros(2)
    torch.save(weights, source := tmp_path / "w.pt")
    with pytest.raises(pt.InitFromError) as err:
        pt.load_pretrained(str(source), ModelState(fresh()))
    text = str(err.value)
    assert "'norm.running_var', 'head.bias' are missing from it" in text and "init_from_missing_ok" in text
    assert "it holds 'extra.weight', which the model has not" in text


def test_missing_ok_patterns_keep_the_models_own_values_and_nothing_else(tmp_path) -> None:
    weights = {k: v for k, v in pretrained().items() if not k.startswith("head.")}
    save_file(weights, source := tmp_path / "w.safetensors")
    model = fresh()
    head = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("head.")}
    loaded = pt.load_pretrained(str(source), ModelState(model), missing_ok=["head.*"])
    assert loaded.kept == ("head.weight", "head.bias")
    assert equal(model, {**weights, **head})
    with pytest.raises(pt.InitFromError, match="'head.bias' is missing"):
        pt.load_pretrained(str(source), ModelState(fresh()), missing_ok=["head.weight"])


# -------------------------------------------------------------------------------- nothing unpickled


class Payload:
    """Creates a file when unpickled: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_torch_save_is_loaded_weights_only_so_no_code_runs(tmp_path) -> None:
    marker = tmp_path / "ran"
    torch.save({**pretrained(), "payload": Payload(marker)}, source := tmp_path / "evil.pt")
    with pytest.raises(pt.InitFromError, match="weights_only=True"):
        pt.load_pretrained(str(source), ModelState(fresh()))
    assert not marker.exists()


def test_dcp_metadata_naming_anything_but_dcp_classes_is_refused_unrun(tmp_path) -> None:
    source = dcp_dir(pretrained(), tmp_path / "w-dcp")
    marker = tmp_path / "ran"
    (source / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(pt.InitFromError, match=r"\.metadata is not DCP metadata: it names pathlib.Path.touch"):
        pt.load_pretrained(str(source), ModelState(fresh()))
    assert not marker.exists()


def test_something_else_is_refused_with_what_is_accepted(tmp_path) -> None:
    (source := tmp_path / "w.bin").write_bytes(b"not weights at all")
    with pytest.raises(pt.InitFromError, match="neither a torch.save file .* nor a safetensors file"):
        pt.load_pretrained(str(source), ModelState(fresh()))
    with pytest.raises(pt.InitFromError, match="does not exist"):
        pt.load_pretrained(str(tmp_path / "nothing.pt"), ModelState(fresh()))
    (tmp_path / "empty").mkdir()
    with pytest.raises(pt.InitFromError, match="is a directory, but neither a checkpoint"):
        pt.load_pretrained(str(tmp_path / "empty"), ModelState(fresh()))


# ----------------------------------------------------------------------------- several ranks, one read

WORKER = r"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[4])
from elastic_ddp.checkpoint import pretrained as pt
from elastic_ddp.state import ModelState
from tests.unit.test_init_from import fresh, equal

rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=rank, world_size=3)
pt.PACK_BYTES = 64  # small packs and sliced large tensors, both with a 3-rank broadcast
reads = []
real = pt._read_source
pt._read_source = lambda *a, **k: reads.append(1) or real(*a, **k)
model = fresh(seed=10 + rank)  # every rank starts different
loaded = pt.load_pretrained(sys.argv[3], ModelState(model))
want = torch.load(sys.argv[3], weights_only=True)
ok, first_reads = equal(model, want), len(reads)
try:
    pt.load_pretrained(sys.argv[3], ModelState(fresh(head=4)))
    error = "none"
except pt.InitFromError as exc:
    error = str(exc)
print(f"RESULT {rank} equal={ok} reads={first_reads} blake3={loaded.record['blake3']} error={error}", flush=True)
dist.destroy_process_group()
"""


def test_three_ranks_end_with_the_source_read_once_and_share_its_errors(tmp_path) -> None:
    torch.save(pretrained(), source := tmp_path / "w.pt")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    store = tmp_path / "store"
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(rank), str(store), str(source), repo], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for rank in range(3)
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    results = [next(line for line in out.splitlines() if line.startswith("RESULT")) for out in outputs]
    digest = b3(source)
    for rank, line in enumerate(results):
        assert f"RESULT {rank} equal=True reads={1 if rank == 0 else 0} blake3={digest} error=" in line, outputs[rank]
        assert "'head.weight' is (3, 5) torch.float32 there, (4, 5) torch.float32 in the model" in line


# --------------------------------------------------------------- other objects: init_from_objects


def ema_of(model: torch.nn.Module):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)


def ema_weights(ema) -> dict[str, torch.Tensor]:
    """The EMA's copy of the model, by the model's keys."""
    return {k: v for k, v in ema.module.state_dict().items()}


def checkpoint_with_ema(model_weights: dict, ema_weights_: dict, root: Path, n_averaged: int = 4) -> Path:
    """Another run's checkpoint: its model and an EMA whose weights differ from the model's."""
    model = fresh()
    model.load_state_dict(model_weights)
    ema = ema_of(fresh())
    ema.module.load_state_dict(ema_weights_)
    ema.n_averaged.fill_(n_averaged)
    mgr = manager(str(root))
    assert mgr.save(3, {"model": ModelState(model), "ema": as_stateful("ema", ema)}, blocking=True) and mgr.close()
    return root / "step-000000003"


@pytest.mark.parametrize("kind", ["safetensors", "torch", "dcp", "checkpoint-without-ema"])
def test_an_ema_copy_takes_the_models_weights_from_a_source_without_its_own_entry(kind, tmp_path) -> None:
    weights = pretrained()
    if kind == "safetensors":
        save_file(weights, source := tmp_path / "w.safetensors")
    elif kind == "torch":
        torch.save({"model": weights, "ema": {"n_averaged": torch.tensor(9)}}, source := tmp_path / "w.pt")
    elif kind == "dcp":
        source = dcp_dir(weights, tmp_path / "w-dcp")
    else:
        source = project_checkpoint(weights, tmp_path / "ckpts")
    model = fresh()
    ema = ema_of(fresh(seed=3))  # its own random init, unlike the model's
    loaded = pt.load_pretrained(str(source), ModelState(model), objects=["ema"], registered={"ema": as_stateful("ema", ema)})
    assert equal(model, weights) and equal(ema.module, weights)
    assert ema.n_averaged.item() == 0  # its other entries keep their values: the first update copies the model
    assert loaded.objects == (("ema", pt.MODEL_WEIGHTS),)
    # The EMA holds its own tensors: training the model later does not move it.
    with torch.no_grad():
        model.body.weight.add_(1.0)
    assert equal(ema.module, weights)


def test_an_ema_takes_its_own_entry_of_another_runs_checkpoint(tmp_path) -> None:
    weights, averaged = pretrained(seed=1), pretrained(seed=5)
    source = checkpoint_with_ema(weights, averaged, tmp_path / "ckpts", n_averaged=4)
    model, ema = fresh(), ema_of(fresh(seed=3))
    loaded = pt.load_pretrained(str(source), ModelState(model), objects=["ema"], registered={"ema": as_stateful("ema", ema)})
    assert equal(model, weights) and equal(ema.module, averaged) and ema.n_averaged.item() == 4
    assert loaded.objects == (("ema", pt.OWN_ENTRY),)


def test_an_object_own_entry_holds_plain_values_too(tmp_path) -> None:
    # A user's object of tensors and plain values, saved by another run, comes back whole.
    model = fresh()
    model.load_state_dict(weights := pretrained())
    mgr = manager(str(tmp_path / "ckpts"))
    saved = Box(seen={3: (1, 2.5)}, total=10, table=torch.arange(4.0))
    assert mgr.save(3, {"model": ModelState(model), "stats": saved}, blocking=True) and mgr.close()
    mine = Box(seen={}, total=0, table=torch.zeros(4))
    pt.load_pretrained(str(tmp_path / "ckpts"), ModelState(fresh()), objects=["stats"], registered={"stats": mine})
    assert mine.values["seen"] == {3: (1, 2.5)} and mine.values["total"] == 10
    assert torch.equal(mine.values["table"], torch.arange(4.0))
    assert weights  # the model loaded as ever


def test_missing_ok_keys_keep_the_objects_own_values(tmp_path) -> None:
    weights = {k: v for k, v in pretrained().items() if not k.startswith("head.")}
    save_file(weights, source := tmp_path / "w.safetensors")
    model, ema = fresh(), ema_of(fresh(seed=3))
    head = {k: v.clone() for k, v in ema_weights(ema).items() if k.startswith("head.")}
    loaded = pt.load_pretrained(
        str(source), ModelState(model), missing_ok=["head.*"], objects=["ema"], registered={"ema": as_stateful("ema", ema)}
    )
    assert loaded.kept == ("head.weight", "head.bias") and equal(ema.module, {**weights, **head})


def test_an_unknown_object_is_named_with_what_is_registered(tmp_path) -> None:
    save_file(pretrained(), source := tmp_path / "w.safetensors")
    model = fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    registered = {"model": ModelState(model), "optimizer": object(), "ema": as_stateful("ema", ema_of(fresh()))}
    with pytest.raises(pt.InitFromError, match=r"names 'emma', which run.setup\(\) did not register \(did you mean 'ema'\?\); it registered 'optimizer', 'ema'"):
        pt.load_pretrained(str(source), ModelState(model), objects=["emma"], registered=registered)
    assert equal(model, before)  # refused before anything was read or loaded


def test_an_object_whose_shapes_differ_is_named_with_both_shapes(tmp_path) -> None:
    save_file(pretrained(), source := tmp_path / "w.safetensors")
    model = fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ema = ema_of(fresh(head=4))  # an EMA of another model: a head of 4
    with pytest.raises(
        pt.InitFromError,
        match=r"does not fit the object 'ema' \(checkpoint.init_from_objects\): the model's 'head.weight' is \(3, 5\) "
        r"torch.float32, 'ema''s 'module.head.weight' is \(4, 5\) torch.float32",
    ):
        pt.load_pretrained(str(source), ModelState(model), objects=["ema"], registered={"ema": as_stateful("ema", ema)})
    assert equal(model, before)  # checked before the model loads


def test_an_objects_own_entry_that_differs_is_named_with_both_shapes(tmp_path) -> None:
    source = checkpoint_with_ema(pretrained(), pretrained(seed=5), tmp_path / "ckpts")
    ema = ema_of(fresh(head=4))
    with pytest.raises(pt.InitFromError, match=r"object 'ema' .*: 'module.head.weight' is \(3, 5\) torch.float32 there, \(4, 5\) torch.float32 in 'ema'"):
        pt.load_pretrained(str(source), ModelState(fresh()), objects=["ema"], registered={"ema": as_stateful("ema", ema)})


def test_an_object_that_is_no_model_copy_and_has_no_entry_is_named(tmp_path) -> None:
    save_file(pretrained(), source := tmp_path / "w.safetensors")
    counter = Box(total=3)
    with pytest.raises(pt.InitFromError, match=r"object 'counter'.*holds no 'counter' of its own \(only a checkpoint of this package"):
        pt.load_pretrained(str(source), ModelState(fresh()), objects=["counter"], registered={"counter": counter})


def test_init_from_objects_setting_is_parsed_and_checked() -> None:
    cfg = load_config(["--checkpoint.init_from=base.pt", "--checkpoint.init_from_objects=ema, teacher"])
    assert cfg.checkpoint.init_from_objects == ["ema", "teacher"]
    assert cfg.identity() == Config().identity()
    with pytest.raises(ConfigError, match=r"init_from_objects \(\['ema'\]\) has no effect without checkpoint.init_from"):
        load_config(["--checkpoint.init_from_objects=ema"])
    for name in ("model", "data"):
        with pytest.raises(ConfigError, match=f"init_from_objects names '{name}', which it cannot start"):
            load_config(["--checkpoint.init_from=base.pt", f"--checkpoint.init_from_objects=ema,{name}"])


EMA_WORKER = r"""
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[5])
from elastic_ddp.checkpoint import pretrained as pt
from elastic_ddp.state import ModelState, as_stateful
from tests.unit.test_init_from import fresh, equal, ema_of, ema_weights, pretrained

rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=rank, world_size=3)
pt.PACK_BYTES = 64  # small packs and sliced large tensors, both with a 3-rank broadcast
out = []
for source, want_ema, how in ((sys.argv[3], pretrained(seed=1), pt.MODEL_WEIGHTS), (sys.argv[4], pretrained(seed=5), pt.OWN_ENTRY)):
    model, ema = fresh(seed=10 + rank), ema_of(fresh(seed=20 + rank))  # every rank starts different
    loaded = pt.load_pretrained(source, ModelState(model), objects=["ema"], registered={"ema": as_stateful("ema", ema)})
    out.append(f"{equal(model, pretrained(seed=1))},{equal(ema.module, want_ema)},{loaded.objects == (('ema', how),)}")
try:
    pt.load_pretrained(sys.argv[3], ModelState(fresh()), objects=["ema"], registered={"ema": as_stateful("ema", ema_of(fresh(head=4)))})
    error = "none"
except pt.InitFromError as exc:
    error = str(exc)
print(f"RESULT {rank} {' '.join(out)} error={error}", flush=True)
dist.destroy_process_group()
"""


def test_three_ranks_start_an_ema_from_the_models_weights_or_its_own_entry(tmp_path) -> None:
    torch.save(pretrained(seed=1), weights_file := tmp_path / "w.pt")
    other_run = checkpoint_with_ema(pretrained(seed=1), pretrained(seed=5), tmp_path / "ckpts")
    script = tmp_path / "worker.py"
    script.write_text(EMA_WORKER)
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "store"), str(weights_file), str(other_run),
                          repo], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for rank in range(3)
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    for rank, out in enumerate(outputs):
        line = next((line for line in out.splitlines() if line.startswith("RESULT")), out)
        assert line.startswith(f"RESULT {rank} True,True,True True,True,True error="), out
        assert "does not fit the object 'ema'" in line and "'module.head.weight' is (4, 5) torch.float32" in line, out


# ------------------------------------------------------------------------- manifest, ckpt list, config


def test_the_manifest_records_the_source_and_ckpt_list_shows_it(tmp_path, capsys) -> None:
    record = {"url": "s3://bucket/base.safetensors", "format": "safetensors", "blake3": "ab" * 32}
    mgr = manager(str(tmp_path / "c"))
    mgr.init_from = record
    model = fresh()
    for step in (10, 20):
        assert mgr.save(step, {"model": ModelState(model)}, blocking=True)
    mgr.close()
    assert [info.manifest["init_from"] for info in list_checkpoints(Storage(str(tmp_path / "c")))] == [record, record]
    assert ckpt_cli.main(["ckpt", "list", str(tmp_path / "c")]) == 0
    assert f"Initialised from s3://bucket/base.safetensors (safetensors, BLAKE3 {'ab' * 32}): steps 10-20." in capsys.readouterr().out
    assert ckpt_cli.main(["ckpt", "list", "--json", str(tmp_path / "c")]) == 0
    assert '"init_from": {' in capsys.readouterr().out


def test_a_malformed_init_from_in_a_manifest_is_refused() -> None:
    from elastic_ddp.checkpoint import manifest as mf

    built = mf.build(step=1, world_size=1, time_s=0.0, versions={}, identity={}, files=[], init_from=None)
    assert "init_from" not in built
    built["init_from"] = {"url": "x"}
    with pytest.raises(mf.ManifestError, match="'init_from' field without string url, format and blake3"):
        mf.parse(mf.canonical_json(built), "here")


def test_init_from_settings_are_not_identity_and_refuse_combinations_without_effect() -> None:
    cfg = load_config(["--checkpoint.init_from=base.pt", "--checkpoint.init_from_missing_ok=head.*, fc.bias"])
    assert cfg.checkpoint.init_from_missing_ok == ["head.*", "fc.bias"]
    assert cfg.identity() == Config().identity()
    with pytest.raises(ConfigError, match="init_from_missing_ok .* has no effect without checkpoint.init_from"):
        load_config(["--checkpoint.init_from_missing_ok=[head.*]"])
    with pytest.raises(ConfigError, match="init_from .* has no effect with checkpoint.resume='120'"):
        load_config(["--checkpoint.init_from=base.pt", "--checkpoint.resume='120'"])
    assert load_config(["--checkpoint.init_from=base.pt", "--checkpoint.resume=never"]).checkpoint.init_from == "base.pt"
