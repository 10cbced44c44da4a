"""Reductions. sum's reduced dims are REDUCE(sum); amax/amin's are REDUCE(max/min): tiling them leaves a partial
that a later all_reduce of the same op completes. Reductions that are not associative over shards this way
(mean before decomposition, argmax, var, cumsum) keep their reduced dims NEED_REP."""
from __future__ import annotations

import torch

from .factors import NEED_REP, PASS, REDUCE, SUM, RuleBuilder

aten = torch.ops.aten


def _dims(arg, ndim):
    if arg is None or (isinstance(arg, (list, tuple)) and len(arg) == 0):
        return set(range(ndim))
    if isinstance(arg, int):
        arg = [arg]
    return {d % max(ndim, 1) for d in arg}


def reduce_rule(kind, op="sum", linear=(), dim_arg=1, keepdim_arg=2):
    """Rule builder for reductions over the dims in arg `dim_arg` (all dims when absent)."""
    def rule(ctx):
        shape = ctx.in_shapes[0]
        red = _dims(ctx.arg(dim_arg, "dim", None), len(shape))
        keep = bool(ctx.arg(keepdim_arg, "keepdim", False))
        b = RuleBuilder()
        in_dims, out_dims = [], []
        for d, s in enumerate(shape):
            f = b.new(s, kind if d in red else PASS, op) if s > 1 else None
            in_dims.append((f,) if f is not None else ())
            if d not in red:
                out_dims.append((f,) if f is not None else ())
            elif keep:
                out_dims.append(())
        results = [out_dims if s is not None else None for s in ctx.out_shapes]
        return b.rule([in_dims] + [None] * (len(ctx.in_shapes) - 1), results, linear)
    return rule


def along_dim(dim_arg=1, linear=()):
    """Shape-preserving ops that mix values along one dim (softmax, cumsum, sort, topk's input): that dim is
    NEED_REP; every result of the same rank shares the operand's factors."""
    def rule(ctx):
        shape = ctx.in_shapes[0]
        dim = ctx.arg(dim_arg, "dim", -1) % max(len(shape), 1)
        b = RuleBuilder()
        ids = [b.new(s, NEED_REP if d == dim else PASS) if s > 1 else None for d, s in enumerate(shape)]

        def dims(s):
            if s is None or len(s) != len(shape):
                return None
            return [(ids[d],) if ids[d] is not None and n == shape[d] else () for d, n in enumerate(s)]

        return b.rule([dims(s) for s in ctx.in_shapes], [dims(s) for s in ctx.out_shapes], linear)
    return rule


def sum_all(ctx):
    b = RuleBuilder()
    return b.rule([b.dims(ctx.in_shapes[0], REDUCE)], [[]], [({0}, SUM)])


def rules() -> dict:
    return {
        aten.sum.dim_IntList: reduce_rule(REDUCE, "sum", [({0}, SUM)]),
        aten.sum.default: sum_all,
        aten.amax.default: reduce_rule(REDUCE, "max", [({0}, ("max",))]),
        aten.amin.default: reduce_rule(REDUCE, "min", [({0}, ("min",))]),
        aten.mean.dim: reduce_rule(NEED_REP),
        aten.max.dim: reduce_rule(NEED_REP),
        aten.min.dim: reduce_rule(NEED_REP),
        aten.argmax.default: reduce_rule(NEED_REP),
        aten.argmin.default: reduce_rule(NEED_REP),
        aten.any.dim: reduce_rule(NEED_REP),
        aten.any.dims: reduce_rule(NEED_REP),
        aten.any.default: reduce_rule(NEED_REP),   # all dims (an assert's `x.isnan().any()`)
        aten.all.default: reduce_rule(NEED_REP),
        aten.all.dim: reduce_rule(NEED_REP),
        aten.prod.dim_int: reduce_rule(NEED_REP),
        aten.logsumexp.default: reduce_rule(NEED_REP),
        aten.var.correction: reduce_rule(NEED_REP),
        aten.var_mean.correction: reduce_rule(NEED_REP),
        aten.cumsum.default: along_dim(1),
        aten.linalg_vector_norm.default: reduce_rule(NEED_REP, dim_arg=2, keepdim_arg=3),   # ConvNeXt-V2's GRN
    }
