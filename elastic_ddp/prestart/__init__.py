"""Warm worker starts: a node's workers forked from a template that has torch and this library imported.

A restart of the workers (a node lost, a node joining, a preemption elsewhere) starts a new Python
process per rank, and before its first line of training each one imports torch (~1 s on the CPUs
measured in benchmarks/RESULTS.md, ``recovery``), this library and ``torch._dynamo`` (which torch's
optimizers import when the first one is made): two thirds of a restart's time. So the agent keeps a
**template**: one process per node, started by this package's rendezvous handler when the agent
starts, that imports all of that once and then waits. It serves as soon as torch is in, which is all
a job's first formation waits for (its workers would import as much from scratch). The rest is
imported by its *successor*, a fork of it that then serves in its place, so that the template never
stops serving to import: started once the template has forked its first worker, or when its agent
asks (:meth:`Template.warm_up`: a node joining a running job, whose arrival restarts every rank),
or after a few seconds without either. Each worker torchrun starts asks the template
for a copy of itself (a fork) that runs the script, and then only relays: its signals to the copy,
the copy's exit status back to torchrun.

How a worker reaches the template: the handler puts :data:`SHIM_DIR` first on the agent's
``PYTHONPATH`` and the template's socket in :data:`ENV_SOCKET`; torchrun's workers inherit both.
Python imports ``sitecustomize`` from there before the script (``shim/sitecustomize.py``, standard
library only), which hands the template its command line, environment, working directory and
standard streams. Anything else -- another interpreter, a process that is not a direct child of the
agent, a command line with options other than ``-u`` -- starts as usual, and so does every worker
when the template is unusable. The shim then runs the ``sitecustomize`` it shadows, if there is one.

A fork is safe only from a process in a state a fresh one would reach by itself. The template
checks, after its imports and before it serves anyone (:func:`fork_hazard`): no thread but its own
and the BLAS pool numpy starts (which stops itself around a fork); no CUDA
driver or NVML library loaded (importing torch loads neither -- CUDA starts in each worker as it
would anyway); and it forks a worker only when the worker's environment is the template's except
for the variables torchrun sets per worker (``template.PER_WORKER``), since libraries read some
variables once, at import. Each worker then gets what is its own: a session, its streams, its
directory, environment, ``argv``, a fresh seed for Python's ``random`` (done at fork by Python
itself), torch's thread count from ``OMP_NUM_THREADS``.

The copy is a child of the template, not of torchrun: the relay passes torchrun's signals on, the
template kills the copy if its relay dies (torchrun's SIGKILL), and dies with the agent
(``PR_SET_PDEATHSIG``), after which its copies leave as orphans (:func:`elastic_ddp.worker.stop.exit_when_orphaned`).
``ELASTIC_DDP_PRESTART=0`` in the agent's environment turns all of this off.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from elastic_ddp.contract import ENV_PRESTART as ENV_SWITCH
from elastic_ddp.contract import ENV_PRESTART_PID as ENV_PID
from elastic_ddp.contract import ENV_PRESTART_SOCKET as ENV_SOCKET
from elastic_ddp.contract import PRESTART_SOCKET, WARM_SUFFIX

__all__ = ["ENV_PID", "ENV_SOCKET", "ENV_SWITCH", "SHIM_DIR", "TEMPLATE_SCRIPT", "Template", "without_shim"]

log = logging.getLogger(__name__)

SHIM_DIR = str(Path(__file__).resolve().parent / "shim")
# Run by its path, not as a module of this package: the package imports torch, and the template
# must count the threads of a process that has imported nothing yet (template.fork_hazard).
TEMPLATE_SCRIPT = str(Path(__file__).resolve().parent / "template.py")


class Template:
    """Agent side: the node's template process, started at once, ready when its imports are done.

    :meth:`environment` is what the agent's workers must inherit to reach it (set in the agent's
    ``os.environ`` by the caller); :meth:`close` ends it. A template that fails to start or finds
    itself unsafe costs nothing: its workers start as usual.
    """

    def __init__(self, directory: str) -> None:
        self.socket_path = os.path.join(directory, PRESTART_SOCKET)
        env = {k: v for k, v in os.environ.items() if k not in (ENV_SOCKET, ENV_PID)}
        self._process: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, TEMPLATE_SCRIPT, self.socket_path, str(os.getpid())],
            env=env, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the template serves (torch imported) or is gone; True when it serves."""
        return self._wait_for(self.socket_path, timeout_s)

    def warm_up(self, timeout_s: float) -> bool:
        """Have the template import the rest of what a worker imports now, not when it is next idle,
        and wait until it has or is gone; True when it has."""
        deadline = time.monotonic() + timeout_s
        if not self.wait_ready(timeout_s):  # its SIGUSR1 handler is set before it serves
            return False
        if self._process is not None and self._process.poll() is None:
            try:
                self._process.send_signal(signal.SIGUSR1)
            except OSError:
                return False
        return self._wait_for(self.socket_path + WARM_SUFFIX, deadline - time.monotonic())

    def _wait_for(self, path: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._process is not None and self._process.poll() is None:
            if os.path.exists(path):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return False

    def environment(self) -> dict[str, str]:
        """``PYTHONPATH`` with the shim first, the template's socket and its pid (a worker that starts
        while the template is still importing torch waits for it while it lives)."""
        path = os.environ.get("PYTHONPATH", "")
        parts = [p for p in path.split(os.pathsep) if p and p != SHIM_DIR]
        pid = str(self._process.pid) if self._process is not None else ""
        return {"PYTHONPATH": os.pathsep.join([SHIM_DIR, *parts]), ENV_SOCKET: self.socket_path, ENV_PID: pid}

    def close(self, timeout_s: float = 5.0) -> None:
        """End the template (its forked workers are torchrun's to stop, and were)."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            deadline = time.monotonic() + timeout_s
            while process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if process.poll() is None:
                process.kill()
                process.wait()
        for path in (self.socket_path, self.socket_path + WARM_SUFFIX):
            try:
                os.unlink(path)
            except OSError:
                pass


def without_shim(environ: dict[str, str]) -> None:
    """Remove what :meth:`Template.environment` added from ``environ`` (in place)."""
    environ.pop(ENV_SOCKET, None)
    environ.pop(ENV_PID, None)
    parts = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != SHIM_DIR]
    if parts:
        environ["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        environ.pop("PYTHONPATH", None)
