"""What the memory tier's parts share: where this rank sits, and the tier's error."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemoryTierError", "Ranks"]


class MemoryTierError(RuntimeError):
    """The memory tier cannot work as configured; the message says why and what to do."""


@dataclass(frozen=True)
class Ranks:
    """This rank in the job (``rank`` of ``world_size``) and on its node (``local_rank`` of
    ``local_world_size`` on node ``node``)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int
