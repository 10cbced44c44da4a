"""Graph network simulator (encode-process-decode, GNS style).

Nodes (N, 8) and relative edge features are encoded by MLPs; each of the message-passing
steps gathers sender/receiver latents with index_select, updates edges with an MLP on the
concatenation, sums messages into receivers (segment sum: index_add in one step,
scatter_add in the other) and updates nodes residually; a decoder predicts (N, 2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._common import ModelSpec, generator, make_config, seeded_build


@dataclass(frozen=True)
class GNSConfig:
    node_in: int = 8
    out: int = 2
    hidden: int = 32
    aggregations: tuple = ("index_add", "scatter_add")  # one entry per message-passing step
    nodes_per_graph: int = 8
    edges_per_graph: int = 24


def mlp(cin: int, hidden: int, cout: int, layer_norm: bool = True) -> nn.Sequential:
    layers = [nn.Linear(cin, hidden), nn.SiLU(), nn.Linear(hidden, cout)]
    if layer_norm:
        layers.append(nn.LayerNorm(cout))
    return nn.Sequential(*layers)


def segment_sum(values: torch.Tensor, index: torch.Tensor, num: int, how: str) -> torch.Tensor:
    """out[i] = sum of values[e] with index[e] == i; values (E, h) -> (num, h)."""
    out = values.new_zeros(num, values.shape[1])  # (num, h)
    if how == "index_add":
        return out.index_add(0, index, values)
    if how == "scatter_add":
        return out.scatter_add(0, index.unsqueeze(1).expand_as(values), values)
    raise ValueError(f"unknown aggregation {how!r}")


class InteractionNetwork(nn.Module):
    def __init__(self, hidden: int, aggregation: str):
        super().__init__()
        self.aggregation = aggregation
        self.edge_mlp = mlp(3 * hidden, hidden, hidden)
        self.node_mlp = mlp(2 * hidden, hidden, hidden)

    def forward(self, h, e, senders, receivers):  # h: (N, hid), e: (E, hid)
        hs = h.index_select(0, senders)  # (E, hid)
        hr = h.index_select(0, receivers)  # (E, hid)
        e = e + self.edge_mlp(torch.cat([e, hs, hr], dim=-1))  # (E, hid)
        agg = segment_sum(e, receivers, h.shape[0], self.aggregation)  # (N, hid)
        h = h + self.node_mlp(torch.cat([h, agg], dim=-1))  # (N, hid)
        return h, e


class GNS(nn.Module):
    def __init__(self, cfg: GNSConfig):
        super().__init__()
        self.cfg = cfg
        self.node_encoder = mlp(cfg.node_in, cfg.hidden, cfg.hidden)
        self.edge_encoder = mlp(cfg.node_in, cfg.hidden, cfg.hidden)
        self.processor = nn.ModuleList(
            InteractionNetwork(cfg.hidden, how) for how in cfg.aggregations
        )
        self.decoder = mlp(cfg.hidden, cfg.hidden, cfg.out, layer_norm=False)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        senders, receivers = edge_index[0], edge_index[1]  # (E,), (E,)
        rel = x.index_select(0, senders) - x.index_select(0, receivers)  # (E, node_in)
        h = self.node_encoder(x)  # (N, hid)
        e = self.edge_encoder(rel)  # (E, hid)
        for step in self.processor:
            h, e = step(h, e, senders, receivers)
        return self.decoder(h)  # (N, out)


def build(device="cpu", **overrides) -> GNS:
    return seeded_build(GNS, GNSConfig, device, **overrides)


def batch(batch_size: int = 4, device="cpu", seed: int = 0, **overrides):
    """`batch_size` disjoint random graphs: N = nodes_per_graph*B, E = edges_per_graph*B."""
    cfg = make_config(GNSConfig, overrides)
    g = generator(seed)
    n, m = cfg.nodes_per_graph, cfg.edges_per_graph
    x = torch.randn(batch_size * n, cfg.node_in, generator=g)  # (N, node_in)
    offset = torch.arange(batch_size).repeat_interleave(m) * n  # (E,): first node of each graph
    senders = torch.randint(0, n, (batch_size * m,), generator=g) + offset  # (E,)
    receivers = torch.randint(0, n, (batch_size * m,), generator=g) + offset  # (E,)
    edge_index = torch.stack([senders, receivers])  # (2, E) int64
    y = torch.randn(batch_size * n, cfg.out, generator=g)  # (N, out)
    return x.to(device), edge_index.to(device), y.to(device)


def loss_fn(model, x, edge_index, y) -> torch.Tensor:
    return F.mse_loss(model(x, edge_index), y)


SPEC = ModelSpec(name="gns", build=build, batch=batch, loss_fn=loss_fn, batch_dims=(0, None, 0))
