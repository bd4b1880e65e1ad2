"""``elastic-ddp ckpt export --format torch|safetensors|dcp``: every format read back by plain torch,
safetensors and DCP in a process where ``elastic_ddp`` cannot be imported, and equal to the
``torch`` export tensor for tensor."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from elastic_ddp.checkpoint import cli as ckpt_cli
from elastic_ddp.checkpoint import export as ex
from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.catalog import read_checkpoint, read_index
from elastic_ddp.checkpoint.errors import CheckpointVerificationError
from elastic_ddp.checkpoint.sharded import read_state
from elastic_ddp.checkpoint.storage import Storage
from elastic_ddp.state import ModelState
from tests.test_checkpoint_unit import manager, run_checkpoint  # noqa: F401 - run_checkpoint is a fixture

OBJECTS = ["model", "optimizer", "scheduler", "ema", "raw_optimizer", "counter"]
TENSOR_OBJECTS = ["model", "optimizer", "ema", "raw_optimizer"]  # 'scheduler' and 'counter' hold plain values only

# Run as ``python -I -S`` with only the interpreter's site-packages directory on sys.path: its .pth
# files (the editable install of elastic_ddp among them) are not processed, so torch and
# safetensors import and elastic_ddp does not -- what a user without this package has. Prints, per
# object, the tensors and plain values of each export flattened to "."-joined string paths.
READER = r"""
import json, sys
sys.path.append(sys.argv[1])
try:
    import elastic_ddp
    importable = True
except ImportError:
    importable = False
import torch
from safetensors import safe_open
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

def flat(node, at=""):
    if isinstance(node, torch.Tensor):
        return {at: node}
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, (list, tuple)) else None
    if items is None:
        return {at: node}
    out = {}
    for key, value in items:
        out.update(flat(value, f"{at}.{key}" if at else str(key)))
    return out

def describe(tree):
    tensors = {k: v for k, v in flat(tree).items() if isinstance(v, torch.Tensor)}
    plain = {k: repr(v) for k, v in flat(tree).items() if not isinstance(v, torch.Tensor)}
    return tensors, plain

def same(got, want):
    return sorted(got) == sorted(want) and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want
    )

out_dir, names = sys.argv[2], sys.argv[3].split(",")
report = {"importable": importable, "objects": {}}
for name in names:
    want, want_plain = describe(torch.load(f"{out_dir}/torch/{name}.pt", weights_only=True))
    entry = report["objects"][name] = {"tensors": len(want)}
    st = f"{out_dir}/safetensors/{name}.safetensors"
    try:
        with safe_open(st, framework="pt") as f:
            got = {k: f.get_tensor(k) for k in f.keys()}
            entry["safetensors_metadata"] = f.metadata()
        entry["safetensors_equal"] = same(got, want)
        entry["safetensors_keys"] = sorted(got)
    except FileNotFoundError:
        pass
    loaded, loaded_plain = describe(_load_state_dict_from_keys(checkpoint_id=f"{out_dir}/dcp/{name}"))
    entry["dcp_load_equal"] = same(loaded, want) and loaded_plain == want_plain
    dcp_to_torch_save(f"{out_dir}/dcp/{name}", f"{out_dir}/{name}-converted.pt")
    converted, converted_plain = describe(torch.load(f"{out_dir}/{name}-converted.pt", weights_only=True))
    entry["dcp_converted_equal"] = same(converted, want) and converted_plain == want_plain
print(json.dumps(report))
"""


def export(url: str, out, *args: str) -> int:
    return ckpt_cli.main(["ckpt", "export", url, str(out), *args])


def read_back_without_elastic_ddp(out_dir, names: list[str]) -> dict:
    site_packages = os.path.dirname(os.path.dirname(torch.__file__))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", READER, site_packages, str(out_dir), ",".join(names)],
        cwd=out_dir, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_every_format_reads_back_without_elastic_ddp_equal_to_the_torch_export(run_checkpoint, tmp_path, capsys) -> None:
    url = run_checkpoint.url
    assert export(url, tmp_path / "torch", "--all") == 0
    assert export(url, tmp_path / "dcp", "--all", "--format", "dcp") == 0
    assert export(url, tmp_path / "safetensors", "--all", "--format", "safetensors") == 0
    printed = capsys.readouterr().out
    assert "Skipped (no tensors; safetensors holds tensors only): 'scheduler', 'counter'." in printed
    # The optimizer's hyperparameters cannot go into safetensors: the summary names them.
    assert "Left out of 'optimizer' (safetensors holds tensors only)" in printed and "param_groups.0.lr" in printed
    assert "Left out of 'model'" not in printed
    assert sorted(os.listdir(tmp_path / "safetensors")) == sorted(f"{name}.safetensors" for name in TENSOR_OBJECTS)
    assert sorted(os.listdir(tmp_path / "dcp")) == sorted(OBJECTS)

    report = read_back_without_elastic_ddp(tmp_path, OBJECTS)
    assert report["importable"] is False
    for name, entry in report["objects"].items():
        assert entry["dcp_load_equal"] and entry["dcp_converted_equal"], name
        if name in TENSOR_OBJECTS:
            assert entry["tensors"] > 0 and entry["safetensors_equal"], name
            metadata = entry["safetensors_metadata"]
            assert metadata["format"] == "pt" and metadata["step"] == "5" and metadata["object"] == name, metadata
            assert metadata["checkpoint"] == url and metadata["rank"] == "0", metadata
    # A model's safetensors keys are exactly its state_dict keys: it loads strictly as Hugging Face tooling would.
    assert report["objects"]["model"]["safetensors_keys"] == sorted(run_checkpoint.model.state_dict())
    assert "state.0.exp_avg" in report["objects"]["raw_optimizer"]["safetensors_keys"]  # int keys joined as text


def test_a_safetensors_model_export_loads_strictly_into_the_model(run_checkpoint, tmp_path) -> None:
    out = tmp_path / "model.safetensors"
    assert export(run_checkpoint.url, out, "--format", "safetensors") == 0
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    fresh.load_state_dict(load_file(out), strict=True)
    for key, value in run_checkpoint.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_tied_weights_export_to_safetensors_under_both_names(tmp_path) -> None:
    # safetensors refuses tensors that share storage; a model's tied weights are stored once per name in
    # a checkpoint and read back as separate tensors, so both names are written, equal.
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    mgr = manager(str(tmp_path / "c"))
    assert mgr.save(1, {"model": ModelState(model)}, blocking=True) and mgr.wait()
    out = tmp_path / "tied.safetensors"
    assert export(mgr.latest().url, out, "--format", "safetensors") == 0
    got = load_file(out)
    assert sorted(got) == ["0.weight", "1.weight"]
    assert torch.equal(got["0.weight"], model[0].weight) and torch.equal(got["1.weight"], model[0].weight)


def test_an_unknown_format_is_a_usage_error(run_checkpoint, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as usage:
        export(run_checkpoint.url, tmp_path / "out", "--format", "onnx")
    assert usage.value.code == 2
    assert "argument --format: invalid choice: 'onnx'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_safetensors_export_of_an_object_without_tensors_fails_naming_it(run_checkpoint, tmp_path, capsys) -> None:
    out = tmp_path / "counter.safetensors"
    assert export(run_checkpoint.url, out, "--object", "counter", "--format", "safetensors") == 1
    err = capsys.readouterr().err
    assert "the object 'counter'" in err and "holds no tensors" in err and "--format torch" in err
    assert not out.exists()
    # Among several named objects, one without tensors fails the export before anything is written.
    some = tmp_path / "some"
    assert export(run_checkpoint.url, some, "--object", "model", "--object", "scheduler", "--format", "safetensors") == 1
    assert "the object 'scheduler'" in capsys.readouterr().err and not some.exists()


def test_dcp_export_needs_a_new_or_empty_directory(run_checkpoint, tmp_path, capsys) -> None:
    out = tmp_path / "dcp"
    out.mkdir()
    assert export(run_checkpoint.url, out, "--format", "dcp") == 0  # empty: replaced by the export
    assert (out / ".metadata").exists()
    assert export(run_checkpoint.url, out, "--format", "dcp") == 1
    assert "is a directory that is not empty" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert export(run_checkpoint.url, tmp_path / "file", "--format", "dcp") == 1
    assert "--format dcp writes a directory" in capsys.readouterr().err


def _read(url: str, reader):
    storage = Storage(url)
    info = read_checkpoint(storage, url)
    index = read_index(storage, info).as_shared(0)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return reader(storage, info, index, pool)


def test_read_objects_gives_what_the_resume_reader_gives(run_checkpoint) -> None:
    def both(storage, info, index, pool):
        files = mf.file_records(info.manifest)
        return ex.read_objects(storage, info.url, index, files, OBJECTS, pool), read_state(
            storage, info.url, index, files, OBJECTS, pool
        )

    got, want = _read(run_checkpoint.url, both)
    for name in OBJECTS:
        assert repr(got[name]) == repr(want[name]), name  # same structure, key types and values


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_read_objects_checks_every_file_it_reads_against_the_manifest(run_checkpoint, damage) -> None:
    data = sorted(n for n in os.listdir(run_checkpoint.url) if n not in ("index.json", mf.MANIFEST_NAME))[0]
    path = os.path.join(run_checkpoint.url, data)
    raw = bytearray(open(path, "rb").read())
    if damage == "flip":
        raw[len(raw) // 2] ^= 1
    elif damage == "truncate":
        raw = raw[:-1]
    else:
        raw += b"\0"
    with open(path, "wb") as f:
        f.write(raw)

    def read(storage, info, index, pool):
        return ex.read_objects(storage, info.url, index, mf.file_records(info.manifest), OBJECTS, pool)

    with pytest.raises(CheckpointVerificationError, match=f"{data}.*does not match its manifest") as failed:
        _read(run_checkpoint.url, read)
    assert failed.value.bad_file == data
