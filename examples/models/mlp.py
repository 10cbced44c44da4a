"""Three-layer GELU MLP regressor: (B, 16) -> (B, 16), MSE loss."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import ModelSpec, generator, make_config, seeded_build


@dataclass(frozen=True)
class MLPConfig:
    d_in: int = 16
    hidden: int = 64
    d_out: int = 16


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.cfg = cfg
        self.fc1 = nn.Linear(cfg.d_in, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, cfg.hidden)
        self.fc3 = nn.Linear(cfg.hidden, cfg.d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, d_in)
        x = F.gelu(self.fc1(x))  # (B, hidden)
        x = F.gelu(self.fc2(x))  # (B, hidden)
        return self.fc3(x)  # (B, d_out)


def build(device="cpu", **overrides) -> MLP:
    return seeded_build(MLP, MLPConfig, device, **overrides)


def batch(batch_size: int = 4, device="cpu", seed: int = 0, **overrides):
    cfg = make_config(MLPConfig, overrides)
    g = generator(seed)
    x = torch.randn(batch_size, cfg.d_in, generator=g)  # (B, d_in)
    y = torch.randn(batch_size, cfg.d_out, generator=g)  # (B, d_out)
    return x.to(device), y.to(device)


def loss_fn(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


SPEC = ModelSpec(name="mlp", build=build, batch=batch, loss_fn=loss_fn, batch_dims=(0, 0))
