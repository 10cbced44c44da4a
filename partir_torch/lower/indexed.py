"""Local kernels for ops that address a tiled dim by positions held in another tensor (Factor.indexed).

A rank holding rows [off, off + n) of the dim shifts each position by -off and masks the positions outside its
shard: the vocabulary-parallel embedding (masked lookup -> partial sum) and cross-entropy (each rank scores the
targets in its class shard; nll_loss's ignore_index does the masking) of Megatron-LM, falling out of the rules.
"""
from __future__ import annotations

import torch

from ..rules.registry import linked
from ..sharding import chunk_size

aten = torch.ops.aten


def _shift(em, idx, off, n, fill):
    """(positions local to this shard, in-shard mask): where(off <= idx < off + n, idx - off, fill)."""
    lo = em.call(aten.ge.Tensor, idx, off)
    hi = em.call(aten.lt.Tensor, idx, em.call(aten.add.Scalar, off, n))
    mask = em.call(aten.logical_and.default, lo, hi)
    local = em.call(aten.sub.Tensor, idx, off)
    return em.call(aten.where.self, mask, local, em.call(aten.full_like.default, idx, fill)), mask


def embedding(em, args, kwargs, off, n):
    weight, idx = args[0], args[1]
    local, mask = _shift(em, idx, off, n, 0)
    out = em.call(aten.embedding.default, weight, local, *args[2:])
    keep = em.call(aten.unsqueeze.default, mask, -1)
    return em.call(aten.mul.Tensor, out, em.call(aten.type_as.default, keep, out))


def embedding_dense_backward(em, args, kwargs, off, n):
    grad, idx, num_weights, padding_idx, scale = (list(args) + [None] * 5)[:5]
    if scale:
        from ..errors import PartitionError

        raise PartitionError("an embedding with scale_grad_by_freq=True cannot be tiled on its vocabulary (the "
                             "frequency counts need every token); tile its feature dim (embedding(dim='feature')) "
                             "or keep the table replicated.")
    local, mask = _shift(em, idx, off, n, 0)
    keep = em.call(aten.unsqueeze.default, mask, -1)
    g = em.call(aten.mul.Tensor, grad, em.call(aten.type_as.default, keep, grad))
    return em.call(aten.embedding_dense_backward.default, g, local, n, -1, False)


def nll_loss_forward(em, args, kwargs, off, n):
    self_, target, weight, reduction, ignore_index = args
    local, _ = _shift(em, target, off, n, ignore_index)
    return em.call(aten.nll_loss_forward.default, self_, local, weight, reduction, ignore_index)


def nll_loss_backward(em, args, kwargs, off, n):
    grad, self_, target, weight, reduction, ignore_index, total = args
    local, _ = _shift(em, target, off, n, ignore_index)
    return em.call(aten.nll_loss_backward.default, grad, self_, local, weight, reduction, ignore_index, total)


def arange(em, args, kwargs, off, n):
    """This rank's positions [off, off + n) of arange(start, end, step): start + step * (off + arange(n))."""
    start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else 1)
    local = em.call(aten.arange.default, n, meta_shape=(n,), dtype=kwargs.get("dtype"), kwargs=kwargs)
    pos = em.call(aten.add.Tensor, local, off)
    if step != 1:
        pos = em.call(aten.mul.Scalar, pos, step)
    if start != 0:
        pos = em.call(aten.add.Scalar, pos, start)
    return pos


from .cp import sdpa_causal, sdpa_causal_backward   # noqa: E402 - causal attention at a query offset (lower/cp.py)

# op -> its kernel, for the ops whose registry row links a kernel here (rules/registry.py LINKS)
IMPLS = linked("local", "lower.indexed", globals())
SIZED = frozenset({sdpa_causal, sdpa_causal_backward})   # kernels that also take the dim's global size


def offset(em, mesh, axes, size):
    """The first position of this rank's shard of a dim of `size` split over `axes` (major to minor), each split
    into chunks of chunk_size (the last one may not divide: uneven, torch.chunk sizes): sum of coord * chunk."""
    off, n = None, size
    for a in axes:
        n = chunk_size(n, [mesh.shape[a]])
        term = em.call(aten.mul.Scalar, em.coords[a], n)
        off = term if off is None else em.call(aten.add.Tensor, off, term)
    return off
