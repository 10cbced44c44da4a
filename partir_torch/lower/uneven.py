"""Uneven tilings in the per-device program: padding that no value sees.

A dim of size P (its size on the rank before this axis splits it) tiled on an axis of size k that does not divide P
is split as DTensor's Shard splits it (torch.chunk): c = ceil(P / k) positions per rank, the rank at coordinate r
holding positions [r c, min((r + 1) c, P)), the last ranks fewer or none. Every rank keeps c positions, so one
program serves all ranks (and the simulator costs the largest shard); the positions past a rank's extent are
padding. Padding never reaches a value:

    collectives   all_gather: gather the padded chunks, keep the first P positions (narrow)
                  reduce_scatter / local slice: pad the whole dim with zeros to k c, then scatter or slice
    reductions    an op that reduces over the tiled dim (sum, matmul's k, amax, nll_loss's batch) reads its operand
                  with the padding filled by the reduction's identity (0, -inf, +inf; nll_loss's target by
                  ignore_index), so the partial result is exact
    elementwise   the padding is computed like any position and is never read by a reduction or kept by a gather

    >>> # vocabulary 1001 on 2 ranks: each holds 501 rows, rank 1's last row is padding
    >>> extent(em, 1001, "model")   # 501 - coord * 501 clamped to [0, 501]: 501 on rank 0, 500 on rank 1
"""
from __future__ import annotations

import torch

from ..rules import tags
from ..sharding import chunk_size

aten = torch.ops.aten


def pad_dim(em, x, shape, d: int, to: int, dtype):
    """x with dim d zero-padded at its end to `to` positions. Returns (node, shape)."""
    shape = list(shape)
    if shape[d] == to:
        return x, tuple(shape)
    pad = [0, 0] * (len(shape) - 1 - d) + [0, to - shape[d]]
    shape[d] = to
    return em.call(aten.constant_pad_nd.default, x, pad, 0.0, meta_shape=tuple(shape), dtype=dtype), tuple(shape)


def narrow_dim(em, x, shape, d: int, n: int, dtype):
    """The first n positions of dim d. Returns (node, shape)."""
    shape = list(shape)
    if shape[d] == n:
        return x, tuple(shape)
    shape[d] = n
    return em.call(aten.slice.Tensor, x, d, 0, n, meta_shape=tuple(shape), dtype=dtype), tuple(shape)


def chunk_of(parent: int, k: int, m: int = 1) -> int:
    """Positions per rank of a dim of `parent` positions split over k ranks in whole blocks of m."""
    return chunk_size(parent // m, [k]) * m


def in_extent(em, parent: int, axis: str, m: int = 1):
    """(c,) bool: which of this rank's c positions (chunk_of) hold data (the rest is padding)."""
    c = chunk_of(parent, em.mesh.shape[axis], m)
    pos = em.call(aten.arange.default, c, meta_shape=(c,), dtype=torch.int64)
    start = em.call(aten.mul.Scalar, em.coords[axis], c, meta_shape=(), dtype=torch.int64)
    glob = em.call(aten.add.Tensor, pos, start, meta_shape=(c,), dtype=torch.int64)
    return em.call(aten.lt.Scalar, glob, parent, meta_shape=(c,), dtype=torch.bool)


def fill_padding(em, x, shape, d: int, parent: int, axis: str, m: int, fill, dtype):
    """x with the padding positions of dim d (tiled unevenly on `axis` in blocks of m, parent size `parent`) set to
    `fill`."""
    keep = in_extent(em, parent, axis, m)
    bshape = [1] * len(shape)
    bshape[d] = shape[d]
    keep = em.call(aten.reshape.default, keep, bshape, meta_shape=tuple(bshape), dtype=torch.bool)
    drop = em.call(aten.logical_not.default, keep, meta_shape=tuple(bshape), dtype=torch.bool)
    return em.call(aten.masked_fill.Scalar, x, drop, fill, meta_shape=tuple(shape), dtype=dtype)


def identity(op: str, dtype):
    """The identity of a reduction (what padding must hold so that it does not change the result)."""
    if op == "sum":
        return False if dtype == torch.bool else 0
    big = torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max
    if dtype.is_floating_point:
        big = float("inf")
    return -big if op == "max" else big


# ops whose reduced operand needs another filler than the reduction's identity: operand slot -> argument index
# holding the filler. nll_loss over a padded batch: a padded target is ignore_index, so neither the loss sum nor
# total_weight counts it.
FILL_FROM_ARG = tags.FILL_FROM_ARG
