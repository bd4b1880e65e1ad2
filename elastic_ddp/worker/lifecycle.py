"""A run's life in one place: where its loop ends, how it ended, and what the process exits with.

An attempt ends in one of four ways (the ``ENDED_*`` values, which the summary line and the
progress record name, see :mod:`elastic_ddp.worker.metrics`):

* :data:`ENDED_FINISHED` -- ``train.max_steps`` reached; node memory is freed and the worker exits 0.
* :data:`ENDED_EXIT_AT_STEP` -- ``train.exit_at_step`` reached (checkpoint committed); exits 0.
* :data:`ENDED_STOPPED` -- this rank was asked to stop (preemption, Ctrl-C); checkpoint committed.
* :data:`ENDED_MEMBERSHIP` -- another node left or joined: this rank committed the agreed step and
  waits for its agent to restart it (:func:`~elastic_ddp.worker.stop.wait_for_restart`).

A loop that has not ended in one of them when the script returns lost the steps since its last
checkpoint: :func:`check_ended` says so with a :class:`RunError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no import of torch here: the metrics import this module
    from elastic_ddp.worker.stop import StopSignal

__all__ = [
    "ENDED_EXIT_AT_STEP", "ENDED_FINISHED", "ENDED_MEMBERSHIP", "ENDED_STOPPED", "RunError", "check_ended",
    "end_ended", "ended_text", "exit_status", "frees_memory", "loop_end", "stop_ended", "stop_event", "stopped",
]  # fmt: skip

# How an attempt ended, as the summary line and the progress record say it.
ENDED_FINISHED = "finished"  # train.max_steps reached
ENDED_EXIT_AT_STEP = "exited"  # train.exit_at_step reached
ENDED_STOPPED = "stopped"  # this rank was asked to stop (preemption, Ctrl-C)
ENDED_MEMBERSHIP = "paused"  # another node left or joined: this rank waits to be restarted
_ENDED_TEXT = {
    ENDED_FINISHED: "finished",
    ENDED_EXIT_AT_STEP: "exited at train.exit_at_step (checkpoint committed)",
    ENDED_STOPPED: "stopped on request (checkpoint committed)",
    ENDED_MEMBERSHIP: "paused for a membership change (checkpoint committed; restarting)",
}


class RunError(RuntimeError):
    """The protocol cannot go on without losing or mixing work; the message says what and what to do."""


def ended_text(ended: str) -> str:
    """How the summary line says ``ended`` (an unknown value as itself)."""
    return _ENDED_TEXT.get(ended, ended)


def loop_end(step: int, max_steps: int, exit_at_step: int | None) -> int:
    """The step the loop ends at, starting after ``step``: ``train.max_steps``, or an earlier
    ``train.exit_at_step`` still ahead."""
    if exit_at_step and exit_at_step > step:
        return min(max_steps, exit_at_step)
    return max_steps


def end_ended(step: int, max_steps: int) -> str:
    """How a loop that reached its end at ``step`` ended: finished, or exited at ``train.exit_at_step``."""
    return ENDED_FINISHED if step == max_steps else ENDED_EXIT_AT_STEP


def stop_ended(requested: bool) -> str:
    """How a loop that stopped ended: this rank was asked to (``requested``), or it pauses for a
    membership change elsewhere."""
    return ENDED_STOPPED if requested else ENDED_MEMBERSHIP


def stop_event(step: int, in_memory: bool) -> str:
    """The event that records a stop at ``step``; ``in_memory``: its state went to node memory only."""
    if in_memory:
        return f"Stopped at step {step} to admit a joining node; its state committed to node memory"
    return f"Stopped at step {step} for a stop request; checkpoint committed"


def stopped(ended: str | None) -> bool:
    """Whether the attempt ended with a stop (this rank's own, or a membership change)."""
    return ended in (ENDED_STOPPED, ENDED_MEMBERSHIP)


def frees_memory(ended: str | None) -> bool:
    """Whether node memory is freed at the end: only once the run is over."""
    return ended == ENDED_FINISHED


def check_ended(ended: str | None, step: int, max_steps: int) -> None:
    """Raise :class:`RunError` when the script returned before the loop ended (``ended`` None) --
    ``step``: the step it was in -- since the steps since the last checkpoint would be lost."""
    if ended is None:
        raise RunError(
            f"The training script returned during step {step}, before run.steps() reached its end "
            f"(train.max_steps={max_steps}); the steps since the last checkpoint would be "
            "lost. Let the loop end by itself; to end early use --train.exit_at_step."
        )


def exit_status(ended: str, stop_signal: StopSignal, restart_wait_s: float) -> int:
    """The worker's exit status once its teardown is done: 0, or after a stop what
    :func:`~elastic_ddp.worker.stop.wait_for_restart` returns (preempted ranks leave now; survivors wait for
    their agent to restart them at the new membership, so the stop costs neither steps nor one of
    torchrun's --max-restarts)."""
    if stopped(ended):
        from elastic_ddp.worker.stop import wait_for_restart

        return wait_for_restart(stop_signal, restart_wait_s)
    return 0
