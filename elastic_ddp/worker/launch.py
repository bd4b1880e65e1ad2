"""The worker's entry and exit: :func:`launch` runs a training script's ``main(run)`` as one rank of an
elastic job, then leaves with the protocol's exit status.

Before the script's first line: the settings (a bad one ends the whole job, not just this attempt,
without spending a restart), SIGTERM as a stop request, an exit of its own if the torchrun agent
dies, the workers' log format. After it: the run's ordered teardown (:meth:`Run.finish
<elastic_ddp.worker.run.Run.finish>`), then the exit a script's end would have
(:func:`~elastic_ddp.worker.exiting.exit_without_teardown`); a failure is recorded for torchrun and
ends the worker at once.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from elastic_ddp.checkpoint import CheckpointError
from elastic_ddp.config import Config, ConfigError, load_config
from elastic_ddp.logs import configure_logging
from elastic_ddp.prestart.environment import settle as settle_environment
from elastic_ddp.worker.exiting import exit_on_settings_error, exit_without_teardown
from elastic_ddp.worker.failures import RecurringFailureError
from elastic_ddp.worker.run import Run, RunError
from elastic_ddp.worker.stop import EXIT_FAILED, StopSignal, exit_when_orphaned, flush_and_exit

__all__ = ["launch"]

log = logging.getLogger(__name__)


def launch(
    main: Callable[[Run], object], config: type[Config] | Config = Config, argv: Sequence[str] | None = None
) -> NoReturn:
    """Run ``main(run)`` as one worker of an elastic job, then exit with the protocol's status.

    ``config``: the script's :class:`~elastic_ddp.config.Config` subclass (its own sections beside the
    library's), or an instance whose values are the defaults; ``argv`` (default ``sys.argv[1:]``)
    holds ``--config FILE`` and ``--section.field=value`` overrides; ``--help`` (``-h``) prints every
    setting and exits 0. A bad setting exits :data:`~elastic_ddp.contract.EXIT_CONFIG` (2) before any
    process group exists, and ends the whole job, not just this attempt (see
    :func:`~elastic_ddp.worker.exiting.exit_on_settings_error`). An exception is recorded (``failures.jsonl``, torchrun's error
    file) and the worker leaves at once with status 1; a known failure prints one clear line,
    anything else its traceback. After ``main`` returns, the worker leaves as the script's end would,
    without the interpreter's module teardown (:func:`~elastic_ddp.worker.exiting.exit_without_teardown`),
    within ``run.exit_timeout_s``.
    """
    # What the script set in the environment before this call is settled: a warm worker whose script
    # changed what torch read at its import has left for a fresh start by now (prestart/environment.py).
    settle_environment()
    args = sys.argv[1:] if argv is None else list(argv)
    if "--help" in args or "-h" in args:
        # Before anything else -- no process group, no signal handlers, no logging set-up -- so it
        # is the same under python and torchrun (where one worker per node prints it).
        from elastic_ddp.config import describe

        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(describe(config), end="", flush=True)
        sys.exit(0)
    try:
        cfg = load_config(args, config)
    except ConfigError as exc:
        exit_on_settings_error(exc)
    # From here SIGTERM/SIGINT ends the worker at once with EXIT_STOPPED (process-group set-up and
    # resume included: nothing to save yet); once the loop starts it means "checkpoint at a step
    # boundary, then exit", within grace_s. Before this line the default action ends the process.
    stop_signal = StopSignal(grace_s=cfg.checkpoint.grace_s)
    exit_when_orphaned()  # if our torchrun agent dies, do not train on as a ghost
    configure_logging("worker")
    try:
        run = Run(cfg, stop_signal)
        with run.failures:  # a crash that recurs at the same step ends with one clear error
            try:
                main(run)
            except Exception:
                # Whatever the script's step raised (a peer lost mid-collective, its own error): keep the last
                # completed step in node memory for the restart, then let the failure be reported below.
                run._keep_failed_step()
                raise
        code = run.finish()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else EXIT_FAILED
    except BaseException as exc:  # noqa: BLE001 - every failure ends the same way: reported, then gone
        _report_and_exit(exc)
    exit_without_teardown(code, cfg.run.exit_timeout_s)


_KNOWN = (RunError, CheckpointError, RecurringFailureError)


def _report_and_exit(exc: BaseException) -> NoReturn:
    """Record ``exc`` for torchrun and leave now, skipping interpreter cleanup.

    Destroying a process group whose peer hangs can block forever (gloo waits on the frozen peer's
    socket), and a failed worker must be gone for its agent to restart the group.
    """
    if isinstance(exc, _KNOWN):
        log.error("%s", exc)
    else:
        traceback.print_exception(exc)
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(exc)  # torchrun prints it as the root cause
    except Exception:  # noqa: BLE001 - the error is already on stderr; the file is a courtesy
        pass
    flush_and_exit(EXIT_FAILED)
