"""Tests of elastic_ddp.worker.metrics: continuity across restarts, read back with TensorBoard itself."""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
import pytest
import yaml
from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.util import tensor_util

from elastic_ddp.config import Config, ConfigError, LoggingConfig
from elastic_ddp.worker.metrics import (
    _ProgressRecord,
    ENDED_EXIT_AT_STEP,
    ENDED_FINISHED,
    ENDED_MEMBERSHIP,
    ENDED_STOPPED,
    PROGRESS_FILE,
    Metrics,
    TensorBoardMetrics,
    console_line,
    create_metrics,
    summary_line,
)
from elastic_ddp.tools.tensorboard import add_parser, tensorboard_command
from tests.helpers.nodes import wait_for


class FakeClock:
    """Wall clock the test moves by hand."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_cfg(tmp_path, **overrides) -> LoggingConfig:
    values = {"tensorboard_dir": str(tmp_path / "tb"), "every_steps": 10, "console": False}
    values.update(overrides)
    return LoggingConfig(**values)


def start_attempt(tmp_path, *, resume_step=None, world_size=2, restart_count=0, clock=None, **cfg):
    return create_metrics(
        make_cfg(tmp_path, **cfg),
        rank=0,
        run_dir=str(tmp_path / "run"),
        resume_step=resume_step,
        world_size=world_size,
        restart_count=restart_count,
        max_steps=40,
        clock=clock or FakeClock(),
    )


def log_range(metrics: Metrics, steps: range, attempt: int) -> None:
    for step in steps:
        metrics.log_step(step, {"train/loss": attempt * 100 + step, "train/lr": 1e-3})


def read_back(tb_dir) -> EventAccumulator:
    """The scalars, read with TensorBoard's classic EventAccumulator.

    That reader purges scalars, images, ... but not tensors (where text lives), so texts are read
    with :func:`read_plugin`, the reader TensorBoard's own server uses.
    """
    # size_guidance 0 keeps every point instead of a reservoir sample.
    accumulator = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def read_plugin(tb_dir) -> plugin_event_accumulator.EventAccumulator:
    """Everything, read as TensorBoard's Python server does (scalars and text become tensors)."""
    accumulator = plugin_event_accumulator.EventAccumulator(
        str(tb_dir), size_guidance={"tensors": 0}, tensor_size_guidance={"tensors": 0}
    )
    accumulator.Reload()
    return accumulator


def texts(tb_dir, tag: str) -> list[tuple[int, str]]:
    return [
        (event.step, event.tensor_proto.string_val[0].decode())
        for event in read_plugin(tb_dir).Tensors(f"{tag}/text_summary")
    ]


def assert_every_tag_strictly_increasing(tb_dir) -> None:
    classic = read_back(tb_dir)
    for tag in classic.Tags()["scalars"]:
        steps = [event.step for event in classic.Scalars(tag)]
        assert steps == sorted(set(steps)), tag
    plugin = read_plugin(tb_dir)
    for tag in plugin.Tags()["tensors"]:
        steps = [event.step for event in plugin.Tensors(tag)]
        assert steps == sorted(set(steps)), tag


def test_resume_from_middle_purges_points_the_failed_attempt_logged_after_the_checkpoint(tmp_path):
    first = start_attempt(tmp_path)
    first.log_config("attempt: 1\n")
    log_range(first, range(1, 31), attempt=1)
    first.close()

    second = start_attempt(tmp_path, resume_step=20, restart_count=1)
    second.log_config("attempt: 2\n")
    second.event("Resumed from ckpt/step-20 (step 20)")
    log_range(second, range(21, 41), attempt=2)
    second.close()

    accumulator = read_back(tmp_path / "tb")
    loss = [(event.step, event.value) for event in accumulator.Scalars("train/loss")]
    assert [step for step, _ in loss] == list(range(1, 41))
    assert loss[:20] == [(step, 100.0 + step) for step in range(1, 21)]
    assert loss[20:] == [(step, 200.0 + step) for step in range(21, 41)]
    plugin_loss = [
        (event.step, float(tensor_util.make_ndarray(event.tensor_proto)))
        for event in read_plugin(tmp_path / "tb").Tensors("train/loss")
    ]
    assert plugin_loss == loss
    assert [step for step, _ in texts(tmp_path / "tb", "config")] == [1, 21]
    assert_every_tag_strictly_increasing(tmp_path / "tb")


def test_fresh_restart_purges_everything_an_attempt_without_checkpoint_logged(tmp_path):
    first = start_attempt(tmp_path)
    first.log_config("attempt: 1\n")
    log_range(first, range(1, 16), attempt=1)
    first.close()

    second = start_attempt(tmp_path, resume_step=None, restart_count=1)
    second.log_config("attempt: 2\n")
    log_range(second, range(1, 11), attempt=2)
    second.close()

    accumulator = read_back(tmp_path / "tb")
    loss = [(event.step, event.value) for event in accumulator.Scalars("train/loss")]
    assert loss == [(step, 200.0 + step) for step in range(1, 11)]
    assert texts(tmp_path / "tb", "config") == [(1, "```yaml\nattempt: 2\n\n```")]
    assert_every_tag_strictly_increasing(tmp_path / "tb")


def test_noop_twin_on_other_ranks_writes_nothing(tmp_path):
    metrics = create_metrics(
        make_cfg(tmp_path, console=True),
        rank=1,
        run_dir=str(tmp_path / "run"),
        resume_step=None,
        world_size=2,
        restart_count=0,
        max_steps=40,
    )
    assert type(metrics) is Metrics
    metrics.log_config("a: 1\n")
    metrics.event("Resumed from somewhere (step 3)")
    log_range(metrics, range(1, 11), attempt=1)
    assert metrics.summary() == ""
    metrics.close()
    metrics.close()
    assert list(tmp_path.iterdir()) == []


def test_should_log_is_the_same_on_every_rank_and_includes_the_attempts_first_step(tmp_path):
    fresh = Metrics(make_cfg(tmp_path), max_steps=35)
    assert [step for step in range(1, 36) if fresh.should_log(step)] == [1, 10, 20, 30, 35]
    other_rank = create_metrics(
        make_cfg(tmp_path), rank=1, run_dir=str(tmp_path / "run"), resume_step=20, world_size=2,
        restart_count=1, max_steps=40,
    )  # fmt: skip
    assert type(other_rank) is Metrics
    with start_attempt(tmp_path, resume_step=20) as rank0:
        assert isinstance(rank0, TensorBoardMetrics)
        # The loop all-reduces the loss at these steps: every rank must give the same answer.
        for metrics in (rank0, other_rank):
            assert [step for step in range(21, 41) if metrics.should_log(step)] == [21, 30, 40]


def test_restart_logs_recovery_time_world_size_change_and_events(tmp_path):
    clock = FakeClock(1000.0)
    first = start_attempt(tmp_path, world_size=4, restart_count=0, clock=clock)
    for step in (10, 20):
        clock.now += 5.0
        first.log_step(step, {"train/loss": 1.0})
    first.close()  # the failure; the last step logged was 20, at t=1010
    record = json.loads((tmp_path / "run" / PROGRESS_FILE).read_text())
    assert record["step"] == 20 and record["time"] == 1010.0 and record["world_size"] == 4

    clock.now = 1052.5
    second = start_attempt(tmp_path, resume_step=20, world_size=2, restart_count=1, clock=clock)
    second.event("Resumed from ckpt/step-20 (step 20)")
    second.log_step(21, {"train/loss": 0.9})
    clock.now += 5.0
    second.log_step(30, {"train/loss": 0.8})
    second.close()

    accumulator = read_back(tmp_path / "tb")
    recovery = [(event.step, event.value) for event in accumulator.Scalars("elastic/recovery_s")]
    assert recovery == [(21, pytest.approx(42.5))]
    world = [(event.step, event.value) for event in accumulator.Scalars("elastic/world_size")]
    assert world == [(10, 4.0), (20, 4.0), (21, 2.0), (30, 2.0)]
    restarts = [(event.step, event.value) for event in accumulator.Scalars("elastic/restart_count")]
    assert restarts == [(10, 0.0), (20, 0.0), (21, 1.0), (30, 1.0)]
    events = texts(tmp_path / "tb", "events")
    assert [step for step, _ in events] == [21]
    text = events[0][1]
    assert "World size changed from 4 to 2" in text
    assert "Resumed from ckpt/step-20 (step 20)" in text
    assert "Failure recovered after 42.5 s" in text


@pytest.mark.parametrize(
    "ended,event",
    [
        (ENDED_FINISHED, "Continuing the run, which ended at step 20; first step now: 21"),
        (ENDED_EXIT_AT_STEP, "Continuing the run, which ended at step 20; first step now: 21"),
        (ENDED_STOPPED, "Resumed 30.0 s after the stop at step 20; first step now: 21"),
        (ENDED_MEMBERSHIP, "Resumed 30.0 s after the stop at step 20; first step now: 21"),
        (None, "Failure recovered after 30.0 s (last step logged before: 20, first step logged now: 21)"),
    ],
    ids=["finished", "exit-at-step", "stopped", "membership", "failed"],
)
def test_the_next_attempt_says_how_the_previous_one_ended(tmp_path, ended, event):
    clock = FakeClock(1000.0)
    first = start_attempt(tmp_path, clock=clock)
    for step in (10, 20):
        clock.now += 5.0
        first.log_step(step, {"train/loss": 1.0})
    clock.now += 2.0  # the final checkpoint; the record keeps the time of the last step logged
    first.close(ended)
    record = json.loads((tmp_path / "run" / PROGRESS_FILE).read_text())
    assert (record["step"], record["time"], record.get("ended")) == (20, 1010.0, ended)

    clock.now = 1040.0
    second = start_attempt(tmp_path, resume_step=20, restart_count=0, clock=clock)
    second.log_step(21, {"train/loss": 0.9})
    second.close(ENDED_FINISHED)

    events = texts(tmp_path / "tb", "events")
    assert events == [(21, f"* {event}")]
    accumulator = read_back(tmp_path / "tb")
    if ended in (ENDED_FINISHED, ENDED_EXIT_AT_STEP):
        # A run that had ended was not recovering from anything: no recovery time.
        assert "elastic/recovery_s" not in accumulator.Tags()["scalars"]
    else:
        assert [(e.step, e.value) for e in accumulator.Scalars("elastic/recovery_s")] == [(21, 30.0)]


def test_an_attempt_that_ended_cleanly_is_followed_by_a_failure_recovery_after_a_crash(tmp_path):
    # The "ended" mark belongs to the attempt that wrote it: a crash after a clean continuation is a failure.
    clock = FakeClock(0.0)
    first = start_attempt(tmp_path, clock=clock)
    first.log_step(10, {"train/loss": 1.0})
    first.close(ENDED_FINISHED)
    crashed = start_attempt(tmp_path, resume_step=10, clock=clock)
    clock.now = 5.0
    crashed.log_step(11, {"train/loss": 1.0})
    crashed.close()  # no "ended": the process died
    assert "ended" not in json.loads((tmp_path / "run" / PROGRESS_FILE).read_text())
    clock.now = 12.0
    with start_attempt(tmp_path, resume_step=10, clock=clock) as third:
        third.log_step(11, {"train/loss": 1.0})
    events = texts(tmp_path / "tb", "events")
    assert events[-1] == (
        11, "* Failure recovered after 7.0 s (last step logged before: 11, first step logged now: 11)"
    )


def test_progress_record_lives_on_any_fsspec_store(tmp_path):
    run_dir = f"memory://metrics-test-{uuid.uuid4().hex}/run"
    clock = FakeClock(500.0)

    def attempt(world_size, resume_step):
        return create_metrics(
            make_cfg(tmp_path),
            rank=0,
            run_dir=run_dir,
            resume_step=resume_step,
            world_size=world_size,
            restart_count=0,
            max_steps=40,
            clock=clock,
        )

    with attempt(3, None) as first:
        first.log_step(10, {"train/loss": 1.0})
    fs, path = fsspec.core.url_to_fs(f"{run_dir}/{PROGRESS_FILE}")
    assert json.loads(fs.cat_file(path))["step"] == 10
    clock.now += 7.0
    with attempt(5, 10) as second:
        second.log_step(11, {"train/loss": 1.0})
    accumulator = read_back(tmp_path / "tb")
    assert [event.value for event in accumulator.Scalars("elastic/recovery_s")] == [7.0]
    assert "World size changed from 3 to 5" in texts(tmp_path / "tb", "events")[0][1]


def test_a_logged_step_is_one_event_holding_every_tag(tmp_path):
    # One serialization and one queued write per logged step, not one per tag.
    with start_attempt(tmp_path) as metrics:
        metrics.log_step(10, {"train/loss": 1.5, "train/lr": 1e-3, "perf/step_time_s": 0.25})
        metrics.log_step(20, {"train/loss": 1.25, "train/lr": 1e-3, "perf/step_time_s": 0.25})
    [event_file] = (tmp_path / "tb").glob("events.out.tfevents.*")
    scalar_events = [e for e in EventFileLoader(str(event_file)).Load() if e.HasField("summary")]
    assert [e.step for e in scalar_events] == [10, 20]
    tags = {"train/loss", "train/lr", "perf/step_time_s", "elastic/world_size", "elastic/restart_count"}
    assert all({value.tag for value in e.summary.value} == tags for e in scalar_events)
    assert [(e.step, e.value) for e in read_back(tmp_path / "tb").Scalars("train/loss")] == [(10, 1.5), (20, 1.25)]


def test_progress_record_is_rewritten_at_most_every_interval_and_its_newest_on_close(tmp_path):
    path = tmp_path / "run" / PROGRESS_FILE
    record = _ProgressRecord(str(tmp_path / "run"), None, min_interval_s=3600.0)
    record.put({"step": 1})
    wait_for(path.exists, 30, interval=0.01, what="the first record, written at once")
    assert json.loads(path.read_text()) == {"step": 1}
    record.put({"step": 2})
    record.put({"step": 3})
    time.sleep(0.3)  # nothing to wait for: within the interval nothing may be written (the thread keeps the newest)
    assert json.loads(path.read_text()) == {"step": 1}
    record.close()
    assert json.loads(path.read_text()) == {"step": 3}


def test_config_yaml_is_readable_back_as_text(tmp_path):
    config = Config()
    with start_attempt(tmp_path) as metrics:
        metrics.log_config(config.to_yaml())
    [(step, text)] = texts(tmp_path / "tb", "config")
    assert step == 1
    body = text.removeprefix("```yaml\n").removesuffix("\n```")
    assert yaml.safe_load(body) == yaml.safe_load(config.to_yaml())


def test_close_is_idempotent_flushes_events_and_ignores_later_calls(tmp_path):
    metrics = start_attempt(tmp_path)
    metrics.log_step(10, {"train/loss": 2.0})
    metrics.event("Checkpoint failed at step 10")  # pending: written by close()
    metrics.close()
    metrics.close()
    metrics.log_step(20, {"train/loss": 1.0})
    metrics.event("too late")
    accumulator = read_back(tmp_path / "tb")
    assert [event.step for event in accumulator.Scalars("train/loss")] == [10]
    assert texts(tmp_path / "tb", "events") == [(10, "* Checkpoint failed at step 10")]


def test_an_exception_leaving_the_process_still_flushes_the_events(tmp_path):
    # flush_s is far beyond the process's life: only the atexit close can write the points.
    script = f"""
from elastic_ddp.config import LoggingConfig
from elastic_ddp.worker.metrics import create_metrics
metrics = create_metrics(
    LoggingConfig(tensorboard_dir={str(tmp_path / "tb")!r}, flush_s=3600, console=False),
    rank=0, run_dir={str(tmp_path / "run")!r}, resume_step=None, world_size=1,
    restart_count=0, max_steps=10,
)
for step in range(1, 6):
    metrics.log_step(step, {{"train/loss": float(step)}})
raise RuntimeError("the training loop failed")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "the training loop failed" in result.stderr
    steps = [event.step for event in read_back(tmp_path / "tb").Scalars("train/loss")]
    assert steps == [1, 2, 3, 4, 5]
    assert json.loads((tmp_path / "run" / PROGRESS_FILE).read_text())["step"] == 5


@pytest.mark.parametrize("rank", [0, 1])
def test_a_url_as_tensorboard_dir_is_refused_on_every_rank(tmp_path, rank):
    with pytest.raises(ConfigError, match="logging.tensorboard_dir"):
        create_metrics(
            LoggingConfig(tensorboard_dir="s3://bucket/tb"),
            rank=rank,
            run_dir=str(tmp_path),
            resume_step=None,
            world_size=1,
            restart_count=0,
            max_steps=10,
        )


def test_console_prints_greppable_lines_at_every_n_steps_and_the_first(tmp_path, capsys):
    clock = FakeClock(0.0)
    with start_attempt(tmp_path, resume_step=20, world_size=4, clock=clock, console=True) as metrics:
        for step in range(21, 41):
            clock.now += 2.0
            metrics.log_step(step, {"train/loss": 1.5, "perf/samples_per_s": 64.0})
        assert metrics.summary().startswith("[rank0] finished: steps=40/40 final_loss=1.5000")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[:3]] == ["step=21/40", "step=30/40", "step=40/40"]
    assert "loss=1.5000 samples_per_s=64.0 world_size=4" in lines[1]
    assert lines[1].endswith("eta=0:00:20")  # 9 steps in 18 s, 10 steps to go


def test_console_line_is_a_pure_function_of_its_inputs():
    line = console_line(
        rank=0,
        step=30,
        max_steps=300,
        scalars={"train/loss": 2.34567, "perf/samples_per_s": 1234.56},
        world_size=4,
        rate_origin=(21, 100.0),
        now=118.0,
    )
    assert line == "[rank0] step=30/300 loss=2.3457 samples_per_s=1234.6 world_size=4 eta=0:09:00"
    first = console_line(
        rank=0, step=21, max_steps=300, scalars={"perf/step_time_s": 0.5},
        world_size=2, rate_origin=(21, 100.0), now=100.0,
    )
    assert first == "[rank0] step=21/300 world_size=2 eta=0:02:20"
    assert console_line(
        rank=0, step=5, max_steps=10, scalars={}, world_size=1, rate_origin=None, now=0.0
    ).endswith("eta=-")


def test_summary_line_reports_steps_loss_wall_time_and_restarts():
    line = summary_line(
        rank=0, step=300, max_steps=300, final_loss=1.23456,
        wall_s=3725.0, attempt_wall_s=65.0, restarts=2,
    )  # fmt: skip
    assert line == (
        "[rank0] finished: steps=300/300 final_loss=1.2346 wall=1:02:05 attempt_wall=0:01:05 restarts=2"
    )
    assert summary_line(
        rank=3, step=None, max_steps=10, final_loss=None, wall_s=0.0, attempt_wall_s=0.0, restarts=0
    ) == "[rank3] finished: steps=-/10 final_loss=- wall=0:00:00 attempt_wall=0:00:00 restarts=0"


@pytest.mark.parametrize(
    "ended,text",
    [
        (ENDED_FINISHED, "finished"),
        (ENDED_EXIT_AT_STEP, "exited at train.exit_at_step (checkpoint committed)"),
        (ENDED_STOPPED, "stopped on request (checkpoint committed)"),
        (ENDED_MEMBERSHIP, "paused for a membership change (checkpoint committed; restarting)"),
    ],
)
def test_summary_line_says_how_the_attempt_ended(ended, text):
    line = summary_line(
        rank=0, step=120, max_steps=300, final_loss=0.5, wall_s=60.0, attempt_wall_s=30.0, restarts=1, ended=ended
    )
    assert line == f"[rank0] {text}: steps=120/300 final_loss=0.5000 wall=0:01:00 attempt_wall=0:00:30 restarts=1"


def test_summary_of_an_attempt_says_how_it_ended(tmp_path):
    with start_attempt(tmp_path) as metrics:
        metrics.log_step(10, {"train/loss": 2.0})
        summary = metrics.summary(ENDED_STOPPED)
        assert summary.startswith("[rank0] stopped on request (checkpoint committed): steps=10/40")


def test_summary_counts_restarts_of_attempts_that_never_logged_and_of_earlier_jobs(tmp_path):
    with start_attempt(tmp_path, restart_count=0) as first:
        first.log_step(10, {"train/loss": 1.0})
    # torchrun's restart 1 failed before it created its metrics; restart 2 is the next to log.
    with start_attempt(tmp_path, resume_step=10, restart_count=2) as third:
        third.log_step(11, {"train/loss": 1.0})
        assert third.summary().endswith(" restarts=2")
    # The job resubmitted: torchrun counts from 0 again, the progress record knows 2 attempts.
    with start_attempt(tmp_path, resume_step=11, restart_count=0) as resubmitted:
        resubmitted.log_step(12, {"train/loss": 1.0})
        assert resubmitted.summary().endswith(" restarts=2")


def test_tensorboard_subcommand_is_registered_with_defaults():
    parser = argparse.ArgumentParser(prog="elastic-ddp")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tensorboard"])
    assert (args.runs, args.port, args.host) == ("runs", 6006, "127.0.0.1")
    args = parser.parse_args(["tensorboard", "--runs", "/r", "--port", "7000", "--host", "0.0.0.0"])
    assert tensorboard_command(args)[1:] == [
        "-m", "tensorboard.main", "--logdir", "/r", "--port", "7000", "--host", "0.0.0.0",
    ]
    assert callable(args.func)


# --- TensorBoard's own server ------------------------------------------------------------


@pytest.fixture(scope="module")
def restarted_run(tmp_path_factory):
    """A run dir with "log 1..30, restart with resume_step=20, log 21..40"."""
    root = tmp_path_factory.mktemp("tbserve")
    first = start_attempt(root)
    first.log_config("attempt: 1\n")
    log_range(first, range(1, 26), attempt=1)
    first.event("Logged by the failed attempt after its last checkpoint")  # written at step 26
    log_range(first, range(26, 31), attempt=1)
    first.close()
    second = start_attempt(root, resume_step=20, restart_count=1)
    second.log_config("attempt: 2\n")
    log_range(second, range(21, 41), attempt=2)
    second.close()
    return root


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def tensorboard_server(logdir, load_fast: str) -> Iterator[Callable[[str, dict[str, str]], Any]]:
    """TensorBoard serving ``logdir`` on a free port; yields ``get(route, query)`` -> parsed JSON.

    ``get`` raises ``urllib.error.URLError`` or ``ConnectionError`` while the server is not
    listening or lacks the data asked for, and fails the test if the server has exited.
    """
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
         "--port", str(port), "--host", "127.0.0.1", f"--load_fast={load_fast}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip

    def get(route: str, query: dict[str, str]) -> Any:
        assert process.poll() is None, process.stderr.read().decode()
        url = f"http://127.0.0.1:{port}/data/plugin/{route}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())

    try:
        yield get
    finally:
        process.kill()
        process.wait(timeout=10)
        process.stderr.close()


def fetch_when_served(fetch: Callable[[], dict[str, Any]], done: Callable[[dict[str, Any]], bool],
                      timeout: float = 60.0) -> dict[str, Any]:
    """Call ``fetch`` until ``done(result)`` or ``timeout`` s; the last complete result (or {}).

    A server still starting or still loading the event files answers with connection or HTTP
    errors; those count as "not yet". The caller asserts on what it got, so a server that never
    serves the data fails there with the data in the message.
    """
    deadline = time.monotonic() + timeout
    result: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            result = fetch()
            if done(result):
                break
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)  # poll interval, bounded by the deadline
    return result


# Both of TensorBoard's loaders: the Rust data server (default when installed) and the Python
# one (--load_fast=false, and the fallback without tensorboard-data-server). They purge
# differently: the Python one ignores the first session START of a run.
@pytest.mark.parametrize("load_fast", ["true", "false"])
def test_tensorboard_server_serves_unique_increasing_steps(restarted_run, load_fast):
    with tensorboard_server(restarted_run, load_fast) as get:

        def fetch() -> dict[str, Any]:
            tags = get("scalars/tags", {}).get("tb", {})
            return {
                "tags": tags,
                "loss": get("scalars/scalars", {"run": "tb", "tag": "train/loss"}),
                "config": get("text/text", {"run": "tb", "tag": "config/text_summary"}),
                "events": get("text/text", {"run": "tb", "tag": "events/text_summary"}),
            }

        served = fetch_when_served(
            fetch, lambda got: len(got["loss"]) >= 40 and len(got["config"]) >= 2 and got["events"]
        )
    assert served, "TensorBoard never served the run's train/loss, config and events"
    # Each point is [wall_time, step, value].
    assert [step for _, step, _ in served["loss"]] == list(range(1, 41))
    assert [value for _, _, value in served["loss"]] == (
        [100.0 + step for step in range(1, 21)] + [200.0 + step for step in range(21, 41)]
    )
    assert {"elastic/world_size", "elastic/restart_count", "elastic/recovery_s"} <= set(served["tags"])
    assert [entry["step"] for entry in served["config"]] == [1, 21]
    # The failed attempt's event at step 26 is purged; the recovery event at 21 stays.
    assert [entry["step"] for entry in served["events"]] == [21]
    assert "Failure recovered" in served["events"][0]["text"]
