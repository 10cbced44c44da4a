"""Small mixture-of-experts LM: GPT-style embeddings/attention, each block's MLP replaced
by a top-k routed MoE whose experts are stacked parameters w1 (E, d, h) and w2 (E, h, d).

dispatch="onehot": every expert runs on every token; outputs are combined densely with
    one_hot(top-k indices) * gates (einsum over the expert dim); the one-hot is built by
    comparing against arange(E), since F.one_hot is not fake-traceable.
dispatch="index":  each token's k chosen experts' weights are gathered with index_select
    and applied with bmm. Both are free of data-dependent shapes and give equal results.
dispatch="capacity": GShard's dispatch. Each sequence is a group; every expert takes at most C tokens of a
    group (C = ceil(capacity_factor * top_k * T / E), first-choice assignments before second-choice ones,
    tokens past capacity dropped: their MoE output is 0 and the residual carries them). Tokens are moved into
    per-expert buffers (B, E, C, d) by a one-hot dispatch einsum, the experts run as batched einsums, and a
    gate-weighted combine einsum brings them back. With groups and experts tiled on one mesh axis, the buffers
    travel by all_to_all. With capacity_factor >= E / top_k no token is dropped and it equals "onehot".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import ModelSpec, init_normal, lm_batch_fn, lm_loss, seeded_build
from .gpt import Attention


@dataclass(frozen=True)
class MoEConfig:
    vocab: int = 64
    seq: int = 16
    d: int = 32
    heads: int = 4
    layers: int = 2
    experts: int = 4
    top_k: int = 2
    hidden: int = 64  # per-expert hidden size
    dispatch: str = "onehot"  # "onehot" | "index" | "capacity"
    capacity_factor: float = 1.25  # dispatch="capacity": expert buffer size relative to an even split


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        if cfg.dispatch not in ("onehot", "index", "capacity"):
            raise ValueError(f"unknown dispatch {cfg.dispatch!r}")
        self.experts, self.top_k, self.dispatch = cfg.experts, cfg.top_k, cfg.dispatch
        self.capacity_factor = cfg.capacity_factor
        self.router = nn.Linear(cfg.d, cfg.experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(cfg.experts, cfg.d, cfg.hidden))
        self.w2 = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.d))
        nn.init.normal_(self.w1, 0.0, 0.02)
        nn.init.normal_(self.w2, 0.0, 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, d)
        if self.dispatch == "capacity":
            return self._capacity_forward(x)
        B, T, D = x.shape
        E, K = self.experts, self.top_k
        xf = x.reshape(B * T, D)  # (N, d), N = B*T tokens
        probs = self.router(xf).softmax(dim=-1)  # (N, E)
        gates, idx = probs.topk(K, dim=-1)  # (N, K) each
        gates = gates / gates.sum(dim=-1, keepdim=True)  # renormalise over chosen experts
        if self.dispatch == "onehot":
            # one_hot(idx, E) as a comparison: F.one_hot range-checks idx with a data-dependent
            # .item(), which fake-tensor tracing rejects.
            one_hot = (idx.unsqueeze(-1) == torch.arange(E, device=idx.device)).to(x.dtype)
            combine = (one_hot * gates.unsqueeze(-1)).sum(1)  # (N, K, E) -> (N, E)
            h = F.gelu(torch.einsum("nd,edh->enh", xf, self.w1))  # (E, N, h)
            y = torch.einsum("enh,ehd->end", h, self.w2)  # (E, N, d)
            out = torch.einsum("ne,end->nd", combine, y)  # (N, d)
        else:
            flat = idx.reshape(-1)  # (N*K,): expert of each (token, slot)
            w1 = self.w1.index_select(0, flat)  # (N*K, d, h)
            w2 = self.w2.index_select(0, flat)  # (N*K, h, d)
            xk = xf.repeat_interleave(K, dim=0).unsqueeze(1)  # (N*K, 1, d)
            h = F.gelu(torch.bmm(xk, w1))  # (N*K, 1, h)
            y = torch.bmm(h, w2).reshape(B * T, K, D)  # (N, K, d)
            out = (y * gates.unsqueeze(-1)).sum(1)  # (N, d)
        return out.reshape(B, T, D)  # (B, T, d)

    def _capacity_forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, d), one group per sequence
        B, T, D = x.shape
        E, K = self.experts, self.top_k
        C = min(T, math.ceil(self.capacity_factor * K * T / E))  # tokens per expert per group
        probs = self.router(x).softmax(dim=-1)  # (B, T, E)
        gates, idx = probs.topk(K, dim=-1)  # (B, T, K)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        # positions are counted in fp32 (exact to 2^24; bf16 would round them past 256 tokens per group)
        mask = (idx.unsqueeze(-1) == torch.arange(E, device=x.device)).to(torch.float32)  # (B, T, K, E)
        # position of each assignment in its expert's buffer: all first choices of the group, then all second
        # choices (GShard's priority), each in token order
        by_slot = mask.transpose(1, 2).reshape(B, K * T, E)
        pos = ((by_slot.cumsum(dim=1) - 1.0) * by_slot).reshape(B, K, T, E).transpose(1, 2)  # (B, T, K, E)
        keep = mask * (pos < C).to(torch.float32)
        slot = ((pos.unsqueeze(-1) == torch.arange(C, device=x.device)).to(torch.float32)
                * keep.unsqueeze(-1)).to(x.dtype)  # (B, T, K, E, C) one-hot slot of each assignment
        dispatch = slot.sum(dim=2)  # (B, T, E, C): a token occupies one slot of each chosen expert
        combine = (slot * gates.unsqueeze(-1).unsqueeze(-1)).sum(dim=2)  # (B, T, E, C)
        expert_in = torch.einsum("btec,btd->becd", dispatch, x)  # (B, E, C, d)
        h = F.gelu(torch.einsum("becd,edh->bech", expert_in, self.w1))
        y = torch.einsum("bech,ehd->becd", h, self.w2)  # (B, E, C, d)
        return torch.einsum("btec,becd->btd", combine, y)  # (B, T, d)


class MoEBlock(nn.Module):
    """x + attn(ln1(x)), then x + moe(ln2(x))."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d)
        self.attn = Attention(cfg.d, cfg.heads, causal=True, impl="sdpa")
        self.ln2 = nn.LayerNorm(cfg.d)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoELM(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d)
        self.wpe = nn.Embedding(cfg.seq, cfg.d)
        self.layers = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d)
        init_normal(self)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens: (B, T) int64
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe.weight[:T]  # (B, T, d)
        for layer in self.layers:
            x = layer(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied head: (B, T, vocab)


def build(device="cpu", **overrides) -> MoELM:
    return seeded_build(MoELM, MoEConfig, device, **overrides)


batch = lm_batch_fn(MoEConfig)
loss_fn = lm_loss

SPEC = ModelSpec(name="moe", build=build, batch=batch, loss_fn=loss_fn, batch_dims=(0, 0))
