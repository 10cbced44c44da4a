"""Convolution (not transposed): batch PASS, spatial dims whole; the channel dims are compound factors of groups.

With g groups, x's channels are (g, Cin/g) and the weight's and result's output channels (g, Cout/g), major to
minor. The groups factor G is PASS everywhere: a rank holding a contiguous run of whole groups convolves them
alone (localize runs it with groups = its local count). With groups=1 (no G factor) Cout is PASS and Cin is a
reduction; with g > 1 the per-group channel factors stay whole (tiled, they would be strided tilings of the
channel dims, which the rule does not claim). Depthwise (g == Cin, one output channel per input channel) is G
alone: batch and channels both PASS.

    convolution           x (n, (G ci)), w ((G co), ci), bias? ((G co))  ->  y (n, (G co))
    convolution_backward  dy (n, (G co)), x (n, (G ci)), w ((G co), ci)
                          ->  dx (n, (G ci)), dw ((G co), ci), db ((G co))
                          n sums into dw and db (tiling the batch leaves them partial(sum)), co into dx
"""
from __future__ import annotations

import torch

from .factors import NEED_REP, PASS, REDUCE, RuleBuilder

aten = torch.ops.aten


def _channels(b: RuleBuilder, groups: int, cin: int, cout: int, ci_kind: str, co_kind: str):
    """(x's channel dim, the output-channel dim, w's dim 1) as factor tuples: (G, ci), (G, co), (ci,).
    With groups > 1 ci and co are NEED_REP; size-1 factors are left out."""
    grouped = groups > 1
    g = (b.new(groups, PASS),) if grouped else ()
    ci = (b.new(cin // groups, NEED_REP if grouped else ci_kind),) if cin // groups > 1 else ()
    co = (b.new(cout // groups, NEED_REP if grouped else co_kind),) if cout // groups > 1 else ()
    return g + ci, g + co, ci


def convolution(ctx):
    """convolution(x (N, Cin, *sp), w (Cout, Cin/g, *k), bias (Cout)?, stride, padding, dilation, transposed,
    output_padding, groups)."""
    if ctx.arg(6, "transposed", False):
        return None
    x, w = ctx.in_shapes[0], ctx.in_shapes[1]
    bias = len(ctx.in_shapes) > 2
    b = RuleBuilder()
    nf = (b.new(x[0]),) if x[0] > 1 else ()
    # groups=1: Cin is a reduction; with a bias it stays whole (every rank would add the bias, counting it k times)
    xc, oc, wc = _channels(b, ctx.arg(8, "groups", 1), x[1], w[0], NEED_REP if bias else REDUCE, PASS)
    sp = [()] * (len(x) - 2)
    operands = [[nf, xc] + sp, [oc, wc] + sp] + ([[oc]] if bias else [])
    return b.rule(operands, [[nf, oc] + sp])


def convolution_backward(ctx):
    """convolution_backward(dy, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
    output_mask) -> (grad_input, grad_weight, grad_bias), a result None where output_mask leaves it out.
    N sums into the weight/bias grads; with groups=1 Cout sums into grad_input and Cin is PASS (grad_bias does not
    depend on it, so it is whole on every rank)."""
    if ctx.arg(7, "transposed", False):
        return None
    go, x, w = ctx.in_shapes[0], ctx.in_shapes[1], ctx.in_shapes[2]
    b = RuleBuilder()
    nf = (b.new(x[0], REDUCE),) if x[0] > 1 else ()
    xc, oc, wc = _channels(b, ctx.arg(9, "groups", 1), x[1], w[0], PASS, REDUCE)
    sp = [()] * (len(x) - 2)
    results = []
    for s, dims in zip(ctx.out_shapes, ([nf, xc] + sp, [oc, wc] + sp, [oc])):
        results.append(None if s is None else dims)
    return b.rule([[nf, oc] + sp, [nf, xc] + sp, [oc, wc] + sp], results)


def rules() -> dict:
    return {aten.convolution.default: convolution, aten.convolution_backward.default: convolution_backward}
