"""The template process: ``python .../elastic_ddp/prestart/template.py SOCKET AGENT_PID`` (see the package).

One thread throughout, so that each fork copies a consistent process: the first imports (torch),
then a loop over the listening socket, the relays' connections (a closed one: its worker is killed)
and finished workers (their status goes to their relay). The rest of what a worker imports is
imported by a successor (:class:`_Successor`), a fork that then serves in the template's place.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import importlib
import importlib.util
import os
import selectors
import signal
import socket
import sys
import time
import traceback


def _load_by_path(name: str, path: str):
    """The standard-library-only module at ``path``, executed as ``name`` without importing its package
    (which would import torch before the template counts its threads)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_HERE = os.path.dirname(os.path.abspath(__file__))
_wire = _load_by_path("_elastic_ddp_prestart_wire", os.path.join(_HERE, "wire.py"))
_contract = _load_by_path("_elastic_ddp_contract", os.path.join(os.path.dirname(_HERE), "contract.py"))
read_message, send_message = _wire.read_message, _wire.send_message

# What torchrun's agent sets for each worker (torch/distributed/elastic/agent/server/
# local_elastic_agent.py and its log specs). A worker whose environment differs from the
# template's in anything else starts as usual.
PER_WORKER = frozenset({
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS", "PYTHONPATH", "PYTHONUNBUFFERED",
})  # fmt: skip
PER_WORKER_PREFIXES = ("TORCHELASTIC_", _contract.ENV_PREFIX)

# What every worker imports first: the template serves once these are in. A job's first formation
# waits for no more, as its workers would import the same from scratch.
PRELOAD_FIRST = ("torch",)
# What a worker of this library imports before its first step besides: imported by the template's
# successor (see _Successor.due for when it starts). A module that cannot be imported there (an
# optional one) is left to the worker. TensorBoard's writer is rank 0's alone, but rank 0 may be
# forked on any node and every rank's first step waits for it: its import (0.22 s here, most of it
# boto3, which tensorboard's file layer pulls in) costs each successor 12 MB.
PRELOAD_REST = (
    "torch._dynamo", "torch.distributed.checkpoint.state_dict", "elastic_ddp.worker.launch", "elastic_ddp.checkpoint",
    "torch.utils.tensorboard",
    # What torch.compile(model) imports (inductor's compiler, 0.6 s and 44 MB here): 0.6 s of every
    # compiled model's worker start otherwise, and its pages are shared with every fork.
    "torch._inductor.compile_fx",
    # Not an import: inductor's probes of the CPU and the C++ compiler, cached for the process's life
    # (0.8 s of a compiled model's first step in every worker otherwise; see the module).
    "elastic_ddp.prestart.warmups:inductor_probes",
)  # fmt: skip
# With no fork and no request from the agent, the successor starts this long after the template
# serves (the agent waits for its peers: the time is better spent importing).
START_AFTER_S = 5.0
# How often the loop looks for finished workers and for its agent when nothing else happens.
POLL_S = 0.05
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def thread_count() -> int | None:
    """Threads of this process (Linux ``/proc``); None where unknown."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def fork_hazard(allowed_threads: int = 1) -> str | None:
    """Why forking this process could hand a worker a broken state; None when it is safe.

    More threads than ``allowed_threads`` (a lock another thread held stays held in the copy; the
    template allows the BLAS thread pool that importing numpy starts, which stops itself before a
    fork and starts again after, as every DataLoader worker forked from a training process relies
    on); a CUDA driver or NVML loaded (their state does not survive a fork: CUDA fails in the
    copy); CUDA initialized through torch.
    """
    threads = thread_count()
    if threads is None:
        return "no /proc to count this process's threads"
    if threads > allowed_threads:
        return f"{threads} threads run in it, {allowed_threads} when it started"
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            loaded = maps.read()
    except OSError:
        return "no /proc to see which libraries it loaded"
    for library in ("libcuda.so", "libnvidia-ml.so"):
        if library in loaded:
            return f"{library} is loaded in it"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialized in it"
    return None


def main(argv: list[str]) -> int:
    socket_path, agent = argv[0], int(argv[1])
    _die_with_parent()
    _name_process(_contract.TEMPLATE_PROCESS_NAME)
    if os.getppid() != agent:
        return 0  # the agent is already gone
    try:
        importlib.import_module("numpy")  # first, alone: the threads it starts are the only ones allowed (fork_hazard)
    except ImportError:
        pass
    allowed = thread_count() or 1
    from elastic_ddp.prestart.environment import ReadRecorder

    global _READ_AT_IMPORT
    _READ_AT_IMPORT = ReadRecorder()
    warm_asked: list[bool] = []
    signal.signal(signal.SIGUSR1, lambda *_: warm_asked.append(True))
    for name in PRELOAD_FIRST:
        _preload(name)
    baseline = _initial_environment()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Listening before the path exists: whoever sees the path can connect (Template.wait_ready).
    staging = f"{socket_path}.{os.getpid()}"
    listener.bind(staging)
    listener.listen(64)
    os.replace(staging, socket_path)
    successor = _Successor(socket_path, allowed, warm_asked)
    served = _serve(listener, agent, fork_hazard(allowed), baseline, successor)
    if served is successor:  # in the successor: the rest imported, it serves in its template's place
        served = _serve(listener, successor.template, successor.take_over(), baseline, None)
    if served is None:
        return 0
    return _run_worker(*served)


# The environment variables read while this process imported (its successor's imports included,
# in the successor): a worker's script that changes one of them before launch starts afresh.
_READ_AT_IMPORT = None


def _preload(name: str) -> None:
    """Import ``name`` (``module:function``: import it and call the function)."""
    module, _, function = name.partition(":")
    _READ_AT_IMPORT.start()
    try:
        imported = importlib.import_module(module)
        if function:
            getattr(imported, function)()
    except Exception:  # noqa: BLE001 - the worker imports (and probes) what it needs itself, and reports
        pass
    finally:
        _READ_AT_IMPORT.stop()
    # What the imports made stays put: no collection in a copy touches (and so copies) those pages,
    # and a worker's exit does not walk them (what Python's gc.freeze documentation advises for a
    # process that forks workers).
    gc.freeze()


class _Successor:
    """The template's warm successor: a fork of it that imports the rest (:data:`PRELOAD_REST`) and
    then serves on the same listener in its place.

    The template itself never imports while it serves, so a worker's start never waits behind an
    import, nor does a finished worker's status (torchrun's detection of a failure). Once the
    successor serves, the template stops accepting and only tends the workers it forked before; it
    stays the successor's parent, and the successor dies with it as it dies with the agent.
    """

    def __init__(self, socket_path: str, allowed_threads: int, warm_asked: list[bool]) -> None:
        self._socket_path, self._allowed, self._warm_asked = socket_path, allowed_threads, warm_asked
        self._serving_since = time.monotonic()
        self._forked = False
        self.template = os.getpid()
        self.pid: int | None = None  # in the template, once forked
        self.reports: int | None = None  # in the template: the pipe the successor says it serves on
        self._report_to: int | None = None  # in the successor: that pipe's other end

    def worker_forked(self) -> None:
        self._forked = True

    def due(self) -> bool:
        """Not started yet, and: a worker was forked (the node trains: the next restart should find
        the rest imported), or the agent asked, or nobody has asked for a fork for a while."""
        if self.pid is not None:
            return False
        return self._forked or bool(self._warm_asked) or time.monotonic() - self._serving_since >= START_AFTER_S

    def start(self) -> bool:
        """Fork the successor: True in it, False in the template."""
        self.reports, self._report_to = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.reports)
            self.reports = None
            return True
        os.close(self._report_to)
        self._report_to = None
        return False

    def take_over(self) -> str | None:
        """In the successor: import the rest, mark the template warm, tell it, and return the fork
        hazard of what is imported."""
        _die_with_parent()
        if os.getppid() != self.template:
            os._exit(0)  # the template is already gone
        for name in PRELOAD_REST:
            _preload(name)
        hazard = fork_hazard(self._allowed)
        with open(self._socket_path + _contract.WARM_SUFFIX, "w"):
            pass
        os.write(self._report_to, b"1")
        os.close(self._report_to)
        return hazard

    def close_in_worker(self) -> None:
        if self.reports is not None:
            os.close(self.reports)


def _initial_environment() -> dict[str, str]:
    """The environment this process was started with (the agent's), before any import changed it."""
    try:
        with open("/proc/self/environ", "rb") as environ:
            entries = environ.read().split(b"\0")
    except OSError:
        return dict(os.environ)
    pairs = (entry.decode(errors="surrogateescape").partition("=") for entry in entries if entry)
    return {key: value for key, _, value in pairs if key != _contract.ENV_PRESTART_SOCKET}


def _name_process(name: str) -> None:
    """What ``ps -o comm`` and ``top`` show for a worker forked from here (its relay keeps the
    script's command line)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the loop's check of its parent is the fallback


# Marks the successor's report pipe among the selector's keys (a relay's connection carries its
# worker's pid, the listener None).
_SUCCESSOR = "successor"


def _serve(listener: socket.socket, parent: int, hazard: str | None, baseline: dict[str, str],
           successor: _Successor | None):  # fmt: skip
    """Serve until ``parent`` (the agent; the template, for its successor) is gone, or until this
    template has handed over to its successor and every worker it forked is gone (None); in a forked
    copy, return the worker to become, or ``successor`` in the successor."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    children: dict[int, socket.socket] = {}
    handed_over = False
    while os.getppid() == parent:
        if successor is not None and successor.due():
            if successor.start():
                # The successor: of the loop's, only the listener is its own.
                selector.close()
                for conn in children.values():
                    conn.close()
                return successor
            selector.register(successor.reports, selectors.EVENT_READ, _SUCCESSOR)
        for key, _ in selector.select(timeout=POLL_S):
            if key.data == _SUCCESSOR:
                serves = os.read(successor.reports, 1) == b"1"  # b"": gone before it served
                selector.unregister(successor.reports)
                os.close(successor.reports)
                successor.reports = None
                if serves:
                    selector.unregister(listener)
                    listener.close()
                    handed_over = True
            elif key.data is None:
                if handed_over:
                    continue  # ready in the same select as the hand-over: the successor accepts it
                conn, _ = listener.accept()
                request, fds = _read_request(conn)
                if request is None:
                    conn.close()
                    continue
                refusal = hazard or _refusal(request, baseline)
                if refusal is not None:
                    _close_fds(fds)
                    _send_quietly(conn, {"refused": refusal})
                    conn.close()
                    continue
                # What the imports put in the environment (a cache directory, say): a fresh worker
                # would have it after the same imports, so the copy keeps it.
                request["added"] = {k: v for k, v in os.environ.items() if k not in baseline}
                if successor is not None:
                    successor.worker_forked()
                pid = os.fork()
                if pid == 0:
                    # The copy: nothing of the loop's is its own.
                    selector.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    if successor is not None:
                        successor.close_in_worker()
                    conn.close()
                    return request, fds
                _close_fds(fds)
                if _send_quietly(conn, {"pid": pid}):
                    children[pid] = conn
                    selector.register(conn, selectors.EVENT_READ, pid)
                else:
                    _kill(pid)
                    conn.close()
            else:
                # A relay only ever closes its end: it is gone, so is its worker.
                pid, conn = key.data, key.fileobj
                if _relay_closed(conn):
                    _kill(pid)
        _reap(children, selector)
        if handed_over and not children and not _alive(successor.pid):
            # The successor died (killed by hand, by the OOM killer): the agent starts another
            # template at its next round once this one is gone too.
            return None
    return None


def _alive(pid: int) -> bool:
    """Whether this process's child ``pid`` still runs (reaping it if it has ended)."""
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return False


def _read_request(conn: socket.socket) -> tuple[dict | None, list[int]]:
    conn.settimeout(5.0)
    try:
        request, fds = read_message(conn, max_fds=4)
    except (OSError, ValueError):
        return None, []
    conn.settimeout(None)
    if request is None or len(fds) != 4:
        _close_fds(fds)
        return None, []
    return request, fds


def _refusal(request: dict, baseline: dict[str, str]) -> str | None:
    """Why this worker must start as usual (see the package docstring), or None."""
    env = request.get("env", {})
    differs = sorted(
        k for k in set(env) | set(baseline)
        if env.get(k) != baseline.get(k) and k not in PER_WORKER and not k.startswith(PER_WORKER_PREFIXES)
    )  # fmt: skip
    if differs:
        return f"its environment differs from the template's in {', '.join(differs[:5])}"
    return None


def _relay_closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        selector.unregister(conn)
        _send_quietly(conn, {"status": status})
        conn.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _send_quietly(conn: socket.socket, message: dict) -> bool:
    try:
        send_message(conn, message)
    except OSError:
        return False
    return True


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _run_worker(request: dict, fds: list[int]) -> int:
    """In the forked copy: become the worker the relay describes, run its script, return its status."""
    os.setsid()  # a session of its own, as torchrun gives each worker
    _name_process(f"{_contract.WORKER_PROCESS_NAME_PREFIX}{request['env'].get('RANK', '')}")
    streams, note_fd = fds[:3], fds[3]
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
    _close_fds([fd for fd in streams if fd > 2])
    os.set_inheritable(note_fd, False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in request["added"].items():
        os.environ.setdefault(key, value)
    script, args = request["script"], request["args"]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    if request.get("unbuffered"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)
    from elastic_ddp.processes import adopt_agent

    adopt_agent(int(request["ppid"]))  # the relay's parent, torchrun's agent
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import runpy

    from elastic_ddp.prestart.environment import arm

    # Last, once the environment is the worker's: from here on, a change is the script's.
    arm(frozenset(_READ_AT_IMPORT.names), note_fd)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        return _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        return 1
    return 0


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
