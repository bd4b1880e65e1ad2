"""A torchrun worker's first moments: ask the node's template for a warm copy that runs the script.

On ``PYTHONPATH`` only in processes of an agent with this package's rendezvous handler (see
``elastic_ddp/prestart/__init__.py``). Acts only in a direct child of that agent started as
``python [-u] SCRIPT ARGS`` while the template answers; otherwise it does nothing and Python goes on
as usual. Acting, it becomes a relay: torchrun's signals go to the copy, and the copy's exit status
is this process's. Standard library only (the names it shares with the agent and the template,
``elastic_ddp/contract.py``, and the wire format are loaded by their paths, not imported as part of
the package): a worker that starts as usual pays for nothing.
"""

import importlib.util
import os
import sys
import time

# How long a worker waits for a template that is still importing torch (a job's first formation
# does not wait for it: the workers do, as they would for their own imports); then it starts as usual.
TEMPLATE_START_WAIT_S = 60.0
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_by_path(name, path):
    """The standard-library-only module at ``path``, executed as ``name`` without importing its package."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_contract = _load_by_path("_elastic_ddp_contract", os.path.join(_PACKAGE, "contract.py"))


def _plain_script_command():
    """(script, args, unbuffered) of ``python [-u] SCRIPT ARGS``; None for any other command line."""
    argv = list(getattr(sys, "orig_argv", ()))
    if len(argv) < 2:
        return None
    options = argv[1 : len(argv) - len(sys.argv)]
    if any(option != "-u" for option in options) or not sys.argv or not sys.argv[0].endswith(".py"):
        return None
    return sys.argv[0], sys.argv[1:], bool(options)


def _starting(pid):
    """Whether the template (``pid``) is still alive: not gone, not a zombie its agent has yet to reap."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_for_template(path):
    """Wait while the template is alive and not yet serving (its socket absent)."""
    pid = os.environ.get(_contract.ENV_PRESTART_PID, "")
    deadline = time.monotonic() + TEMPLATE_START_WAIT_S
    while not os.path.exists(path) and pid.isdigit() and _starting(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _relay():
    path = os.environ.get(_contract.ENV_PRESTART_SOCKET, "")
    if not path or os.environ.get(_contract.ENV_AGENT_PID, "") != str(os.getppid()):
        return
    command = _plain_script_command()
    if command is None:
        return
    _wait_for_template(path)
    import signal
    import socket

    wire = _load_by_path("_elastic_ddp_prestart_wire", os.path.join(_PACKAGE, "prestart", "wire.py"))
    script, args, unbuffered = command
    # From before the request on: the copy may run (and torchrun signal) before the reply comes.
    # Every signal is kept: should the copy leave for a fresh start, this process gets them back.
    child, pending = [], []

    def forward(signum, frame):
        pending.append(signum)
        if not child:
            return
        try:
            os.kill(child[0], signum)
        except ProcessLookupError:
            pass

    relayed = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
    previous = {signum: signal.signal(signum, forward) for signum in relayed}

    def start_as_usual(why=None):
        conn.close()
        os.close(note)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if why:
            print(f"[elastic_ddp] This worker starts without its node's template: {why}.", file=sys.stderr, flush=True)
        if pending:
            os.kill(os.getpid(), pending[0])

    # The copy writes here why it left for a fresh start (elastic_ddp/prestart/environment.py).
    note, note_for_copy = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(2.0)
        conn.connect(path)
        request = {"script": script, "args": args, "unbuffered": unbuffered, "cwd": os.getcwd(),
                   "env": dict(os.environ), "ppid": os.getppid()}  # fmt: skip
        wire.send_message(conn, request, [0, 1, 2, note_for_copy])
        reply, _ = wire.read_message(conn)
    except (OSError, ValueError):
        start_as_usual()  # no template (yet)
        return
    finally:
        os.close(note_for_copy)
    if not reply or "pid" not in reply:
        start_as_usual(reply.get("refused") if reply else None)
        return
    try:
        child.append(int(reply["pid"]))
        afresh = _relay_until_exit(conn, wire, child[0], pending, note)
    except BaseException:
        os._exit(1)
    # The copy left before the script's start was past what only a fresh process can honour: the
    # script runs here, with the signals torchrun sent meanwhile.
    start_as_usual(afresh)


def _relay_until_exit(conn, wire, child, pending, note):
    """Pass on the signals that came during the handshake, then wait for the copy's status and
    leave with it: its exit code, or death by its signal. Returns only when the copy asked for a
    fresh start instead (the reason it wrote to ``note``)."""
    import signal

    for signum in list(pending):  # a signal that comes from here on is forwarded by the handler
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass
    conn.settimeout(None)
    try:
        reply, _ = wire.read_message(conn)
    except (OSError, ValueError):
        reply = None
    afresh = _read_all(note)
    if afresh:
        return afresh
    status = (reply or {}).get("status")
    if status is None:
        # The template is gone; the copy leaves as an orphan, with the same status.
        os._exit(_contract.EXIT_ORPHANED)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those have no handler to reset
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _read_all(fd):
    """What the copy wrote to the note pipe before it ended (its status is known, so it is there)."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 4096):
            data += chunk
    except OSError:  # BlockingIOError: nothing more, though a process forked from the copy holds the pipe
        pass
    return data.decode(errors="replace")


def _chain():
    """Run the ``sitecustomize`` this one shadows (a distribution's, a virtualenv's), if any."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_relay()
_chain()
