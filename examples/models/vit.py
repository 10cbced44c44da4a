"""Vision transformer classifier on (B, 3, 16, 16): 4x4 conv patch embedding, learned class
token and position embedding, pre-LN non-causal blocks (gpt naming), head on the class token."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import ModelSpec, generator, init_normal, make_config, seeded_build
from .gpt import Block


@dataclass(frozen=True)
class ViTConfig:
    image: int = 16
    patch: int = 4
    channels: int = 3
    d: int = 32
    heads: int = 4
    layers: int = 2
    classes: int = 10
    attention: str = "sdpa"  # "matmul" | "sdpa" (always non-causal)


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        n_patches = (cfg.image // cfg.patch) ** 2
        self.patch_embed = nn.Conv2d(cfg.channels, cfg.d, cfg.patch, stride=cfg.patch)
        self.cls_token = nn.Parameter(torch.empty(1, 1, cfg.d))
        self.pos_embed = nn.Parameter(torch.empty(1, 1 + n_patches, cfg.d))
        self.layers = nn.ModuleList(
            Block(cfg.d, cfg.heads, causal=False, impl=cfg.attention) for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.classes)
        init_normal(self)
        nn.init.normal_(self.cls_token, 0.0, 0.02)
        nn.init.normal_(self.pos_embed, 0.0, 0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # images: (B, C, S, S)
        B = images.shape[0]
        x = self.patch_embed(images)  # (B, d, S/p, S/p)
        x = x.flatten(2).transpose(1, 2)  # (B, P, d), P = (S/p)^2 patches
        cls = self.cls_token.expand(B, -1, -1)  # (B, 1, d)
        x = torch.cat([cls, x], dim=1) + self.pos_embed  # (B, 1+P, d)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, 0]))  # (B, classes)


def build(device="cpu", **overrides) -> ViT:
    return seeded_build(ViT, ViTConfig, device, **overrides)


def batch(batch_size: int = 4, device="cpu", seed: int = 0, **overrides):
    cfg = make_config(ViTConfig, overrides)
    g = generator(seed)
    images = torch.randn(batch_size, cfg.channels, cfg.image, cfg.image, generator=g)
    labels = torch.randint(0, cfg.classes, (batch_size,), generator=g)  # (B,) int64
    return images.to(device), labels.to(device)


def loss_fn(model, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(images), labels)


SPEC = ModelSpec(name="vit", build=build, batch=batch, loss_fn=loss_fn, batch_dims=(0, 0))
