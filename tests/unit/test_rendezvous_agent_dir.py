"""The agent's directory: marked as its agent's, and removed by a later agent once that one is gone."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from elastic_ddp.processes import process_mark
from elastic_ddp.rendezvous.agent_dir import PREFIX, create_agent_dir, remove_dirs_of_gone_agents


@pytest.fixture
def temp(monkeypatch):
    """The temp directory the agent directories go to, empty and this test's own (a short path, as a
    temp directory must be for the sockets in them: pytest's own are often too long)."""
    path = Path(tempfile.mkdtemp(prefix="edp-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _agent_dir(parent, name: str, mark: str | None):
    path = parent / f"{PREFIX}{name}"
    path.mkdir()
    (path / "leaving.sock").write_bytes(b"")
    if mark is not None:
        (path / "owner").write_text(mark)
    return path


def _here(mark: str) -> str:
    """An owner mark of a process on this host, in this PID namespace."""
    return f"{socket.gethostname()} {os.readlink('/proc/self/ns/pid')}\n{mark}"


def _mark_of_a_process_that_ended() -> str:
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        mark = process_mark(child.pid)
    finally:
        child.kill()
        child.wait()
    assert mark is not None
    return mark


def test_a_new_agent_directory_is_in_the_temp_directory_and_marked_with_this_process(temp):
    path = create_agent_dir()
    assert os.path.dirname(path) == str(temp) and os.path.basename(path).startswith(PREFIX)
    assert open(os.path.join(path, "owner")).read() == _here(process_mark(os.getpid()))
    assert sorted(os.listdir(path)) == ["owner"]


def test_the_directory_of_an_agent_that_is_gone_is_removed_and_a_live_ones_kept(temp):
    gone = _agent_dir(temp, "gone", _here(_mark_of_a_process_that_ended()))
    live = _agent_dir(temp, "live", _here(process_mark(os.getpid())))
    assert remove_dirs_of_gone_agents(str(temp)) == 1
    assert not gone.exists() and live.exists()


def test_a_reused_pid_does_not_pass_for_the_agent_that_had_it(temp):
    # This process's pid with another start time: the agent that had the pid is gone.
    pid, started = process_mark(os.getpid()).split("-")
    reused = _agent_dir(temp, "reused", _here(f"{pid}-{int(started) - 1}"))
    assert remove_dirs_of_gone_agents(str(temp)) == 1
    assert not reused.exists()


def test_unmarked_directories_other_hosts_or_containers_and_other_names_are_left_alone(temp):
    unmarked = _agent_dir(temp, "unmarked", None)  # being created, or from before the marks
    garbled = _agent_dir(temp, "garbled", _here("not a mark"))
    gone_mark = _mark_of_a_process_that_ended()
    namespace = os.readlink("/proc/self/ns/pid")
    other_host = _agent_dir(temp, "other-host", f"another-{socket.gethostname()} {namespace}\n{gone_mark}")
    other_container = _agent_dir(temp, "other-container", f"{socket.gethostname()} pid:[1]\n{gone_mark}")
    other_prefix = temp / "someone-else-gone"
    other_prefix.mkdir()
    (other_prefix / "owner").write_text(_here(_mark_of_a_process_that_ended()))
    plain_file = temp / f"{PREFIX}file"
    plain_file.write_text("x")
    assert remove_dirs_of_gone_agents(str(temp)) == 1
    assert not garbled.exists()
    assert unmarked.exists() and other_host.exists() and other_container.exists()
    assert other_prefix.exists() and plain_file.exists()


def test_creating_a_directory_first_removes_those_of_agents_that_are_gone(temp):
    gone = _agent_dir(temp, "gone", _here(_mark_of_a_process_that_ended()))
    path = create_agent_dir()
    assert not gone.exists()
    assert [entry.name for entry in temp.iterdir()] == [os.path.basename(path)]


def test_an_unreadable_temp_directory_removes_nothing(tmp_path):
    assert remove_dirs_of_gone_agents(str(tmp_path / "missing")) == 0


def test_a_temp_directory_too_long_for_a_socket_path_puts_the_agent_directory_in_tmp(tmp_path, monkeypatch):
    # A deep TMPDIR (a Slurm job's, a test harness's) made the template's bind fail ("AF_UNIX path too
    # long") and every worker start cold, with nothing but a traceback in the agent's log.
    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    path = create_agent_dir()
    try:
        assert os.path.dirname(path) == "/tmp" and os.path.basename(path).startswith(PREFIX)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(os.path.join(path, "prestart.sock.4194304"))  # the template's staging name
        finally:
            listener.close()
    finally:
        shutil.rmtree(path)
    short = Path(tempfile.mkdtemp(prefix="edp-", dir="/tmp"))
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(short))  # short enough: the temp directory itself
        assert os.path.dirname(create_agent_dir()) == str(short)
    finally:
        shutil.rmtree(short)
