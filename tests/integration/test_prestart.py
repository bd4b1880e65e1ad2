"""Warm worker starts (elastic_ddp.prestart): a worker forked from its node's template behaves as a
process torchrun started itself -- its command line, directory, environment, streams, exit status
and signals -- and starts as usual whenever the template cannot serve it.

This test process plays the agent: it starts the template and then workers the way torchrun does
(``python -u SCRIPT ARGS``, the agent's environment plus the worker's variables). The last test runs
real torchrun agents through etcd and checks that a restarted worker is a fork of the template.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from elastic_ddp.prestart import ENV_SWITCH, Template
from elastic_ddp.prestart.template import PRELOAD_REST
from elastic_ddp.worker.stop import ENV_AGENT_PID
from tests.helpers.job import Job
from tests.helpers.nodes import cmdline, descendants, parent_pid, wait_for, worker_pids

# A worker that reports what it was forked with; "warm": every module the successor preloads is in, and
# inductor's probes (the successor's one call besides its imports) answered before the fork.
WORKER = f"PRELOAD_REST = {PRELOAD_REST!r}\n" + textwrap.dedent("""
    import json, os, signal, sys
    if "wait-for-sigterm" in sys.argv:
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))  # before the report the test waits for
    report = {
        "pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(), "name": __name__,
        "rank": os.environ.get("RANK"), "torch": "torch" in sys.modules, "warm": all(name.partition(":")[0] in sys.modules for name in PRELOAD_REST)
                 and sys.modules["torch._inductor.cpu_vec_isa"].valid_vec_isa_list.cache_info().currsize > 0,
        "path0": sys.path[0],
        "stdin": sys.stdin.readline().strip(),
    }
    print(json.dumps(report), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if "wait-for-sigterm" in sys.argv:
        import time
        time.sleep(60)
    if len(sys.argv) > 1 and sys.argv[1] == "sleep":
        import time
        time.sleep(60)
    if len(sys.argv) > 1 and sys.argv[1] == "kill-self":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(7 if "exit-7" in sys.argv else 0)
""")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    directory = tmp_path_factory.mktemp("agent")
    os.environ.pop("PYTEST_CURRENT_TEST", None)  # what the template sees as the agent's environment
    made = Template(str(directory))
    assert made.warm_up(120), "the template did not import what a worker of this library imports"
    try:
        yield made
    finally:
        made.close()
    assert not made.alive


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def start(template: Template | None, script: Path, *args: str, cwd: Path, **extra: str) -> subprocess.Popen:
    """A worker as torchrun starts one: ``python -u SCRIPT ARGS``, in a session of its own."""
    env = {**os.environ, ENV_AGENT_PID: str(os.getpid()), "RANK": "3", ENV_SWITCH: "1", **extra}
    env.pop("PYTEST_CURRENT_TEST", None)  # pytest changes it between the template's start and here
    if template is not None:
        env.update(template.environment())
    worker = subprocess.Popen([sys.executable, "-u", str(script), *args], cwd=cwd, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    worker.stdin.write("hello\n")
    worker.stdin.close()
    return worker


def finish(worker: subprocess.Popen) -> tuple[int, dict, str]:
    worker.stdin = None  # written and closed at the start
    out, err = worker.communicate(timeout=120)
    return worker.returncode, json.loads(out.splitlines()[0]), err


def _status_within(relay: subprocess.Popen, timeout: float, copy: int) -> int:
    """The relay's exit status; past ``timeout``, a failure that says where the relay and its copy
    were (a stop that never ends is what a lost signal looks like to torchrun)."""
    try:
        return relay.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        where = {"relay": _where(relay.pid), "copy": _where(copy)}
        for pid in (relay.pid, copy):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        relay.stdin = None  # written and closed at the start
        _, err = relay.communicate(timeout=30)
        pytest.fail(f"no exit within {timeout} s of the signal: {where}; stderr: {err[-3000:]}")


def _where(pid: int) -> str:
    """A process's state, thread count, kernel wait channel and system call, from /proc."""
    try:
        status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        syscall = Path(f"/proc/{pid}/syscall").read_text().split()[:1]
    except OSError:
        return "gone"
    return f"{status.get('State')}, {status.get('Threads')} threads, waits in {wchan or '-'}, syscall {syscall}"


def test_a_forked_worker_has_its_own_command_line_directory_environment_streams_and_status(template, script, tmp_path):
    cwd = tmp_path / "somewhere"
    cwd.mkdir()
    worker = start(template, script, "exit-7", "--b=c", cwd=cwd)
    code, report, err = finish(worker)
    assert "starts without" not in err and "Error in sitecustomize" not in err, err
    assert report["warm"] and report["ppid"] != os.getpid()  # a fork of the template, which imported the library
    assert report["pid"] != worker.pid
    assert code == 7
    assert report["argv"] == [str(script), "exit-7", "--b=c"] and report["name"] == "__main__"
    assert report["cwd"] == str(cwd) and report["path0"] == str(script.parent)
    assert report["rank"] == "3" and report["stdin"] == "hello"
    assert "to stderr" in err


def test_without_a_template_or_with_another_environment_a_worker_starts_as_usual(template, script, tmp_path):
    cases = {
        "no template": start(None, script, cwd=tmp_path),
        "another environment": start(template, script, cwd=tmp_path, SOME_LIBRARY_SETTING="1"),
        "not a direct child of the agent": start(template, script, cwd=tmp_path, **{ENV_AGENT_PID: "1"}),
    }
    for case, worker in cases.items():
        code, report, _ = finish(worker)
        assert code == 0 and report["pid"] == worker.pid and not report["torch"], case


def test_a_signal_to_the_relay_reaches_the_worker_and_a_kill_of_either_ends_both(template, script, tmp_path):
    # torchrun's SIGTERM goes to the worker's process group: the relay passes it on.
    worker = start(template, script, "wait-for-sigterm", cwd=tmp_path)
    report = json.loads(worker.stdout.readline())
    os.killpg(worker.pid, signal.SIGTERM)
    assert _status_within(worker, 60, report["pid"]) == 75
    # torchrun's SIGKILL (after its grace) ends the relay: the template kills the worker.
    worker = start(template, script, "sleep", cwd=tmp_path)
    report = json.loads(worker.stdout.readline())
    os.kill(worker.pid, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{report['pid']}").exists(), 30, what="the forked worker to be killed")
    # A worker that dies by a signal: its relay dies by the same one (and runs nothing itself).
    worker = start(template, script, "kill-self", cwd=tmp_path)
    worker.stdin = None  # written and closed at the start
    out, err = worker.communicate(timeout=60)
    assert worker.returncode == -signal.SIGKILL
    assert len(out.splitlines()) == 1 and "Error in sitecustomize" not in err, (out, err)


def test_a_template_serves_once_torch_is_in_and_a_successor_imports_the_rest_and_serves_in_its_place(script, tmp_path):
    # Three templates: one that forks a worker at once (a first formation), one its agent asks to
    # warm up (a node joining a running job), one left alone (an agent waiting for its peers).
    os.environ.pop("PYTEST_CURRENT_TEST", None)
    for directory in ("forked", "asked", "idle"):
        (tmp_path / directory).mkdir()
    templates = {name: Template(str(tmp_path / name)) for name in ("forked", "asked", "idle")}
    successors = []
    try:
        # A worker started while its template still imports torch waits for it and is forked by the
        # template itself: torch is in, the library left to the worker.
        assert not Path(templates["forked"].socket_path).exists()
        code, report, _ = finish(start(templates["forked"], script, cwd=tmp_path))
        assert code == 0 and report["torch"] and not report["warm"], report
        assert report["ppid"] == templates["forked"]._process.pid
        assert templates["asked"].warm_up(120)
        for name, made in templates.items():
            wait_for(lambda: Path(made.socket_path + ".warm").exists(), 120, what=f"the {name} template's successor")
            code, report, _ = finish(start(made, script, cwd=tmp_path))
            assert code == 0 and report["warm"], (name, report)
            # A fork of the successor, itself a fork of the template that stopped accepting.
            assert parent_pid(report["ppid"]) == made._process.pid, name
            successors.append(report["ppid"])
    finally:
        for made in templates.values():
            made.close()
    assert not any(made.alive for made in templates.values())
    # The successors die with their templates.
    wait_for(lambda: all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in successors), 30,
             what="the successors to die with their templates")  # fmt: skip
    assert not list(tmp_path.glob("*/prestart.sock*")), "a template's socket or marker was left behind"


def test_a_template_forks_only_from_a_safe_state():
    from elastic_ddp.prestart import template as template_module

    assert template_module.fork_hazard(template_module.thread_count()) is None
    stop = threading.Event()
    extra = threading.Thread(target=stop.wait)
    extra.start()
    try:
        hazard = template_module.fork_hazard(template_module.thread_count() - 1)
    finally:
        stop.set()
        extra.join()
    assert hazard is not None and "threads run in it" in hazard


@pytest.mark.slow
def test_under_torchrun_a_restarted_worker_is_forked_from_the_template_and_the_job_finishes(etcd_endpoint, tmp_path):
    job = Job(etcd_endpoint, tmp_path, nnodes="1", flags=["--train.max_steps=60", "--checkpoint.every_steps=10", "--data.ledger=true"])
    node = job.add_node()
    try:
        job.wait_for_step(15)
        job.wait_for_commit()
        # Its forks keep its command line; the template itself is the agent's child.
        [template_pid] = [p for p in descendants(node.pid) if b"prestart/template.py" in cmdline(p) and parent_pid(p) == node.pid]
        forked = worker_pids(node.pid)
        assert forked and all(parent_pid(p) == template_pid for p in forked)
        relays = [p for p in descendants(node.pid) if parent_pid(p) == node.pid and p != template_pid]
        os.kill(relays[0], signal.SIGKILL)  # the worker torchrun knows: the relay (and so its fork)
        wait_for(lambda: any(p not in forked for p in worker_pids(node.pid)), 120,
                 what="a restarted worker forked from the template")  # fmt: skip
        assert node.wait(timeout=240) == 0, node.output()[-4000:]
    finally:
        job.cleanup()
    assert job.restarts() == 1
    assert max(s for s, _ in job.progress()) == 60


def test_the_template_is_gone_with_its_agent(tmp_path):
    # A stand-in agent that starts a template and is then SIGKILLed: the template dies with it.
    agent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from elastic_ddp.prestart import Template
        t = Template({str(tmp_path)!r})
        print(t._process.pid, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    pid = int(agent.stdout.readline())
    # Serving means its imports are done, and it asked to die with its parent before them.
    wait_for(lambda: (tmp_path / "prestart.sock").exists(), 120, what="the template to serve")
    agent.kill()
    agent.wait()
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), 30, what="the template to die with its agent")


def _zombie(pid: int) -> bool:
    try:
        return "(Z)" in Path(f"/proc/{pid}/stat").read_text() or " Z " in Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
