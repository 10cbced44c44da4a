"""Models whose step branches on tensor values (tests/test_branches.py). They live outside the test module: pytest
rewrites the `assert` statements of test modules, and these asserts must compile as Python compiles a model's."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Branchy(nn.Module):
    """`if not padding_mask.any():` (FSMT), layerdrop (M2M100: a draw per layer, a layer skipped when it is below
    p), an `.item()` whose value is a length (Flaubert's `lengths.max().item()`), and an assert on activations."""

    def __init__(self, d=8, layers=3, layerdrop=0.5):
        super().__init__()
        self.emb = nn.Linear(4, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                    for _ in range(layers))
        self.head = nn.Linear(d, 1)
        self.drop = nn.Dropout(0.1)
        self.layerdrop = layerdrop

    def forward(self, x, mask):
        h = self.drop(self.emb(x))                      # (B, T, d)
        if not mask.any():                              # no padding anywhere in the (global) batch
            h = h * 1.5
        n = int(mask.sum(1).max().item())               # the longest padded stretch: a value, not a bool
        h = torch.cat([h[:, :n] * 0.5, h[:, n:]], 1)
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            h = h + self.drop(layer(h))                 # draws after the layerdrop draw
        assert not torch.isnan(h).any()
        return self.head(h).mean()


class ParamBranch(nn.Module):
    """A branch on a parameter's value (held as ZeRO-3 shards: the guard gathers it whole)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        h = self.a(x)
        if self.a.bias.sum() > 0.15:
            h = torch.relu(h)
        return self.b(h).pow(2).mean()


class Asserting(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 1)

    def forward(self, x):
        assert torch.isfinite(x).all(), "inputs must be finite"
        return self.a(x).mean()


class MaskedLoss(nn.Module):
    """Boolean-mask indexing into the loss (Qwen2-Audio's `logits[..., :-1, :][shift_attention_mask != 0]`): a shape
    that depends on the data."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)

    def forward(self, x, labels, mask):
        logits = self.a(x)                              # (B, T, V)
        return nn.functional.cross_entropy(logits[mask != 0], labels[mask != 0])   # (n, V), (n,)


class PythonLayerdrop(nn.Module):
    """MusicGen's layerdrop: `random.uniform(0, 1)` (Python's generator, invisible to the trace)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        import random

        if self.training and random.uniform(0, 1) < 0.5:
            return self.a(x).sum() * 2
        return self.a(x).sum()


class SelectedLoss(nn.Module):
    """A loss over the selected positions only (issue 26 item 2: the count sizes the selection, nothing else):
    Qwen2-Audio's `cross_entropy(logits[mask != 0].view(-1, V), labels[mask != 0].view(-1))`, plus `x[mask].mean()`
    and a sum. `count_as_int`: the count also scales the loss as a Python int (`sel.shape[0]`), which no static
    size can answer: that selection stays a count guard."""

    def __init__(self, count_as_int=False):
        super().__init__()
        self.up, self.down = nn.Linear(4, 16), nn.Linear(16, 6)
        self.count_as_int = count_as_int

    def forward(self, x, labels, mask):
        logits = self.down(nn.functional.gelu(self.up(x)))                  # (B, T, V)
        shift_logits = logits[..., :-1, :][mask[..., 1:] != 0].contiguous()  # (n, V)
        shift_labels = labels[..., 1:][mask[..., 1:] != 0].contiguous()     # (n,)
        loss = nn.functional.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
        sel = torch.tanh(logits)[mask != 0]                                  # (m, V)
        loss = loss + sel.pow(2).mean() + 0.01 * sel.sum(-1).sum()
        if self.count_as_int:
            loss = loss * (1 + 1 / sel.shape[0])
        return loss


class MoELoop(nn.Module):
    """Hugging Face's eager MoE loop (Mixtral, Qwen2-MoE, DBRX): per expert, `torch.where` over its slice of the
    one-hot mask gives the (top-k slot, token) pairs routed to it; the expert's output, scaled by the routing
    weight, is added back with index_add_. hit=True loops only over the experts hit (`expert_hit`, a nonzero)."""

    def __init__(self, d=8, experts=4, top_k=2, hit=False):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))
                                     for _ in range(experts))
        self.inp, self.head = nn.Linear(4, d), nn.Linear(d, 1)
        self.top_k, self.hit, self.n = top_k, hit, experts

    def forward(self, x, labels, mask):
        B, T, _ = x.shape
        h = self.inp(x).reshape(B * T, -1)                                  # (tokens, d)
        probs = self.router(h).softmax(-1)
        routing_weights, selected = torch.topk(probs, self.top_k, dim=-1)   # (tokens, k)
        routing_weights = routing_weights / routing_weights.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        expert_mask = nn.functional.one_hot(selected, num_classes=self.n).permute(2, 1, 0)   # (E, k, tokens)
        if self.hit:
            hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
            loop = [e[0] for e in hit]
        else:
            loop = range(self.n)
        for e in loop:
            idx, top_x = torch.where(expert_mask[e])
            cur = self.experts[e](h[top_x]) * routing_weights[top_x, idx, None]
            out.index_add_(0, top_x, cur.to(h.dtype))
        y = self.head(out + h).reshape(B, T)
        return (y.pow(2) * mask).mean()


class _Block(nn.Module):
    """A pre-norm residual block (the residual inside it, as in HF's layers); `memory`: a decoder's cross input."""

    def __init__(self, d, cross=False):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.cross = nn.Linear(d, d) if cross else None
        self.drop = nn.Dropout(0.1)

    def forward(self, h, memory=None):
        out = h + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(h)))))
        if self.cross is not None:
            out = out + self.cross(memory).mean(1, keepdim=True)
        return out


class LayerdropEncDec(nn.Module):
    """M2M100's layerdrop: a draw per layer of an encoder and a decoder, `continue` past a skipped layer; the
    encoder's output is read only inside the decoder's layers (skipping all of them leaves the encoder without a
    gradient). residual_outside: `h = h + layer(h)` instead (not layerdrop's shape: traced as paths)."""

    def __init__(self, d=16, layers=3, layerdrop=0.5, residual_outside=False, aux=False, norm=None):
        super().__init__()
        self.emb, self.dec_emb = nn.Linear(4, d), nn.Linear(4, d)
        self.enc = nn.ModuleList(_Block(d) for _ in range(layers))
        self.dec = nn.ModuleList(_Block(d, cross=True) for _ in range(layers))
        self.head = nn.Linear(d, 1)
        self.drop = nn.Dropout(0.1)
        self.layerdrop, self.residual_outside, self.aux = layerdrop, residual_outside, aux
        if norm is not None:         # a module with running statistics inside each encoder layer
            for layer in self.enc:
                layer.norm = norm(d)

    def forward(self, x, y):
        h = self.drop(self.emb(x))
        for layer in self.enc:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            h = h + layer(h) if self.residual_outside else layer(h)
        g = self.drop(self.dec_emb(y))
        extra = 0.0
        for layer in self.dec:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            g = layer(g, h)
            if self.aux:             # DETR's auxiliary loss on every decoder layer's output
                extra = extra + self.head(g).mean()
        return self.head(g).pow(2).mean() + extra


class SplitExperts(nn.Module):
    """JetMoE's experts: the rows sorted by expert, `x.split(counts.tolist())`, one linear per chunk, `torch.cat`.
    read_count: the code also reads a count as a Python int (no static form: the counts stay guards)."""

    def __init__(self, d=8, n=4, top_k=2, read_count=False):
        super().__init__()
        self.inp, self.router = nn.Linear(4, d), nn.Linear(d, n)
        self.weight = nn.Parameter(torch.randn(n, d, d) * 0.3)
        self.n, self.top_k, self.read_count = n, top_k, read_count

    def forward(self, x):
        h = self.inp(x).flatten(0, 1)                                       # (tokens, d)
        gates, idx = torch.topk(torch.softmax(self.router(h), -1), self.top_k)
        counts = torch.zeros(h.shape[0], self.n).scatter(1, idx, 1).long().sum(0)
        sizes = counts.tolist()
        if self.read_count and sizes[0] > 100:
            h = h * 2
        order = idx.flatten().sort(0)[1]
        rows = order.div(self.top_k, rounding_mode="trunc")
        chunks = h[rows].split(sizes, dim=0)
        out = torch.cat([F.linear(c, self.weight[i]) for i, c in enumerate(chunks)], dim=0)
        out = out * gates.flatten()[order][:, None]
        y = torch.zeros_like(h).index_add(0, rows, out)
        return y.pow(2).mean()
