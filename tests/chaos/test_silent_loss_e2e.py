"""No silent loss: every way a job could lose or mix work without saying so ends in one clear error.

Each test runs a real training script (recipes/train_classifier.py, alone or under torchrun) and
checks the exit status and the one message a user would read:

* a full disk at the final save, and periodic saves that keep failing, end the job non-zero with the
  URL, the step and the cause in plain words;
* two nodes whose "shared" checkpoint directory is in fact each its own disk stop before step 1;
* a fresh start on a URL that holds checkpoints, and a resume with other identity settings, are
  refused, naming what differs and the flag that allows it -- and the flag works;
* a second and third SIGTERM while stopping (Slurm signals every process, torchrun forwards, the batch
  script forwards again) do not kill the stop checkpoint;
* the summary and the events say what happened: a stop is not "finished", and extending a finished
  run is not a "failure recovered".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_ddp.checkpoint.manager import list_checkpoints
from elastic_ddp.checkpoint.storage import Storage
from tests.helpers.job import CLASSIFIER, Job, env, resumed_steps, steps
from tests.helpers.nodes import descendants, start_node, wait_for

pytestmark = pytest.mark.slow


def classifier(root: Path, *flags: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """recipes/train_classifier.py as a job of one rank (no torchrun), small and fast."""
    command = [
        sys.executable, str(CLASSIFIER), f"--run.root={root}", "--run.name=digits",
        "--train.global_batch_size=16", "--logging.every_steps=1", *flags,
    ]  # fmt: skip
    return subprocess.run(command, env=env(), capture_output=True, text=True, timeout=timeout)


def committed(url: Path) -> list[int]:
    return [info.step for info in list_checkpoints(Storage(str(url)))]


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MB tmpfs, nearly filled: a classifier checkpoint (~0.4 MB) no longer fits."""
    mount_dir = tmp_path / "disk"
    mount_dir.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_dir)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"Mounting a size-limited tmpfs is not permitted here: {proc.stderr.strip()}")
    try:
        free = subprocess.run(["df", "-B1", "--output=avail", str(mount_dir)], capture_output=True, text=True, check=True)
        (mount_dir / "filler").write_bytes(b"\0" * max(int(free.stdout.split()[-1]) - 100_000, 0))
        yield mount_dir
    finally:
        subprocess.run(["umount", "-l", str(mount_dir)], check=False)


def test_a_full_disk_at_the_final_save_exits_nonzero_naming_url_step_and_full(small_disk, tmp_path):
    url = small_disk / "ckpt"
    result = classifier(tmp_path, "--train.max_steps=6", "--checkpoint.every_steps=0", f"--checkpoint.url={url}")
    assert result.returncode != 0, result.stdout[-3000:]
    error = result.stderr
    assert str(url) in error and "step 6" in error and "full" in error, error[-3000:]
    assert "finished" not in result.stdout  # no success line after a lost final save
    assert committed(url) == []


def test_periodic_saves_failing_in_a_row_stop_the_job(small_disk, tmp_path):
    url = small_disk / "ckpt"
    result = classifier(
        tmp_path, "--train.max_steps=100", "--checkpoint.every_steps=2", "--checkpoint.async_save=false",
        "--checkpoint.max_failed_saves=3", f"--checkpoint.url={url}",
    )  # fmt: skip
    assert result.returncode != 0, result.stdout[-3000:]
    assert "3 checkpoint saves in a row failed (checkpoint.max_failed_saves=3)" in result.stderr, result.stderr[-3000:]
    assert max(s for s, _ in steps(result.stdout)) < 100  # stopped, not trained to the end


def test_nodes_with_their_own_disks_behind_a_local_url_stop_before_step_1(etcd_endpoint, tmp_path):
    # Two machines with separate disks: each agent in its own directory, checkpoint.url relative.
    job = Job(etcd_endpoint, tmp_path, nnodes="2", recipe=CLASSIFIER, flags=["--checkpoint.url=ckpt"],
              torchrun_flags=["--max-restarts=0"])  # fmt: skip
    try:
        for index in range(2):
            (tmp_path / f"machine{index}").mkdir()
            job.add_node(cwd=tmp_path / f"machine{index}")
        codes = [node.wait(timeout=180) for node in job.nodes]
    finally:
        job.cleanup()
    output = job.output()
    assert all(code != 0 for code in codes), output[-4000:]
    for node in job.nodes:
        assert "is not storage shared by all nodes" in node.output(), node.output()[-3000:]
    assert steps(output) == [], "no node may train a step"


def test_a_fresh_start_on_a_url_with_checkpoints_is_refused_and_overwrite_replaces_them(tmp_path):
    url = tmp_path / "digits" / "checkpoints"
    assert classifier(tmp_path, "--train.max_steps=4", "--checkpoint.every_steps=2").returncode == 0
    assert committed(url) == [2, 4]
    refused = classifier(tmp_path, "--train.max_steps=4", "--checkpoint.resume=never")
    assert refused.returncode != 0
    assert f"checkpoint.resume=never, but {url} already holds 2 checkpoint(s)" in refused.stderr, refused.stderr[-3000:]
    assert "--checkpoint.overwrite=true" in refused.stderr
    assert committed(url) == [2, 4]  # nothing lost
    fresh = classifier(tmp_path, "--train.max_steps=3", "--checkpoint.resume=never", "--checkpoint.overwrite=true")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert committed(url) == [3]


def test_a_resume_with_other_identity_settings_is_refused_naming_the_fields(tmp_path):
    url = tmp_path / "digits" / "checkpoints"
    assert classifier(tmp_path, "--train.max_steps=4").returncode == 0
    refused = classifier(tmp_path, "--train.max_steps=8", "--train.seed=7", "--model.dropout=0.3")
    assert refused.returncode != 0
    assert "model.dropout: checkpoint 0.1, now 0.3" in refused.stderr and "train.seed: checkpoint 1337, now 7" in refused.stderr
    assert "--checkpoint.allow_identity_change=true" in refused.stderr
    assert committed(url) == [4]
    allowed = classifier(tmp_path, "--train.max_steps=8", "--train.seed=7", "--checkpoint.allow_identity_change=true")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert resumed_steps(allowed.stdout) == [4]
    manifest = json.loads((url / "step-000000008" / "manifest.json").read_text())
    assert manifest["identity"]["train.seed"] == 7  # the run goes on with its new identity


def test_extending_a_finished_run_continues_it_and_ctrl_c_says_stopped(tmp_path):
    first = classifier(tmp_path, "--train.max_steps=3")
    assert first.returncode == 0 and "finished: steps=3/3" in first.stdout, first.stdout[-2000:]
    longer = classifier(tmp_path, "--train.max_steps=5")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "Continuing the run, which ended at step 3" in longer.stdout
    assert "Failure recovered" not in longer.stdout
    # Ctrl-C: a stop at an agreed step with its checkpoint, said as such.
    log = tmp_path / "interrupted.log"
    node = start_node(
        [sys.executable, str(CLASSIFIER), f"--run.root={tmp_path}", "--run.name=digits", "--train.global_batch_size=16",
         "--logging.every_steps=1", "--train.max_steps=100000", "--checkpoint.every_steps=0"], env(), log,
    )  # fmt: skip
    try:
        wait_for(lambda: any(s >= 10 for s, _ in steps(node.output())), 120, what="step 10")
        node.process.send_signal(signal.SIGINT)
        code = node.wait(timeout=60)
    finally:
        node.cleanup()
    output = node.output()
    last = max(s for s, _ in steps(output))
    assert code == 75, output[-3000:]  # EXIT_STOPPED: run again to resume
    assert f"stopped on request (checkpoint committed): steps={last}/100000" in output
    assert "finished:" not in output.split("Continuing")[-1]
    assert committed(tmp_path / "digits" / "checkpoints")[-1] == last


def test_repeated_sigterms_to_the_worker_process_group_do_not_kill_the_stop_checkpoint(etcd_endpoint, tmp_path):
    release = tmp_path / "release"
    job = Job(etcd_endpoint, tmp_path, nnodes="1", recipe=CLASSIFIER,
              flags=["--train.max_steps=100000", "--checkpoint.every_steps=0"],
              extra_env={"ELASTIC_DDP_FAULT": f"wait@before_manifest:rank=0:until={release}"})  # fmt: skip
    try:
        node = job.add_node()
        job.wait_for_step(8)
        [worker] = [pid for pid in descendants(node.pid) if _cmdline(pid).endswith(f"--checkpoint.every_steps=0")]
        os.killpg(worker, signal.SIGTERM)  # the worker is its own session's leader: its group
        time.sleep(0.1)
        os.killpg(worker, signal.SIGTERM)
        job.wait_until(lambda: "holding this save" in job.output(), 60, "the stop save to start")
        os.killpg(worker, signal.SIGTERM)  # and once more while the checkpoint is being written
        release.touch()
        job.wait_until(lambda: "stopped on request (checkpoint committed)" in job.output(), 60, "the stop to finish")
    finally:
        job.cleanup()
    output = job.output()
    # The first two may reach Python as one (a signal that arrives while its handler is pending is
    # folded into it); the third came while the checkpoint was being written.
    assert output.count("received again while stopping") >= 1, output[-4000:]
    stop_step = committed(job.run_dir / "checkpoints")[-1]
    assert f"step-{stop_step:09d}" in output and stop_step >= 8


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""
