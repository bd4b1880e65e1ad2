"""TensorBoard metrics of recipes/train.py under real torchrun, read back with TensorBoard itself.

Two jobs, each shared by the tests that look at it:

* a worker SIGKILLed mid-run (``ELASTIC_DDP_FAULT=kill@...``): one agent with two workers on the
  etcd rendezvous restarts both, and they resume from the last committed checkpoint;
* a scale-down: two agents, the one hosting rank 0 (the TensorBoard writer) killed with its
  worker; the survivor's worker becomes rank 0 and writes on into the same event directory.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers.job import RECIPE, RESUMED_LINE, TEST_RDZV_CONF, TINY, env, steps
from tests.helpers.nodes import Node, start_node, wait_for
from tests.unit.test_metrics import (
    assert_every_tag_strictly_increasing,
    fetch_when_served,
    read_back,
    tensorboard_server,
    texts,
)

pytestmark = pytest.mark.slow

MAX_STEPS = 24
CHECKPOINT_EVERY = 5
# Past two checkpoint steps, so the failed attempt logs steps its successor redoes.
KILL_STEP = 12
CKPT_TAGS = ("ckpt/stall_s", "ckpt/save_s", "ckpt/bytes", "ckpt/throughput_bytes_per_s", "ckpt/failed_saves")
FIRST_COMMIT = re.compile(rf"Checkpoint committed at \S+/step-{CHECKPOINT_EVERY:09d}:")
RECOVERED = re.compile(r"Failure recovered after ([\d.]+) s")


def torchrun(endpoint: str, run_id: str, root: Path, *, nnodes: str, nproc_per_node: int, flags: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}", "--max-restarts=2", "--monitor-interval=0.1",
        "--rdzv-backend=etcd", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", TEST_RDZV_CONF,
        str(RECIPE), f"--run.root={root}", f"--run.name={run_id}", *TINY,
        f"--checkpoint.every_steps={CHECKPOINT_EVERY}", *flags,
    ]  # fmt: skip


def new_run_id() -> str:
    return f"tb-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class FinishedRun:
    """A job that has ended: where it wrote and what its agents printed."""

    root: Path
    run_id: str
    output: str

    @property
    def tensorboard_dir(self) -> Path:
        return self.root / self.run_id / "tensorboard"

    def resume(self) -> tuple[str, int]:
        """URL and step of the one checkpoint a restarted attempt resumed from."""
        [(url, step)] = [(m[1], int(m[2])) for m in RESUMED_LINE.finditer(self.output)]
        return url, step


def series(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in read_back(tb_dir).Scalars(tag)]


# --- a worker killed mid-run, torchrun restarts the group ---------------------------------


@pytest.fixture(scope="module")
def killed_worker_run(etcd_server, tmp_path_factory) -> FinishedRun:
    root = tmp_path_factory.mktemp("killed-worker")
    run_id = new_run_id()
    # One agent with both workers: it restarts the whole group, so rank 0 sees restart count 1.
    command = torchrun(
        etcd_server.endpoint, run_id, root, nnodes="1", nproc_per_node=2, flags=[f"--train.max_steps={MAX_STEPS}"]
    )
    node = start_node(command, env(ELASTIC_DDP_FAULT=f"kill@{KILL_STEP}:rank=1:restart=0"), root / "node.log")
    try:
        code = node.wait(timeout=240)
    finally:
        node.cleanup()
    output = node.output()
    assert code == 0, output[-6000:]
    return FinishedRun(root, run_id, output)


def test_killed_worker_every_tag_has_unique_increasing_steps_and_the_loss_reaches_the_last_step(killed_worker_run):
    run = killed_worker_run
    _, resumed_at = run.resume()
    first_attempt = run.output.split("event: Resumed from")[0]
    # Without the purge, the steps the failed attempt logged after its checkpoint would repeat.
    assert max(step for step, _ in steps(first_attempt)) > resumed_at, first_attempt[-4000:]
    assert_every_tag_strictly_increasing(run.tensorboard_dir)

    loss = read_back(run.tensorboard_dir).Scalars("train/loss")
    assert [event.step for event in loss] == list(range(1, MAX_STEPS + 1))
    # The points kept after the resume step are the successor's: logged after it started.
    [recovery] = read_back(run.tensorboard_dir).Scalars("elastic/recovery_s")
    assert all(event.wall_time >= recovery.wall_time for event in loss if event.step > resumed_at)
    assert all(event.wall_time < recovery.wall_time for event in loss if event.step <= resumed_at)


def test_killed_worker_restart_count_recovery_time_and_world_size(killed_worker_run):
    run = killed_worker_run
    _, resumed_at = run.resume()
    tb_dir = run.tensorboard_dir
    restarts = series(tb_dir, "elastic/restart_count")
    assert restarts == [(step, 0.0 if step <= resumed_at else 1.0) for step in range(1, MAX_STEPS + 1)]
    [(step, recovery_s)] = series(tb_dir, "elastic/recovery_s")
    print(f"elastic/recovery_s = {recovery_s:.2f} s at step {step} (resumed from step {resumed_at})")
    assert step == resumed_at + 1 and recovery_s > 0
    assert {value for _, value in series(tb_dir, "elastic/world_size")} == {2.0}


def test_killed_worker_checkpoint_tags_describe_the_last_save(killed_worker_run):
    tb_dir = killed_worker_run.tensorboard_dir
    assert set(CKPT_TAGS) <= set(read_back(tb_dir).Tags()["scalars"])
    last = {tag: series(tb_dir, tag)[-1] for tag in CKPT_TAGS}
    print("ckpt/* at the last step:", {tag: value for tag, (_, value) in last.items()})
    assert {step for step, _ in last.values()} == {MAX_STEPS}
    # The last step's save is blocking: training stalls for all of it.
    assert last["ckpt/stall_s"][1] == pytest.approx(last["ckpt/save_s"][1])
    assert last["ckpt/bytes"][1] > 0
    assert last["ckpt/throughput_bytes_per_s"][1] == pytest.approx(
        last["ckpt/bytes"][1] / last["ckpt/save_s"][1], rel=1e-4
    )
    # Reported at every logged step, so a failure shows at once.
    assert [step for step, _ in series(tb_dir, "ckpt/failed_saves")] == list(range(1, MAX_STEPS + 1))


def test_killed_worker_events_tell_the_resume_and_the_recovery_and_each_attempt_logs_its_config(killed_worker_run):
    run = killed_worker_run
    url, resumed_at = run.resume()
    events = dict(texts(run.tensorboard_dir, "events"))
    assert set(events) == {resumed_at + 1}, events
    assert f"Resumed from {url} (step {resumed_at})" in events[resumed_at + 1]
    recovered = RECOVERED.search(events[resumed_at + 1])
    assert recovered, events
    print(f"event: Failure recovered after {recovered[1]} s")

    configs = texts(run.tensorboard_dir, "config")
    assert [step for step, _ in configs] == [1, resumed_at + 1]
    for _, text in configs:
        config = yaml.safe_load(text.removeprefix("```yaml\n").removesuffix("\n```"))
        assert config["run"]["name"] == run.run_id
        assert config["train"]["max_steps"] == MAX_STEPS
        assert config["checkpoint"]["every_steps"] == CHECKPOINT_EVERY


# Both loaders of TensorBoard's server: the Rust data server and the Python one.
@pytest.mark.parametrize("load_fast", ["true", "false"])
def test_tensorboard_server_serves_the_restarted_run_as_one_curve(killed_worker_run, load_fast):
    run = killed_worker_run
    _, resumed_at = run.resume()
    # Served as `elastic-ddp tensorboard --runs <root>` would: the run is <run id>/tensorboard.
    name = f"{run.run_id}/tensorboard"
    with tensorboard_server(run.root, load_fast) as get:

        def fetch() -> dict:
            return {
                tag: get("scalars/scalars", {"run": name, "tag": tag})
                for tag in ("train/loss", "elastic/recovery_s", "elastic/restart_count")
            } | {
                "events": get("text/text", {"run": name, "tag": "events/text_summary"}),
                "config": get("text/text", {"run": name, "tag": "config/text_summary"}),
            }

        served = fetch_when_served(fetch, lambda got: len(got["train/loss"]) >= MAX_STEPS and got["events"])
    assert served, f"TensorBoard never served {name}"
    # Each scalar point is [wall_time, step, value].
    loss = [(step, value) for _, step, value in served["train/loss"]]
    expected = series(run.tensorboard_dir, "train/loss")
    assert [step for step, _ in loss] == list(range(1, MAX_STEPS + 1))
    assert loss == [(step, pytest.approx(value)) for step, value in expected]
    assert [step for _, step, _ in served["elastic/recovery_s"]] == [resumed_at + 1]
    assert served["elastic/restart_count"][-1][1:] == [MAX_STEPS, 1.0]
    assert [entry["step"] for entry in served["events"]] == [resumed_at + 1]
    assert "Resumed from" in served["events"][0]["text"]
    assert [entry["step"] for entry in served["config"]] == [1, resumed_at + 1]


# --- scale-down through the etcd rendezvous ------------------------------------------------


def rank0_node(nodes: list[Node]) -> Node | None:
    return next((node for node in nodes if "[rank0] step=" in node.output()), None)


def test_scale_down_world_size_curve_shows_2_then_1_and_an_event_says_so(etcd_endpoint, tmp_path):
    run_id = new_run_id()
    command = torchrun(etcd_endpoint, run_id, tmp_path, nnodes="1:2", nproc_per_node=1, flags=["--train.max_steps=100000"])
    nodes = [start_node(command, env(), tmp_path / f"node{index}.log") for index in range(2)]
    try:
        # Killed only once the first checkpoint is committed: an async save still in flight dies
        # with its writer, and the survivor would then start over instead of resuming.
        wait_for(
            lambda: any(s > CHECKPOINT_EVERY and w == 2 for node in nodes for s, w in steps(node.output()))
            and any(FIRST_COMMIT.search(node.output()) for node in nodes),
            180, what="steps past the first committed checkpoint at world size 2",
        )  # fmt: skip
        writer = rank0_node(nodes)
        assert writer is not None
        survivor = nodes[1 - nodes.index(writer)]
        writer.kill()
        wait_for(lambda: len(steps(survivor.output())) >= 5, 180, what="5 steps of the survivor at world size 1")
        # A SIGTERM to the survivor stops it at a step boundary; closing the metrics flushes them.
        survivor.terminate()
        survivor.wait(timeout=120)
    except (TimeoutError, subprocess.TimeoutExpired) as exc:
        raise AssertionError("\n".join([str(exc), *(node.output()[-3000:] for node in nodes)])) from None
    finally:
        for node in nodes:
            node.cleanup()

    survivor_output = survivor.output()
    assert {w for _, w in steps(survivor_output)} == {1}, survivor_output[-4000:]
    [resumed_at] = [int(m[2]) for m in RESUMED_LINE.finditer(survivor_output)]
    run = FinishedRun(tmp_path, run_id, survivor_output)
    assert_every_tag_strictly_increasing(run.tensorboard_dir)
    world = series(run.tensorboard_dir, "elastic/world_size")
    last_step = world[-1][0]
    assert world == [(step, 2.0 if step <= resumed_at else 1.0) for step in range(1, last_step + 1)]
    events = dict(texts(run.tensorboard_dir, "events"))
    assert "World size changed from 2 to 1" in events.get(resumed_at + 1, ""), events
    [(_, recovery_s)] = series(run.tensorboard_dir, "elastic/recovery_s")
    print(f"scale-down: elastic/recovery_s = {recovery_s:.2f} s, resumed from step {resumed_at}")
