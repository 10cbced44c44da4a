"""Convolution: batch and output channels PASS, input channels REDUCE (groups=1, no bias), spatial dims whole."""
from __future__ import annotations

import torch

from .factors import NEED_REP, PASS, REDUCE, RuleBuilder

aten = torch.ops.aten


def convolution(ctx):
    """convolution(x (N, Cin, *sp), w (Cout, Cin/g, *k), bias (Cout)?, ..., transposed, _, groups)."""
    if ctx.arg(6, "transposed", False):
        return None
    x, w = ctx.in_shapes[0], ctx.in_shapes[1]
    groups = ctx.arg(8, "groups", 1)
    b = RuleBuilder()
    # grouped: a rank's slice of Cout would be matched to the wrong input groups, so Cout stays whole
    n, co = b.new(x[0]), b.new(w[0], PASS if groups == 1 else NEED_REP)
    # Cin is a reduction (groups=1); with a bias it stays whole: every rank would add the bias, counting it k times
    ci = b.new(x[1], REDUCE if len(ctx.in_shapes) == 2 else NEED_REP) if groups == 1 else None
    sp = [()] * (len(x) - 2)
    cif = (ci,) if ci is not None and x[1] > 1 else ()
    nf, cof = ((n,) if x[0] > 1 else ()), ((co,) if w[0] > 1 else ())
    operands = [[nf, cif] + sp, [cof, cif] + sp] + ([[cof]] if len(ctx.in_shapes) > 2 else [])
    return b.rule(operands, [[nf, cof] + sp])


def convolution_backward(ctx):
    """-> (grad_input, grad_weight, grad_bias). N sums into the weight/bias grads; Cout sums into grad_input;
    Cin is PASS (grad_bias does not depend on it, so it is whole on every rank)."""
    if ctx.arg(7, "transposed", False) or ctx.arg(9, "groups", 1) != 1:
        return None
    go, x, w = ctx.in_shapes[0], ctx.in_shapes[1], ctx.in_shapes[2]
    b = RuleBuilder()
    nf = (b.new(x[0], REDUCE),) if x[0] > 1 else ()
    cof = (b.new(w[0], REDUCE),) if w[0] > 1 else ()
    cif = (b.new(x[1], PASS),) if x[1] > 1 else ()
    sp = [()] * (len(x) - 2)
    results = []
    for s, dims in zip(ctx.out_shapes, ([nf, cif] + sp, [cof, cif] + sp, [cof])):
        results.append(None if s is None else dims)
    return b.rule([[nf, cof] + sp, [nf, cif] + sp, [cof, cif] + sp], results)


def rules() -> dict:
    return {aten.convolution.default: convolution, aten.convolution_backward.default: convolution_backward}
