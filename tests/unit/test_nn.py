"""SampleDropout: each sample's mask follows that sample's seed -- not its rank, micro-batch or
position -- at the usual rate and scaling, and is the identity when off."""

from __future__ import annotations

import pytest
import torch

from elastic_ddp.data import sample_seeds
from elastic_ddp.worker.nn import SampleDropout


def test_sample_dropout_mask_follows_the_sample_not_the_batch():
    drop = SampleDropout(0.3, site=4).train()
    x = torch.randn(8, 16, 32)
    seeds = sample_seeds(9, step=2, global_indices=range(100, 108))
    assert isinstance(seeds, list)
    full = drop(x, seeds)
    for b in range(8):
        assert torch.equal(drop(x[b : b + 1], seeds[b : b + 1])[0], full[b])
    order = [5, 2, 7, 0, 1, 6, 3, 4]
    assert torch.equal(drop(x[order], [seeds[i] for i in order]), full[order])
    assert torch.equal(drop(x, seeds), full)  # the same seeds again: the same masks
    # Another step, another site: other masks.
    assert not torch.equal(drop(x, sample_seeds(9, step=3, global_indices=range(100, 108))), full)
    assert not torch.equal(SampleDropout(0.3, site=5).train()(x, seeds), full)


def test_sample_dropout_takes_seeds_as_a_tensor_too():
    drop = SampleDropout(0.5, site=1).train()
    x = torch.randn(3, 10)
    seeds = sample_seeds(0, 1, [4, 5, 6])
    assert torch.equal(drop(x, torch.tensor(seeds)), drop(x, seeds))


def test_sample_dropout_does_not_draw_from_the_global_generator():
    drop = SampleDropout(0.5, site=0).train()
    before = torch.get_rng_state()
    drop(torch.ones(4, 8), sample_seeds(0, 0, range(4)))
    assert torch.equal(torch.get_rng_state(), before)


def test_sample_dropout_rate_and_scaling():
    drop = SampleDropout(0.25, site=0).train()
    out = drop(torch.ones(4, 64, 64), sample_seeds(0, 0, range(4)))
    zero_fraction = (out == 0).float().mean().item()
    assert abs(zero_fraction - 0.25) < 0.02
    assert torch.allclose(out[out != 0], torch.tensor(1 / 0.75))


def test_dropout_off_is_the_identity():
    x = torch.randn(2, 4, 8)
    assert SampleDropout(0.0, 0).train()(x, None) is x
    assert SampleDropout(0.5, 0).eval()(x, None) is x


def test_sample_dropout_refuses_missing_or_miscounted_seeds_and_bad_rates():
    drop = SampleDropout(0.1, site=0).train()
    with pytest.raises(ValueError, match="needs the micro-batch's sample_seeds"):
        drop(torch.ones(2, 3), None)
    with pytest.raises(ValueError, match="Got 3 sample seeds for a batch of 2"):
        drop(torch.ones(2, 3), [1, 2, 3])
    for p in (-0.1, 1.0):
        with pytest.raises(ValueError, match=rf"Dropout probability \({p}\) must be in \[0, 1\)"):
            SampleDropout(p, site=0)
