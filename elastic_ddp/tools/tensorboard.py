"""``elastic-ddp tensorboard``: serve the runs' TensorBoard logs, and never leave the server behind.

The command starts TensorBoard (the installed package) as a child on a directory of runs and
supervises it: a signal that stops the command is passed on to TensorBoard, which is killed if it
does not exit soon after. :mod:`elastic_ddp.tools.cli` registers it through :func:`add_parser`.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
from typing import Any

__all__ = ["add_parser", "tensorboard_command"]


def tensorboard_command(args: argparse.Namespace) -> list[str]:
    """The command line that serves ``args.runs`` with TensorBoard (the installed package)."""
    return [
        sys.executable,
        "-m",
        "tensorboard.main",
        "--logdir",
        args.runs,
        "--port",
        str(args.port),
        "--host",
        args.host,
    ]


# Signals that stop `elastic-ddp tensorboard`; each is passed on to the TensorBoard child.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How long TensorBoard may take to exit after a passed-on signal before it is killed.
_TENSORBOARD_STOP_S = 10.0


def _run_tensorboard(args: argparse.Namespace) -> int:
    """Serve ``args.runs`` with a TensorBoard child until it exits or this process is signalled.

    SIGINT, SIGTERM and SIGHUP are passed on to TensorBoard, which is killed if it has not exited
    :data:`_TENSORBOARD_STOP_S` seconds later, so stopping this command never leaves a server
    running on its own. Returns TensorBoard's exit status, or 128 + the signal number when stopped
    by a signal (the shell's convention).
    """
    command = tensorboard_command(args)
    received: list[int] = []
    child: subprocess.Popen | None = None
    killer: threading.Timer | None = None

    def stop(signum: int, frame: object) -> None:
        nonlocal killer
        received.append(signum)
        if child is None:
            return  # not started yet: passed on right after the start
        child.send_signal(signum)
        if killer is None:
            killer = threading.Timer(_TENSORBOARD_STOP_S, child.kill)
            killer.daemon = True
            killer.start()

    # Handlers first, so no signal can arrive between the child's start and them.
    previous = {signum: signal.signal(signum, stop) for signum in _STOP_SIGNALS}
    try:
        print(f"Serving {args.runs} at http://{args.host}:{args.port}/ (Ctrl-C stops)", flush=True)
        # A session of its own: a terminal's Ctrl-C reaches only this process, so TensorBoard gets
        # each signal exactly once, from here.
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
        if received:
            stop(received.pop(), None)
        code = child.wait()
    finally:
        if child is not None and child.poll() is None:  # this process is failing: take TensorBoard along
            child.kill()
            child.wait()
        if killer is not None:
            killer.cancel()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 + received[0] if received else code


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``elastic-ddp tensorboard [--runs DIR] [--port N] [--host H]``.

    ``subparsers`` is what ``ArgumentParser.add_subparsers()`` returned; the command is run as
    ``args.func(args)`` and returns TensorBoard's exit status.
    """
    parser = subparsers.add_parser(
        "tensorboard",
        help="Serve the runs' TensorBoard logs.",
        description="Start TensorBoard on a directory of runs (each run's tensorboard/ becomes a run).",
    )
    parser.add_argument("--runs", default="runs", help="Directory holding the runs (default: runs).")
    parser.add_argument("--port", type=int, default=6006, help="Port to serve on (default: 6006).")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="Address to bind (default: 127.0.0.1; use 0.0.0.0 to reach it from other machines).",
    )
    parser.set_defaults(func=_run_tensorboard)
    return parser
