"""A worker's exit at the end of its script: what Python's own exit does for the script, without
the module teardown that costs most of a restart.

With torch (and ``torch._dynamo``) imported, the interpreter's teardown -- clearing thousands of
modules and freeing their objects -- takes 0.65-0.9 s on a 2-core host, against 0.03-0.05 s for
``os._exit`` (measured). Every worker of a restart pays it, and no agent can form the next round
until its workers are gone; a preemption pays it twice in series (the preempted node's workers,
then the survivors' at the restart), and the node's return once more.

What the script may rely on is kept, in Python's order: other non-daemon threads are joined, the
``atexit`` handlers run (``logging``'s flush among them), and every file object still open is
flushed and closed -- text wrappers first, then Python-level files (a ``GzipFile`` writes its
trailer on close), then buffered writers -- as the objects' finalizers would. The standard streams
are flushed, not closed. Objects' other ``__del__`` methods do not run; Python does not promise
they run at exit either.

Finding the open files means looking at every object the collector tracks: 0.07-0.25 s in a worker
(measured), on the path of every restart. :func:`prepare_exit` does that search ahead, while a
rank waits for its agent to restart it (a survivor of a membership change), and freezes what it
searched, so that the exit itself only looks at the objects made since.
"""

from __future__ import annotations

import atexit
import gc
import io
import sys
import threading
from typing import NoReturn

from elastic_ddp.stop import flush_and_exit

__all__ = ["exit_without_teardown", "prepare_exit"]

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


def exit_without_teardown(status: int) -> NoReturn:
    """Leave with ``status`` as the end of the script would, minus the interpreter's module teardown
    (see the module docstring for what is kept)."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    close_open_files()
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
