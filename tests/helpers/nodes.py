"""Start, kill and watch torchrun "nodes" (an agent and all its descendants) in tests.

torchrun starts workers with ``start_new_session=True``, so killing the agent or its process
group leaves workers running. :meth:`Node.kill` therefore walks the agent's process tree through
``/proc/<pid>/task/*/children`` (Linux) and SIGKILLs every process found, workers first found
before the agent is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from elastic_ddp.contract import TEMPLATE_PROCESS_NAME, WORKER_PROCESS_NAME_PREFIX

__all__ = ["Node", "descendants", "record_raises", "start_node", "wait_for"]

_T = TypeVar("_T")


def wait_for(predicate: Callable[[], _T], timeout: float, interval: float = 0.1, what: str = "condition") -> _T:
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout`` s pass.

    Raises:
        TimeoutError: naming ``what``.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"Timed out after {timeout:g} s waiting for {what}.")
        time.sleep(interval)


def record_raises(monkeypatch, owner: object, name: str, error: type[BaseException]) -> list[BaseException]:
    """Wrap ``owner.name`` (for the test's duration) so that every ``error`` it raises is recorded,
    then raised as before; the list of recorded errors, which grows as they happen."""
    raised: list[BaseException] = []
    call = getattr(owner, name)

    def recording(*args, **kwargs):
        try:
            return call(*args, **kwargs)
        except error as exc:
            raised.append(exc)
            raise

    monkeypatch.setattr(owner, name, recording)
    return raised


def _children(pid: int) -> list[int]:
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
        except OSError:
            continue
        found.extend(int(p) for p in text.split())
    return found


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first, breadth-first)."""
    result, frontier = [], [pid]
    while frontier:
        nxt = []
        for parent in frontier:
            for child in _children(parent):
                if child not in result:
                    result.append(child)
                    nxt.append(child)
        frontier = nxt
    return result


def worker_pids(agent: int) -> list[int]:
    """The processes that run an agent's workers' script: the forks of its workers' template or of
    the template's warm successor (elastic_ddp.prestart; torchrun sees their relays), or where there
    is none its direct children."""
    tree = descendants(agent)
    templates = {p for p in tree if b"prestart/template.py" in cmdline(p) and comm(p) == TEMPLATE_PROCESS_NAME}
    if templates:
        # A fork becomes a worker as ``edp-rank<N>``; the successor's probe subprocesses are not workers.
        return [p for p in tree if parent_pid(p) in templates and comm(p).startswith(WORKER_PROCESS_NAME_PREFIX)]
    return [p for p in tree if parent_pid(p) == agent]


def comm(pid: int) -> str:
    """What ``ps -o comm`` shows for ``pid``; empty when it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` (``/proc``); None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def cmdline(pid: int) -> bytes:
    """The command line of ``pid``, NUL-separated; empty when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class Node:
    """One torchrun agent started by :func:`start_node`; output goes to ``log_path``."""

    def __init__(self, process: subprocess.Popen, log_path: Path, log_file) -> None:
        self.process = process
        self.log_path = log_path
        self._log_file = log_file
        self._known: set[int] = set()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def tree(self) -> list[int]:
        """The agent and its live descendants (remembered, so orphans are still killed later)."""
        live = [self.pid, *descendants(self.pid)] if self.process.poll() is None else []
        self._known.update(live)
        return live

    def kill(self) -> None:
        """SIGKILL the agent and every descendant (a node dying with its workers)."""
        # Freeze the agent first so it cannot start replacements, then list the tree again.
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGSTOP)
        for pid in self.tree():
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        for pid in [*self.tree(), *self._known]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        self._close_log()

    def terminate(self) -> None:
        """SIGTERM to the agent only (it stops its workers, like a preemption notice)."""
        self.tree()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """The agent's exit code; raises ``subprocess.TimeoutExpired`` after ``timeout`` s."""
        code = self.process.wait(timeout)
        self._close_log()
        return code

    def output(self) -> str:
        """Everything the agent and its workers have written so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def cleanup(self) -> None:
        """Kill whatever is left (safe to call more than once)."""
        if self.process.poll() is None:
            self.kill()
        for pid in self._known:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._close_log()

    def _close_log(self) -> None:
        if self._log_file is not None and not self._log_file.closed:
            self._log_file.close()

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()


def start_node(
    cmd: Sequence[str], env: Mapping[str, str] | None, log_path: str | os.PathLike, cwd: str | os.PathLike | None = None
) -> Node:
    """Start ``cmd`` (a torchrun command line) with ``env`` (None: inherit) in ``cwd`` (None: this
    directory; a node of its own directory is like a machine with its own disk), output to ``log_path``."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "ab")
    process = subprocess.Popen(
        list(cmd), env=None if env is None else dict(env), stdin=subprocess.DEVNULL, stdout=log_file,
        stderr=subprocess.STDOUT, cwd=cwd,
    )  # fmt: skip
    return Node(process, log_path, log_file)
