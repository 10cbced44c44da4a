"""The held-out decoder of issue 20 (not in the zoo, so that no rule or tactic was fitted to it): a Llama-style
decoder with grouped-query attention whose kv heads are repeated with `repeat_interleave`, rotary position
embeddings, attention written out (q k^T, causal mask, softmax, @ v), RMSNorm and a SwiGLU MLP, written the way a user writes one.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary(x, cos, sin):
    """x (B, H, T, hd) rotated by position: the two halves of each head as (re, im)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.wq = nn.Linear(d, heads * self.hd, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.heads, self.hd).transpose(1, 2)       # (B, H, T, hd)
        k = self.wk(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)    # (B, KV, T, hd)
        v = self.wv(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)   # (B, H, T, hd)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)                   # (B, H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v             # (B, H, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.attn = Attention(d, heads, kv_heads)
        self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class GQADecoder(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, kv_heads=2, ffn=64, layers=2, seq=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(seq).float(), inv)                  # (T, hd / 2)
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1)[:, : hd // 2], persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1)[:, : hd // 2], persistent=False)

    def forward(self, tokens):
        T = tokens.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, cos, sin)
        return self.head(self.norm(x))


def build(seed: int = 0) -> GQADecoder:
    torch.manual_seed(seed)
    return GQADecoder()


def loss_fn(model, tokens, targets):
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def batch(batch_size: int = 8, seq: int = 16, vocab: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
