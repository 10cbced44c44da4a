"""Models whose step branches on tensor values (tests/test_branches.py). They live outside the test module: pytest
rewrites the `assert` statements of test modules, and these asserts must compile as Python compiles a model's."""
from __future__ import annotations

import torch
import torch.nn as nn


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
