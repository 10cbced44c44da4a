"""Batch norm with per-rank statistics: data_parallel(axis, batchnorm="local"), what DDP does by default.

The step is captured as "ghost" batch norm over G groups of the batch, G the size of the data-parallel axis: the
batch (N, C, *) is viewed as (G, N/G, C, *) and each group is normalised by its own statistics, (G, C), in one op
(rules/group_bn.py). With the batch tiled on the axis, group g is rank g's shard: each rank runs eager's
native_batch_norm (and its backward) on its batch, as DDP's rank does, with no collective. The one-device program
is exactly DDP's (each rank's slice through the eager module in train mode, the gradients averaged), so it is
checked like any other program, not trusted.

Running statistics: DDP updates each rank's buffers from its own batch and broadcasts rank 0's at the start of the
next forward (broadcast_buffers=True), so what it keeps (and checkpoints) is rank 0's update: group 0's statistics.
Here each group's kernel updates its own copy of the buffers, and the state takes group 0's through a one-hot sum
over the groups: a (2, C) partial sum on the axis, all-reduced once per norm and needed only by the state written
at the end of the step (bucketed with the other norms' and the gradients). Every rank then holds rank 0's
buffers, as DDP's ranks do after its broadcast.
"""
from __future__ import annotations

import torch

from ..errors import PartitionError
from ..rules.group_bn import GROUP_BN_BACKWARD_OP, GROUP_BN_OP
from .decompositions import _bn_backward, _bn_eval

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


def _rank0(running, dtype):
    """Group 0's (running_mean, running_var) from their (G, 2, C) stack: sum_g onehot0[g] * running[g]."""
    g = running.shape[0]
    first = aten.eq.Scalar(aten.arange.default(g, device=running.device), 0).to(dtype)       # (G,) one-hot
    s0 = aten.sum.dim_IntList(aten.mul.Tensor(running.to(dtype), aten.view.default(first, [g, 1, 1])), [0])
    return aten.select.int(s0, 0, 0), aten.select.int(s0, 0, 1)                          # (C,) each


def _train(groups, x, weight, bias, running_mean, running_var, momentum, eps):
    """(out, save_mean (G, C), save_invstd (G, C), rank 0's new running mean, rank 0's new running var)."""
    _group_count(x, groups)
    out, mean, invstd, running = GROUP_BN_OP(_grouped(x, groups), weight, bias, running_mean, running_var,
                                             momentum, eps)
    new_mean = new_var = None
    if running_mean is not None:
        m0, v0 = _rank0(running, running.dtype)       # exact: a sum of one value and zeros
        new_mean, new_var = m0.to(running_mean.dtype), v0.to(running_var.dtype)
    return aten.view.default(out, list(x.shape)), mean, invstd, new_mean, new_var


def _backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask):
    """Grouped statistics (save_mean (G, C)) come from _train: each group's gradients by eager's kernel; the
    weight and bias gradients sum over the groups (partial over the ranks, reduced with the other gradients).
    Anything else is the global kernel's."""
    if not (train and save_mean is not None and save_mean.dim() == 2):
        return _bn_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                            output_mask)
    g = save_mean.shape[0]
    dx, dw, db = GROUP_BN_BACKWARD_OP(_grouped(grad_out, g), _grouped(x, g), weight, save_mean, save_invstd, eps)
    return (aten.view.default(dx, list(x.shape)) if output_mask[0] else None,
            aten.sum.dim_IntList(dw, [0]) if output_mask[1] else None,
            aten.sum.dim_IntList(db, [0]) if output_mask[2] else None)


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
