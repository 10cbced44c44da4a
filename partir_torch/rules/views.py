"""Views and data movement: reshape uses compound factors; permutes map dims; slicing a dim keeps it whole."""
from __future__ import annotations

import math

import torch

from .factors import ALL_OPS, NEED_REP, RuleBuilder, reshape_factors

aten = torch.ops.aten
MOVES = [({0}, ALL_OPS)]


def view(ctx):
    b = RuleBuilder()
    ins, outs = reshape_factors(b, ctx.in_shapes[0], ctx.out_shapes[0])
    return b.rule([ins] + [None] * (len(ctx.in_shapes) - 1), [outs], MOVES)


def permute_by(perm_of):
    def rule(ctx):
        shape = ctx.in_shapes[0]
        b = RuleBuilder()
        ins = b.dims(shape)
        perm = perm_of(ctx, len(shape))
        return b.rule([ins], [[ins[p] for p in perm]], MOVES)
    return rule


def _permute(ctx, n):
    return [d % n for d in ctx.arg(1, "dims")]


def _transpose(ctx, n):
    a, c = ctx.arg(1, "dim0") % max(n, 1), ctx.arg(2, "dim1") % max(n, 1)
    perm = list(range(n))
    perm[a], perm[c] = perm[c], perm[a]
    return perm


def _t(ctx, n):
    return list(reversed(range(n)))


def expand(ctx):
    """expand(x, sizes): result dims are PASS; broadcast dims of x (size 1) have no factor."""
    b = RuleBuilder()
    out = ctx.out_shapes[0]
    ids = b.dims(out)
    shape = ctx.in_shapes[0]
    off = len(out) - len(shape)
    ins = [ids[off + d] if s != 1 else () for d, s in enumerate(shape)]
    return b.rule([ins], [ids], MOVES)


def squeeze_like(ctx):
    """unsqueeze / squeeze: size-1 dims have no factor, so matching the non-1 dims in order is the whole rule."""
    b = RuleBuilder()
    shape = ctx.in_shapes[0]
    ins = b.dims(shape)
    kept = [d for d, n in zip(ins, shape) if n != 1]      # the non-1 dims (a size-0 dim has no factor either)
    out = ctx.out_shapes[0]
    if len(kept) != sum(1 for n in out if n != 1):
        return None
    nz = iter(kept)
    return b.rule([ins], [[next(nz) if n != 1 else () for n in out]], MOVES)


def along(dim_arg, like_result=False):
    """Ops that cut or join along one dim (slice, select, split, cat, unbind): that dim is kept whole (it has no
    factor, so a tiling of it is gathered first); the other dims are PASS, matched in order (select drops its dim).
    like_result: dims are named after the result's shape (cat, whose first operand may be a legacy empty tensor).
    """
    def rule(ctx):
        shape = ctx.out_shapes[0] if like_result else ctx.in_shapes[0]
        dim = ctx.arg(dim_arg, "dim", 0) % max(len(shape), 1)
        b = RuleBuilder()
        ids = [(b.new(s),) if s > 1 and d != dim else () for d, s in enumerate(shape)]
        kept = [i for d, i in enumerate(ids) if d != dim]

        def dims(s):
            if s is None:
                return None
            return ids if len(s) == len(ids) else kept if len(s) == len(kept) else None

        return b.rule([dims(s) for s in ctx.in_shapes], [dims(s) for s in ctx.out_shapes],
                      [(set(range(len(ctx.in_shapes))), ALL_OPS)])
    return rule


def split_rule(ctx):
    """split into equal chunks along dim: that dim is (chunks, size) and each result's dim is the size factor, so a
    tiling of the size part (strided by the number of chunks: a fused q/k/v projection) reaches every chunk."""
    shape = ctx.in_shapes[0]
    dim = ctx.arg(2, "dim", 0) % max(len(shape), 1)
    sizes = [s[dim] for s in ctx.out_shapes if s is not None]
    if len(set(sizes)) != 1 or sizes[0] * len(ctx.out_shapes) != shape[dim] or sizes[0] <= 1:
        return along(2)(ctx)
    b = RuleBuilder()
    ids = [(b.new(s),) if s > 1 and d != dim else () for d, s in enumerate(shape)]
    chunks, part = b.new(len(ctx.out_shapes), "need_rep"), b.new(sizes[0])
    ins = list(ids)
    ins[dim] = (chunks, part)
    out = list(ids)
    out[dim] = (part,)
    return b.rule([ins], [out if s is not None else None for s in ctx.out_shapes], MOVES)


def cat_rule(ctx):
    """cat of equal-size pieces along dim: the result's dim is (pieces, size), the mirror of split_rule (the
    gradient of a fused q/k/v projection). torch.cat skips 1-d empty operands (an empty cache joined with new
    keys): they get no dims (nothing to tile) and the others are named after the result."""
    shapes = [s for s in ctx.in_shapes]
    out = ctx.out_shapes[0]
    dim = ctx.arg(1, "dim", 0) % max(len(out), 1)
    legacy = [tuple(s) == (0,) and len(out) != 1 for s in shapes]
    if sum(legacy) == len(shapes) - 1 and len(shapes) > 1:
        # one piece and legacy empties (a fresh KV cache joined with the new keys): a copy, every dim PASS
        b = RuleBuilder()
        ids = b.dims(out)
        return b.rule([() if e else ids for e in legacy], [ids], [({i for i, e in enumerate(legacy) if not e}, ALL_OPS)])
    sizes = {s[dim] for s in shapes if len(s) == len(out)}
    if (len(sizes) != 1 or len(shapes) * next(iter(sizes)) != out[dim] or next(iter(sizes)) <= 1
            or any(len(s) != len(out) for s in shapes)):
        return along(1, like_result=True)(ctx)
    b = RuleBuilder()
    ids = [(b.new(s),) if s > 1 and d != dim else () for d, s in enumerate(out)]
    pieces, part = b.new(len(shapes), "need_rep"), b.new(next(iter(sizes)))
    ins = list(ids)
    ins[dim] = (part,)
    res = list(ids)
    res[dim] = (pieces, part)
    return b.rule([ins for _ in shapes], [res], [(set(range(len(shapes))), ALL_OPS)])


def scatter_into(dim_arg, drops_dim):
    """select_scatter / slice_scatter (x, src, dim, ...): the result is x with one dim's positions replaced by src
    (a setitem on a fresh tensor, functionalized): that dim is kept whole, the others PASS through x, src and the
    result alike; linear in x and src together (each rank's scatter of its partial pieces sums to the whole)."""
    def rule(ctx):
        shape = ctx.in_shapes[0]
        dim = ctx.arg(dim_arg, "dim", 0) % max(len(shape), 1)
        b = RuleBuilder()
        ids = [(b.new(s),) if s > 1 and d != dim else () for d, s in enumerate(shape)]
        src = [i for d, i in enumerate(ids) if d != dim] if drops_dim else ids
        if len(src) != len(ctx.in_shapes[1]):
            return None
        return b.rule([ids, src], [ids], [({0, 1}, ALL_OPS)])
    return rule


def pad_rule(ctx):
    """constant_pad_nd(x, pad, value): a padded dim is kept whole, the others PASS; linear (a partial x stays
    partial) only when the padding value is 0 (a value v would be counted once per rank)."""
    shape = ctx.in_shapes[0]
    pad = ctx.arg(1, "pad")
    padded = {len(shape) - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}
    b = RuleBuilder()
    ids = [(b.new(s),) if s > 1 and d not in padded else () for d, s in enumerate(shape)]
    return b.rule([ids], [ids], MOVES if ctx.arg(2, "value", 0) == 0 else [])


def slice_rule(ctx):
    """slice over the whole dim (start 0, end >= size, step 1) is a plain copy; otherwise the dim is NEED_REP."""
    shape = ctx.in_shapes[0]
    dim = ctx.arg(1, "dim", 0) % max(len(shape), 1)
    if tuple(ctx.out_shapes[0]) == tuple(shape):
        b = RuleBuilder()
        ids = b.dims(shape)
        return b.rule([ids], [ids], MOVES)
    return along(1)(ctx)


def select_backward(ctx):
    """select_backward(grad, input_sizes, dim, index): the result gains the selected dim (kept whole)."""
    out = ctx.out_shapes[0]
    dim = ctx.arg(2, "dim") % len(out)
    b = RuleBuilder()
    ids = [(b.new(s),) if s > 1 and d != dim else () for d, s in enumerate(out)]
    return b.rule([[f for d, f in enumerate(ids) if d != dim]], [ids], MOVES)


def dense(size, stride) -> bool:
    """size/stride lay a tensor out row-major with no gaps (a size-1 dim's stride does not matter)."""
    acc = 1
    for n, st in zip(reversed(size), reversed(stride)):
        if n != 1 and st != acc:
            return False
        acc *= n
    return True


def _whole_storage(ctx, base_slot: int, size, stride, offset) -> bool:
    """The view (size, stride, offset) of the base operand is all of it, in its own row-major order: the base is
    contiguous from offset 0, the view dense, of as many elements."""
    val = ctx.operands[base_slot].meta["val"]
    return (val.is_contiguous() and val.storage_offset() == 0 and (offset or 0) == 0 and dense(size, stride)
            and math.prod(size) == val.numel())


def as_strided(ctx):
    """as_strided(x, size, stride, offset) that reads all of a contiguous x in its order is x.view(size) (ConvNeXt's
    pooled head and its gradient, functionalized): reshape's compound factors. Any other as_strided: no rule."""
    size, stride = ctx.arg(1, "size"), ctx.arg(2, "stride")
    if not _whole_storage(ctx, 0, size, stride, ctx.arg(3, "storage_offset", 0)):
        return None
    return view(ctx)


def as_strided_scatter(ctx):
    """as_strided_scatter(base, src, size, stride, offset) whose view is all of a contiguous base: the result is
    src.view(base.shape) (base's values are all overwritten); linear in src."""
    size, stride = ctx.arg(2, "size"), ctx.arg(3, "stride")
    if not _whole_storage(ctx, 0, size, stride, ctx.arg(4, "storage_offset", 0)):
        return None
    b = RuleBuilder()
    base, src = reshape_factors(b, ctx.in_shapes[0], ctx.in_shapes[1])
    return b.rule([base, src], [base], [({1}, ALL_OPS)])


def flip(ctx):
    """flip(x, dims): the flipped dims stay whole (a rank's shard would land on another rank), the others pass.
    A permutation of elements: a partial value of any reduction stays partial."""
    x = ctx.in_shapes[0]
    flipped = {d % len(x) for d in ctx.arg(1, "dims")}
    b = RuleBuilder()
    fs = [(b.new(n),) if d not in flipped and n > 1 else () for d, n in enumerate(x)]
    return b.rule([fs], [fs], [({0}, ALL_OPS)])


def unfold(ctx):
    """x.unfold(dim, size, step) (..., n, ...) -> (..., L, ..., size), and unfold_backward(grad, input_sizes, dim,
    size, step) back: windows along `dim` (whole), every other dim passes. Linear."""
    backward = ctx.node.target == aten.unfold_backward.default
    x = ctx.out_shapes[0] if backward else ctx.in_shapes[0]
    dim = ctx.arg(2 if backward else 1, "dim") % len(x)
    b = RuleBuilder()
    fs = [(b.new(n),) if d != dim and n > 1 else () for d, n in enumerate(x)]
    windows = fs + [()]
    return b.rule([windows if backward else fs], [fs if backward else windows], [({0}, ("sum",))])


def complex_pairs(ctx):
    """view_as_complex (..., 2) -> (...) and view_as_real (...) -> (..., 2): the leading dims pass, the pair of
    (real, imaginary) parts stays whole. Linear: a partial value stays partial."""
    x, out = ctx.in_shapes[0], ctx.out_shapes[0]
    b = RuleBuilder()
    lead = [(b.new(n),) if n > 1 else () for n in (x if len(x) < len(out) else out)]
    pair = (b.new(2, NEED_REP),)
    ins, outs = (lead + [pair], lead) if len(x) > len(out) else (lead, lead + [pair])
    return b.rule([ins], [outs], [({0}, ("sum",))])


def rules() -> dict:
    return {
        aten.view.default: view, aten._unsafe_view.default: view, aten.reshape.default: view,
        aten.view_copy.default: view,
        aten.permute.default: permute_by(_permute), aten.transpose.int: permute_by(_transpose),
        aten.t.default: permute_by(_t),
        aten.expand.default: expand,
        aten.unsqueeze.default: squeeze_like, aten.squeeze.dim: squeeze_like, aten.squeeze.dims: squeeze_like,
        aten.squeeze.default: squeeze_like,
        aten.slice.Tensor: slice_rule, aten.select.int: along(1),
        aten.split.Tensor: split_rule, aten.split_with_sizes.default: split_rule,
        aten.cat.default: cat_rule, aten.constant_pad_nd.default: pad_rule,
        aten.select_scatter.default: scatter_into(2, True), aten.slice_scatter.default: scatter_into(2, False), aten.unbind.int: along(1),
        aten.slice_backward.default: along(2), aten.select_backward.default: select_backward,
        aten.as_strided.default: as_strided, aten.as_strided_scatter.default: as_strided_scatter,
        aten.view_as_complex.default: complex_pairs, aten.view_as_real.default: complex_pairs,
        aten.flip.default: flip,
        aten.unfold.default: unfold,                          # Mamba-style scans over a reversed sequence
    }
