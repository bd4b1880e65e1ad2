"""How a worker stops: a stop signal that repeated signals cannot turn into a kill, a grace period
that bounds a stuck stop, an agreement that all ranks reach at the same step, a survivor's wait for
its restart, and the exit of a worker whose agent is gone."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import types

import pytest

from elastic_ddp.tools.etcd_server import free_port
from elastic_ddp.worker.stop import (
    ENV_AGENT_PID,
    ENV_SETTINGS_ERROR_DIR,
    EXIT_NOT_RESTARTED,
    EXIT_ORPHANED,
    EXIT_STOPPED,
    EXIT_STOP_TIMEOUT,
    MAX_STEPS_BETWEEN_AGREEMENTS,
    StopAgreement,
    StopSignal,
    clear_restart_marks,
    members_gone,
    nodes_joining,
    read_settings_error,
    report_members_gone,
    report_nodes_joining,
    report_settings_error,
    steps_between,
    wait_for_restart,
)
from tests.helpers.nodes import wait_for
from tests.helpers.ranks import run_ranks


def python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def stop_signal():
    """A StopSignal for SIGTERM and SIGINT in this process, in its training-loop phase (before it, a
    signal would end the process), without a grace timer (which would end it too)."""
    stop = StopSignal()
    stop.steps_started()
    yield stop
    stop.restore()


# --- StopSignal ------------------------------------------------------------------------------


def test_a_second_and_third_sigterm_while_stopping_are_logged_and_ignored(stop_signal, caplog):
    caplog.set_level(logging.WARNING, logger="elastic_ddp.worker.stop")
    assert not stop_signal.requested
    # On Linux a signal a process sends itself is handled before os.kill returns.
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop_signal.requested and stop_signal.received == signal.SIGTERM
    first_at = stop_signal.received_at
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    # Still here, still stopping, the first signal's record unchanged.
    assert stop_signal.requested and stop_signal.repeats == 2
    assert (stop_signal.received, stop_signal.received_at) == (signal.SIGTERM, first_at)
    repeats = [r.getMessage() for r in caplog.records if "received again" in r.getMessage()]
    assert repeats == ["Signal SIGTERM received again while stopping; the stop checkpoint goes on."] * 2


def test_ctrl_c_is_a_stop_request_too_and_a_later_sigterm_does_not_replace_it(stop_signal):
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop_signal.received == signal.SIGINT and stop_signal.repeats == 1


def test_restore_puts_back_the_previous_handlers_and_wakeup_fd_and_ends_its_thread():
    before = signal.getsignal(signal.SIGTERM)
    threads = set(threading.enumerate())
    stop = StopSignal(signals=(signal.SIGTERM,))
    assert signal.getsignal(signal.SIGTERM) == stop._handle
    stop.restore()
    assert signal.getsignal(signal.SIGTERM) == before
    assert signal.set_wakeup_fd(-1) == -1  # none was set before the StopSignal
    assert [t for t in threading.enumerate() if t not in threads] == []


def test_a_stop_that_does_not_finish_within_the_grace_period_exits_with_its_own_status():
    result = python("""
        import logging, os, signal, threading
        from elastic_ddp.worker.stop import StopSignal
        logging.basicConfig(level=logging.INFO)
        stop = StopSignal(grace_s=0.2)
        stop.steps_started()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a repeat does not kill it
        print("stopping", stop.requested, stop.repeats, flush=True)
        threading.Event().wait(100)  # a rank stuck where it cannot reach a step boundary
        print("still running", flush=True)
    """)
    assert result.returncode == EXIT_STOP_TIMEOUT, result.stderr
    assert result.stdout.splitlines() == ["stopping True 1"]
    assert "has not finished its stop at a step boundary; exiting" in result.stderr
    # Where it was stuck: every thread's stack, the main thread's at the wait above (line 10).
    assert "(most recent call first)" in result.stderr, result.stderr
    assert 'File "<string>", line 10 in <module>' in result.stderr, result.stderr


# The main thread waits in C++ (as in a collective whose peer is gone), where no Python signal
# handler runs until the call returns; the signal comes from another thread once it waits.
_BLOCKED_IN_CPP = """
    import datetime, logging, os, signal, sys, threading
    import torch.distributed as dist
    from elastic_ddp.worker.stop import StopSignal, report_members_gone
    logging.basicConfig(level=logging.INFO)
    if sys.argv[1] == "gone":
        report_members_gone(os.environ["ELASTIC_DDP_SETTINGS_ERROR_DIR"], "1 node(s) left round 7")
    stop = StopSignal(grace_s=float(sys.argv[2]))
    stop.steps_started()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=100))
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    store.wait(["never"])
    print("still running", flush=True)
"""


@pytest.mark.parametrize(
    ("case", "grace_s", "status", "says"),
    [
        ("gone", "600", EXIT_STOPPED, "because 1 node(s) left round 7; this rank waits on a peer that is gone"),
        ("preempted", "2", EXIT_STOP_TIMEOUT, "has not finished its stop at a step boundary; exiting"),
    ],
)
def test_a_rank_blocked_in_cpp_when_signalled_leaves_after_its_grace_short_when_nodes_of_its_round_are_gone(
    tmp_path, monkeypatch, case, grace_s, status, says
):
    monkeypatch.setenv(ENV_SETTINGS_ERROR_DIR, str(tmp_path))
    result = python(_BLOCKED_IN_CPP, case, grace_s, timeout=60)
    assert result.returncode == status, result.stderr
    assert result.stdout == ""
    assert says in result.stderr
    # A stop that timed out shows where each thread was; a rank leaving a gone peer does not.
    assert ("(most recent call first)" in result.stderr) == (case == "preempted"), result.stderr


def test_the_agents_marks_are_read_until_it_clears_them_for_the_next_workers(tmp_path):
    assert members_gone(str(tmp_path)) is None and members_gone("") is None
    assert nodes_joining(str(tmp_path)) is None and nodes_joining("") is None
    report_members_gone(str(tmp_path), "2 node(s) left round 3")
    report_nodes_joining(str(tmp_path), "round 4 was opened after round 3")
    assert members_gone(str(tmp_path)) == "2 node(s) left round 3"
    assert nodes_joining(str(tmp_path)) == "round 4 was opened after round 3"
    clear_restart_marks(str(tmp_path))
    assert members_gone(str(tmp_path)) is None and nodes_joining(str(tmp_path)) is None
    clear_restart_marks(str(tmp_path))  # idempotent


def test_a_signal_is_for_a_join_only_when_the_agent_marked_it_so_before_signalling(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_SETTINGS_ERROR_DIR, str(tmp_path))
    for marked in (False, True):
        if marked:
            report_nodes_joining(str(tmp_path), "round 2 was opened after round 1")
        stop = StopSignal()
        stop.steps_started()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested
            assert stop.for_join == ("round 2 was opened after round 1" if marked else None)
        finally:
            stop.restore()


def test_before_the_training_loop_a_signal_ends_the_process_at_once_with_the_stop_status():
    result = python("""
        import os, signal, threading
        from elastic_ddp.worker.stop import StopSignal
        stop = StopSignal(grace_s=60)  # resuming, say: no step yet, so nothing to save
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(100)
        print("still running", flush=True)
    """, timeout=60)
    assert result.returncode == EXIT_STOPPED, result.stderr
    assert result.stdout == ""
    expected = f"Signal SIGTERM received before training started: nothing to save yet; exiting with status {EXIT_STOPPED}."
    assert expected in result.stderr


def test_a_forked_child_is_ended_by_sigterm_as_without_the_stop_signal():
    # A pool's terminate() SIGTERMs workers that may be blocked on its queue's lock, then joins them:
    # a child that kept the parent's handler would only note the signal, and the join would never end.
    result = python("""
        import os, signal
        from elastic_ddp.worker.stop import StopSignal
        stop = StopSignal()
        stop.steps_started()  # in the parent a signal now only asks for a stop
        ready, ready_write = os.pipe()
        child = os.fork()
        if child == 0:
            os.write(ready_write, b"1")  # past the fork's own hooks, as a pool's worker waiting for work
            signal.pause()  # an inherited handler would note the signal and return here
            os._exit(0)
        os.read(ready, 1)
        os.kill(child, signal.SIGTERM)
        _, status = os.waitpid(child, 0)
        print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, stop.requested, flush=True)
        stop.restore()
    """, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"], result.stdout + result.stderr


def test_a_signal_to_a_forked_child_before_the_training_loop_does_not_end_the_parent():
    result = python("""
        import multiprocessing
        from elastic_ddp.worker.stop import StopSignal
        stop = StopSignal()
        # A pool made before the loop (data preparation); leaving the block SIGTERMs its workers.
        with multiprocessing.get_context("fork").Pool(2) as pool:
            assert pool.map(abs, [-1, -2]) == [1, 2]
        # The watcher reads the pipe in order: a byte from the children would end this process
        # before the one restore() writes to wake it.
        stop.restore()
        print("alive", flush=True)
    """, timeout=60)
    assert (result.returncode, result.stdout) == (0, "alive\n"), result.stderr


# A worker of a world of two whose peer never comes: init_process_group waits for it in C++.
_LONELY_WORKER = """
import elastic_ddp as edp
edp.launch(lambda run: None)
"""


def test_a_worker_waiting_for_its_peers_in_process_group_setup_stops_at_once_on_sigterm(tmp_path):
    port = free_port()
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
    worker = subprocess.Popen([sys.executable, "-c", _LONELY_WORKER, f"--run.root={tmp_path}"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        # Rank 0 hosts the store at MASTER_PORT: once it accepts, the worker waits for rank 1.
        wait_for(lambda: worker.poll() is not None or _accepts(port), 120, what="the worker's store")
        assert worker.poll() is None, worker.stdout.read()
        worker.send_signal(signal.SIGTERM)
        # torchrun gives a worker 30 s before SIGKILL; before this fix the worker used all of them.
        code = worker.wait(timeout=15)
        output = worker.stdout.read()
    finally:
        worker.kill()
        worker.wait()
    assert code == EXIT_STOPPED, output
    assert "received before training started" in output


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


# --- StopAgreement ---------------------------------------------------------------------------


def test_without_a_group_the_agreement_reads_the_flag_directly():
    flag = types.SimpleNamespace(requested=False, for_join=None)
    agreement = StopAgreement(flag, group=None)
    assert agreement.after_step() is False
    flag.requested = True
    assert agreement.after_step() is True
    agreement.close()


_AGREEMENT_WORKER = """
import json, sys, types
import torch
import torch.distributed as dist
from elastic_ddp.worker.stop import StopAgreement

rank, store_path, scenarios = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
group = dist.new_group(backend="gloo")
results = []
for flag_rank, k in scenarios:
    flag = types.SimpleNamespace(requested=False, for_join=None)
    agreement = StopAgreement(flag, group)
    agreed = []
    for step in range(1, k + 2):
        if rank == flag_rank and step == k:
            flag.requested = True  # the signal arrives before step k's work
        gradient = torch.ones(1)
        dist.all_reduce(gradient)  # the step's own collective, on the default group
        agreed.append(agreement.after_step())
    agreement.close()
    results.append(agreed)
print(json.dumps(results), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_flag_set_on_one_rank_before_step_k_is_agreed_by_both_ranks_after_step_k_plus_1(tmp_path):
    scenarios = [[1, 3], [0, 1], [1, 5]]  # (rank that is signalled, step k)
    for rank in run_ranks(tmp_path, _AGREEMENT_WORKER, 2, json.dumps(scenarios)):
        # Not at step k (the all-reduce holding the flag is still in flight), at step k + 1 on both.
        assert json.loads(rank.stdout) == [[False] * k + [True] for _, k in scenarios]


def test_without_a_group_a_stop_needs_the_durable_tier_unless_it_is_for_a_join():
    flag = types.SimpleNamespace(requested=True, for_join="round 2 was opened after round 1")
    agreement = StopAgreement(flag, group=None)
    assert agreement.after_step() is True and agreement.durable is False
    flag.for_join = None  # a preemption
    assert agreement.after_step() is True and agreement.durable is True


_DURABLE_WORKER = """
import json, sys, types
import torch.distributed as dist
from elastic_ddp.worker.stop import StopAgreement

rank, store_path, scenarios = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
dist.init_process_group("gloo", store=dist.FileStore(store_path, 3), rank=rank, world_size=3)
group = dist.new_group(backend="gloo")
results = []
for signals in scenarios:  # {rank: "join" | "outside"}, all arriving before step 2's work
    flag = types.SimpleNamespace(requested=False, for_join=None)
    agreement = StopAgreement(flag, group)
    for step in range(1, 4):
        kind = signals.get(str(rank))
        if kind and step == 2:
            flag.requested, flag.for_join = True, ("round 2 was opened after round 1" if kind == "join" else None)
        if agreement.after_step():
            results.append([step, agreement.durable])
            break
    agreement.close()
print(json.dumps(results), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_three_ranks_agree_a_stop_needs_no_durable_tier_only_when_every_signalled_rank_was_stopped_for_a_join(tmp_path):
    scenarios = [
        {"0": "join"},  # one node's agent saw the join first; the others' signals are still on their way
        {"0": "join", "2": "join"},
        {"0": "join", "1": "outside"},  # a preemption at the same step: storage after all
        {"2": "outside"},
    ]
    for rank in run_ranks(tmp_path, _DURABLE_WORKER, 3, json.dumps(scenarios)):
        assert json.loads(rank.stdout) == [[3, False], [3, False], [3, True], [3, True]]


def test_without_a_group_the_values_are_agreed_as_passed():
    agreement = StopAgreement(types.SimpleNamespace(requested=False, for_join=None), group=None, values=2)
    assert agreement.agreed is None
    assert agreement.after_step(lambda: (0.5, 2.0)) is False
    assert agreement.agreed == (0.5, 2.0)
    with pytest.raises(ValueError, match="made for 2 value"):
        agreement.after_step(lambda: (1.0,))


_VALUES_WORKER = """
import json, sys, types
import torch.distributed as dist
from elastic_ddp.worker.stop import StopAgreement

rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
group = dist.new_group(backend="gloo")
agreement = StopAgreement(types.SimpleNamespace(requested=False, for_join=None), group, values=2)
seen = []
for step in range(1, 5):
    # rank 0 reports a large first value, rank 1 a large second one; both change per step
    mine = (10.0 * step, 1.0) if rank == 0 else (1.0, 100.0 * step)
    stop = agreement.after_step(lambda: mine)
    seen.append([stop, None if agreement.agreed is None else list(agreement.agreed)])
agreement.close()
print(json.dumps(seen), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_values_ride_on_the_agreement_and_every_rank_sees_the_maxima_one_step_later(tmp_path):
    expected = [[False, None]] + [[False, [10.0 * (step - 1), 100.0 * (step - 1)]] for step in range(2, 5)]
    for rank in run_ranks(tmp_path, _VALUES_WORKER, 2):
        assert json.loads(rank.stdout) == expected



_PERIOD_WORKER = """
import json, sys, types
import torch.distributed as dist
from elastic_ddp.worker.stop import StopAgreement

rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 3), rank=rank, world_size=3)
group = dist.new_group(backend="gloo")
now = [0.0]
step_s = [0.1, 0.25, 0.2][rank]  # the ranks' own step times; the slowest sets the pace for all
flag = types.SimpleNamespace(requested=False, for_join=None)
agreement = StopAgreement(flag, group, values=1, period_s=1.0, clock=lambda: now[0])
reports, agreed_at, stopped_at = [], [], None
for step in range(1, 30):
    now[0] += step_s
    if rank == 2 and step == 8:
        flag.requested = True  # the signal arrives during step 8
    def report(step=step):
        reports.append(step)
        return (float(step),)
    if agreement.after_step(report):
        stopped_at = step
        break
    if agreement.agreed is not None:
        agreed_at.append([step, agreement.agreed[0]])
agreement.close()
print(json.dumps({"reports": reports, "agreed": agreed_at, "stopped": stopped_at}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_with_a_period_every_rank_agrees_at_the_same_steps_paced_by_the_slowest_rank(tmp_path):
    # Agreements after steps 1, 2 and 3 (no step time agreed before the one of step 3), then every
    # 1.0 s / 0.25 s = 4 steps: 7, 11, 15. Each reads what the one before started; the signal of step 8
    # rides on the all-reduce started after step 11 and stops every rank after step 15.
    for rank in run_ranks(tmp_path, _PERIOD_WORKER, 3):
        seen = json.loads(rank.stdout)
        assert seen == {"reports": [1, 2, 3, 7, 11], "agreed": [[2, 1.0], [3, 2.0], [7, 3.0], [11, 7.0]], "stopped": 15}


@pytest.mark.parametrize(
    ("period_s", "step_s", "expected"),
    [(0.0, 0.05, 1), (1.0, 0.0, 1), (1.0, 2.0, 1), (1.0, 0.05, 20), (1.0, 0.3, 3), (1.0, 1e-6, MAX_STEPS_BETWEEN_AGREEMENTS)],
)
def test_the_steps_between_agreements_are_a_period_of_steps_within_bounds(period_s, step_s, expected):
    assert steps_between(period_s, step_s) == expected


# --- after the stop checkpoint ---------------------------------------------------------------


def test_a_signalled_rank_leaves_at_once_with_the_stop_status(stop_signal):
    os.kill(os.getpid(), signal.SIGTERM)
    assert wait_for_restart(stop_signal, timeout_s=3600) == EXIT_STOPPED


def test_a_survivor_leaves_when_its_agent_signals_the_restart(stop_signal):
    # The agent's SIGTERM comes while the survivor waits; without it the wait would last an hour.
    sender = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
    sender.start()
    try:
        assert wait_for_restart(stop_signal, timeout_s=3600) == EXIT_STOPPED
    finally:
        sender.cancel()
    assert stop_signal.requested


def test_a_survivor_that_is_never_restarted_leaves_with_an_error(stop_signal, caplog):
    assert wait_for_restart(stop_signal, timeout_s=0.01) == EXIT_NOT_RESTARTED
    assert "No restart within" in caplog.text


# --- orphaned workers ------------------------------------------------------------------------

_WORKER = """
import threading
from elastic_ddp.worker.stop import exit_when_orphaned
exit_when_orphaned(poll_s=0.05)
print("watching", flush=True)
threading.Event().wait(100)
"""

_AGENT = f"""
import os, subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", {_WORKER!r}], stdout=subprocess.PIPE, text=True)
assert worker.stdout.readline() == "watching\\n"
print(worker.pid, flush=True)
os._exit(0)  # the agent dies without a word to its worker
"""

# Adopts orphans (Linux's PR_SET_CHILD_SUBREAPER), so it can read the orphaned worker's exit status.
_SUPERVISOR = f"""
import ctypes, os, subprocess, sys
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
agent = subprocess.Popen([sys.executable, "-c", {_AGENT!r}], stdout=subprocess.PIPE, text=True)
worker = int(agent.stdout.readline())
agent.wait()
_, status = os.waitpid(worker, 0)
print(os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="adopting orphans needs Linux's subreaper")
def test_a_worker_whose_agent_dies_exits_by_itself_with_the_orphan_status():
    result = python(_SUPERVISOR)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(EXIT_ORPHANED), result.stderr
    assert "is gone; exiting this orphaned worker" in result.stderr


def test_a_settings_error_is_reported_only_to_the_agent_that_started_this_process(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_SETTINGS_ERROR_DIR, raising=False)
    assert not report_settings_error("bad")  # no agent with this package's handler: nothing to tell
    monkeypatch.setenv(ENV_SETTINGS_ERROR_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_AGENT_PID, str(os.getppid() + 1))  # the variables were inherited from elsewhere
    assert not report_settings_error("bad") and read_settings_error(str(tmp_path)) is None
    monkeypatch.setenv(ENV_AGENT_PID, str(os.getppid()))
    assert report_settings_error("train.x: unknown setting")
    assert read_settings_error(str(tmp_path)) == "train.x: unknown setting"
    assert [p.name for p in tmp_path.iterdir()] == ["settings-error.txt"]  # written whole, then renamed
