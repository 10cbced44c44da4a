"""Tiny two-level UNet on (B, 3, 16, 16) images: conv + GroupNorm + SiLU blocks, a strided
conv and an avg-pool on the way down, nearest upsampling + channel-concat skips on the way
up, and an output conv back to 3 channels. MSE loss to a target image."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import ModelSpec, generator, make_config, seeded_build


@dataclass(frozen=True)
class UNetConfig:
    channels: int = 3
    size: int = 16  # image height = width (must be divisible by 4)
    base: int = 8  # channels at full resolution
    groups: int = 4  # GroupNorm groups


class ConvBlock(nn.Module):
    """conv3x3 (optionally strided) -> GroupNorm -> SiLU."""

    def __init__(self, cin: int, cout: int, groups: int, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1)
        self.norm = nn.GroupNorm(groups, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(self.conv(x)))


class UNet(nn.Module):
    def __init__(self, cfg: UNetConfig):
        super().__init__()
        self.cfg = cfg
        c, g = cfg.base, cfg.groups
        self.enc1 = ConvBlock(cfg.channels, c, g)  # full res
        self.enc2 = ConvBlock(c, 2 * c, g, stride=2)  # 1/2 res
        self.mid = ConvBlock(2 * c, 2 * c, g)  # 1/4 res (after avg_pool)
        self.dec2 = ConvBlock(4 * c, 2 * c, g)  # 1/2 res, after concat with enc2
        self.dec1 = ConvBlock(3 * c, c, g)  # full res, after concat with enc1
        self.out = nn.Conv2d(c, cfg.channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, S, S)
        s1 = self.enc1(x)  # (B, c, S, S)
        s2 = self.enc2(s1)  # (B, 2c, S/2, S/2)
        m = self.mid(F.avg_pool2d(s2, 2))  # (B, 2c, S/4, S/4)
        u2 = F.interpolate(m, scale_factor=2, mode="nearest")  # (B, 2c, S/2, S/2)
        u2 = self.dec2(torch.cat([u2, s2], dim=1))  # cat: (B, 4c, S/2, S/2) -> (B, 2c, ...)
        u1 = F.interpolate(u2, scale_factor=2, mode="nearest")  # (B, 2c, S, S)
        u1 = self.dec1(torch.cat([u1, s1], dim=1))  # cat: (B, 3c, S, S) -> (B, c, S, S)
        return self.out(u1)  # (B, 3, S, S)


def build(device="cpu", **overrides) -> UNet:
    return seeded_build(UNet, UNetConfig, device, **overrides)


def batch(batch_size: int = 4, device="cpu", seed: int = 0, **overrides):
    cfg = make_config(UNetConfig, overrides)
    g = generator(seed)
    shape = (batch_size, cfg.channels, cfg.size, cfg.size)
    x = torch.randn(shape, generator=g)  # (B, 3, S, S)
    y = torch.randn(shape, generator=g)  # (B, 3, S, S)
    return x.to(device), y.to(device)


def loss_fn(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


SPEC = ModelSpec(name="unet", build=build, batch=batch, loss_fn=loss_fn, batch_dims=(0, 0))
