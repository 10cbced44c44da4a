"""The decoder-only LM that the simulator's reference runs are rebuilt as (benchmarks/sim_reference.py).

One module covers the published configurations: GPT/MPT (LayerNorm, GELU MLP, tied head) and Llama/MaxText
(RMSNorm, SwiGLU MLP, untied head, grouped-query attention, a head_dim that need not be d / heads, as in MaxText's
``global_parameter_scale`` models). Positional encodings are left out: they are elementwise work of a few
hundredths of a percent of the step. Names follow the zoo's Llama (``layers.N.attn.wq``...), so the Megatron plan
below and ``remat("layers.*")`` select the same modules for every row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int
    seq: int
    d: int
    heads: int
    layers: int
    hidden: int = 0            # MLP hidden size; 0 = 4d
    kv_heads: int = 0          # 0 = heads
    head_dim: int = 0          # 0 = d // heads
    gated: bool = False        # SwiGLU (w2(silu(w1 x) * w3 x)) instead of GELU
    tied: bool = True          # output head shares the embedding

    @property
    def hd(self) -> int:
        return self.head_dim or self.d // self.heads

    @property
    def ffn(self) -> int:
        return self.hidden or 4 * self.d


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Attention(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.h, self.kv, self.hd = c.heads, c.kv_heads or c.heads, c.hd
        self.wq = nn.Linear(c.d, self.h * self.hd, bias=False)
        self.wk = nn.Linear(c.d, self.kv * self.hd, bias=False)
        self.wv = nn.Linear(c.d, self.kv * self.hd, bias=False)
        self.wo = nn.Linear(self.h * self.hd, c.d, bias=False)

    def forward(self, x):                                              # x: (B, T, d)
        B, T, _ = x.shape
        q = self.wq(x).reshape(B, T, self.h, self.hd).transpose(1, 2)   # (B, H, T, hd)
        k = self.wk(x).reshape(B, T, self.kv, self.hd).transpose(1, 2)  # (B, KV, T, hd)
        v = self.wv(x).reshape(B, T, self.kv, self.hd).transpose(1, 2)
        if self.kv != self.h:
            k = k.repeat_interleave(self.h // self.kv, dim=1)          # (B, H, T, hd)
            v = v.repeat_interleave(self.h // self.kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)     # (B, H, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.h * self.hd))


class MLP(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.gated = c.gated
        self.w1 = nn.Linear(c.d, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.d, bias=False)
        self.w3 = nn.Linear(c.d, c.ffn, bias=False) if c.gated else None

    def forward(self, x):
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        norm = RMSNorm if c.gated else nn.LayerNorm
        self.norm1, self.attn, self.norm2, self.mlp = norm(c.d), Attention(c), norm(c.d), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.cfg = c
        self.emb = nn.Embedding(c.vocab, c.d)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.d) if c.gated else nn.LayerNorm(c.d)
        self.head = None if c.tied else nn.Linear(c.d, c.vocab, bias=False)

    def forward(self, tokens):                                          # tokens: (B, T) int64
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return F.linear(x, self.emb.weight) if self.head is None else self.head(x)   # (B, T, vocab)


def loss_fn(model, tokens, targets):
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


# Megatron-LM's layout (Shoeybi et al. 2019): q/k/v and the MLP's input projections split by columns, the output
# projections by rows, so each block needs one all-reduce forward and one backward per sub-layer.
MEGATRON_PLAN = {"layers.*.attn.wq.weight": "colwise", "layers.*.attn.wk.weight": "colwise",
                 "layers.*.attn.wv.weight": "colwise", "layers.*.attn.wo.weight": "rowwise",
                 "layers.*.mlp.w1.weight": "colwise", "layers.*.mlp.w3.weight": "colwise",
                 "layers.*.mlp.w2.weight": "rowwise"}


def build(c: DecoderConfig) -> Decoder:
    with torch.device("meta"):
        return Decoder(c)


def plan_for(c: DecoderConfig) -> dict:
    """Megatron's plan for this config, with the vocabulary-parallel embedding and head Megatron-LM uses."""
    plan = {k: v for k, v in MEGATRON_PLAN.items() if c.gated or "w3" not in k}
    return {**plan, "emb.weight": "vocab", **({} if c.tied else {"head.weight": "vocab"})}
