"""Elementwise ops: every dim of the (broadcast) result is a PASS factor shared with the operands' aligned dims."""
from __future__ import annotations

import torch

from .factors import ALL_OPS, SUM, RuleBuilder
from . import tags

aten = torch.ops.aten


def pointwise(ctx, linear=()):
    """Broadcasting elementwise rule. Operand dims are right-aligned to the result; broadcast (size-1) dims get no
    factor. Results of the same shape share the factors (ops with several outputs)."""
    b = RuleBuilder()
    out = next(s for s in ctx.out_shapes if s is not None)
    ids = [b.new(s) if s > 1 else None for s in out]

    def align(shape):
        off = len(out) - len(shape)
        return [(ids[off + d],) if s > 1 and ids[off + d] is not None else () for d, s in enumerate(shape)]

    operands = [align(s) if len(s) <= len(out) else None for s in ctx.in_shapes]
    results = [None if s is None else align(s) for s in ctx.out_shapes]
    return b.rule(operands, results, linear)


def _lin(modes):
    def rule(ctx):
        n = len(ctx.in_shapes)
        ok = [(slots, ops) for slots, ops in modes if all(i < n for i in slots)]
        return pointwise(ctx, ok)
    return rule


# Linear in both tensor operands together: a partial value plus a replicated one would count the latter n times.
LINEAR_JOINT = _lin([({0, 1}, SUM)])
# Linear in either operand when the other is replicated (x * y, x / y in x).
LINEAR_EITHER = _lin([({0}, SUM), ({1}, SUM)])
LINEAR_FIRST = _lin([({0}, SUM)])
# Moves or copies elements without arithmetic: linear for every reduction.
MOVES = _lin([({0}, ALL_OPS)])
# where(cond, a, b): linear in a and b together.
WHERE = _lin([({1, 2}, SUM)])

NONLINEAR = [
    aten.abs.default, aten.acos.default, aten.asin.default, aten.atan.default, aten.atan2.default,
    aten.bitwise_and.Tensor, aten.bitwise_not.default, aten.bitwise_or.Tensor, aten.ceil.default,
    aten.clamp.default, aten.clamp.Tensor, aten.clamp_max.default, aten.clamp_min.default, aten.cos.default,
    aten.cosh.default, aten.eq.Scalar, aten.eq.Tensor, aten.erf.default, aten.exp.default, aten.exp2.default,
    aten.expm1.default, aten.floor.default, aten.fill.Scalar, aten.ge.Scalar, aten.ge.Tensor, aten.gelu.default,
    aten.gelu_backward.default, aten.gt.Scalar, aten.gt.Tensor, aten.hardtanh.default,
    aten.hardtanh_backward.default, aten.isinf.default, aten.isnan.default, aten.le.Scalar, aten.le.Tensor,
    aten.leaky_relu.default, aten.leaky_relu_backward.default, aten.lerp.Scalar, aten.lerp.Tensor,
    aten.log.default, aten.log1p.default, aten.log2.default, aten.logical_and.default, aten.logical_not.default,
    aten.logical_or.default, aten.lt.Scalar, aten.lt.Tensor, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
    aten.maximum.default, aten.minimum.default, aten.ne.Scalar, aten.ne.Tensor, aten.pow.Scalar,
    aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.reciprocal.default, aten.relu.default,
    aten.remainder.Scalar, aten.remainder.Tensor, aten.round.default, aten.rsqrt.default, aten.rsub.Scalar,
    aten.rsub.Tensor, aten.sigmoid.default, aten.sigmoid_backward.default, aten.sign.default, aten.silu.default,
    aten.silu_backward.default, aten.sin.default, aten.sinh.default, aten.sqrt.default, aten.tanh.default,
    aten.tanh_backward.default, aten.threshold_backward.default, aten.trunc.default, aten.addcdiv.default,
    aten.addcmul.default, aten.sgn.default, aten.square.default, aten.xlogy.Tensor, aten.logaddexp.default,
    aten.softplus.default, aten.softplus_backward.default, aten.mish.default, aten.elu.default,
    aten.elu_backward.default, aten.bitwise_xor.Tensor, aten.floor_divide.default, aten.fmod.Scalar,
    aten.fmod.Tensor, aten.copysign.Tensor, aten.nan_to_num.default,
    aten.hardsigmoid.default, aten.hardsigmoid_backward.default, aten.hardswish.default,
    aten.hardswish_backward.default, aten.celu.default, aten.threshold.default, aten.mish_backward.default,
    aten.softshrink.default, aten.softshrink_backward.default, aten.hardshrink.default,
    aten.hardshrink_backward.default,
]
def cast(src_slot):
    """_to_copy / copy (which casts to the destination's dtype): a float (or same-kind) result is linear for every
    reduction; a float -> int cast truncates, which is monotone (max, min) but not additive; -> bool is neither."""
    def rule(ctx):
        src, dst = ctx.operands[src_slot].meta["val"].dtype, ctx.out_dtypes[0]
        ops = () if dst == torch.bool else ALL_OPS if dst.is_floating_point or not src.is_floating_point else (
            "max", "min")
        return pointwise(ctx, [({src_slot}, ops)] if ops else [])
    return rule


# Tensor factories shaped like their operand: the operand's values are not read, but its layout is the result's.
LIKE = [aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
        aten.fill.Scalar, aten.fill.Tensor]
# Random draws (dropout's mask) stay whole: every rank draws the whole tensor from the same generator state and
# keeps its slice, so the step equals the single-device one bit for bit and replicated values agree across ranks
# (a per-shard draw would give each rank of a replicated axis a different mask).
RANDOM = sorted(tags.ops("random") - tags.ops("random_factory"), key=str)   # factories are nn.py's


def whole(ctx):
    """Every dim kept whole (random draws); a result its users tile is the rank's slice of the whole draw, which
    is no conflict."""
    from .factors import RuleBuilder

    b = RuleBuilder()
    return b.rule([[()] * len(x) for x in ctx.in_shapes], [None if o is None else [()] * len(o)
                                                            for o in ctx.out_shapes], sliced_results=True)


def rules() -> dict:
    table = {op: pointwise for op in NONLINEAR + LIKE}
    table.update({op: whole for op in RANDOM})
    table.update({
        aten.add.Tensor: LINEAR_JOINT, aten.sub.Tensor: LINEAR_JOINT,
        aten.add.Scalar: pointwise, aten.sub.Scalar: pointwise,
        aten.mul.Tensor: LINEAR_EITHER, aten.mul.Scalar: LINEAR_FIRST,
        aten.div.Tensor: LINEAR_FIRST, aten.div.Scalar: LINEAR_FIRST, aten.div.Tensor_mode: pointwise,
        aten.neg.default: LINEAR_FIRST,
        aten.where.self: WHERE,
        aten.clone.default: MOVES, aten.alias.default: MOVES, aten.detach.default: MOVES,
        aten._to_copy.default: cast(0), aten.lift_fresh_copy.default: MOVES, aten.contiguous.default: MOVES,
        aten.copy.default: cast(1),
    })
    return table
