"""Shared pieces of the model zoo: the ModelSpec record, seeded building, LM helpers."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelSpec:
    """Everything a test or benchmark needs to build, feed and train one zoo model."""

    name: str
    build: Callable[..., nn.Module]  # build(device="cpu", **config_overrides) -> nn.Module
    batch: Callable[..., tuple]  # batch(batch_size=4, device="cpu", seed=0, **config_overrides)
    loss_fn: Callable  # loss_fn(model, *batch) -> scalar; only calls model(*inputs)
    batch_dims: tuple[Optional[int], ...]  # sample dim of each batch tensor (None: no batch dim)


def make_config(config_cls, overrides: dict):
    """Default config of `config_cls` with `overrides` applied (unknown keys raise)."""
    return dataclasses.replace(config_cls(), **overrides)


def seeded_build(model_cls, config_cls, device="cpu", **overrides) -> nn.Module:
    """Build `model_cls(config)` with torch.manual_seed(0), leaving the global RNG untouched.

    Weights are always drawn on CPU (so every real device gets the same values) and then
    moved; device="meta" constructs directly on meta, allocating nothing.
    """
    cfg = make_config(config_cls, overrides)
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if device.type == "meta":
            with torch.device("meta"):
                return model_cls(cfg)
        return model_cls(cfg).to(device)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def init_normal(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2 style init: N(0, std) for Linear/Embedding weights, zero biases."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


def lm_batch_fn(config_cls):
    """batch(batch_size, device, seed, **overrides) -> (tokens (B, T), targets (B, T)) int64."""

    def batch(batch_size: int = 4, device="cpu", seed: int = 0, **overrides):
        cfg = make_config(config_cls, overrides)
        seq = torch.randint(0, cfg.vocab, (batch_size, cfg.seq + 1), generator=generator(seed))
        tokens = seq[:, :-1].contiguous()  # (B, T)
        targets = seq[:, 1:].contiguous()  # (B, T): next-token targets
        return tokens.to(device), targets.to(device)

    return batch


def lm_loss(model, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over (B*T, vocab)."""
    logits = model(tokens)  # (B, T, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
