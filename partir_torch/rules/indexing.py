"""Indexing: the indexed dim of the source stays whole; dims of the index tensor are PASS."""
from __future__ import annotations

import math

import torch

from .factors import ALL_OPS, NEED_REP, REDUCE, RuleBuilder
from .reduction import along_dim

aten = torch.ops.aten

_ZEROS = {aten.new_zeros.default, aten.zeros.default, aten.zeros_like.default}
_FULLS = {aten.full.default: 1, aten.new_full.default: 2, aten.full_like.default: 1}


def structural_zero(a) -> bool:
    """Is `a` a graph node that is all zeros by construction (new_zeros, zeros_like, full(..., 0))? Rules may rely
    on it (accumulating into zeros is a sum over ranks, index_put below); the verifier then feeds zeros there."""
    if not isinstance(a, torch.fx.Node) or a.op != "call_function":
        return False
    if a.target in _ZEROS:
        return True
    i = _FULLS.get(a.target)
    return i is not None and len(a.args) > i and a.args[i] == 0


def index_select(ctx):
    """index_select(x, dim, index (E,)) -> x with dim replaced by E."""
    shape, dim = ctx.in_shapes[0], ctx.arg(1, "dim") % len(ctx.in_shapes[0])
    b = RuleBuilder()
    xs = [(b.new(s, NEED_REP if d == dim else "pass"),) if s > 1 else () for d, s in enumerate(shape)]
    e = ctx.in_shapes[1][0] if ctx.in_shapes[1] else 1
    ef = (b.new(e),) if e > 1 else ()
    out = [ef if d == dim else f for d, f in enumerate(xs)]
    return b.rule([xs, [ef] if ctx.in_shapes[1] else []], [out])


def _advanced(ctx, x, indices, idx_shapes, b, positions="pass"):
    """Factors of advanced indexing x[indices]: (x's dims, the index tensors' dims, the indexed result's dims), the
    indexed dims of x NEED_REP, the indices' broadcast dims (kind `positions`) shared with the result (where the
    indexed dims were when they are adjacent, else first), x's other dims PASS. None for boolean masks."""
    pos = [d for d, ix in enumerate(indices) if ix is not None]
    if not pos or len(idx_shapes) != len(pos) or any(
            isinstance(ix, torch.fx.Node) and ix.meta["val"].dtype in (torch.bool, torch.uint8)
            for ix in indices if ix is not None):
        return None
    nb = max(len(s) for s in idx_shapes)
    bshape = [max((s[j - (nb - len(s))] for s in idx_shapes if j >= nb - len(s)), default=1) for j in range(nb)]
    bf = [(b.new(n, positions),) if n > 1 else () for n in bshape]
    xs = [(b.new(n, NEED_REP if d in pos else "pass"),) if n > 1 else () for d, n in enumerate(x)]
    rest = [d for d in range(len(x)) if d not in pos]
    if pos == list(range(pos[0], pos[0] + len(pos))):
        out = [xs[d] for d in rest if d < pos[0]] + bf + [xs[d] for d in rest if d > pos[0]]
    else:
        out = bf + [xs[d] for d in rest]
    ins = [[bf[nb - len(s) + j] if n > 1 else () for j, n in enumerate(s)] for s in idx_shapes]
    return xs, ins, out


def index_tensor(ctx):
    """x[i0, i1, ...] with integer index tensors (aten.index.Tensor): see _advanced. Linear in x."""
    b = RuleBuilder()
    got = _advanced(ctx, ctx.in_shapes[0], ctx.arg(1, "indices"), ctx.in_shapes[1:], b)
    if got is None or len(got[2]) != len(ctx.out_shapes[0]):
        return None
    xs, ins, out = got
    return b.rule([xs] + ins, [out], [({0}, ALL_OPS)])


def _masked_put(ctx):
    """x[mask] = v (or += v) with one boolean mask over x's leading dims and one value (x.masked_fill(mask, v), as
    `ids[ids == image_token_id] = 0` writes it): elementwise, every dim PASS, the mask's dims x's; None otherwise."""
    indices = ctx.arg(1, "indices")
    if len(indices) != 1 or not isinstance(indices[0], torch.fx.Node) \
            or indices[0].meta["val"].dtype not in (torch.bool, torch.uint8):
        return None
    x, m, v = ctx.in_shapes[0], ctx.in_shapes[1], ctx.in_shapes[2]
    if tuple(m) != tuple(x[:len(m)]) or math.prod(v) != 1 or tuple(ctx.out_shapes[0]) != tuple(x):
        return None
    b = RuleBuilder()
    xs = b.dims(x)
    return b.rule([xs, xs[:len(m)], [()] * len(v)], [xs])


def index_put(ctx):
    """x[i0, i1, ...] = v (or += v with accumulate=True), shaped like x: x's indexed dims stay whole, and so do the
    positions (the indices' broadcast dims, in v too) unless they are accumulated into zeros (REDUCE); x's other
    dims PASS through v and the result. Linear in (x, v) together: sum partials for accumulate=True; sum, max or
    min for a plain put (entries are selected)."""
    b = RuleBuilder()
    indices = ctx.arg(1, "indices")
    n_idx = sum(ix is not None for ix in indices)
    x, v = ctx.in_shapes[0], ctx.in_shapes[1 + n_idx]
    # the positions: accumulated into zeros (the gradient of x[i]), each rank scatters the positions it holds and
    # the ranks' results sum to the whole (a partial(sum) result); otherwise they stay whole
    acc = ctx.arg(3, "accumulate", False)
    positions = REDUCE if acc and structural_zero(ctx.arg(0, "self")) else NEED_REP
    got = _advanced(ctx, x, indices, ctx.in_shapes[1:1 + n_idx], b, positions=positions)
    if got is None:
        return _masked_put(ctx)
    if len(v) != len(got[2]) or tuple(ctx.out_shapes[0]) != tuple(x):
        return None
    xs, ins, out = got
    vs = [fs if n > 1 else () for fs, n in zip(out, v)]
    ops = ("sum",) if acc else ALL_OPS
    return b.rule([xs] + ins + [vs], [xs], [({0, 1 + n_idx}, ops)])


def gather(ctx):
    """gather(x, dim, index) -> shaped like index. Other dims are PASS where x and index agree in size."""
    x, idx = ctx.in_shapes[0], ctx.in_shapes[1]
    dim = ctx.arg(1, "dim") % len(x)
    b = RuleBuilder()
    xs, ids = [], []
    for d, (sx, si) in enumerate(zip(x, idx)):
        if d == dim or sx != si or sx == 1:
            xs.append(())
            ids.append((b.new(si),) if d == dim and si > 1 else ())
        else:
            f = (b.new(sx),)
            xs.append(f)
            ids.append(f)
    return b.rule([xs, ids], [ids])


def scatter_like(src_pos):
    """scatter_add / index_add (x, dim, index, src): result shaped like x; the scattered dim stays whole and the
    other dims of x are PASS, shared with src (and a full-rank index) where sizes agree."""
    def rule(ctx):
        x = ctx.in_shapes[0]
        dim = ctx.arg(1, "dim") % len(x)
        b = RuleBuilder()
        xs = [(b.new(s),) if s > 1 and d != dim else () for d, s in enumerate(x)]

        def dims(s):
            if len(s) != len(x):
                return [()] * len(s)
            return [f if d != dim and s[d] == x[d] else () for d, f in enumerate(xs)]

        return b.rule([xs] + [dims(s) for s in ctx.in_shapes[1:]], [xs])
    return rule


def one_hot(ctx):
    b = RuleBuilder()
    ins = b.dims(ctx.in_shapes[0])
    return b.rule([ins], [ins + [()]])


def rules() -> dict:
    return {
        aten.index_select.default: index_select, aten.index.Tensor: index_tensor, aten.index_put.default: index_put,
        aten.gather.default: gather,
        aten.scatter_add.default: scatter_like(3), aten.index_add.default: scatter_like(3),
        aten.scatter_reduce.two: scatter_like(3),         # TAPAS's segment reductions
        aten.scatter.src: scatter_like(3), aten.scatter.value: scatter_like(3),
        aten.one_hot.default: one_hot,
    }
