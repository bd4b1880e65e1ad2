"""ByteGPT: shapes, weight tying, per-sample dropout that follows the sample (not its rank,
micro-batch or position), and a loss that falls on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from elastic_ddp.config import ModelConfig
from elastic_ddp.data import ByteWindows, DataCursor, ElasticSampler, StepBatches
from elastic_ddp.model import ByteGPT, SampleDropout, optimizer_groups, per_sample_loss, sample_seeds

TINY = dict(block_size=16, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny tensors: on shared CI cores, intra-op threads cost more in contention than they gain.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_model(dropout: float = 0.0, seed: int = 0) -> ByteGPT:
    torch.manual_seed(seed)
    return ByteGPT(ModelConfig(dropout=dropout, **TINY))


def tokens(batch: int, time: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, time), generator=torch.Generator().manual_seed(seed))


def test_forward_shapes_tying_and_length_check():
    model = make_model()
    assert model(tokens(3)).shape == (3, 16, 256)
    assert model(tokens(2, time=5)).shape == (2, 5, 256)
    assert model.lm_head.weight is model.wte.weight
    with pytest.raises(ValueError, match="block_size \\(16\\)"):
        model(tokens(1, time=17))


def test_same_seed_same_init():
    a, b = make_model(seed=3), make_model(seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_per_sample_loss_is_the_mean_over_positions():
    logits, y = torch.randn(4, 16, 256), tokens(4)
    losses = per_sample_loss(logits, y)
    assert losses.shape == (4,)
    torch.testing.assert_close(losses.mean(), F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    torch.testing.assert_close(losses[1], F.cross_entropy(logits[1], y[1]))


def test_sample_dropout_mask_follows_the_sample_not_the_batch():
    drop = SampleDropout(0.3, site=4).train()
    x = torch.randn(8, 16, 32)
    seeds = sample_seeds(9, step=2, global_indices=range(100, 108))
    full = drop(x, seeds)
    for b in range(8):
        assert torch.equal(drop(x[b : b + 1], seeds[b : b + 1])[0], full[b])
    order = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    assert torch.equal(drop(x[order], seeds[order]), full[order])
    # Another step, another site: other masks.
    assert not torch.equal(drop(x, sample_seeds(9, step=3, global_indices=range(100, 108))), full)
    assert not torch.equal(SampleDropout(0.3, site=5).train()(x, seeds), full)


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
    # A model with dropout in eval mode computes what the same weights without dropout compute.
    with_dropout, without = make_model(dropout=0.5), make_model(dropout=0.0)
    with_dropout.eval()
    without.train()  # p = 0: training mode changes nothing
    torch.testing.assert_close(with_dropout(tokens(2)), without(tokens(2)))


def test_model_output_of_a_sample_does_not_depend_on_its_batch():
    model = make_model(dropout=0.2).train()
    x = tokens(8)
    seeds = sample_seeds(1, step=7, global_indices=range(40, 48))
    full = model(x, seeds)
    for b in (0, 5):
        torch.testing.assert_close(model(x[b : b + 1], seeds[b : b + 1])[0], full[b], rtol=1e-5, atol=1e-5)
    other_step = model(x, sample_seeds(1, step=8, global_indices=range(40, 48)))
    assert not torch.allclose(other_step, full, atol=1e-3)
    with pytest.raises(ValueError, match="needs sample_seeds"):
        model(x)


def test_optimizer_groups_decay_matrices_only():
    model = make_model()
    decay, no_decay = optimizer_groups(model, 0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_loss_falls_within_50_cpu_steps():
    text = b"elastic training resumes where it stopped; no sample twice, none skipped.\n" * 60
    windows = ByteWindows(torch.frombuffer(bytearray(text), dtype=torch.uint8), TINY["block_size"])
    sampler = ElasticSampler(len(windows), global_batch_size=16, seed=0)
    model = make_model(dropout=0.1).train()
    optimizer = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=3e-3)
    losses = []
    for batch in StepBatches(windows, sampler, DataCursor(), rank=0, world_size=1, num_steps=50):
        for mb in batch.micro_batches:
            loss = (per_sample_loss(model(mb.x, mb.seeds), mb.y) * mb.weight).sum()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 5.0 and last < 0.6 * first, (first, last)
