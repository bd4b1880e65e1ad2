"""A warm worker's script that sets environment variables before ``import torch``: started afresh.

A fresh worker runs its script from the first line: a script that writes
``os.environ["TORCHINDUCTOR_MAX_AUTOTUNE"] = "1"`` and then imports torch gets autotuning, because
torch's inductor configuration reads its variables once, when it is imported. A worker forked from the
node's template (see the package) starts with torch imported already: the same line comes too late
for it, and the script would silently run with other settings after its first restart than in its
first attempt.

So the template records which variables the code it imports reads (:class:`ReadRecorder`; 93 for
``import torch``, 379 with ``torch._dynamo`` and this library), and each fork watches the script's
changes of the environment (a Python audit hook on ``os.putenv``/``os.unsetenv``) until the
environment is settled: when the script calls :func:`elastic_ddp.launch`, or, for a script without
the library, once its process group exists. A change of a recorded variable, or of one that the
native libraries torch loads read as they load (:data:`READ_AT_LOAD_PREFIXES`: OpenMP, MKL,
OpenBLAS), ends the fork at once, before anything of the script's has run past that line; its relay
(``shim/sitecustomize.py``) prints one line saying why and runs the script itself, as a fresh process
(:func:`arm`'s ``note_fd`` carries the reason). Only the script's own code counts -- a change made by
an installed package as it is imported (scikit-learn and threadpoolctl set ``KMP_DUPLICATE_LIB_OK``),
by the standard library or by this library is what a fresh process gets too -- and so does only a
change that alters the value.

Standard library only, and nothing runs while no fork is armed: a worker that starts as usual, or
a fork once settled, pays one early return per audited event.
"""

from __future__ import annotations

import _collections_abc
import os
import site
import sys
import sysconfig

__all__ = ["READ_AT_LOAD_PREFIXES", "ReadRecorder", "arm", "settle"]

# Variables that native libraries read once, as torch loads them (not through os.environ): the
# OpenMP runtime's thread pool, MKL's and OpenBLAS's settings.
READ_AT_LOAD_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_")


class ReadRecorder:
    """Records the names Python code reads from ``os.environ`` (``[]``, ``get``, ``in``,
    ``os.getenv``) between :meth:`start` and :meth:`stop`: what imports read once and keep."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self._previous: type | None = None

    def start(self) -> None:
        names = self.names
        environ_type = type(os.environ)

        class _Recording(environ_type):  # type: ignore[misc,valid-type]
            def __getitem__(self, key):
                names.add(key)
                return super().__getitem__(key)

        self._previous = environ_type
        os.environ.__class__ = _Recording  # the same object: every module's reference to it records

    def stop(self) -> None:
        if self._previous is not None:
            os.environ.__class__ = self._previous
            self._previous = None


# The armed state of this process: the names that matter, the relay's pipe, the directories whose
# code is not the script's.
_armed: tuple[frozenset[str], int, tuple[str, ...]] | None = None
_hook_installed = False


def arm(read_at_import: frozenset[str], note_fd: int) -> None:
    """In a fork of the template, before its script runs: watch the script's environment changes
    (see the module docstring). ``read_at_import``: what the template's imports read;
    ``note_fd``: the write end of the relay's pipe, for the reason a fresh start is needed."""
    global _armed, _hook_installed
    _armed = (read_at_import, note_fd, _installed_code())
    if not _hook_installed:
        sys.addaudithook(_audit)  # audit hooks cannot be removed: settle() makes it return at once
        os.register_at_fork(after_in_child=_forget_in_child)
        _hook_installed = True


def settle() -> None:
    """The script's environment is settled (:func:`elastic_ddp.launch` calls this first): from here
    on its changes are made with torch imported in a fresh worker too, and are the script's own."""
    global _armed
    if _armed is not None:
        note_fd = _armed[1]
        _armed = None
        try:
            os.close(note_fd)  # end of file: the relay reads that no fresh start was needed
        except OSError:
            pass


def _forget_in_child() -> None:
    """A process forked from the worker (a DataLoader worker) is not the script's start: nothing to
    watch there, and the relay's pipe is not its to hold."""
    settle()


def _audit(event: str, args: tuple) -> None:
    if _armed is None or (event != "os.putenv" and event != "os.unsetenv"):
        return
    names, note_fd, installed = _armed
    key = os.fsdecode(args[0])
    if key not in names and not key.startswith(READ_AT_LOAD_PREFIXES):
        return
    value = os.fsdecode(args[1]) if event == "os.putenv" else None
    if os.environ.get(key) == value or _set_by(installed):
        return
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        settle()  # a script without the library, past its start: nothing can be started afresh now
        return
    what = "sets" if value is not None else "removes"
    reader = "torch reads it when it is imported" if key in names else "a library torch loads reads it as it loads"
    _start_afresh(
        note_fd,
        f"the script {what} {key} before torch is imported, and {reader}; a fork of the template, which "
        "has torch imported, would not see it",
    )


# Where os.environ's own methods live: its class, and the mapping methods it inherits (setdefault,
# update) -- by the code's own file name, which for the frozen modules of Python 3.11+ is "<frozen os>".
_MAPPING_CODE = frozenset(
    {os._Environ.__setitem__.__code__.co_filename, _collections_abc.MutableMapping.setdefault.__code__.co_filename}
)


def _installed_code() -> tuple[str, ...]:
    """The directories of code that is not the script's: the standard library, every site-packages
    directory, this library's and torch's (either may be installed elsewhere, e.g. editable)."""
    paths = sysconfig.get_paths()
    dirs = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    dirs.update(site.getsitepackages())
    dirs.add(site.getusersitepackages())
    for name in ("torch", "elastic_ddp"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.add(os.path.dirname(module.__file__))
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


def _set_by(directories: tuple[str, ...]) -> bool:
    """Whether the code that changed the environment (past os.environ's own frames) lives under one
    of ``directories``."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in _MAPPING_CODE:
        frame = frame.f_back
    return frame is None or os.path.realpath(frame.f_code.co_filename).startswith(directories)


def _start_afresh(note_fd: int, why: str) -> None:
    """Tell the relay why, and leave before any more of the script runs (its buffered output with
    it: the fresh start prints it)."""
    try:
        os.write(note_fd, why.encode(errors="replace")[:4000])
    finally:
        os._exit(0)
