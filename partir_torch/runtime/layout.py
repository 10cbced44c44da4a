"""Moving between full tensors and per-rank shards of a Sharding (used by both runtimes)."""
from __future__ import annotations

import torch

from ..mesh import Mesh
from ..sharding import Sharding


def shard_of(full: torch.Tensor, sh: Sharding, mesh: Mesh, coord: dict) -> torch.Tensor:
    """The chunk of `full` held by the rank at `coord`: each dim split over its axes, major to minor; a strided
    axis (split factor s) chunks the minor part of the dim seen as (s, n / s)."""
    out = full
    for d, axes in enumerate(sh.dims):
        for a in axes:
            k = mesh.shape[a]
            s = sh.local_stride(a, mesh)
            n = out.shape[d]
            split = out.reshape(out.shape[:d] + (s, n // s) + out.shape[d + 1:])
            chunk = (n // s) // k
            part = split.narrow(d + 1, coord[a] * chunk, chunk)
            out = part.reshape(out.shape[:d] + (n // k,) + out.shape[d + 1:])
    return out.contiguous().clone()


def assemble(locals_by_rank: dict, sh: Sharding, mesh: Mesh, shape) -> torch.Tensor:
    """The full tensor from every rank's chunk (partial axes combined with their reduce op)."""
    first = next(iter(locals_by_rank.values()))
    numel = 1
    for n in shape:
        numel *= n
    index = torch.arange(numel).reshape(tuple(shape))
    partial = dict(sh.partial)
    tiled = sh.tiled_axes()
    flat = None
    for r, t in locals_by_rank.items():
        coord = mesh.coordinate(r)
        if any(coord[a] != 0 for a in mesh.axes if a not in tiled and a not in partial):
            continue
        where = shard_of(index, sh, mesh, coord).reshape(-1)
        vals = t.reshape(-1).to(first.dtype)
        if flat is None:
            flat = torch.zeros(numel, dtype=first.dtype, device=first.device)
            seen = torch.zeros(numel, dtype=torch.bool)
        op = next(iter(set(partial.values())), "sum")
        if partial and seen[where].any():
            cur = flat[where]
            flat[where] = cur + vals if op == "sum" else torch.maximum(cur, vals) if op == "max" else \
                torch.minimum(cur, vals)
        else:
            flat[where] = vals
        seen[where] = True
    return flat.reshape(tuple(shape))


def same_layout(a: Sharding, b: Sharding) -> bool:
    """The same data layout (explicitly-replicated markers aside)."""
    return tuple(map(tuple, a.dims)) == tuple(map(tuple, b.dims)) and tuple(a.partial) == tuple(b.partial) and \
        tuple(a.strides) == tuple(b.strides)
