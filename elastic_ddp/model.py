"""ByteGPT: a small nanoGPT-like causal transformer over the 256 byte values.

Its one unusual part is dropout. Ordinary dropout draws from the process's global RNG, so a
sample's mask depends on which rank it lands on, how many samples precede it in the micro-batch
and how often the job restarted. :class:`SampleDropout` instead builds each sample's mask from that
sample's own seed (see :func:`sample_seeds`: derived from the run's seed, the step and the global
sample index) and the dropout site's index: the same step computes the same gradient at any world
size, micro-batch size or after any resume.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from elastic_ddp.config import ModelConfig
from elastic_ddp.data.seeds import derive_seed, sample_seeds

__all__ = ["ByteGPT", "SampleDropout", "optimizer_groups", "per_sample_loss", "sample_seeds"]

VOCAB_SIZE = 256  # one token per byte value: no tokenizer to version or ship


class SampleDropout(nn.Module):
    """Dropout whose mask for sample ``b`` depends only on ``(seeds[b], site)``.

    ``forward(x, seeds)``: ``x`` is ``[B, ...]``, ``seeds`` an ``int64 [B]`` tensor. In training with
    ``p > 0`` each element is zeroed with probability ``p`` and the rest scaled by ``1 / (1 - p)``;
    otherwise ``x`` is returned unchanged.

    Masks are drawn on ``x``'s device with a generator of that device, re-seeded per sample: no
    host-to-device copy, but one small RNG launch per sample and site (on CUDA, B launches where
    plain dropout needs one). A mask drawn on CPU differs from one drawn on CUDA for the same seed,
    so the invariance holds among runs on the same kind of device.
    """

    def __init__(self, p: float, site: int) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout probability ({p}) must be in [0, 1).")
        self.p = p
        self.site = site

    def forward(self, x: torch.Tensor, seeds: torch.Tensor | None) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if seeds is None:
            raise ValueError(
                "ByteGPT with dropout > 0 in training mode needs sample_seeds (see "
                "elastic_ddp.model.sample_seeds); without them dropout would not be reproducible."
            )
        if seeds.shape != (x.shape[0],):
            raise ValueError(f"sample_seeds has shape {tuple(seeds.shape)}; expected ({x.shape[0]},).")
        generator = torch.Generator(device=x.device)
        keep = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        for b, seed in enumerate(seeds.tolist()):
            generator.manual_seed(derive_seed("site", seed, self.site))
            noise = torch.rand(x.shape[1:], generator=generator, device=x.device)
            keep[b] = noise >= self.p
        return x * keep / (1.0 - self.p)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, site: int) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.drop = SampleDropout(cfg.dropout, site)

    def forward(self, x: torch.Tensor, seeds: torch.Tensor | None) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        # No dropout inside attention: SDPA's dropout uses the global RNG (see SampleDropout).
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(batch, time, width)
        return self.drop(self.proj(y), seeds)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, site: int) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = SampleDropout(cfg.dropout, site)

    def forward(self, x: torch.Tensor, seeds: torch.Tensor | None) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))), seeds)


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg, site=1 + 2 * index)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg, site=2 + 2 * index)

    def forward(self, x: torch.Tensor, seeds: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), seeds)
        return x + self.mlp(self.ln2(x), seeds)


class ByteGPT(nn.Module):
    """Causal language model over bytes, shaped by :class:`ModelConfig`.

    Token and position embeddings, ``n_layer`` pre-LN blocks, a final LayerNorm and an output layer
    tied to the token embedding. Parameters are initialised from torch's global RNG: the caller seeds
    it (``torch.manual_seed(cfg.train.seed)``) so that every rank starts from the same weights.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(VOCAB_SIZE, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = SampleDropout(cfg.dropout, site=0)
        self.blocks = nn.ModuleList(Block(cfg, index) for index in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: fewer parameters, better small models
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream keeps its
        # variance from growing with depth.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor, sample_seeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, 256]`` for byte tokens ``x`` (``int64 [B, T]``, ``T <= block_size``).

        ``sample_seeds`` (``int64 [B]``, from :func:`sample_seeds`, on any device) is needed in
        training mode with dropout > 0 and ignored otherwise.
        """
        if x.dim() != 2 or x.shape[1] > self.block_size:
            raise ValueError(
                f"ByteGPT takes tokens of shape [batch, time] with time <= block_size "
                f"({self.block_size}); got {tuple(x.shape)}."
            )
        if sample_seeds is not None:
            # Seeds are only read as Python ints (to seed generators); DDP moves every tensor input
            # to the GPU, so fetch them back once here instead of once per dropout site.
            sample_seeds = sample_seeds.cpu()
        positions = torch.arange(x.shape[1], device=x.device)
        h = self.drop(self.wte(x) + self.wpe(positions), sample_seeds)
        for block in self.blocks:
            h = block(h, sample_seeds)
        return self.lm_head(self.ln_f(h))


def per_sample_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each sample, averaged over its positions: ``float [B]``.

    Weight and sum these (see ``elastic_ddp.data.rank_loss_scale``) rather than taking a batch
    mean, so that uneven splits across ranks and micro-batches give the global-batch mean gradient.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # a low-precision log-softmax over 256 classes loses too much
    losses = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    return losses.view(y.shape).mean(dim=1)


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: weight decay on matrices and embeddings, none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
