"""Small control messages among a checkpoint's ranks: decisions, reports and verdicts.

All of them run on the checkpoint's own gloo group, never on the training loop's group, and all are
O(N) in bytes at most: a broadcast from one rank, a gather to rank 0, one all-reduce for "did any
rank fail". Without a process group (one process) every call is local.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.checkpoint.errors import CheckpointError, describe_error
from elastic_ddp.checkpoint.fence import StaleWriterError


@dataclass(frozen=True)
class Outcome:
    """What rank 0's call gave every rank: its ``value``, or the ``error`` it raised (never both)."""

    value: Any = None
    error: Exception | None = None

    def unwrap(self) -> Any:
        """The value; the error, raised, if the call failed."""
        if self.error is not None:
            raise self.error
        return self.value


def global_rank(group: Any, rank: int) -> int:
    """The rank ``dist`` calls expect for rank ``rank`` of ``group`` (None: the default group)."""
    return rank if group is None else dist.get_global_rank(group, rank)


class Collectives:
    """Control collectives on ``group`` (a gloo group; None with ``distributed`` False: one process).

    ``url`` names the checkpoint storage in messages about failures that happen on rank 0.
    """

    def __init__(self, group: Any, rank: int, world_size: int, *, distributed: bool, url: str) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.distributed = distributed
        self.url = url

    def broadcast(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on rank 0 and give its result to every rank; if ``fn`` raises, every rank raises it."""
        return self.attempt(fn, *args).unwrap()

    def attempt(self, fn: Callable[..., Any], *args: Any) -> Outcome:
        """Run ``fn(*args)`` on rank 0 and give every rank the :class:`Outcome`: its value or its error."""
        outcome = Outcome()
        if self.rank == 0:
            try:
                outcome = Outcome(value=fn(*args))
            except Exception as exc:  # shipped to every rank so all of them fail the same way
                # Client exceptions may not pickle; a CheckpointError carrying the message always does.
                keep = (CheckpointError, StaleWriterError)
                outcome = Outcome(error=exc if isinstance(exc, keep) else CheckpointError(describe_error(exc, self.url)))
        return self.broadcast_from(0, outcome)

    def broadcast_from(self, rank: int, value: Any) -> Any:
        """``value`` as rank ``rank`` has it, on every rank."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=global_rank(self.group, rank), group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on rank 0 (in rank order); other ranks get an empty list."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=global_rank(self.group, 0), group=self.group)
        return out or []

    def first_failure(self, failed: bool) -> int | None:
        """The lowest rank for which ``failed`` is true (one all-reduce), or None."""
        if not self.distributed:
            return 0 if failed else None
        flag = torch.tensor([self.rank if failed else self.world_size], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        first = int(flag.item())
        return None if first == self.world_size else first

    def agree(self, problem: str | None, what: str) -> None:
        """Raise the same CheckpointError on every rank if any rank has a ``problem``."""
        failed = self.first_failure(problem is not None)
        if failed is not None:
            detail = self.broadcast_from(failed, problem)
            raise CheckpointError(f"{what}: rank {failed}: {detail}")
