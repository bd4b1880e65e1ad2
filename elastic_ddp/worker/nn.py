"""Per-sample randomness: layers whose random draws depend on the sample, not on the rank.

Ordinary dropout draws from the process's global generator. A checkpoint restores that generator
exactly at the same world size, so a resumed run is bitwise identical with plain ``nn.Dropout``.
At *another* world size the same sample lands on another rank, at another position of another
micro-batch, and gets another mask: the run is statistically the same, not identical.

:class:`SampleDropout` instead builds each sample's mask from that sample's own seed
(:attr:`~elastic_ddp.data.loader.MicroBatch.sample_seeds`: derived from the run's seed, the step and
the global sample index) and the dropout site: the same step computes the same gradient at any
world size, micro-batch size or after any resume.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from elastic_ddp.data.seeds import derive_seed

__all__ = ["SampleDropout"]


class SampleDropout(nn.Module):
    """Dropout whose mask for sample ``b`` depends only on ``(seeds[b], site)``.

    ``forward(x, seeds)``: ``x`` is ``[B, ...]``, ``seeds`` a sequence of ``B`` ints (the micro-batch's
    ``sample_seeds``; a list, not a tensor, so that DDP does not move it to the GPU and back). In
    training with ``p > 0`` each element is zeroed with probability ``p`` and the rest scaled by
    ``1 / (1 - p)``; otherwise ``x`` is returned unchanged. ``site`` tells dropout layers of one model
    apart (give each a distinct integer).

    Cost: masks are drawn on ``x``'s device with a generator of that device, re-seeded per sample:
    one small RNG launch per sample and site (on CUDA, B launches where plain dropout needs one).
    A mask drawn on CPU differs from one drawn on CUDA for the same seed, so the invariance holds
    among runs on the same kind of device.
    """

    def __init__(self, p: float, site: int) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout probability ({p}) must be in [0, 1).")
        self.p = p
        self.site = site

    def forward(self, x: torch.Tensor, seeds: Sequence[int] | None) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if seeds is None:
            raise ValueError(
                "SampleDropout with p > 0 in training mode needs the micro-batch's sample_seeds; without "
                "them dropout would not be reproducible at another world size."
            )
        seeds = seeds.tolist() if isinstance(seeds, torch.Tensor) else list(seeds)
        if len(seeds) != x.shape[0]:
            raise ValueError(f"Got {len(seeds)} sample seeds for a batch of {x.shape[0]}.")
        generator = torch.Generator(device=x.device)
        keep = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        for b, seed in enumerate(seeds):
            generator.manual_seed(derive_seed("site", int(seed), self.site))
            noise = torch.rand(x.shape[1:], generator=generator, device=x.device)
            keep[b] = noise >= self.p
        return x * keep / (1.0 - self.p)
