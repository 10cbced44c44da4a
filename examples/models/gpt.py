"""GPT-2 style decoder-only LM: learned positions, pre-LayerNorm blocks, GELU MLP, tied head.

Attention is written either with explicit matmul + causal mask + softmax ("matmul")
or with F.scaled_dot_product_attention ("sdpa"). `Attention`, `MLP` and `Block` are
reused by the MoE and ViT models.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import ModelSpec, init_normal, lm_batch_fn, lm_loss, seeded_build


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq: int = 16
    d: int = 32
    heads: int = 4
    layers: int = 2
    attention: str = "matmul"  # "matmul" | "sdpa"
    dropout: float = 0.0


class Attention(nn.Module):
    """Multi-head self-attention with separate wq/wk/wv/wo Linear(d, d) projections."""

    def __init__(self, d: int, heads: int, causal: bool = True, impl: str = "matmul",
                 dropout: float = 0.0):
        super().__init__()
        if d % heads:
            raise ValueError(f"d={d} not divisible by heads={heads}")
        if impl not in ("matmul", "sdpa"):
            raise ValueError(f"unknown attention impl {impl!r}")
        self.heads, self.causal, self.impl, self.dropout = heads, causal, impl, dropout
        self.wq = nn.Linear(d, d)
        # no key bias: it shifts every logit of a row equally, so its gradient is exactly zero and only rounding
        # noise reaches AdamW (which would turn it into +-lr steps that differ with the summation order)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d)
        self.wo = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, d)
        B, T, D = x.shape
        H = self.heads
        hd = D // H
        q = self.wq(x).reshape(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.wk(x).reshape(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        v = self.wv(x).reshape(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        if self.impl == "sdpa":
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (B, H, T, T)
            if self.causal:
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # (T, T)
                att = att.masked_fill(~mask, float("-inf"))
            att = att.softmax(dim=-1)
            if self.dropout > 0:
                att = F.dropout(att, self.dropout, self.training)
            y = att @ v  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, D)  # (B, T, d)
        return self.wo(y)


class MLP(nn.Module):
    """GELU feed-forward d -> hidden -> d (hidden defaults to 4d)."""

    def __init__(self, d: int, hidden: int | None = None):
        super().__init__()
        hidden = hidden or 4 * d
        self.w1 = nn.Linear(d, hidden)
        self.w2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


def _dropout(p: float) -> nn.Module:
    # No dropout op at all in the graph unless asked for.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d: int, heads: int, causal: bool = True, impl: str = "matmul",
                 dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, causal=causal, impl=impl, dropout=dropout)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)
        self.drop = _dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d)
        self.wpe = nn.Embedding(cfg.seq, cfg.d)
        self.drop = _dropout(cfg.dropout)
        self.layers = nn.ModuleList(
            Block(cfg.d, cfg.heads, causal=True, impl=cfg.attention, dropout=cfg.dropout)
            for _ in range(cfg.layers)
        )
        self.ln_f = nn.LayerNorm(cfg.d)
        init_normal(self)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: (B, T) int64
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe.weight[:T]  # (B, T, d)
        x = self.drop(x)
        for layer in self.layers:
            x = layer(x)
        x = self.ln_f(x)
        return F.linear(x, self.wte.weight)  # tied head: (B, T, vocab)


def build(device="cpu", **overrides) -> GPT:
    return seeded_build(GPT, GPTConfig, device, **overrides)


batch = lm_batch_fn(GPTConfig)
loss_fn = lm_loss

SPEC = ModelSpec(name="gpt", build=build, batch=batch, loss_fn=loss_fn, batch_dims=(0, 0))
