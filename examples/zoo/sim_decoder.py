"""The decoder-only LM that the simulator's reference runs are rebuilt as (examples/zoo/sim_reference.py).

One module covers the published configurations: GPT/MPT (LayerNorm, GELU MLP, tied head) and Llama/MaxText
(RMSNorm, SwiGLU MLP, untied head, grouped-query attention, a head_dim that need not be d / heads, as in MaxText's
``global_parameter_scale`` models), with q, k and v in one head-major GEMM where the source fuses them
(``fused_qkv``: Megatron's GPT, llm-foundry's MPT). Positional encodings are left out: they are elementwise work of a few
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
    fused_qkv: bool = False    # one q/k/v GEMM (Megatron's linear_qkv, MPT's Wqkv), head-major; needs kv_heads == heads

    def __post_init__(self):
        if self.fused_qkv and self.kv_heads not in (0, self.heads):
            raise ValueError(f"fused_qkv needs kv_heads == heads (got heads {self.heads}, kv_heads {self.kv_heads})")

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
        self.h, self.kv, self.hd, self.fused = c.heads, c.kv_heads or c.heads, c.hd, c.fused_qkv
        if c.fused_qkv:
            self.wqkv = nn.Linear(c.d, 3 * self.h * self.hd, bias=False)
        else:
            self.wq = nn.Linear(c.d, self.h * self.hd, bias=False)
            self.wk = nn.Linear(c.d, self.kv * self.hd, bias=False)
            self.wv = nn.Linear(c.d, self.kv * self.hd, bias=False)
        self.wo = nn.Linear(self.h * self.hd, c.d, bias=False)

    def qkv(self, x):                                                  # x: (B, T, d)
        B, T, _ = x.shape
        if self.fused:
            # Megatron's layout: output rows grouped by head, [q_h k_h v_h] within a head, so that a colwise split
            # of the weight gives each tensor-parallel rank whole heads
            qkv = self.wqkv(x).reshape(B, T, self.h, 3 * self.hd)
            return [t.transpose(1, 2) for t in qkv.split(self.hd, dim=-1)]     # 3 x (B, H, T, hd)
        return (self.wq(x).reshape(B, T, self.h, self.hd).transpose(1, 2),    # (B, H, T, hd)
                self.wk(x).reshape(B, T, self.kv, self.hd).transpose(1, 2),   # (B, KV, T, hd)
                self.wv(x).reshape(B, T, self.kv, self.hd).transpose(1, 2))

    def forward(self, x):                                              # x: (B, T, d)
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
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
    if c.fused_qkv:
        plan = {"layers.*.attn.wqkv.weight": "colwise",
                **{k: v for k, v in plan.items() if not k.startswith(("layers.*.attn.wq", "layers.*.attn.wk",
                                                                      "layers.*.attn.wv"))}}
    return {**plan, "emb.weight": "vocab", **({} if c.tied else {"head.weight": "vocab"})}
