"""Ops that stack, repeat or split without arithmetic: what an unrolled RNN (stack of the per-step hidden states,
unsafe_split of the four LSTM gates) and instance norm (running statistics repeated per sample) trace to."""
from __future__ import annotations

import torch

from .factors import ALL_OPS, RuleBuilder
from .views import split_rule

aten = torch.ops.aten


def stack(ctx):
    """stack(tensors, dim): the new dim holds the pieces and stays whole; every other dim is PASS in all slots.
    Linear in all operands together (a partial of each piece is a partial of the stack)."""
    shape = ctx.in_shapes[0]
    out = ctx.out_shapes[0]
    dim = ctx.arg(1, "dim", 0) % len(out)
    b = RuleBuilder()
    ids = b.dims(shape)
    res = ids[:dim] + [()] + ids[dim:]     # (…, pieces, …)
    return b.rule([ids for _ in ctx.in_shapes], [res], [(set(range(len(ctx.in_shapes))), ALL_OPS)])


def repeat(ctx):
    """repeat(x, repeats): out dim d is (r, s) with r = repeats[d] copies (major) of x's aligned dim of size s.
    r is a PASS factor of the result only (a rank makes its share of the copies: repeats localised); s is shared
    with x (minor where r > 1: x tiled gives the result tiled strided by r)."""
    shape = ctx.in_shapes[0]
    reps = list(ctx.arg(1, "repeats"))
    lead = len(reps) - len(shape)
    b = RuleBuilder()
    ins, outs = [], []
    for d, r in enumerate(reps):
        s = shape[d - lead] if d >= lead else 1
        fs = (b.new(s),) if s > 1 else ()
        if d >= lead:
            ins.append(fs)
        outs.append(((b.new(r),) if r > 1 else ()) + fs)
    return b.rule([ins], [outs], [({0}, ALL_OPS)])


def rules() -> dict:
    return {
        aten.stack.default: stack,
        aten.repeat.default: repeat,
        aten.unsafe_split.Tensor: split_rule,
        aten.unsafe_split_with_sizes.default: split_rule,
    }
