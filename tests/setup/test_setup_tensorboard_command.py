"""`elastic-ddp tensorboard` never leaves its TensorBoard child serving after it is stopped.

The real command is started as a process; a stop signal to it must reach TensorBoard, and a child
that ignores the signal is killed after ``tensorboard_cli._TENSORBOARD_STOP_S``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from elastic_ddp.tools.etcd_server import free_port
from tests.helpers.nodes import descendants, wait_for

# A stand-in for TensorBoard that ignores SIGTERM, SIGINT and SIGHUP: only SIGKILL stops it.
STUBBORN_CHILD = (
    "import os, signal, time\n"
    "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP): signal.signal(s, signal.SIG_IGN)\n"
    "print(f'child {os.getpid()}', flush=True)\n"
    "time.sleep(600)\n"
)


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _serves(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, socket.timeout):
        return False


@pytest.fixture
def processes():
    """Processes a test started, and pids it found; whatever still runs at the end is killed,
    with every descendant (a failed test must not leave a TensorBoard serving)."""
    started: list[subprocess.Popen] = []
    extra_pids: list[int] = []
    yield started, extra_pids
    for process in started:
        extra_pids.extend(descendants(process.pid))
        if process.poll() is None:
            process.kill()
            process.wait(10)
    for pid in extra_pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_stops_the_real_tensorboard_it_started(tmp_path, processes):
    started, extra_pids = processes
    port = free_port()
    command = subprocess.Popen(
        [sys.executable, "-m", "elastic_ddp.tools.cli", "tensorboard", "--runs", str(tmp_path), "--port", str(port)],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    started.append(command)
    wait_for(lambda: _serves(port) or command.poll() is not None, 120, what="TensorBoard to serve")
    assert command.poll() is None, f"elastic-ddp tensorboard exited with {command.returncode}"
    tree = descendants(command.pid)  # TensorBoard and its data server
    assert tree, "elastic-ddp tensorboard serves without a child process"
    extra_pids.extend(tree)

    command.send_signal(signal.SIGTERM)
    assert command.wait(30) == 128 + signal.SIGTERM
    survivors = [pid for pid in tree if _alive(pid)]
    assert not survivors, f"processes {survivors} of TensorBoard outlived `elastic-ddp tensorboard`"
    assert not _serves(port)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_child_that_ignores_the_signal_is_killed(tmp_path, processes, signum):
    started, extra_pids = processes
    # The command's own parser and function, with the child swapped for one that ignores signals.
    code = (
        "import argparse, sys\n"
        "from elastic_ddp.tools import tensorboard as metrics\n"
        "metrics._TENSORBOARD_STOP_S = 1.0\n"
        f"metrics.tensorboard_command = lambda args: [sys.executable, '-c', {STUBBORN_CHILD!r}]\n"
        "parser = argparse.ArgumentParser()\n"
        "metrics.add_parser(parser.add_subparsers())\n"
        "args = parser.parse_args(['tensorboard', '--runs', '.'])\n"
        "sys.exit(args.func(args))\n"
    )
    # stderr to a file: the child inherits it, and a pipe would not reach EOF while the child lives.
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as stderr_file:
        command = subprocess.Popen(
            [sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE, stderr=stderr_file, text=True
        )
    started.append(command)
    line = command.stdout.readline()
    while line and not line.startswith("child "):
        line = command.stdout.readline()
    assert line, stderr.read_text()
    child = int(line.split()[1])
    extra_pids.append(child)

    command.send_signal(signum)
    assert command.wait(30) == 128 + signum, stderr.read_text()
    assert not _alive(child), "a child that ignored the signal outlived `elastic-ddp tensorboard`"
