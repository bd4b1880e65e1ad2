"""Jittered pauses between tries of a step etcd did not answer."""

from __future__ import annotations

import random
import time

__all__ = ["Backoff"]


class Backoff:
    """Pauses between tries of something etcd did not answer, until a deadline.

    Each pause doubles from ``first`` up to ``most`` seconds and is jittered (x0.5 to x1.5), so
    that 1,000 nodes that lost etcd together do not come back in step. :meth:`pause` sleeps and
    returns True, or returns False at once when the pause would end past ``deadline`` (monotonic)
    -- the caller then gives up with the error it has.
    """

    def __init__(self, deadline: float, first: float = 0.5, most: float = 5.0) -> None:
        self.deadline = deadline
        self._first, self._most = first, most
        self._next = first

    def pause(self) -> bool:
        if time.monotonic() + self._next >= self.deadline:
            return False
        time.sleep(self._next * random.uniform(0.5, 1.5))
        self._next = min(self._next * 2, self._most)
        return True

    def reset(self) -> None:
        """etcd answered: the next pause starts short again."""
        self._next = self._first
