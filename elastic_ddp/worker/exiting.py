"""A worker's exit at the end of its script: what Python's own exit does for the script, without
the module teardown that costs most of a restart.

With torch (and ``torch._dynamo``) imported, the interpreter's teardown -- clearing thousands of
modules and freeing their objects -- takes 0.65-0.9 s on a 2-core host, against 0.03-0.05 s for
``os._exit`` (measured). Every worker of a restart pays it, and no agent can form the next round
until its workers are gone; a preemption pays it twice in series (the preempted node's workers,
then the survivors' at the restart), and the node's return once more.

What the script may rely on is kept, in Python's order (``Py_FinalizeEx``: ``threading._shutdown``,
then ``atexit``):

1. the threading exit hooks (``threading._register_atexit``), newest first. ``concurrent.futures``
   registers one that wakes every idle pool thread and tells it to leave: a live
   ``ThreadPoolExecutor`` -- a user's uploader, torch.compile's inductor pool -- ends only once it ran;
2. the other non-daemon threads joined;
3. the ``atexit`` handlers (``logging``'s flush among them);
4. every file object still open flushed and closed -- text wrappers first, then Python-level files
   (a ``GzipFile`` writes its trailer on close), then buffered writers -- as the objects' finalizers
   would. The standard streams are flushed, not closed.

Objects' other ``__del__`` methods do not run; Python does not promise they run at exit either.

Unlike Python, the exit is bounded: the run's end is committed before it starts, and a thread that
never ends would otherwise hold the node (and a batch allocation) until it is killed. Past
``timeout_s`` the threads still alive are named with their stacks and the worker leaves with the
run's status.

Finding the open files means looking at every object the collector tracks: 0.07-0.25 s in a worker
(measured), on the path of every restart. :func:`prepare_exit` does that search ahead, while a
rank waits for its agent to restart it (a survivor of a membership change), and freezes what it
searched, so that the exit itself only looks at the objects made since.

A worker whose settings are invalid never reaches the script: :func:`exit_on_settings_error` prints
the error, tells the agent, and leaves with :data:`~elastic_ddp.contract.EXIT_CONFIG`.
"""

from __future__ import annotations

import atexit
import gc
import io
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import NoReturn

from elastic_ddp.agent_marks import report_settings_error
from elastic_ddp.contract import EXIT_CONFIG
from elastic_ddp.worker.stop import flush_and_exit

__all__ = [
    "DEFAULT_EXIT_TIMEOUT_S", "exit_on_settings_error", "exit_without_teardown", "prepare_exit",
    "run_threading_exit_hooks",
]  # fmt: skip

log = logging.getLogger(__name__)

# How long the exit may take when the caller names no bound (run.exit_timeout_s's default).
DEFAULT_EXIT_TIMEOUT_S = 60.0

# The C implementations of a file's layers, outermost first; any other io.IOBase subclass is a
# Python-level file (gzip, bz2, lzma, a user's own), which wraps one of these.
_TEXT = (io.TextIOWrapper,)
_BUFFERED = (io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair)
_C_LAYERS = (*_TEXT, *_BUFFERED, io.BufferedReader, io.FileIO, io.BytesIO, io.StringIO)

# The file objects prepare_exit() found among the objects it then froze (the collector's later
# searches skip frozen objects, and no object made before it becomes a file after it).
_found_early: list[io.IOBase] = []


def prepare_exit() -> None:
    """Search for the exit's open files now, and freeze the objects searched (no cyclic garbage
    collection for them from here on: call it only once the process has nothing left but to exit).
    Files opened later are found at the exit, among the objects made since."""
    _found_early.extend(_file_objects())
    gc.freeze()


def exit_without_teardown(status: int, timeout_s: float = DEFAULT_EXIT_TIMEOUT_S) -> NoReturn:
    """Leave with ``status`` as the end of the script would, minus the interpreter's module teardown
    (see the module docstring for what is kept). Within ``timeout_s``: past it, the threads that
    keep the process alive are named with their stacks on stderr and the process leaves with
    ``status`` all the same."""
    watchdog = threading.Timer(timeout_s, _overdue, args=(status, timeout_s))
    watchdog.name = "exit-watchdog"
    watchdog.daemon = True
    watchdog.start()
    run_threading_exit_hooks()
    current = threading.current_thread()
    # Threads may start threads while they end: join until none is left, as threading._shutdown does.
    while pending := [t for t in threading.enumerate() if t is not current and not t.daemon and t.is_alive()]:
        for thread in pending:
            thread.join()
    atexit._run_exitfuncs()
    close_open_files()
    flush_and_exit(status)


def run_threading_exit_hooks() -> None:
    """Run the callbacks registered with ``threading._register_atexit``, newest first, once, as
    ``threading._shutdown()`` does before it joins the non-daemon threads (the one access to
    threading's private list of them)."""
    threading._SHUTTING_DOWN = True  # what _shutdown sets: a late registration raises, as at a real exit
    hooks = list(reversed(threading._threading_atexits))
    threading._threading_atexits.clear()
    for hook in hooks:
        try:
            hook()
        except Exception:  # noqa: BLE001 - Python's own exit would print it and go on to the next step
            traceback.print_exc()


def _overdue(status: int, timeout_s: float) -> None:
    """The watchdog's end: name what holds the exit, then leave with the run's status."""
    frames = sys._current_frames()
    holding = [t for t in threading.enumerate() if t.is_alive() and (not t.daemon or t is threading.main_thread())]
    lines = [
        f"The run ended (exit status {status}), but its process has not exited {timeout_s:.0f} s later "
        "(run.exit_timeout_s): these threads keep it alive, and it leaves now without them."
    ]
    for thread in holding:
        role = "main thread, running the exit" if thread is threading.main_thread() else "non-daemon thread"
        lines.append(f'Thread "{thread.name}" ({role}):')
        frame = frames.get(thread.ident)
        lines.append("".join(traceback.format_stack(frame)).rstrip() if frame is not None else "  (no Python frame)")
    log.warning("%s", "\n".join(lines))
    flush_and_exit(status)


def close_open_files() -> None:
    """Flush and close every file object still open in this process (the standard streams: flush only)."""
    files = [*_found_early, *_file_objects()]
    streams = (sys.stdout, sys.stderr, sys.stdin, sys.__stdout__, sys.__stderr__, sys.__stdin__)
    standard = {id(stream) for stream in streams} | {id(getattr(stream, "buffer", None)) for stream in streams}

    text = [f for f in files if isinstance(f, _TEXT)]
    python_level = [f for f in files if not isinstance(f, _C_LAYERS)]
    buffered = [f for f in files if isinstance(f, _BUFFERED)]
    for file in (*text, *python_level, *buffered):
        try:
            if file.closed:
                continue
            if id(file) in standard:
                file.flush()
            else:
                file.close()
        except Exception:  # noqa: BLE001 - as the interpreter's finalizers do: one file's error stops no other
            pass


def _file_objects() -> list[io.IOBase]:
    """The file objects among those the collector tracks and has not frozen."""
    objects = gc.get_objects()
    # One issubclass per type (hundreds), not one isinstance per object (hundreds of thousands, and
    # an isinstance reads ``__class__``, which some of torch's deprecated aliases warn on).
    file_types = {kind for kind in set(map(type, objects)) if issubclass(kind, io.IOBase)}
    return [obj for obj in objects if type(obj) in file_types]


# How long a worker whose settings are invalid waits for its agent to stop it (exit_on_settings_error);
# the agent looks every --monitor-interval (0.1 s by default).
_SETTINGS_ERROR_WAIT_S = 30.0


def exit_on_settings_error(exc: Exception) -> NoReturn:
    """Print what is wrong and leave with EXIT_CONFIG: no restart can fix a setting.

    A worker of an agent with this package's rendezvous handler also reports the message to its
    agent (:func:`~elastic_ddp.agent_marks.report_settings_error`) and stays alive until the agent stops
    it (at most ``_SETTINGS_ERROR_WAIT_S``, or until the agent is gone). Alive, it is no failure:
    the agent finds the report when it next polls for membership changes, stops the worker, closes
    the rendezvous with the message for every node and exits with it -- without spending a restart,
    which torch's agent would count for a worker that failed before it asks the rendezvous again.
    Anywhere else (torch's c10d rendezvous, plain python) the worker leaves at once; torchrun then
    restarts it until --max-restarts is spent, and its summary shows this message (the error file).
    """
    print(exc, file=sys.stderr, flush=True)
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(exc)  # torchrun's summary shows it (when it has a file)
    except Exception:  # noqa: BLE001 - the message is already on stderr; the file is a courtesy
        pass
    if report_settings_error(str(exc)):
        agent = os.getppid()

        def stopped(signum: int, frame: object) -> None:
            os._exit(EXIT_CONFIG)  # nothing to clean up; torch's interpreter teardown costs seconds

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stopped)
        deadline = time.monotonic() + _SETTINGS_ERROR_WAIT_S
        while time.monotonic() < deadline and os.getppid() == agent:
            time.sleep(0.1)
    sys.exit(EXIT_CONFIG)
