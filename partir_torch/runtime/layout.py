"""Moving between full tensors and per-rank shards of a Sharding (used by both runtimes)."""
from __future__ import annotations

import torch

from ..mesh import Mesh
from ..sharding import Sharding, chunk_extent, chunk_size


def shard_of(full: torch.Tensor, sh: Sharding, mesh: Mesh, coord: dict, fill=0) -> torch.Tensor:
    """The chunk of `full` held by the rank at `coord`: each dim split over its axes, major to minor; a strided
    axis (split factor s) chunks the minor part of the dim seen as (s, n / s). An axis that does not divide its
    dim splits it as torch.chunk does, each rank's chunk padded with `fill` to the largest (lower/uneven.py)."""
    out = full
    for d, axes in enumerate(sh.dims):
        for a in axes:
            k = mesh.shape[a]
            s = sh.local_stride(a, mesh)
            n = out.shape[d]
            m = sh.block(a)
            if s == 1 and (n // m) % k:      # uneven: whole blocks of m positions, padding at the end
                c = chunk_size(n // m, [k]) * m
                pad = out.new_full(out.shape[:d] + (c * k - n,) + out.shape[d + 1:], fill)
                out = torch.cat([out, pad], d)
                n = c * k
            split = out.reshape(out.shape[:d] + (s, n // s) + out.shape[d + 1:])
            chunk = (n // s) // k
            part = split.narrow(d + 1, coord[a] * chunk, chunk)
            out = part.reshape(out.shape[:d] + (n // k,) + out.shape[d + 1:])
    return out.contiguous().clone()


def _plain(sh: Sharding, mesh: Mesh, shape) -> bool:
    """Each rank's chunk is a block of the full tensor reached by narrowing (no partial, no strided axis, even)."""
    return not sh.partial and not sh.uneven_dims(shape, mesh) and \
        all(sh.local_stride(a, mesh) == 1 for a in sh.tiled_axes())


def _block(full: torch.Tensor, sh: Sharding, mesh: Mesh, coord: dict) -> torch.Tensor:
    """The view of `full` that the rank at `coord` holds, for a _plain sharding (shard_of without the copy)."""
    out = full
    for d, axes in enumerate(sh.dims):
        for a in axes:
            chunk = out.shape[d] // mesh.shape[a]
            out = out.narrow(d, coord[a] * chunk, chunk)
    return out


def assemble_into(dest: torch.Tensor, locals_by_rank: dict, sh: Sharding, mesh: Mesh) -> None:
    """Write the full tensor of every rank's chunk into `dest` in place (write-through of the held state into an
    eager module, runtime/owner.py): each chunk copied into its block, no index tensors."""
    shape = tuple(dest.shape)
    if not _plain(sh, mesh, shape):
        dest.copy_(assemble(locals_by_rank, sh, mesh, shape))
        return
    tiled = sh.tiled_axes()
    with torch.no_grad():
        for r, t in locals_by_rank.items():
            coord = mesh.coordinate(r)
            if all(coord[a] == 0 for a in mesh.axes if a not in tiled):
                _block(dest, sh, mesh, coord).copy_(t)


def assemble(locals_by_rank: dict, sh: Sharding, mesh: Mesh, shape) -> torch.Tensor:
    """The full tensor from every rank's chunk (partial axes combined with their reduce op)."""
    first = next(iter(locals_by_rank.values()))
    if _plain(sh, mesh, tuple(shape)):
        out = torch.empty(tuple(shape), dtype=first.dtype, device=first.device)
        assemble_into(out, locals_by_rank, sh, mesh)
        return out
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
        where = shard_of(index, sh, mesh, coord, fill=-1).reshape(-1)
        vals = t.reshape(-1).to(first.dtype)
        if sh.uneven_dims(shape, mesh):     # padding positions hold no value
            keep = where >= 0
            where, vals = where[keep], vals[keep]
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
        tuple(a.strides) == tuple(b.strides) and tuple(a.blocks) == tuple(b.blocks)


def unpadded(t: torch.Tensor, sh: Sharding, mesh: Mesh, coord: dict, shape) -> torch.Tensor:
    """A rank's held shard without its padding: the torch.chunk-sized local tensor DTensor's Shard expects."""
    for d, (parent, axis, m) in sh.uneven_dims(shape, mesh).items():
        t = t.narrow(d, 0, chunk_extent(parent // m, mesh.shape[axis], coord[axis]) * m)
    return t


def padded(t: torch.Tensor, sh: Sharding, mesh: Mesh, shape) -> torch.Tensor:
    """A torch.chunk-sized local tensor padded with zeros to the size the program holds (the largest chunk)."""
    for d, (parent, axis, m) in sh.uneven_dims(shape, mesh).items():
        c = chunk_size(parent // m, [mesh.shape[axis]]) * m
        if t.shape[d] < c:
            t = torch.cat([t, t.new_zeros(t.shape[:d] + (c - t.shape[d],) + t.shape[d + 1:])], d)
    return t
