"""Contractions. The contracted factor is a REDUCE: tiling it leaves the result partial(sum)."""
from __future__ import annotations

import torch

from .factors import SUM, einsum

aten = torch.ops.aten

LIN2 = [({0}, SUM), ({1}, SUM)]


def _spec(spec, linear):
    def rule(ctx):
        return einsum(spec, ctx.in_shapes, ctx.out_shapes, linear=linear)
    return rule


def addmm(ctx):
    # addmm(bias, m1, m2) = bias + m1 @ m2; the bias broadcasts: (n,), (1, n) or (m, n).
    # k stays whole: tiled, every rank would add the whole bias, and the partial sum would count it k times.
    bias = "mn"[2 - len(ctx.in_shapes[0]):]
    return einsum(f"{bias},mk,kn->mn", ctx.in_shapes, ctx.out_shapes, need_rep="k",
                  linear=[({0, 1}, SUM), ({0, 2}, SUM)])


def baddbmm(ctx):
    bias = "bmn"[3 - len(ctx.in_shapes[0]):]   # k stays whole, as in addmm
    return einsum(f"{bias},bmk,bkn->bmn", ctx.in_shapes, ctx.out_shapes, need_rep="k",
                  linear=[({0, 1}, SUM), ({0, 2}, SUM)])


def solve_triangular(ctx):
    """linalg_solve_triangular(A (*, n, n), B (*, n, k), upper, left=True) -> X: A X = B per batch (X A = B when
    left=False). The batch dims pass (broadcast where A or B has size 1); the solved dims stay whole; B's free dim
    (k, or n of X A = B's rows) passes: columns (rows) are solved independently. Linear in B."""
    a, bsh, out = ctx.in_shapes[0], ctx.in_shapes[1], ctx.out_shapes[0]
    lead = "abcdefgh"[:len(out) - 2]
    of = lambda s: lead[len(lead) - (len(s) - 2):]      # noqa: E731 - an operand's batch letters (right-aligned)
    x = "nk" if bool(ctx.arg(3, "left", True)) else "kn"
    return einsum(f"{of(a)}nn,{of(bsh)}{x}->{lead}{x}", ctx.in_shapes, ctx.out_shapes, need_rep="n",
                  linear=[({1}, SUM)])


def rules() -> dict:
    return {
        aten.mm.default: _spec("mk,kn->mn", LIN2),       # k is a reduction: tiling it makes the result partial(sum)
        aten.bmm.default: _spec("bmk,bkn->bmn", LIN2),
        aten.mv.default: _spec("mk,k->m", LIN2),
        aten.dot.default: _spec("k,k->", LIN2),
        aten.addmm.default: addmm,
        aten.baddbmm.default: baddbmm,
        aten.linalg_solve_triangular.default: solve_triangular,   # gated delta-net chunks (Qwen3-Next, Qwen3.5)
    }
