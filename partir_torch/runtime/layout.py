"""Moving between full tensors and per-rank shards of a Sharding (used by both runtimes)."""
from __future__ import annotations

import torch

from ..mesh import Mesh
from ..sharding import Sharding


def shard_of(full: torch.Tensor, sh: Sharding, mesh: Mesh, coord: dict) -> torch.Tensor:
    """The chunk of `full` held by the rank at `coord`: each dim split over its axes, major to minor."""
    out = full
    for d, axes in enumerate(sh.dims):
        if not axes:
            continue
        idx, k = 0, 1
        for a in axes:
            idx = idx * mesh.shape[a] + coord[a]
            k *= mesh.shape[a]
        size = full.shape[d] // k
        out = out.narrow(d, idx * size, size)
    return out.contiguous().clone()


def assemble(locals_by_rank: dict, sh: Sharding, mesh: Mesh, shape) -> torch.Tensor:
    """The full tensor from every rank's chunk (partial axes summed / maxed / mined)."""
    tiled = sh.tiled_axes()
    partial = dict(sh.partial)
    first = next(iter(locals_by_rank.values()))
    full = torch.empty(tuple(shape), dtype=first.dtype, device=first.device)
    acc: dict = {}
    for r, t in locals_by_rank.items():
        coord = mesh.coordinate(r)
        if any(coord[a] != 0 for a in mesh.axes if a not in tiled and a not in partial):
            continue
        key = tuple(coord[a] for a in mesh.axes if a in tiled)
        acc.setdefault(key, []).append(t)
    for key, parts in acc.items():
        t = parts[0]
        ops = set(partial.values())
        if len(parts) > 1:
            op = ops.pop() if ops else "sum"
            stack = torch.stack(parts)
            t = stack.sum(0) if op == "sum" else stack.amax(0) if op == "max" else stack.amin(0)
        coord = dict(zip([a for a in mesh.axes if a in tiled], key))
        view = full
        for d, axes in enumerate(sh.dims):
            if not axes:
                continue
            idx, k = 0, 1
            for a in axes:
                idx = idx * mesh.shape[a] + coord[a]
                k *= mesh.shape[a]
            size = shape[d] // k
            view = view.narrow(d, idx * size, size)
        view.copy_(t)
    return full
