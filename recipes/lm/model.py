"""ByteGPT: a small nanoGPT-like causal transformer over the 256 byte values.

Its one unusual part is dropout: :class:`~elastic_ddp.worker.nn.SampleDropout` builds each sample's mask
from that sample's own seed, so the same step computes the same gradient at any world size,
micro-batch size or after any resume (plain ``nn.Dropout`` gives that only at the same world size).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from elastic_ddp.config import Section
from elastic_ddp.worker.nn import SampleDropout

__all__ = ["ByteGPT", "ByteGPTConfig", "optimizer_groups", "warmup_cosine"]

VOCAB_SIZE = 256  # one token per byte value: no tokenizer to version or ship


class ByteGPTConfig(Section):
    """Shape of the byte-level transformer (the recipe's ``model`` section). Every field shapes the
    checkpoint, so all are part of the run's identity."""

    identity: ClassVar[bool] = True

    block_size: int = Field(default=64, gt=0, description="Context length in bytes.")
    n_layer: int = Field(default=2, gt=0, description="Number of transformer blocks.")
    n_head: int = Field(default=4, gt=0, description="Attention heads per block.")
    n_embd: int = Field(default=128, gt=0, description="Embedding width; a multiple of model.n_head.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout probability (per-sample masks).")

    @model_validator(mode="after")
    def _check_heads(self) -> ByteGPTConfig:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be a multiple of model.n_head ({self.n_head})."
            )
        return self


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ByteGPTConfig, site: int) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.drop = SampleDropout(cfg.dropout, site)

    def forward(self, x: torch.Tensor, seeds: Sequence[int] | None) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        # No dropout inside attention: SDPA's dropout uses the global RNG (see SampleDropout).
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.0)
        y = y.transpose(1, 2).contiguous().view(batch, time, width)
        return self.drop(self.proj(y), seeds)


class MLP(nn.Module):
    def __init__(self, cfg: ByteGPTConfig, site: int) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = SampleDropout(cfg.dropout, site)

    def forward(self, x: torch.Tensor, seeds: Sequence[int] | None) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))), seeds)


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: ByteGPTConfig, index: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg, site=1 + 2 * index)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg, site=2 + 2 * index)

    def forward(self, x: torch.Tensor, seeds: Sequence[int] | None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), seeds)
        return x + self.mlp(self.ln2(x), seeds)


class ByteGPT(nn.Module):
    """Causal language model over bytes, shaped by :class:`ByteGPTConfig`.

    Token and position embeddings, ``n_layer`` pre-LN blocks, a final LayerNorm and an output layer
    tied to the token embedding. Parameters are initialised from torch's global RNG: the caller seeds
    it (``torch.manual_seed(cfg.train.seed)``) so that every rank starts from the same weights.
    """

    def __init__(self, cfg: ByteGPTConfig) -> None:
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

    def forward(self, x: torch.Tensor, sample_seeds: Sequence[int] | None = None) -> torch.Tensor:
        """Logits ``[B, T, 256]`` for byte tokens ``x`` (``int64 [B, T]``, ``T <= block_size``).

        ``sample_seeds`` (``int64 [B]``, from :func:`sample_seeds`, on any device) is needed in
        training mode with dropout > 0 and ignored otherwise.
        """
        if x.dim() != 2 or x.shape[1] > self.block_size:
            raise ValueError(
                f"ByteGPT takes tokens of shape [batch, time] with time <= block_size "
                f"({self.block_size}); got {tuple(x.shape)}."
            )
        positions = torch.arange(x.shape[1], device=x.device)
        h = self.drop(self.wte(x) + self.wpe(positions), sample_seeds)
        for block in self.blocks:
            h = block(h, sample_seeds)
        return self.lm_head(self.ln_f(h))


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: weight decay on matrices and embeddings, none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def warmup_cosine(warmup_steps: int, max_steps: int, min_ratio: float):
    """An ``LambdaLR`` factor: linear warm-up to 1, then cosine decay to ``min_ratio`` at ``max_steps``.

    A pure function of the step, so a resumed run follows exactly the curve of an uninterrupted one.
    """

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(max_steps - warmup_steps, 1)
        progress = min(max(step - warmup_steps, 0) / span, 1.0)
        return min_ratio + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - min_ratio)

    return factor
