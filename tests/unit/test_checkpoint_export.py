"""``elastic-ddp ckpt export --format torch|safetensors|dcp``: every format read back by plain torch,
safetensors and DCP in a process where ``elastic_ddp`` cannot be imported, and equal to the
``torch`` export tensor for tensor."""

from __future__ import annotations

import concurrent.futures
import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from elastic_ddp.tools import checkpoint as ckpt_cli
from elastic_ddp.checkpoint import export as ex
from elastic_ddp.checkpoint import objects
from elastic_ddp.checkpoint.formats import dcp as dcp_writer
from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.catalog import read_checkpoint, read_index
from elastic_ddp.checkpoint.errors import CheckpointVerificationError
from elastic_ddp.checkpoint.sharded import read_state
from elastic_ddp.checkpoint.storage import Storage
from elastic_ddp.state import ModelState
from tests.helpers.checkpoint import Box, manager, storages_built

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


def test_verify_and_export_each_build_one_storage_for_the_checkpoint(run_checkpoint, tmp_path, monkeypatch) -> None:
    built = storages_built(monkeypatch)
    assert ckpt_cli.main(["ckpt", "verify", run_checkpoint.url]) == 0
    assert built == [run_checkpoint.url]
    built.clear()
    assert export(run_checkpoint.url, tmp_path / "out", "--all") == 0
    assert built == [run_checkpoint.url]


def _read(url: str, reader):
    storage = Storage(url)
    info = read_checkpoint(storage, url)
    index = read_index(storage, info).as_shared(0)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return reader(storage, info, index, pool)


def test_load_objects_gives_what_the_resume_reader_gives(run_checkpoint) -> None:
    def both(storage, info, index, pool):
        files = mf.file_records(info.manifest)
        return objects.load_objects(storage, info.url, index, files, OBJECTS, pool), read_state(
            storage, info.url, index, files, OBJECTS, pool
        )

    got, want = _read(run_checkpoint.url, both)
    for name in OBJECTS:
        assert repr(got[name]) == repr(want[name]), name  # same structure, key types and values


def _damage(url: str, how: str) -> str:
    """Damage the first data file of the checkpoint at ``url``; its name."""
    data = sorted(n for n in os.listdir(url) if n not in ("index.json", mf.MANIFEST_NAME))[0]
    path = os.path.join(url, data)
    raw = bytearray(open(path, "rb").read())
    if how == "flip":
        raw[len(raw) // 2] ^= 1
    elif how == "truncate":
        raw = raw[:-1]
    elif how == "extend":
        raw += b"\0"
    if how == "remove":
        os.remove(path)
    else:
        with open(path, "wb") as f:
            f.write(raw)
    return data


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_load_objects_checks_every_file_it_reads_against_the_manifest(run_checkpoint, damage) -> None:
    data = _damage(run_checkpoint.url, damage)

    def read(storage, info, index, pool):
        return objects.load_objects(storage, info.url, index, mf.file_records(info.manifest), OBJECTS, pool)

    with pytest.raises(CheckpointVerificationError, match=f"{data}.*does not match its manifest") as failed:
        _read(run_checkpoint.url, read)
    assert failed.value.bad_file == data


@pytest.mark.parametrize("fmt", ex.FORMATS)
@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "remove"])
def test_a_file_failing_its_check_mid_export_leaves_no_output(run_checkpoint, tmp_path, fmt, damage) -> None:
    # The CLI verifies the checkpoint before it exports; a file that changes after that check (or an
    # export called directly) is caught as it streams, and nothing is left under the name asked for.
    data = _damage(run_checkpoint.url, damage)
    (tmp_path / "exports").mkdir()
    out = tmp_path / "exports" / "out"

    def export_model(storage, info, index, pool):
        [stored] = objects.open_objects(storage, info.url, index, mf.file_records(info.manifest), ["model"]).values()
        return ex.write(fmt, "model", stored, str(out), metadata={})

    with pytest.raises(ex.ExportError, match=f"Reading 'model' from .* failed: .*{data}") as failed:
        _read(run_checkpoint.url, export_model)
    assert isinstance(failed.value.__cause__, CheckpointVerificationError)
    assert failed.value.__cause__.bad_file == data
    assert os.listdir(tmp_path / "exports") == []  # neither the output nor its .partial


def _mixed_checkpoint(root) -> tuple[str, dict]:
    """A checkpoint of one object whose tensors straddle three data files: dtypes of every element
    size, a scalar, an empty tensor, tensors in a list and in a tuple (which DCP pickles whole)."""
    gen = torch.Generator().manual_seed(0)
    state = {
        "big": torch.randn(1000, 37, generator=gen),
        "half": torch.randn(33, generator=gen).to(torch.bfloat16),
        "small": torch.randint(-5, 5, (17,), dtype=torch.int8, generator=gen),
        "mask": torch.rand(9, generator=gen) > 0.5,
        "wide": torch.randn(5, dtype=torch.float64, generator=gen),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.0),
        "nested": {"list": [torch.ones(4), 2.5], "pair": (torch.arange(7), "t")},
        "count": 3,
    }

    class Model:
        def state_dict(self) -> dict:
            return state

        def load_state_dict(self, _: dict) -> None:
            pass

    mgr = manager(str(root), write_threads=3, min_file_mb=0)
    assert mgr.save(1, {"model": Model()}, blocking=True) and mgr.wait()
    url = mgr.latest().url
    assert len([n for n in os.listdir(url) if n.startswith("shard-")]) == 3
    return url, state


def _equal(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    if isinstance(want, dict):
        return isinstance(got, dict) and list(got) == list(want) and all(_equal(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return type(got) is type(want) and len(got) == len(want) and all(_equal(a, b) for a, b in zip(got, want))
    return got == want


def test_torch_export_is_the_archive_torch_save_writes(tmp_path) -> None:
    import zipfile

    url, state = _mixed_checkpoint(tmp_path / "c")
    out = tmp_path / "model.pt"
    assert export(url, out) == 0
    assert _equal(torch.load(out, weights_only=True), state)
    assert _equal(torch.load(out, weights_only=True, mmap=True), state)
    # Every storage record holds its bytes with their CRC-32, as torch.save's own: the archive is sound.
    assert zipfile.ZipFile(out).testzip() is None
    torch.save(state, tmp_path / "ref.pt")

    def records(path) -> dict:
        with zipfile.ZipFile(path) as archive:
            return {i.filename.split("/", 1)[1]: (i.file_size, i.CRC) for i in archive.infolist()}

    got, want = records(out), records(tmp_path / "ref.pt")
    assert sorted(got) == sorted(want)
    for name in got:
        if name not in ("data.pkl", ".data/serialization_id"):  # the pickle's memo of "cpu" differs
            assert got[name] == want[name], name


def test_safetensors_export_has_the_spec_layout_and_reads_as_save_file_writes(tmp_path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    url, state = _mixed_checkpoint(tmp_path / "c")
    out = tmp_path / "model.safetensors"
    assert export(url, out, "--format", "safetensors") == 0
    tensors = {
        "big": state["big"], "half": state["half"], "small": state["small"], "mask": state["mask"],
        "wide": state["wide"], "empty": state["empty"], "scalar": state["scalar"],
        "nested.list.0": state["nested"]["list"][0], "nested.pair.0": state["nested"]["pair"][0],
    }  # fmt: skip
    got = load_file(out)
    assert sorted(got) == sorted(tensors) and all(_equal(got[k], v) for k, v in tensors.items())
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    ref = load_file(tmp_path / "ref.safetensors")
    assert sorted(ref) == sorted(got) and all(_equal(got[k], ref[k]) for k in ref)
    with safe_open(out, framework="pt") as f:
        assert f.metadata()["format"] == "pt" and f.metadata()["step"] == "1"
    # The header: its length a multiple of 8 (padded with spaces), every tensor at a multiple of its element size.
    raw = out.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    assert length % 8 == 0 and raw[8 : 8 + length].decode().rstrip(" ").endswith("}")
    for key, entry in header.items():
        if key != "__metadata__":
            assert entry["data_offsets"][0] % tensors[key].element_size() == 0, key
    assert 8 + length + max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__") == len(raw)


def test_safetensors_export_of_a_dtype_it_lacks_names_the_tensor(tmp_path, capsys) -> None:
    mgr = manager(str(tmp_path / "c"))
    assert mgr.save(1, {"model": Box(w=torch.ones(2), z=torch.ones(3, dtype=torch.complex128))}, blocking=True) and mgr.wait()
    out = tmp_path / "model.safetensors"
    assert export(mgr.latest().url, out, "--format", "safetensors") == 1
    err = capsys.readouterr().err
    assert "safetensors cannot hold 'z' of 'model': it has no torch.complex128 dtype" in err and "--format torch" in err
    assert not out.exists() and not (tmp_path / "model.safetensors.partial").exists()


def test_every_format_of_a_multi_file_checkpoint_reads_back_without_elastic_ddp(tmp_path) -> None:
    url, state = _mixed_checkpoint(tmp_path / "c")
    for fmt in ex.FORMATS:
        assert export(url, tmp_path / fmt, "--all", "--format", fmt) == 0
    report = read_back_without_elastic_ddp(tmp_path, ["model"])
    entry = report["objects"]["model"]
    assert entry["tensors"] == 9 and entry["safetensors_equal"] and entry["dcp_load_equal"] and entry["dcp_converted_equal"]
    assert _equal(torch.load(tmp_path / "torch" / "model.pt", weights_only=True), state)


def test_dcp_export_holds_one_tensor_at_a_time(tmp_path, monkeypatch) -> None:
    # With groups of one tensor, DCP is handed each tensor only after the one before was written and
    # dropped: at no time are two of the checkpoint's tensors alive (a tuple's tensors go together).
    import weakref

    url, state = _mixed_checkpoint(tmp_path / "c")
    monkeypatch.setattr(dcp_writer, "_GROUP_BYTES", 0)
    alive: set[int] = set()
    most = [0]
    get = dcp_writer._WholeTensors.get

    def tracked(self, tensor: int) -> torch.Tensor:
        value = get(self, tensor)
        alive.add(tensor)
        weakref.finalize(value, alive.discard, tensor)
        most[0] = max(most[0], len(alive))
        return value

    monkeypatch.setattr(dcp_writer._WholeTensors, "get", tracked)
    assert export(url, tmp_path / "dcp", "--format", "dcp") == 0
    assert most[0] == 1
    files = [n for n in os.listdir(tmp_path / "dcp") if n.endswith(".distcp")]
    assert len(files) == 9  # 8 tensors of their own, and the tuple (a plain value) with the count
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "converted.pt")
    converted = torch.load(tmp_path / "converted.pt", weights_only=True)
    assert _equal(converted["nested"]["pair"], state["nested"]["pair"]) and _equal(converted["big"], state["big"])
