"""Batch norm with per-rank statistics: data_parallel(axis, batchnorm="local"), what DDP does by default.

The step is captured as "ghost" batch norm over G groups of the batch, G the size of the data-parallel axis: the
batch (N, C, *) is viewed as (G, N/G, C, *) and each group is normalised by its own statistics, (G, C). With the
batch tiled on the axis, group g is rank g's shard, so the statistics and the backward's sums are local: no
collective. The one-device program is exactly DDP's (each rank's slice through the eager module in train mode,
the gradients averaged), so it is checked like any other program, not trusted.

Running statistics: DDP updates each rank's buffers from its own batch and broadcasts rank 0's at the start of the
next forward (broadcast_buffers=True), so what it keeps (and checkpoints) is rank 0's update: group 0's statistics.
Here the update reads group 0's (mean, var) through a one-hot sum over the groups: a (2, C) partial sum on the
axis, all-reduced once per norm and needed only by the state written at the end of the step (bucketed with the
other norms'). Every rank then holds rank 0's buffers, as DDP's ranks do after its broadcast.
"""
from __future__ import annotations

import torch

from ..errors import PartitionError
from .decompositions import _acc_dtype, _affine, _bn_backward, _bn_eval, _stat_dtype

aten = torch.ops.aten


def _grouped(t, g):
    return aten.view.default(t, [g, t.shape[0] // g] + list(t.shape[1:]))         # (N, C, *) -> (G, N/G, C, *)


def _group_count(x, groups):
    """Elements per channel in one group; the batch must split into `groups` equal groups."""
    if x.dim() < 2 or x.shape[0] % groups:
        raise PartitionError(f"data_parallel(batchnorm='local'): a batch norm's input of shape {tuple(x.shape)} "
                             f"cannot be split into {groups} per-rank batches (one per rank of the data-parallel "
                             f"axis, size {groups}): {groups} does not divide the batch {x.shape[0] if x.dim() else 0}. "
                             f"Use a batch size divisible by {groups}, or batchnorm='global'.")
    return x.numel() // x.shape[1] // groups


def _per_group(t, ndim):
    return aten.view.default(t, [t.shape[0], 1, t.shape[1]] + [1] * (ndim - 3))     # (G, C) -> (G, 1, C, 1, ...)


def _group_stats(xg, n):
    """(mean, biased var) per group, (G, C) each, two passes in the accumulation dtype as eager's kernel."""
    red = [1] + list(range(3, xg.dim()))
    acc = _stat_dtype(xg)
    mean = aten.div.Scalar(aten.sum.dim_IntList(xg, red, dtype=acc), n)                # (G, C)
    xc = aten.sub.Tensor(xg.to(acc), _per_group(mean, xg.dim()))                       # (G, N/G, C, *)
    var = aten.div.Scalar(aten.sum.dim_IntList(aten.mul.Tensor(xc, xc), red), n)
    return mean, var, xc


def _rank0_update(mean, var, running_mean, running_var, momentum, n):
    """Running statistics updated from group 0's (mean, var): sum_g onehot0[g] * stats[g]."""
    if running_mean is None and running_var is None:
        return None, None
    g = mean.shape[0]
    stats = aten.stack.default([mean, var], 1)                                          # (G, 2, C)
    first = aten.eq.Scalar(aten.arange.default(g, device=mean.device), 0).to(stats.dtype)   # (G,) one-hot
    s0 = aten.sum.dim_IntList(aten.mul.Tensor(stats, aten.view.default(first, [g, 1, 1])), [0])   # (2, C)
    m0, v0 = aten.select.int(s0, 0, 0), aten.select.int(s0, 0, 1)
    new_mean = new_var = None
    if running_mean is not None:
        new_mean = aten.add.Tensor(aten.mul.Scalar(m0, momentum), aten.mul.Scalar(running_mean, 1 - momentum))
        new_mean = new_mean.to(running_mean.dtype)
    if running_var is not None:
        unbiased = aten.mul.Scalar(v0, n / max(n - 1, 1))
        new_var = aten.add.Tensor(aten.mul.Scalar(unbiased, momentum), aten.mul.Scalar(running_var, 1 - momentum))
        new_var = new_var.to(running_var.dtype)
    return new_mean, new_var


def _train(groups, x, weight, bias, running_mean, running_var, momentum, eps):
    """(out, save_mean (G, C), save_rstd (G, C), new running mean, new running var)."""
    n = _group_count(x, groups)
    xg = _grouped(x.to(_acc_dtype(x.dtype)), groups)
    mean, var, xc = _group_stats(xg, n)
    rstd = aten.rsqrt.default(aten.add.Scalar(var, eps))
    out = aten.view.default(aten.mul.Tensor(xc, _per_group(rstd, xg.dim())), list(x.shape)).to(xg.dtype)
    out = _affine(out, weight, bias)
    new_mean, new_var = _rank0_update(mean, var, running_mean, running_var, momentum, n)
    save = x.dtype if x.device.type == "cpu" else xg.dtype
    return out.to(x.dtype), mean.to(save), rstd.to(save), new_mean, new_var


def _backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask):
    """Grouped statistics (save_mean (G, C)) come from _train: each group's dx from its own sums of dy and
    dy * (x - mean); the weight and bias gradients sum over the groups (partial over the ranks, reduced with the
    other gradients). Anything else is the global kernel's."""
    if not (train and save_mean is not None and save_mean.dim() == 2):
        return _bn_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                            output_mask)
    g = save_mean.shape[0]
    acc = _acc_dtype(x.dtype)
    dy, xg = _grouped(grad_out.to(acc), g), _grouped(x.to(acc), g)                    # (G, N/G, C, *)
    red = [1] + list(range(3, xg.dim()))
    n = x.numel() // x.shape[1] // g
    mean, invstd = save_mean.to(acc), save_invstd.to(acc)
    xc = aten.sub.Tensor(xg, _per_group(mean, xg.dim()))
    s64 = _stat_dtype(dy)
    gsum = aten.sum.dim_IntList(dy, red, dtype=s64).to(acc)                              # (G, C)
    dot = aten.sum.dim_IntList(aten.mul.Tensor(dy, xc), red, dtype=s64).to(acc)
    grad_input = None
    if output_mask[0]:
        proj = aten.mul.Tensor(xc, _per_group(aten.mul.Tensor(aten.div.Scalar(dot, n),
                                                              aten.mul.Tensor(invstd, invstd)), xg.dim()))
        dx = aten.sub.Tensor(aten.sub.Tensor(dy, proj), _per_group(aten.div.Scalar(gsum, n), xg.dim()))
        scale = invstd if weight is None else aten.mul.Tensor(invstd, aten.view.default(weight.to(acc), [1, -1]))
        grad_input = aten.view.default(aten.mul.Tensor(dx, _per_group(scale, xg.dim())), list(x.shape)).to(x.dtype)
    wdtype = x.dtype if weight is None else weight.dtype
    grad_weight = aten.sum.dim_IntList(aten.mul.Tensor(dot, invstd), [0]).to(wdtype) if output_mask[1] else None
    grad_bias = aten.sum.dim_IntList(gsum, [0]).to(wdtype) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias


def local_decompositions(groups: int) -> dict:
    """The batch-norm decompositions of batchnorm="local" on an axis of `groups` ranks (see the module docstring)."""
    def functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
        if not training:
            out, m, r = _bn_eval(x, weight, bias, running_mean, running_var, eps)
            return out, m, r, running_mean, running_var
        return _train(groups, x, weight, bias, running_mean, running_var, momentum, eps)

    def native(x, weight, bias, running_mean, running_var, training, momentum, eps):
        if not training:
            return _bn_eval(x, weight, bias, running_mean, running_var, eps)
        return _train(groups, x, weight, bias, running_mean, running_var, momentum, eps)[:3]

    def no_stats(x, weight, bias, training, momentum, eps):
        return _train(groups, x, weight, bias, None, None, momentum, eps)[:3]

    return {aten.native_batch_norm.default: native, aten._native_batch_norm_legit_functional.default: functional,
            aten._native_batch_norm_legit.no_stats: no_stats, aten.native_batch_norm_backward.default: _backward}


def sink_running_statistics(cap) -> None:
    """Move the running statistics' updates (what only they read, up to the sums that select rank 0's statistics)
    to just before the step's output: the sums' all_reduces, issued where the sums are made, then have nothing
    waiting on them before the end, and lowering merges them into one bucket (lower/bucket.py), as DDP sends all
    buffers in one broadcast, instead of one collective per norm waited for mid-forward."""
    graph = cap.gm.graph
    out = graph.output_node()
    flat = out.args[0]
    sink: set = set()
    todo = [a for a, name in zip(flat, cap.output_names) if name.startswith("buffers.") and isinstance(a, torch.fx.Node)]
    while todo:
        n = todo.pop()
        if n in sink or n.op != "call_function" or n.target is aten.sum.dim_IntList \
                or any(u is not out and u not in sink for u in n.users):
            continue
        sink.add(n)
        todo.extend(n.all_input_nodes)
    for n in [n for n in graph.nodes if n in sink]:       # program order kept
        out.prepend(n)
    cap.gm.recompile()
