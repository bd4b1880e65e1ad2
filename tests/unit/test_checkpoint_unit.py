"""CheckpointManager without a process group: memory:// and local directories."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import threading
import uuid

import blake3
import pytest
import torch

from elastic_ddp.checkpoint import (
    ENV_CHECKPOINT_KEY,
    FENCE_NAME,
    CheckpointError,
    CheckpointManager,
    StaleWriterError,
    retention_plan,
)
from elastic_ddp.tools import checkpoint as ckpt_cli
from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.staging import ShareStager
from elastic_ddp.faults import ENV_FAULT
from elastic_ddp.state import ModelState, OptimizerState
from tests.helpers.checkpoint import Box, assert_same, clone_state, manager, objects, tiny, train
from tests.helpers.nodes import wait_for

@pytest.fixture
def mem_url() -> str:
    return f"memory://ckpt-{uuid.uuid4().hex}"


class Evil:
    """Unpickling this creates the marker file: proof that a tampered pickle was (not) executed."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def save_steps(mgr: CheckpointManager, model, opt, steps, **kw) -> dict[int, tuple[dict, dict]]:
    snapshots = {}
    for step in steps:
        train(model, opt)
        mgr.save(step, objects(model, opt, extra=Box(step=step)), **kw)
        snapshots[step] = clone_state(model, opt)
    assert mgr.wait()
    return snapshots


def test_model_and_optimizer_state_dicts_are_torchs_and_follow_a_model_that_changes(monkeypatch) -> None:
    # The adapters check torch's options once (the memory tier takes these every few steps) and
    # again only when the parameters change.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    import elastic_ddp.state as state_module

    checks = []
    original = state_module._verify_options
    monkeypatch.setattr(state_module, "_verify_options", lambda *a, **k: checks.append(1) or original(*a, **k))
    model, opt = tiny()
    model_state, optim_state = ModelState(model), OptimizerState(model, opt)

    def same(got: dict, want: dict) -> bool:
        def tensor(t: torch.Tensor) -> list:  # the same live storage, shape and dtype
            return [t.data_ptr(), list(t.shape), str(t.dtype)]

        return json.dumps(got, default=tensor, sort_keys=True) == json.dumps(want, default=tensor, sort_keys=True)

    for _ in range(3):
        train(model, opt)
        assert same(model_state.state_dict(), get_model_state_dict(model))
        assert same(optim_state.state_dict(), get_optimizer_state_dict(model, opt))
    assert len(checks) == 2
    model.append(torch.nn.Linear(2, 2))  # a new layer, and its parameters in the optimizer
    opt.add_param_group({"params": list(model[2].parameters())})
    train(model, opt)
    assert "2.weight" in model_state.state_dict() and "2.weight" in optim_state.state_dict()["state"]
    assert same(optim_state.state_dict(), get_optimizer_state_dict(model, opt))
    assert len(checks) == 4


def test_save_load_roundtrip_restores_model_optimizer_and_registered_objects(mem_url: str) -> None:
    model, opt = tiny()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train(model, opt)  # a step as a loop takes it: the optimizer's, then the scheduler's
    scheduler.step()
    mgr = manager(mem_url)
    cursor = Box(epoch=1, offset=96, betas=(0.9, 0.95), name="x", nothing=None)
    mgr.save(7, objects(model, opt, scheduler=scheduler, cursor=cursor))
    assert mgr.close()
    expected = clone_state(model, opt)

    fresh_model, fresh_opt = tiny(seed=1)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2, gamma=0.5)
    fresh_cursor = Box(epoch=0, offset=0, betas=(0.0, 0.0), name="", nothing=None)
    torch.manual_seed(99)
    mgr2 = manager(mem_url)
    info = mgr2.resolve("auto")
    assert info is not None and info.step == 7 and info.world_size == 1
    exact = mgr2.load(info, objects(fresh_model, fresh_opt, scheduler=fresh_scheduler, cursor=fresh_cursor))
    assert exact
    assert_same(fresh_model, fresh_opt, expected)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert fresh_cursor.values == cursor.values
    stats = mgr.last_save
    assert stats is not None and stats.bytes == info.bytes > 0 and stats.throughput_bytes_per_s > 0


def test_async_save_writes_the_values_of_its_step_while_training_mutates_them(mem_url: str) -> None:
    model, opt = tiny(width=256)
    mgr = manager(mem_url, async_save=True)
    mgr.save(1, objects(model, opt))
    expected = clone_state(model, opt)
    # Training goes on at once: mutate every parameter and optimizer tensor in place.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)
        for state in opt.state.values():
            state["exp_avg"].mul_(-1).add_(5)
    assert mgr.wait(), mgr.last_error
    fresh_model, fresh_opt = tiny(seed=3, width=256)
    mgr.load(mgr.latest(), objects(fresh_model, fresh_opt))
    assert_same(fresh_model, fresh_opt, expected)
    assert mgr.last_save.stall_s < mgr.last_save.save_s


def test_stager_copies_only_the_given_ranges_reuses_its_buffers_and_aliases_for_a_blocking_cpu_save() -> None:
    stager = ShareStager()
    a, b = torch.arange(10, dtype=torch.float32), torch.ones(3, dtype=torch.int64)
    sources = {"f0": [(a, 2, 6), (b, 0, 3)]}
    first = stager.stage(sources, copy=True)
    assert first.staged_bytes == 4 * 4 + 3 * 8 == stager.held_bytes
    (buffer,) = first.files["f0"]
    assert bytes(buffer) == a[2:6].numpy().tobytes() + b.numpy().tobytes()
    a.add_(100)  # training mutates the tensor: the staged copy keeps the saved values
    assert bytes(buffer)[:16] == torch.arange(2, 6, dtype=torch.float32).numpy().tobytes()
    second = stager.stage(sources, copy=True)
    assert second.files["f0"][0].obj.ctypes.data == buffer.obj.ctypes.data  # the same host buffer, refilled
    assert bytes(second.files["f0"][0])[:16] == a[2:6].numpy().tobytes()
    in_place = stager.stage(sources, copy=False)
    assert in_place.staged_bytes == 0
    a[3] = -1.0  # a blocking save writes the tensors themselves: no copy was made
    assert bytes(in_place.files["f0"][0]) == a[2:6].numpy().tobytes()


def test_manifest_records_step_world_size_time_versions_identity_and_checksums(tmp_path) -> None:
    model, opt = tiny()
    mgr = manager(str(tmp_path), identity={"train.seed": 3, "model.width": 8})
    mgr.save(3, objects(model, opt), blocking=True)
    manifest = json.loads((tmp_path / "step-000000003" / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 1 and manifest["time"] > 0
    assert manifest["identity"] == {"train.seed": 3, "model.width": 8} and len(manifest["identity_digest"]) == 16
    assert mgr.list()[0].identity == manifest["identity"]
    assert manifest["versions"]["torch"] == torch.__version__ and "elastic_ddp" in manifest["versions"]
    on_disk = {p.name: p.stat().st_size for p in (tmp_path / "step-000000003").iterdir() if p.name != "manifest.json"}
    assert {n: f["size"] for n, f in manifest["files"].items()} == on_disk
    assert manifest["format"] == 4 and manifest["checksum"] == "blake3"
    step_dir = tmp_path / "step-000000003"
    assert {n: f["blake3"] for n, f in manifest["files"].items()} == {
        n: blake3.blake3((step_dir / n).read_bytes()).hexdigest() for n in on_disk
    }
    assert "signature" not in manifest


def test_interrupted_save_is_never_listed_and_older_leftovers_are_cleaned(tmp_path) -> None:
    model, opt = tiny()
    mgr = manager(str(tmp_path))
    save_steps(mgr, model, opt, [1])
    for step in (2, 99):  # leftovers: one older than the next save, one newer (maybe being written)
        leftover = tmp_path / f"step-{step:09d}"
        leftover.mkdir()
        (leftover / "shard-00000-00.bin").write_bytes(b"partial")
        (leftover / "index.json").write_bytes(b"partial")
    assert [i.step for i in mgr.list()] == [1]
    assert mgr.latest().step == 1
    save_steps(mgr, model, opt, [3])
    assert [i.step for i in mgr.list()] == [1, 3]
    assert not (tmp_path / "step-000000002").exists()
    assert (tmp_path / "step-000000099").exists()


def test_retention_plan_keeps_the_newest_the_multiples_and_the_protected() -> None:
    delete, why = retention_plan([1, 2, 3, 4, 5, 6, 8], keep_last=2, keep_every=4, protected={1})
    assert delete == [2, 3, 5] and "keep_last=2" in why
    assert retention_plan([5], keep_last=1, keep_every=None, protected=set())[0] == []


def test_retention_deletes_old_checkpoints_only_after_a_newer_commit(mem_url: str) -> None:
    model, opt = tiny()
    mgr = manager(mem_url, keep_last=2, keep_every=4)
    save_steps(mgr, model, opt, [1, 2])
    assert [i.step for i in mgr.list()] == [1, 2]
    save_steps(mgr, model, opt, [3, 4, 5, 6])
    assert [i.step for i in mgr.list()] == [4, 5, 6]


def test_retention_reads_a_manifest_once_and_then_only_lists_the_directory(tmp_path, monkeypatch) -> None:
    from elastic_ddp.checkpoint.storage import Storage

    model, opt = tiny()
    mgr = manager(str(tmp_path), keep_last=2)
    save_steps(mgr, model, opt, [1])
    bad = tmp_path / "step-000000000"  # a committed-looking directory whose manifest cannot be read
    bad.mkdir()
    (bad / "manifest.json").write_text("{not json")
    reads, lists = [], []
    real_read, real_list = Storage.read_bytes, Storage.list_dirs
    monkeypatch.setattr(Storage, "read_bytes", lambda self, url: reads.append(url) or real_read(self, url))
    monkeypatch.setattr(Storage, "list_dirs", lambda self, url: lists.append(url) or real_list(self, url))
    save_steps(mgr, model, opt, [2])
    assert [url.rsplit("/", 2)[-2] for url in reads] == ["step-000000000"]  # step 1 is known committed
    reads.clear(), lists.clear()
    save_steps(mgr, model, opt, [3, 4])
    # Each save: one listing, no manifest read but the unreadable one's (skipped, as list() skips it:
    # it is neither one of the kept checkpoints nor a leftover to sweep).
    assert len(lists) == 2 and all(url.endswith("step-000000000/manifest.json") for url in reads)
    assert [i.step for i in mgr.list()] == [3, 4] and bad.exists()


def test_resolve_follows_the_resume_setting(mem_url: str) -> None:
    model, opt = tiny()
    mgr = manager(mem_url)
    save_steps(mgr, model, opt, [2, 4])
    assert mgr.resolve("never") is None
    assert mgr.resolve("auto").step == 4
    assert mgr.resolve("2").step == 2
    assert mgr.resolve(f"{mem_url}/step-000000002").step == 2
    with pytest.raises(CheckpointError, match="step-000000007"):
        mgr.resolve("7")
    assert manager(f"{mem_url}/empty").resolve("auto") is None


def test_loading_state_the_checkpoint_lacks_is_refused_naming_it(mem_url: str) -> None:
    model, opt = tiny()
    save_steps(manager(mem_url), model, opt, [1])
    mgr = manager(mem_url)
    with pytest.raises(CheckpointError, match="no state named 'scaler'.*'extra', 'model', 'optim'"):
        mgr.load(mgr.latest(), objects(model, opt, scaler=Box(scale=1.0)))


def _as_format_3(ckpt_dir) -> None:
    """Rewrite a checkpoint's manifest as the previous format wrote it: SHA-256 checksums."""
    import hashlib

    manifest = json.loads((ckpt_dir / "manifest.json").read_text())
    manifest.update(format=3, checksum="sha256")
    manifest["files"] = {
        name: {"size": rec["size"], "sha256": hashlib.sha256((ckpt_dir / name).read_bytes()).hexdigest()}
        for name, rec in manifest["files"].items()
    }
    (ckpt_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_of_the_previous_format_with_sha256_checksums_still_loads_and_is_still_verified(tmp_path) -> None:
    model, opt = tiny()
    snaps = save_steps(manager(str(tmp_path)), model, opt, [1, 2])
    for step in (1, 2):
        _as_format_3(tmp_path / f"step-00000000{step}")
    assert ckpt_cli.main(["ckpt", "verify", str(tmp_path / "step-000000002")]) == 0
    shard = tmp_path / "step-000000002" / "shard-00000-00.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    mgr = manager(str(tmp_path))
    info = mgr.latest()
    assert info.step == 1  # the damaged step 2 failed its SHA-256 check
    fresh_model, fresh_opt = tiny(seed=5)
    mgr.load(info, objects(fresh_model, fresh_opt))
    assert_same(fresh_model, fresh_opt, snaps[1])


@pytest.mark.parametrize(("change", "says"), [
    ({"format": 5}, "has format 5; this version reads formats 3, 4"),
    ({"checksum": "sha256"}, "names checksum 'sha256'; format 4 uses 'blake3'"),
])  # fmt: skip
def test_a_manifest_of_an_unknown_format_or_checksum_is_refused_naming_both(tmp_path, change, says) -> None:
    model, opt = tiny()
    save_steps(manager(str(tmp_path)), model, opt, [1])
    path = tmp_path / "step-000000001" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(CheckpointError, match=re.escape(says)):
        manager(str(tmp_path)).resolve("1")


def test_a_blocking_save_returns_at_its_commit_and_retention_finishes_in_the_background(tmp_path, monkeypatch) -> None:
    model, opt = tiny()
    mgr = manager(str(tmp_path), keep_last=1)
    save_steps(mgr, model, opt, [1])
    release, deleting = threading.Event(), threading.Event()
    remove_tree = mgr.storage.remove_tree

    def slow_remove_tree(url: str) -> None:
        if url.endswith("step-000000001"):
            deleting.set()
            assert release.wait(30)
        remove_tree(url)

    monkeypatch.setattr(mgr.storage, "remove_tree", slow_remove_tree)
    train(model, opt)
    assert mgr.save(2, objects(model, opt), blocking=True)  # returns while step 1 is being deleted
    assert (tmp_path / "step-000000002" / "manifest.json").exists()
    assert deleting.wait(30) and (tmp_path / "step-000000001").exists()
    release.set()
    assert mgr.wait()
    assert [c.step for c in mgr.list()] == [2] and not (tmp_path / "step-000000001").exists()


@pytest.mark.parametrize("damage", ["flip_byte", "truncate"])
def test_damaged_shard_fails_verify_and_latest_falls_back_with_a_warning(tmp_path, damage, caplog, capsys) -> None:
    model, opt = tiny()
    mgr = manager(str(tmp_path))
    snaps = save_steps(mgr, model, opt, [1, 2])
    shard = tmp_path / "step-000000002" / "shard-00000-00.bin"
    data = bytearray(shard.read_bytes())
    if damage == "flip_byte":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) - 10]
    shard.write_bytes(bytes(data))

    assert ckpt_cli.main(["ckpt", "verify", str(tmp_path / "step-000000002")]) == 1
    assert "shard-00000-00.bin" in capsys.readouterr().err
    with caplog.at_level(logging.WARNING, logger="elastic_ddp.checkpoint"):
        info = mgr.latest()
    assert info.step == 1
    assert "step-000000002" in caplog.text and "shard-00000-00.bin" in caplog.text
    fresh_model, fresh_opt = tiny(seed=5)
    mgr.load(info, objects(fresh_model, fresh_opt))
    assert_same(fresh_model, fresh_opt, snaps[1])
    # Training reaches step 2 again: a sound save replaces the damaged one instead of being skipped.
    save_steps(mgr, fresh_model, fresh_opt, [2])
    assert ckpt_cli.main(["ckpt", "verify", str(tmp_path / "step-000000002")]) == 0
    assert mgr.latest().step == 2


def _plant(ckpt_dir, name: str, marker: str, *, rewrite_manifest: bool) -> bytes:
    """Replace file ``name`` with a code-running pickle; optionally fix the manifest's checksums."""
    payload = pickle.dumps(Evil(marker))
    (ckpt_dir / name).write_bytes(payload)
    if rewrite_manifest:
        # An attacker who can write the bucket also fixes up the checksums, but cannot sign.
        manifest = json.loads((ckpt_dir / "manifest.json").read_text())
        manifest["files"][name] = mf.FileRecord(name, len(payload), mf.hash_bytes(payload)).to_json()
        manifest.pop("signature", None)
        (ckpt_dir / "manifest.json").write_text(json.dumps(manifest))
    return payload


@pytest.mark.parametrize("name", ["index.json", "shard-00000-00.bin"])
@pytest.mark.parametrize("rewrite_manifest", [False, True])
def test_a_planted_pickle_is_refused_and_never_unpickled(tmp_path, name: str, rewrite_manifest: bool) -> None:
    marker = str(tmp_path / "pwned")
    root = tmp_path / "ckpts"
    model, opt = tiny()
    mgr = manager(str(root))
    save_steps(mgr, model, opt, [1, 2])
    payload = _plant(root / "step-000000002", name, marker, rewrite_manifest=rewrite_manifest)

    assert mgr.latest().step == 1
    tampered = mgr.list()[-1]
    with pytest.raises(CheckpointError, match=re.escape(name) if not rewrite_manifest else "index.json"):
        mgr.load(tampered, objects(model, opt))
    assert ckpt_cli.main(["ckpt", "export", tampered.url, str(tmp_path / "out.pt")]) == 1
    assert not os.path.exists(marker)
    # The payload is live: unpickling it really would have run code.
    pickle.loads(payload)
    assert os.path.exists(marker)


def test_signed_manifest_refuses_unsigned_and_re_checksummed_checkpoints(tmp_path, monkeypatch, caplog) -> None:
    key = "s3cr3t-" + uuid.uuid4().hex
    marker = str(tmp_path / "pwned")
    root = tmp_path / "ckpts"
    model, opt = tiny()
    save_steps(manager(str(root)), model, opt, [1])  # saved without a key: unsigned
    monkeypatch.setenv(ENV_CHECKPOINT_KEY, key)
    with caplog.at_level(logging.DEBUG, logger="elastic_ddp.checkpoint"):
        mgr = manager(str(root))
        assert mgr.latest() is None  # the only checkpoint is unsigned: refused
        save_steps(mgr, model, opt, [2, 3])
        assert mgr.latest().step == 3
        manifest_bytes = (root / "step-000000003" / "manifest.json").read_bytes()
        assert b"hmac-sha256" in manifest_bytes and key.encode() not in manifest_bytes

        _plant(root / "step-000000003", "index.json", marker, rewrite_manifest=True)
        assert mgr.latest().step == 2
        with pytest.raises(CheckpointError, match="not signed"):
            mgr.load(mgr.list()[-1], objects(model, opt))
        with pytest.raises(CheckpointError, match="verification"):
            mgr.resolve("3")
    assert key not in caplog.text
    assert not os.path.exists(marker)
    monkeypatch.setenv(ENV_CHECKPOINT_KEY, "another-key")
    assert manager(str(root)).latest() is None  # step 2 is signed with the other key


def test_cli_lists_verifies_and_exports_plain_weights(tmp_path, capsys) -> None:
    model, opt = tiny()
    mgr = manager(str(tmp_path / "c"))
    save_steps(mgr, model, opt, [1, 2])
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    assert ckpt_cli.main(["ckpt", "list", str(tmp_path / "c"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [e["step"] for e in listed] == [1, 2]
    assert {"step", "url", "world_size", "bytes", "time"} <= set(listed[0])
    assert ckpt_cli.main(["ckpt", "list", str(tmp_path / "c")]) == 0
    assert "step-000000002" in capsys.readouterr().out

    url = listed[-1]["url"]
    assert ckpt_cli.main(["ckpt", "verify", url]) == 0
    assert ckpt_cli.main(["ckpt", "verify", str(tmp_path / "c" / "nope")]) == 1
    out = tmp_path / "weights.pt"
    assert ckpt_cli.main(["ckpt", "export", url, str(out)]) == 0
    weights = torch.load(out, weights_only=True)
    assert set(weights) == set(expected)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


def test_elastic_ddp_ckpt_commands_run_through_the_top_level_cli(tmp_path) -> None:
    import subprocess
    import sys

    model, opt = tiny()
    save_steps(manager(str(tmp_path / "c")), model, opt, [4])
    run = [sys.executable, "-m", "elastic_ddp.tools.cli", "ckpt"]
    listed = subprocess.run([*run, "list", str(tmp_path / "c"), "--json"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    url = json.loads(listed.stdout)[0]["url"]
    out = tmp_path / "w.pt"
    assert subprocess.run([*run, "export", url, str(out)], capture_output=True, timeout=60).returncode == 0
    assert set(torch.load(out, weights_only=True)) == set(model.state_dict())


def _same_tree(got, want, where: str = "") -> None:
    """``got`` (an export read back) equals ``want`` (what was saved): containers of the same kind,
    dict keys of the same types in the same order, tensors equal in dtype, shape and bytes."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict), where
        assert [(type(k), k) for k in got] == [(type(k), k) for k in want], where
        for key in want:
            _same_tree(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same_tree(g, w, f"{where}.{i}")
    else:
        assert type(got) is type(want) and got == want, where


@pytest.mark.parametrize("name", [None, "ema", "optimizer", "raw_optimizer", "scheduler", "counter"])
def test_export_writes_one_object_as_a_weights_only_file_equal_to_what_was_saved(run_checkpoint, tmp_path, name, capsys) -> None:
    out = tmp_path / "out.pt"
    argv = ["ckpt", "export", run_checkpoint.url, str(out)] + (["--object", name] if name else [])
    assert ckpt_cli.main(argv) == 0
    _same_tree(torch.load(out, weights_only=True), run_checkpoint.saved[name or "model"])
    printed = capsys.readouterr().out
    assert f"Wrote {name or 'model'!r}" in printed and "of step 5" in printed and "per-rank" not in printed.lower()


def test_an_exported_ema_loads_into_a_fresh_averaged_model(run_checkpoint, tmp_path) -> None:
    from torch.optim.swa_utils import AveragedModel

    out = tmp_path / "ema.pt"
    assert ckpt_cli.main(["ckpt", "export", run_checkpoint.url, str(out), "--object", "ema"]) == 0
    fresh_model, _ = tiny(seed=9)
    fresh = AveragedModel(fresh_model)
    fresh.load_state_dict(torch.load(out, weights_only=True))
    assert int(fresh.n_averaged) == 2
    for (key, got), want in zip(fresh.state_dict().items(), run_checkpoint.ema.state_dict().values()):
        assert torch.equal(got, want), key
    assert not torch.equal(fresh.module[0].weight, run_checkpoint.model[0].weight)  # the average, not the model


def test_export_all_and_several_objects_write_a_directory_of_name_pt_files(run_checkpoint, tmp_path, capsys) -> None:
    saved = run_checkpoint.saved
    assert ckpt_cli.main(["ckpt", "export", run_checkpoint.url, str(tmp_path / "all"), "--all"]) == 0
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == sorted(f"{name}.pt" for name in saved)
    for name in saved:
        _same_tree(torch.load(tmp_path / "all" / f"{name}.pt", weights_only=True), saved[name], name)
    assert f"Wrote {len(saved)} objects of step 5" in capsys.readouterr().out

    some = tmp_path / "some"
    assert ckpt_cli.main(["ckpt", "export", run_checkpoint.url, str(some), "--object", "ema", "--object", "optimizer"]) == 0
    assert sorted(p.name for p in some.iterdir()) == ["ema.pt", "optimizer.pt"]
    _same_tree(torch.load(some / "optimizer.pt", weights_only=True), saved["optimizer"])
    # A directory needs OUT not to be a file, a single object needs OUT not to be a directory.
    assert ckpt_cli.main(["ckpt", "export", run_checkpoint.url, str(some / "ema.pt"), "--all"]) == 1
    assert "is a file" in capsys.readouterr().err
    assert ckpt_cli.main(["ckpt", "export", run_checkpoint.url, str(some), "--object", "ema"]) == 1
    assert "is a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        ckpt_cli.main(["ckpt", "export", run_checkpoint.url, str(some), "--object", "ema", "--all"])
    assert usage.value.code == 2


@pytest.mark.parametrize(("name", "hint"), [("emma", "did you mean 'ema'?"), ("teacher", "")])
def test_export_of_an_unknown_object_fails_listing_what_the_checkpoint_holds(run_checkpoint, tmp_path, name, hint, capsys) -> None:
    out = tmp_path / "out.pt"
    assert ckpt_cli.main(["ckpt", "export", run_checkpoint.url, str(out), "--object", "model", "--object", name]) == 1
    err = capsys.readouterr().err
    assert f"holds no object named {name!r}" in err and (hint in err if hint else "did you mean" not in err)
    assert "'model', 'optimizer', 'scheduler', 'ema', 'raw_optimizer', 'counter'" in err
    assert not out.exists()


def test_export_rank_must_be_a_rank_of_the_save(run_checkpoint, tmp_path, capsys) -> None:
    # Saved by one process: nothing differs across ranks, and rank 0 is the only rank of the save.
    # (Rank R's per-rank values: tests/integration/test_checkpoint_torchrun.py exports them from a 2-rank save.)
    out = tmp_path / "out.pt"
    for rank in ("1", "-1"):
        assert ckpt_cli.main(["ckpt", "export", run_checkpoint.url, str(out), "--rank", rank]) == 1
        assert "the only valid rank is 0" in capsys.readouterr().err
    assert not out.exists()
    assert ckpt_cli.main(["ckpt", "export", run_checkpoint.url, str(out), "--rank", "0"]) == 0
    _same_tree(torch.load(out, weights_only=True), run_checkpoint.saved["model"])


def test_a_group_fenced_by_a_newer_round_neither_clears_nor_commits(tmp_path, monkeypatch) -> None:
    root = tmp_path / "ckpts"
    model, opt = tiny()
    stale = manager(str(root), rdzv_round=3)
    save_steps(stale, model, opt, [1])
    assert json.loads((root / FENCE_NAME).read_text())["round"] == 3
    # The job re-formed without the stale group: the new group claims the run at its start.
    current = manager(str(root), rdzv_round=4)
    in_flight = root / "step-000000002"
    in_flight.mkdir()
    (in_flight / "shard-00000-00.bin").write_bytes(b"the new group's save in progress")

    train(model, opt)
    stale.save(2, objects(model, opt))
    assert not stale.wait()
    assert "stale writer" in stale.last_error and "round 4" in stale.last_error
    assert (in_flight / "shard-00000-00.bin").read_bytes() == b"the new group's save in progress"
    assert [c.step for c in current.list()] == [1]

    save_steps(current, model, opt, [2])
    assert [(c.step, c.manifest["rdzv_round"]) for c in current.list()] == [(1, 3), (2, 4)]


def test_a_writer_held_before_its_commit_while_a_newer_group_claims_the_run_does_not_commit(tmp_path, monkeypatch) -> None:
    root, release = tmp_path / "ckpts", tmp_path / "release"
    model, opt = tiny()
    stale = manager(str(root), rdzv_round=0)
    monkeypatch.setenv(ENV_FAULT, f"wait@before_manifest:rank=0:until={release}")
    stale.save(5, objects(model, opt))  # async: held in the background before the manifest
    wait_for(lambda: (root / "step-000000005" / "index.json").exists(), 30, what="the files of step 5")
    manager(str(root), rdzv_round=1)
    release.touch()
    assert not stale.wait()
    assert "Refusing to commit" in stale.last_error
    assert stale.list() == []


def test_without_a_rendezvous_round_nothing_is_fenced(tmp_path) -> None:
    root = tmp_path / "ckpts"
    model, opt = tiny()
    save_steps(manager(str(root)), model, opt, [1])
    assert not (root / FENCE_NAME).exists()
    assert "rdzv_round" not in manager(str(root)).list()[0].manifest


def test_a_stale_group_whose_save_fails_leaves_the_new_groups_directory_alone(tmp_path, monkeypatch) -> None:
    root, release = tmp_path / "ckpts", tmp_path / "release"
    model, opt = tiny()
    stale = manager(str(root), rdzv_round=0)
    cleared = root / "step-000000005"
    cleared.mkdir()
    monkeypatch.setenv(ENV_FAULT, f"wait@before_write:rank=0:until={release}")
    stale.save(5, objects(model, opt))  # async: clears the directory, then is held before writing
    wait_for(lambda: not cleared.exists(), 30, what="the stale group's preflight")
    # Meanwhile the job re-formed without it; the new group is saving the same step. Its file is
    # where the stale writer will try to write, so the stale save fails (not on the fence).
    manager(str(root), rdzv_round=1)
    (cleared / "shard-00000-00.bin").mkdir(parents=True)
    (cleared / "the-new-groups-data").write_bytes(b"in flight")
    release.touch()
    assert not stale.wait()
    assert "shard-00000-00.bin" in stale.last_error
    assert (cleared / "the-new-groups-data").read_bytes() == b"in flight"


def test_a_stale_group_that_commits_before_a_takeover_skips_retention_and_the_leftover_sweep(tmp_path, monkeypatch) -> None:
    root, release = tmp_path / "ckpts", tmp_path / "release"
    model, opt = tiny()
    stale = manager(str(root), rdzv_round=0, keep_last=1)
    save_steps(stale, model, opt, [1])
    monkeypatch.setenv(ENV_FAULT, f"wait@after_manifest:rank=0:until={release}")
    stale.save(5, objects(model, opt))  # committed, then held before its clean-up
    wait_for(lambda: (root / "step-000000005" / "manifest.json").exists(), 30, what="the commit of step 5")
    manager(str(root), rdzv_round=1)  # the new group resumed from step 1 and is saving step 2
    in_flight = root / "step-000000002"
    in_flight.mkdir()
    (in_flight / "shard-00000-00.bin").write_bytes(b"in flight")
    release.touch()
    assert stale.wait()
    assert (in_flight / "shard-00000-00.bin").read_bytes() == b"in flight"
    assert [c.step for c in stale.list()] == [1, 5]  # keep_last=1 would have deleted step 1


def test_state_a_checkpoint_cannot_hold_is_refused_at_save_naming_where_it_is(mem_url: str) -> None:
    model, opt = tiny()
    mgr = manager(mem_url)
    with pytest.raises(TypeError, match=r"'extra\.when'.*datetime"):
        import datetime

        mgr.save(1, objects(model, opt, extra=Box(when=datetime.date(2026, 1, 1))), blocking=True)
    assert mgr.list() == []


def test_loading_into_a_model_of_another_shape_names_the_tensor_and_both_shapes(mem_url: str) -> None:
    model, opt = tiny(width=8)
    save_steps(manager(mem_url), model, opt, [1])
    other, other_opt = tiny(width=16)
    mgr = manager(mem_url)
    with pytest.raises(CheckpointError, match=r"'model\.0\.weight' is torch\.float32 of shape \[8, 8\] in the checkpoint but torch\.float32 of shape \[16, 16\] here"):
        mgr.load(mgr.latest(), objects(other, other_opt))


def test_remove_all_deletes_every_checkpoint_and_a_fenced_group_is_refused(tmp_path) -> None:
    root = tmp_path / "ckpts"
    model, opt = tiny()
    old = manager(str(root), rdzv_round=2)
    save_steps(old, model, opt, [1, 2])
    assert [c.step for c in old.list_collective()] == [1, 2]

    current = manager(str(root), rdzv_round=3)  # a newer group claims the run
    with pytest.raises(StaleWriterError, match="round 3"):
        old.remove_all()
    assert [c.step for c in current.list_collective()] == [1, 2]

    current.remove_all()
    assert current.list_collective() == [] and current.latest() is None
    assert not list(root.glob("step-*"))
    save_steps(current, model, opt, [1])
    assert [c.step for c in current.list()] == [1]


def test_any_object_with_a_state_dict_registers_as_it_is_and_anything_else_is_refused_naming_the_protocol():
    from torch.optim.swa_utils import AveragedModel

    from elastic_ddp.state import as_stateful

    model, opt = tiny()
    ema = as_stateful("ema", AveragedModel(model, use_buffers=True))
    assert isinstance(ema, ModelState) and "module.0.weight" in ema.state_dict() and "n_averaged" in ema.state_dict()
    assert as_stateful("optim", opt) is opt  # another optimizer, as is (its own state_dict)
    with pytest.raises(TypeError, match=r"'counts' \(builtins.dict\) has no state_dict\(\).*elastic_ddp.state.Stateful"):
        as_stateful("counts", {"a": 1})
    with pytest.raises(ValueError, match="State name 'a.b' is not allowed"):
        as_stateful("a.b", opt)
