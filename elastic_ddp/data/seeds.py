"""Seeds that are the same in every process, on every platform, for every world size.

Python's ``hash()`` is salted per process and ``torch.initial_seed()`` differs per rank, so neither
can name a random stream that two ranks (or a restarted job) must agree on. Every seed of the data
pipeline and of dropout is instead derived here from plain integers with a cryptographic hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

_SEED_MASK = (1 << 63) - 1  # keep seeds non-negative int64, valid for torch and numpy alike


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends on ``parts`` only (stable across processes, hosts, Python versions).

    Use a string tag as the first part to keep streams of different purposes apart:
    ``derive_seed("order", seed, epoch)`` and ``derive_seed("dropout", seed, step, i)`` never collide
    by construction, even for equal numbers.
    """
    for part in parts:
        if not isinstance(part, (int, str)) or isinstance(part, bool):
            raise TypeError(f"derive_seed takes ints and strs, not {type(part).__name__} ({part!r}).")
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def sample_seeds(seed: int, step: int, global_indices: Sequence[int]) -> list[int]:
    """Per-sample random seeds of one optimizer step, one per index of ``global_indices``.

    Sample ``i`` at step ``step`` gets ``derive_seed("dropout", seed, step, i)``: the same on whichever
    rank and in whichever micro-batch it lands, different at every step (so a sample seen again in a
    later epoch gets a fresh mask), and the same again when a restarted job replays that step.
    """
    return [derive_seed("dropout", seed, step, int(i)) for i in global_indices]
