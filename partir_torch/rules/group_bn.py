"""Batch norm over groups of the batch as one op, whose kernel on each rank is eager's own batch norm on its batch.

data_parallel(axis, batchnorm="local") (capture/bn_local.py) captures batch norm over G groups, G the axis size:
the input viewed (G, M, C, *) (M = N / G) and each group normalised by its own statistics. The rule tiles the group
dim only (the statistics need the whole group), so on the axis each rank holds one group and runs the one
native_batch_norm / native_batch_norm_backward call DDP's rank runs; on one device the op loops over the groups.

    out (G, M, C, *), mean (G, C), invstd (G, C), running (G, 2, C) =
        group_batch_norm(x (G, M, C, *), weight (C)?, bias (C)?, running_mean (C)?, running_var (C)?, momentum, eps)

`running` stacks each group's updated (running_mean, running_var), as its rank's buffers would be after the step
((0,) without running statistics); the caller picks rank 0's. The backward returns each group's weight and bias
gradients (G, C); summed over the groups they are partial sums over the ranks, reduced as gradients.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .factors import einsum

aten = torch.ops.aten


def _one(x, weight, bias, running_mean, running_var, momentum, eps):
    rm = None if running_mean is None else running_mean.clone()
    rv = None if running_var is None else running_var.clone()
    out, mean, invstd = aten.native_batch_norm.default(x, weight, bias, rm, rv, True, momentum, eps)
    running = torch.stack([rm, rv]) if rm is not None else None
    return out, mean, invstd, running


@torch.library.custom_op("partir::group_batch_norm", mutates_args=())
def group_batch_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                     running_var: Tensor | None, momentum: float, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    each = [_one(x[g], weight, bias, running_mean, running_var, momentum, eps) for g in range(x.shape[0])]
    if len(each) == 1:           # a rank's one group: views, no copy of the activations
        out, mean, invstd, running = each[0]
        return (out.unsqueeze(0), mean.unsqueeze(0), invstd.unsqueeze(0),
                x.new_empty((0,)) if running is None else running.unsqueeze(0))
    stack = lambda i: torch.stack([e[i] for e in each])   # noqa: E731
    return stack(0), stack(1), stack(2), x.new_empty((0,)) if running_mean is None else stack(3)


@group_batch_norm.register_fake
def _(x, weight, bias, running_mean, running_var, momentum, eps):
    g, c = x.shape[0], x.shape[2]
    stat = x.dtype if x.device.type == "cpu" else torch.float32
    running = x.new_empty((0,)) if running_mean is None else running_mean.new_empty((g, 2, c))
    return x.new_empty(x.shape), x.new_empty((g, c), dtype=stat), x.new_empty((g, c), dtype=stat), running


@torch.library.custom_op("partir::group_batch_norm_backward", mutates_args=())
def group_batch_norm_backward(grad: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, invstd: Tensor,
                              eps: float) -> tuple[Tensor, Tensor, Tensor]:
    each = [aten.native_batch_norm_backward.default(grad[g], x[g], weight, None, None, mean[g], invstd[g], True, eps,
                                                    [True, True, True]) for g in range(x.shape[0])]
    if len(each) == 1:
        return tuple(t.unsqueeze(0) for t in each[0])
    return tuple(torch.stack([e[i] for e in each]) for i in range(3))


@group_batch_norm_backward.register_fake
def _(grad, x, weight, mean, invstd, eps):
    g, c = x.shape[0], x.shape[2]
    wdtype = x.dtype if weight is None else weight.dtype
    return x.new_empty(x.shape), x.new_empty((g, c), dtype=wdtype), x.new_empty((g, c), dtype=wdtype)


GROUP_BN_OP = torch.ops.partir.group_batch_norm.default
GROUP_BN_BACKWARD_OP = torch.ops.partir.group_batch_norm_backward.default


def _x(ndim: int) -> str:
    return "gmc" + "hwd"[:ndim - 3]                # group, member, channel, then the reduced spatial dims


def group_bn_rule(ctx):
    """Groups pass, channels pass (each channel's statistics are its own); a group's members and positions are
    reduced over by the statistics: whole. `k` is the (mean, var) pair of the running statistics."""
    x = _x(len(ctx.in_shapes[0]))
    names = ("weight", "bias", "running_mean", "running_var")
    args = [x] + ["c" if ctx.arg(i, name) is not None else "" for i, name in enumerate(names, 1)]
    running = "gkc" if ctx.out_shapes[3] is not None and len(ctx.out_shapes[3]) == 3 else "_"
    spec = ",".join(a for a in args if a) + f"->{x},gc,gc,{running}"
    return einsum(spec, ctx.in_shapes, ctx.out_shapes, need_rep="mkhwd")


def group_bn_backward_rule(ctx):
    x = _x(len(ctx.in_shapes[1]))
    w = ",c" if ctx.arg(2, "weight") is not None else ""
    return einsum(f"{x},{x}{w},gc,gc->{x},gc,gc", ctx.in_shapes, ctx.out_shapes, need_rep="mhwd")


def rules() -> dict:
    return {GROUP_BN_OP: group_bn_rule, GROUP_BN_BACKWARD_OP: group_bn_backward_rule}
