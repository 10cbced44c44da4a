"""Neural-network ops: norms, softmax, losses, embedding, dropout, factories (attention: rules/attention.py)."""
from __future__ import annotations

import math

import torch

from .factors import BLOCKED, NEED_REP, PASS, REDUCE, SUM, RuleBuilder, einsum
from .reduction import along_dim
from .views import unfold

aten = torch.ops.aten


def norm_rule(lead_of, lead_kind=PASS):
    """Layer/RMS-style norms: the normalised dims are NEED_REP; leading dims are `lead_kind` (PASS forward;
    REDUCE in backward, where the weight and bias gradients sum over them). Slots are matched by shape:
    full (lead + norm), statistics (lead + ones), or parameters (norm)."""
    def rule(ctx):
        shape = ctx.in_shapes[lead_of[0]]
        n_lead = lead_of[1](ctx, shape)
        b = RuleBuilder()
        lead = [(b.new(s, lead_kind),) if s > 1 else () for s in shape[:n_lead]]
        norm = [(b.new(s, NEED_REP),) if s > 1 else () for s in shape[n_lead:]]
        full, stats = tuple(shape), tuple(shape[:n_lead]) + (1,) * (len(shape) - n_lead)

        def dims(s):
            if s is None:
                return None
            s = tuple(s)
            if s == full:
                return lead + norm
            if s == stats:
                return lead + [()] * (len(shape) - n_lead)
            if s == tuple(shape[n_lead:]):
                return norm
            return [()] * len(s)

        return b.rule([dims(s) for s in ctx.in_shapes], [dims(s) for s in ctx.out_shapes])
    return rule


def _ln_lead(arg_index):
    return lambda ctx, shape: len(shape) - len(ctx.arg(arg_index, "normalized_shape"))


def group_norm_rule(lead_kind):
    """native_group_norm(x (N, C, *), w (C)?, b (C)?, N, C, HxW, group, eps) -> (out, mean (N, G), rstd (N, G)) and
    its backward (grad_out, x, mean, rstd, w?, ...) -> (dx, dw, db). C is (G, C/G): whole groups may be tiled
    (PASS), a group's channels stay together (NEED_REP); N is `lead_kind` (REDUCE in backward, where dw and db sum
    over it); spatial dims stay whole. The int args N, C, HxW and group are localised by lowering."""
    def rule(ctx):
        x = ctx.in_shapes[0]
        groups = ctx.arg(6 if lead_kind == PASS else 8, "group")
        b = RuleBuilder()
        n = (b.new(x[0], lead_kind),) if x[0] > 1 else ()
        g = (b.new(groups),) if groups > 1 else ()
        cg = (b.new(x[1] // groups, NEED_REP),) if x[1] // groups > 1 else ()
        x_dims = [n, g + cg] + [()] * (len(x) - 2)
        by_shape = {(x[0], groups): [n, g], (x[1],): [g + cg], tuple(x): x_dims}

        def dims(s):
            return None if s is None else by_shape.get(tuple(s), [()] * len(s))

        return b.rule([dims(s) for s in ctx.in_shapes], [dims(s) for s in ctx.out_shapes])
    return rule


def nll_loss_forward(ctx):
    """nll_loss_forward(self (N, C), target (N,), weight (C)?, reduction, ignore_index) -> (out, total_weight).
    reduction=sum: N is REDUCE (both outputs partial(sum)); none: out is (N,) and total_weight partial. mean is
    decomposed at capture into sum / total_weight; if it reaches here, N stays whole."""
    if len(ctx.in_shapes[0]) != 2:
        return None
    reduction = ctx.arg(3, "reduction", 1)
    w = ",c" if len(ctx.in_shapes) == 3 else ""
    out = "n" if reduction == 0 else ""
    # C tiled (vocabulary-parallel cross-entropy): each rank picks the targets in its class shard
    return einsum(f"nc,n{w}->{out},", ctx.in_shapes, ctx.out_shapes, need_rep="nc" if reduction == 1 else "",
                  indexed="c")


def nll_loss_backward(ctx):
    """nll_loss_backward(grad_out, self (N, C), target (N,), weight?, reduction, ignore_index, total_weight)."""
    if len(ctx.in_shapes[1]) != 2:
        return None
    g = "n" if len(ctx.in_shapes[0]) == 1 else ""
    spec_w = ",c" if len(ctx.in_shapes) == 5 else ""
    return einsum(f"{g},nc,n{spec_w},->nc", ctx.in_shapes, ctx.out_shapes, indexed="c")


def embedding(ctx):
    """embedding(weight (V, D), indices (*)) -> (*, D). V tiled: a masked local lookup, partial(sum) result."""
    idx = "ijkl"[:len(ctx.in_shapes[1])]
    return einsum(f"vd,{idx}->{idx}d", ctx.in_shapes, ctx.out_shapes, indexed="v", linear=[({0}, SUM)])


def embedding_dense_backward(ctx):
    """grad_weight (V, D) = scatter-add of grad_output (*, D) by indices: token dims are REDUCE. A partial
    grad_output flows through (the table comes out partial) only when the table has fewer rows than the tokens
    scattered; else it is reduced first, as the smaller of the two (a position table of 512 rows scattered from 16
    positions, their gradient already summed over the batch: reducing the table moved 32x the bytes)."""
    idx = "ijkl"[:len(ctx.in_shapes[1])]
    tokens = math.prod(ctx.in_shapes[1])
    linear = [({0}, SUM)] if ctx.out_shapes[0] is not None and ctx.out_shapes[0][0] < tokens else ()
    return einsum(f"{idx}d,{idx}->vd", ctx.in_shapes, ctx.out_shapes, indexed="v", linear=linear)


def factory(ctx):
    """Tensor factories (full, zeros, ones, empty, rand): every result dim is PASS; lowering gives local sizes."""
    b = RuleBuilder()
    return b.rule([None] * len(ctx.in_shapes), [b.dims(s) if s is not None else None for s in ctx.out_shapes])


def blocked_factory(ctx):
    """rand / randn: drawn whole on every rank from the same generator state (then sliced), so that a step
    equals the single-device step for any tiling."""
    b = RuleBuilder()
    return b.rule([None] * len(ctx.in_shapes), [b.dims(s, BLOCKED) for s in ctx.out_shapes])


def arange(ctx):
    """arange: its one dim is an indexed factor: a rank holding positions [off, off + n) computes
    start + step * (off + arange(n)) (lower/indexed.py)."""
    b = RuleBuilder()
    (n,), = ctx.out_shapes
    return b.rule([None] * len(ctx.in_shapes), [[(b.new(n, indexed=True),)]])


def last_two_whole(ctx):
    """tril / triu: the last two dims hold the positions the mask depends on."""
    shape = ctx.in_shapes[0]
    b = RuleBuilder()
    dims = [(b.new(s),) if s > 1 and d < len(shape) - 2 else () for d, s in enumerate(shape)]
    return b.rule([dims], [dims])


def spatial(ctx):
    """Pooling and upsampling (and their backwards): (N, C) PASS in every slot, spatial dims whole."""
    b = RuleBuilder()
    shape = ctx.in_shapes[0]
    nc = [(b.new(s),) if s > 1 else () for s in shape[:2]]
    dims = lambda s: None if s is None else nc + [()] * (len(s) - 2)
    return b.rule([dims(s) for s in ctx.in_shapes], [dims(s) for s in ctx.out_shapes])


def patches(ctx):
    """im2col (N, C, H, W) -> (N, C*kh*kw, L) and col2im, its inverse (ConvBERT's span convolution through
    nn.Unfold / nn.Fold): the batch passes, every other dim is rearranged whole. Unbatched calls: no factor."""
    x, out = ctx.in_shapes[0], ctx.out_shapes[0]
    batched = len(x) == (4 if ctx.node.target == aten.im2col.default else 3)
    b = RuleBuilder()
    n = (b.new(x[0], PASS),) if batched and x[0] > 1 else ()
    ins = [n] + [() for _ in x[1:]] if batched else [() for _ in x]
    outs = [n] + [() for _ in out[1:]] if batched else [() for _ in out]
    return b.rule([ins], [outs], [({0}, ("sum",))])



def fft_rule(ctx):
    """_fft_c2c / _fft_r2c / _fft_c2r over `dim` (FNet's token mixing): the transformed dims stay whole (their
    sizes may change: one-sided real transforms), every other dim passes. Linear in the input."""
    x, out = ctx.in_shapes[0], ctx.out_shapes[0]
    dims = {d % len(x) for d in ctx.arg(1, "dim")}
    b = RuleBuilder()
    fs = [(b.new(n),) if d not in dims and n > 1 else () for d, n in enumerate(x)]
    return b.rule([fs], [[f if d not in dims else () for d, f in enumerate(fs)] if len(out) == len(x) else None],
                  [({0}, ("sum",))])


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
    from .pointwise import pointwise
    return {
        aten.native_layer_norm.default: norm_rule((0, _ln_lead(1))),
        aten.native_layer_norm_backward.default: norm_rule((1, _ln_lead(2)), REDUCE),
        aten.native_group_norm.default: group_norm_rule(PASS),
        aten.native_group_norm_backward.default: group_norm_rule(REDUCE),
        aten._softmax.default: along_dim(1), aten._log_softmax.default: along_dim(1),
        aten._safe_softmax.default: along_dim(1),
        aten.glu.default: along_dim(1), aten.glu_backward.default: along_dim(2),   # halves split `dim`
        aten._softmax_backward_data.default: along_dim(2), aten._log_softmax_backward_data.default: along_dim(2),
        aten.sort.default: along_dim(1), aten.sort.stable: along_dim(1), aten.topk.default: along_dim(2),
        aten.nll_loss_forward.default: nll_loss_forward, aten.nll_loss_backward.default: nll_loss_backward,
        aten.embedding.default: embedding, aten.embedding_dense_backward.default: embedding_dense_backward,
        aten.native_dropout_backward.default: pointwise,
        aten.im2col.default: patches, aten.col2im.default: patches,
        aten.linalg_solve_triangular.default: solve_triangular,   # gated delta-net chunks (Qwen3-Next, Qwen3.5)
        aten.unfold_backward.default: unfold,                     # views.py's unfold, backward
        aten._fft_c2c.default: fft_rule, aten._fft_r2c.default: fft_rule, aten._fft_c2r.default: fft_rule,
        aten.full.default: factory, aten.zeros.default: factory, aten.ones.default: factory,
        aten.empty.memory_format: factory, aten.scalar_tensor.default: factory, aten.rand.default: blocked_factory,
        aten.randn.default: blocked_factory, aten.new_zeros.default: factory, aten.new_ones.default: factory,
        aten.new_empty.default: factory, aten.new_full.default: factory, aten.empty_strided.default: factory,
        aten.new_empty_strided.default: factory,
        aten.arange.default: arange, aten.arange.start: arange, aten.arange.start_step: arange,
        aten.tril.default: last_two_whole, aten.triu.default: last_two_whole,
        aten.upsample_nearest2d.default: spatial, aten.upsample_nearest2d.vec: spatial,
        aten.upsample_nearest2d_backward.default: spatial, aten.avg_pool2d.default: spatial,
        aten.upsample_bilinear2d.default: spatial, aten.upsample_bilinear2d.vec: spatial,
        aten.upsample_bilinear2d_backward.default: spatial,
        aten.avg_pool2d_backward.default: spatial, aten.max_pool2d_with_indices.default: spatial,
        aten.max_pool2d_with_indices_backward.default: spatial,
    }
