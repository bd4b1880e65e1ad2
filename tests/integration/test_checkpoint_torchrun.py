"""Multi-rank saves under real torchrun (gloo, CPU): shares, resharding on resume, read-once, kill -9 mid-save."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from elastic_ddp.checkpoint import CheckpointManager
from elastic_ddp.tools import checkpoint as ckpt_cli
from elastic_ddp.config import CheckpointConfig
from elastic_ddp.faults import ENV_FAULT
from elastic_ddp.state import ModelState, OptimizerState

WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "ckpt_worker.py")
IDENTITY = {"worker": "ckpt_worker"}  # the worker's run identity


def _descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def torchrun(nproc: int, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "--monitor-interval=0.1", WORKER, *args]
    # Output goes to a file, not a pipe: a pipe held open by a stray worker would block the read.
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [proc.pid, *_descendants(proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
            log.seek(0)
            pytest.fail(f"torchrun {args} did not finish in {timeout} s:\n{log.read()[-6000:]}")
        log.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, log.read(), "")


def check(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def load_in_process_and_compare(url: str, dump: str) -> None:
    """Resume at world size 1 (no process group) and compare with the saver's values."""
    sys.path.insert(0, str(Path(WORKER).parent))
    try:
        import ckpt_worker
    finally:
        sys.path.pop(0)
    model, opt = ckpt_worker.build()
    mgr = CheckpointManager(CheckpointConfig(url=url), identity=IDENTITY)
    progress = ckpt_worker.Progress()
    info = mgr.resolve("auto")
    mgr.load(info, ckpt_worker.objects(model, opt, progress))
    expected = torch.load(dump, weights_only=True)[info.step]
    for key, value in expected["model"].items():
        assert torch.equal(model.state_dict()[key], value), key
    assert progress.world != 1


def writers_of_data(ckpt_dir: Path) -> set[int]:
    """Ranks that wrote pieces of the replicated state (from the checkpoint's index)."""
    index = json.loads((ckpt_dir / "index.json").read_text())
    return {f["writer"] for f in index["files"] if f["pieces"]}


def test_save_at_4_ranks_stages_shares_and_resumes_at_2_reading_once_then_falls_back_past_a_bad_byte(tmp_path) -> None:
    url, dump = str(tmp_path / "ck"), str(tmp_path / "expected.pt")
    out = check(torchrun(4, "save", "--url", url, "--steps", "3", "--save-at", "2", "3", "--dump", dump))
    manifest = json.loads((tmp_path / "ck" / "step-000000003" / "manifest.json").read_text())
    assert manifest["world_size"] == 4
    assert writers_of_data(tmp_path / "ck" / "step-000000003") == {0, 1, 2, 3}
    staged = [(int(m[1]), int(m[2])) for m in re.finditer(r"rank \d staged (\d+) of (\d+) replicated bytes", out)]
    assert len(staged) == 4, out[-3000:]
    for share, total in staged:  # each rank copied its quarter of the replicated state, not a replica
        assert 0 < share <= 1.2 * total / 4, (share, total)

    out = check(torchrun(2, "load", "--url", url, "--dump", dump))
    assert out.count("resumed step 3 saved at world size 4: OK (own state restored: False") == 2, out[-3000:]
    read = sum(int(m[1]) for m in re.finditer(r"read (\d+) bytes", out))
    assert read == manifest["bytes"]  # every byte of the checkpoint read once, by one rank or the other
    load_in_process_and_compare(url, dump)

    shard = next(p for p in sorted((tmp_path / "ck" / "step-000000003").glob("shard-00002-*.bin")) if p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    out = check(torchrun(2, "load", "--url", url, "--dump", dump))
    assert out.count("resumed step 2 saved at world size 4: OK") == 2, out[-3000:]
    assert out.count(f"Skipping checkpoint {url}/step-000000003: file {shard.name!r} failed verification") == 2


def test_save_at_2_ranks_resumes_at_3_and_at_2_with_each_ranks_own_state(tmp_path) -> None:
    url, dump = str(tmp_path / "ck"), str(tmp_path / "expected.pt")
    check(torchrun(2, "save", "--url", url, "--steps", "2", "--save-at", "2", "--dump", dump))
    assert writers_of_data(tmp_path / "ck" / "step-000000002") == {0, 1}
    mine = tmp_path / "mine-1.pt"  # `ckpt export --rank 1`: rank 1's per-rank object (values 10 * rank + step)
    assert ckpt_cli.main(["ckpt", "export", f"{url}/step-000000002", str(mine), "--object", "mine", "--rank", "1"]) == 0
    exported = torch.load(mine, weights_only=True)
    assert exported["rank"] == 1 and torch.equal(exported["values"], torch.full((5,), 12.0))
    out = check(torchrun(3, "load", "--url", url, "--dump", dump))
    assert out.count("resumed step 2 saved at world size 2: OK (own state restored: False") == 3, out[-3000:]
    out = check(torchrun(2, "load", "--url", url, "--dump", dump))
    assert out.count("resumed step 2 saved at world size 2: OK (own state restored: True") == 2, out[-3000:]


@pytest.mark.parametrize("point", ["kill@before_write:rank=1", "kill@mid_write:rank=1", "kill@after_write:rank=0", "kill@before_manifest:rank=0"])
def test_kill_9_of_a_rank_mid_save_leaves_the_previous_checkpoint_latest(tmp_path, point: str) -> None:
    url = str(tmp_path / "ck")
    # The previous checkpoint, saved alone: step 1.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    first = CheckpointManager(CheckpointConfig(url=url), identity=IDENTITY)
    assert first.save(1, {"model": ModelState(model), "optim": OptimizerState(model, opt)}, blocking=True)

    result = torchrun(2, "save", "--url", url, "--steps", "2", "--save-at", "2", "--fault-step", "2", "--fault", point)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "SIGKILL" in result.stdout or "Signal 9" in result.stdout or "-9" in result.stdout, result.stdout[-3000:]

    mgr = CheckpointManager(CheckpointConfig(url=url), identity=IDENTITY)
    assert [i.step for i in mgr.list()] == [1]
    info = mgr.latest()
    assert info.step == 1 and mgr.verify(info).ok
    assert not (tmp_path / "ck" / "step-000000002" / "manifest.json").exists()
    assert ENV_FAULT not in os.environ


def test_a_rank_that_hangs_at_a_save_is_detected_after_the_training_groups_timeout_not_the_checkpoints(tmp_path) -> None:
    url = str(tmp_path / "ck")
    # checkpoint.timeout_s stays at its 600 s: the peers' save must fail after the 3 s of dist's timeout,
    # and the job end, well within the 120 s torchrun() allows it.
    result = torchrun(3, "save", "--url", url, "--steps", "3", "--save-at", "2", "3", "--hang", "2:3",
                      "--dist-timeout-s", "3", timeout=120)  # fmt: skip
    assert result.returncode != 0, result.stdout[-3000:]
    assert "timed out" in result.stdout.lower() or "timeout" in result.stdout.lower(), result.stdout[-3000:]
    assert [i.step for i in CheckpointManager(CheckpointConfig(url=url), identity=IDENTITY).list()] == [2]
