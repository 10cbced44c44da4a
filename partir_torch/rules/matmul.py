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


def rules() -> dict:
    return {
        aten.mm.default: _spec("mk,kn->mn", LIN2),       # k is a reduction: tiling it makes the result partial(sum)
        aten.bmm.default: _spec("bmk,bkn->bmn", LIN2),
        aten.mv.default: _spec("mk,k->m", LIN2),
        aten.dot.default: _spec("k,k->", LIN2),
        aten.addmm.default: addmm,
        aten.baddbmm.default: baddbmm,
    }
