"""Llama style decoder LM: hand-written RMSNorm, real-valued rotary embeddings
(rotate-half form), grouped-query attention via SDPA, SwiGLU feed-forward, untied head."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import ModelSpec, init_normal, lm_batch_fn, lm_loss, seeded_build


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 64
    seq: int = 16
    d: int = 32
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    hidden: int = 64  # SwiGLU hidden size
    rope_theta: float = 10000.0
    eps: float = 1e-5
    # True: rope cos/sin are non-persistent buffers (capture must lift buffers to inputs).
    # False: no buffers; the tables are recomputed in forward from arange (pure factory ops).
    rope_buffers: bool = True


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq: int, head_dim: int, theta: float, device=None):
    """cos/sin tables, each (seq, head_dim), for the rotate-half rotary form."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    )  # (head_dim/2,)
    pos = torch.arange(seq, dtype=torch.float32, device=device)  # (seq,)
    ang = torch.outer(pos, inv_freq)  # (seq, head_dim/2)
    ang = torch.cat([ang, ang], dim=-1)  # (seq, head_dim)
    return ang.cos(), ang.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # each (..., head_dim/2)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, hd); cos/sin: (T, hd) broadcast over (B, H)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Causal GQA: `heads` query heads share `kv_heads` key/value heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.d % cfg.heads or cfg.heads % cfg.kv_heads:
            raise ValueError("need d % heads == 0 and heads % kv_heads == 0")
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.hd = cfg.d // cfg.heads
        self.wq = nn.Linear(cfg.d, cfg.heads * self.hd, bias=False)
        self.wk = nn.Linear(cfg.d, cfg.kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(cfg.d, cfg.kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(cfg.heads * self.hd, cfg.d, bias=False)

    def forward(self, x, cos, sin):  # x: (B, T, d)
        B, T, _ = x.shape
        H, KV, hd = self.heads, self.kv_heads, self.hd
        q = self.wq(x).reshape(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.wk(x).reshape(B, T, KV, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = self.wv(x).reshape(B, T, KV, hd).transpose(1, 2)  # (B, KV, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = k.repeat_interleave(H // KV, dim=1)  # (B, H, T, hd)
        v = v.repeat_interleave(H // KV, dim=1)  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, H * hd)  # (B, T, H*hd)
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)  # gate
        self.w3 = nn.Linear(d, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, d, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d, cfg.eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d, cfg.eps)
        self.feed_forward = FeedForward(cfg.d, cfg.hidden)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.d)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d, cfg.eps)
        self.output = nn.Linear(cfg.d, cfg.vocab, bias=False)
        if cfg.rope_buffers:
            cos, sin = rope_tables(cfg.seq, cfg.d // cfg.heads, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)  # (seq, hd)
            self.register_buffer("rope_sin", sin, persistent=False)  # (seq, hd)
        init_normal(self)

    def reset_buffers(self) -> None:
        """Recompute the rope tables in place (e.g. after a meta build + to_empty)."""
        cfg = self.cfg
        if not cfg.rope_buffers:
            return
        cos, sin = rope_tables(cfg.seq, cfg.d // cfg.heads, cfg.rope_theta, self.rope_cos.device)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: (B, T) int64
        T = tokens.shape[1]
        if self.cfg.rope_buffers:
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hd)
        else:
            hd = self.cfg.d // self.cfg.heads
            cos, sin = rope_tables(T, hd, self.cfg.rope_theta, tokens.device)  # (T, hd)
        x = self.tok_embeddings(tokens)  # (B, T, d)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))  # (B, T, vocab)


def build(device="cpu", **overrides) -> Llama:
    return seeded_build(Llama, LlamaConfig, device, **overrides)


batch = lm_batch_fn(LlamaConfig)
loss_fn = lm_loss

SPEC = ModelSpec(name="llama", build=build, batch=batch, loss_fn=loss_fn, batch_dims=(0, 0))
