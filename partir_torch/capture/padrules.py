"""The padding rules of counts.py: how each consumer of a padded selection reads its padding (see counts.py's
docstring for the table). `Rules` is a mixin of `counts.Padding`: each rule takes the call (func, its name, args,
kwargs), the padded operands (`tracked`: (tensor, kind, Group, dim | coordinate, fresh, kept)) and `fail`, which
raises Unpadded; it returns the call's result, with the padded results tracked."""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

from ..rules.tags import draws_random
from .ctc import ctc_loss_static


# Elementwise functions and methods (by name, in-place and reflected forms included): the result is padded like
# its padded operands.
POINTWISE = frozenset("""abs add bfloat16 clamp clamp_max clamp_min clip clone contiguous cos detach div double
eq erf exp expm1 float floor ge gelu gt half hardsigmoid hardswish le leaky_relu log log1p log_sigmoid logical_and
logical_not logical_or lt masked_fill maximum minimum mish mul ne neg pow reciprocal relu relu6 rsqrt rsub selu sigmoid
sign silu sin softplus sqrt square sub tanh to truediv type type_as where""".split())
VIEWS = frozenset("reshape view squeeze unsqueeze flatten".split())


def _same_node(a, b, depth: int) -> bool:
    """The same value: one node, or the same deterministic op on the same arguments (two draws never are)."""
    if a is b:
        return True
    if depth == 0 or a.op != "call_function" or b.op != "call_function" or a.target != b.target \
            or len(a.args) != len(b.args) or a.kwargs != b.kwargs or draws_random(a):
        return False
    for x, y in zip(a.args, b.args):
        if hasattr(x, "op") and hasattr(y, "op"):
            if not _same_node(x, y, depth - 1):
                return False
        elif x != y or hasattr(x, "op") or hasattr(y, "op"):
            return False
    return True


class Rules:
    """The consumers of padded values (mixed into counts.Padding, which owns `_get` and `_track`)."""

    def _pointwise(self, func, name, args, kwargs, tracked, group, fail):
        kept = tuple(o for o in group.order if any(o in e[5] for e in tracked))
        if any(e[5] != kept for e in tracked):     # broadcast each to the coordinates of all
            if name.endswith("_"):
                fail("writes in place over fewer candidate coordinates")
            swap = {id(e[0]): group.expand(e[0], e[3], e[5], kept) for e in tracked}
            args, kwargs = tree_map(lambda a: swap.get(id(a), a) if isinstance(a, torch.Tensor) else a,
                                    (args, kwargs))
            tracked = [(swap[id(e[0])],) + e[1:5] + (kept,) for e in tracked]
        out = func(*args, **kwargs)
        mine = {id(e2[0]) for e2 in tracked}
        if not isinstance(out, torch.Tensor):
            fail("gives a non-tensor")
        R = out.dim()
        pos = {R - e[0].dim() + e[3] for e in tracked}
        if len(pos) != 1:
            fail("aligns its rows with another dim")
        e = pos.pop()
        flat, _ = tree_flatten((args, kwargs))
        for t in flat:
            if isinstance(t, torch.Tensor) and id(t) not in mine and name not in ("to", "type_as"):
                at = e - (R - t.dim())
                if 0 <= at < t.dim() and t.shape[at] != 1:
                    fail("broadcasts it with a tensor along its rows")
        if out.shape[e] != group.rows(kept):
            fail("changes its rows")
        if name.endswith("_") and any(out is e2[0] and not e2[4] for e2 in tracked):
            fail("writes in place into a view of the selected tensor")
        fresh = all(e2[4] for e2 in tracked if out is e2[0])       # contiguous(), to(): maybe the operand itself
        return self._track(out, "rows", group, e, fresh=fresh, kept=kept)

    def _dropout(self, func, name, args, kwargs, tracked, group, fail):
        b = inspect.signature(F.dropout).bind(*args, **kwargs)
        b.apply_defaults()
        if b.arguments["p"] != 0 and b.arguments["training"]:
            fail("draws a dropout mask per row (the number of draws would be the padded size)")
        return self._pointwise(func, name, args, kwargs, tracked, group, fail)

    def _view(self, func, name, args, kwargs, tracked, group, fail):
        (t, kind, _, d, fresh, kept), = tracked
        if args[0] is not t:
            fail("reads it")
        out = func(*args, **kwargs)
        if kind == "coords":
            # nonzero of a 1-D mask is (N, 1): `.squeeze(1)`, `.view(-1)`, `.flatten()` give its one coordinate
            if t.shape[1] != 1 or out.dim() != 1:
                fail("reshapes the nonzero matrix (index with its columns, nonzero(m)[:, j], or torch.where(m))")
            return self._track(out, "index", group, 0)
        pre, post = math.prod(t.shape[:d]), math.prod(t.shape[d + 1:])
        rows = group.rows(kept)
        for e in range(out.dim()):
            if math.prod(out.shape[:e]) == pre and out.shape[e] == rows and math.prod(out.shape[e + 1:]) == post:
                return self._track(out, "rows", group, e, fresh=fresh, kept=kept)
        fail("merges its rows with another dim")

    def _linear(self, func, name, args, kwargs, tracked, group, fail):
        (t, kind, _, d, _, kept), = tracked
        other = args[1] if len(args) > 1 else kwargs.get("weight", kwargs.get("other"))
        if kind != "rows" or args[0] is not t or d >= t.dim() - 1 or not isinstance(other, torch.Tensor) \
                or other.dim() > 2:
            fail("contracts over its rows (or broadcasts them with a batched operand)")
        return self._track(func(*args, **kwargs), "rows", group, d, kept=kept)

    def _norm(self, func, name, args, kwargs, tracked, group, fail):
        (t, kind, _, d, _, kept), = tracked
        if kind != "rows" or args[0] is not t:
            fail("normalises with it")
        if name in ("layer_norm", "rms_norm", "group_norm"):
            shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
            ok = d < t.dim() - len(tuple(shape))
        else:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            ok = dim is not None and dim % t.dim() != d
        if not ok:
            fail("normalises over its rows")
        return self._track(func(*args, **kwargs), "rows", group, d, kept=kept)

    def _reduce(self, func, name, args, kwargs, tracked, group, fail):
        (t, kind, _, d, _, kept), = tracked
        if kind != "rows" or args[0] is not t:
            fail("reduces with it")
        rest = list(args[1:])
        dtype = kwargs.get("dtype")
        if rest and isinstance(rest[0], torch.dtype):
            dtype = rest.pop(0)
        dim = kwargs.get("dim", rest[0] if rest else None)
        keepdim = kwargs.get("keepdim", rest[1] if len(rest) > 1 else False)
        dims = list(range(t.dim())) if dim is None or dim == [] or dim == () else \
            [x % t.dim() for x in ((dim,) if isinstance(dim, int) else dim)]
        if d not in dims:
            out = func(*args, **kwargs)
            return self._track(out, "rows", group, d if keepdim else d - sum(x < d for x in dims), kept=kept)
        if name not in ("sum", "mean"):
            fail(f"{name} over its rows has no padding rule")
        t = group.expand(t, d, kept)
        z = t.masked_fill(~group.valid_at(d, t.dim()), 0)
        out = z.sum(dims, keepdim=keepdim, dtype=dtype)
        if name == "mean":
            other = math.prod(t.shape[x] for x in dims if x != d)
            out = out / (group.count().to(out.dtype) * other)
        return out

    def _loss(self, func, name, args, kwargs, tracked, group, fail):
        sig = inspect.signature(F.cross_entropy if name == "cross_entropy" else F.nll_loss)
        b = sig.bind(*args, **kwargs)
        b.apply_defaults()
        x, y = b.arguments["input"], b.arguments["target"]
        ex, ey = self._get(x), self._get(y)
        if ex is None or ey is None or ex[3] != 0 or ey[3] != 0 or x.dim() != 2 or y.dim() != 1 \
                or y.is_floating_point() or any(self._get(v) is not None for k, v in b.arguments.items()
                                                if k not in ("input", "target")):
            fail("is a loss whose input and target are not rows of the same selection")
        b.arguments["input"] = group.expand(x, 0, ex[5])
        b.arguments["target"] = torch.where(group.valid, group.expand(y, 0, ey[5]), b.arguments["ignore_index"])
        out = func(*b.args, **b.kwargs)
        if b.arguments["reduction"] == "none":
            return self._track(out, "rows", group, 0)
        return out

    def _ctc(self, func, name, args, kwargs, tracked, group, fail):
        """F.ctc_loss of a (batch, label) selection (HF's `labels.masked_select(mask)`) with the mask's row counts
        as target lengths: ctc.py's static recursion on the rows, each row's labels moved to its front."""
        b = inspect.signature(F.ctc_loss).bind(*args, **kwargs)
        b.apply_defaults()
        tg, tl = b.arguments["targets"], b.arguments["target_lengths"]
        e = self._get(tg)
        if e is None or any(self._get(v) is not None for k, v in b.arguments.items() if k != "targets") \
                or e[1] != "rows" or e[3] != 0 or tg.dim() != 1 or len(group.shape) != 2 or group.order != (0, 1) \
                or e[5] != group.order or not isinstance(tl, torch.Tensor) \
                or not isinstance(b.arguments["input_lengths"], torch.Tensor):
            fail("is a CTC loss whose targets are not one selection of (batch, label) rows")
        if not self._row_counts(tl, group):
            fail("is a CTC loss whose target lengths are not the selection's count per row")
        rows = tg.reshape(group.shape)
        order = torch.sort((~group.mask).to(torch.uint8), dim=1, stable=True).indices
        return ctc_loss_static(b.arguments["log_probs"], rows.gather(1, order), b.arguments["input_lengths"], tl,
                               b.arguments["blank"], b.arguments["reduction"], b.arguments["zero_infinity"])

    def _row_counts(self, lengths, group) -> bool:
        """Whether `lengths` is traced as the group's mask summed over its last dim (`mask.sum(-1)`)."""
        if self.node_of is None:
            return False
        n, m = self.node_of(lengths), self.node_of(group.mask)
        if n is None or m is None:
            return False
        while m.op == "call_function" and m.target is torch.ops.aten.expand.default:
            m = m.args[0]
        return (n.op == "call_function" and n.target is torch.ops.aten.sum.dim_IntList
                and list(n.args[1]) in ([-1], [1]) and not (len(n.args) > 2 and n.args[2])
                and not n.kwargs.get("keepdim", False) and _same_node(n.args[0], m, 4))

    def _index(self, func, name, args, kwargs, tracked, group, fail):
        y, key = args
        if self._get(y) is not None:
            entry = self._get(y)
            if entry[1] != "rows" or isinstance(key, torch.Tensor) or any(
                    isinstance(k, torch.Tensor) for k in (key if isinstance(key, tuple) else (key,))):
                fail("indexes it")
            return self._row_slice(y, key, entry, group, fail, func)
        items = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in items):
            fail("indexes with it after an Ellipsis")
        coords = self._get(key)
        if coords is not None and coords[1] == "coords":
            fail("indexes with the whole nonzero matrix")
        out_dims, adv, yi = [], [], 0          # out_dims: "1" | ("y", dim) | "N"
        for k in items:
            e = self._get(k)
            if k is None:
                out_dims.append("1")
            elif e is not None and e[1] == "index":
                if adv and adv[-1][0] != yi - 1:
                    fail("indexes with it in non-adjacent dims")
                if not adv:
                    out_dims.append("N")
                adv.append((yi, e[3]))
                yi += 1
            elif isinstance(k, slice) and k == slice(None):
                out_dims.append(("y", yi))
                yi += 1
            else:
                fail("indexes with it next to another index")
        out_dims += [("y", i) for i in range(yi, y.dim())]
        if len({j for _, j in adv}) != len(adv):
            fail("indexes two dims with one coordinate")
        p0, a = adv[0][0], len(adv)
        for p, j in adv:
            if y.shape[p] < group.shape[j]:
                fail("indexes a dim smaller than the mask's")
            if y.shape[p] > group.shape[j]:
                y = y.narrow(p, 0, group.shape[j])
        present = sorted(adv, key=lambda pj: group.order.index(pj[1]))
        y = y.permute(list(range(p0)) + [p for p, _ in present] + list(range(p0 + a, y.dim())))
        kept = tuple(j for _, j in present)        # the other coordinates broadcast: not materialised here
        pre, post = list(y.shape[:p0]), list(y.shape[p0 + a:])
        z = y.reshape(pre + [group.rows(kept)] + post)
        shape = [1 if o == "1" else group.rows(kept) if o == "N" else z.shape[o[1] if o[1] < p0 else o[1] - a + 1]
                 for o in out_dims]
        out = z.reshape(shape)
        return self._track(out, "rows", group, out_dims.index("N"), fresh=False, kept=kept)

    def _row_slice(self, t, key, entry, group, fail, func):
        d = entry[3]
        items = list(key) if isinstance(key, tuple) else [key]
        if Ellipsis in items:
            i = items.index(Ellipsis)
            used = sum(k is not None for k in items if k is not Ellipsis)
            items[i:i + 1] = [slice(None)] * (t.dim() - used)
        yi, oi, e = 0, 0, None
        for k in items:
            if k is None:
                oi += 1
                continue
            if yi == d:
                if not (isinstance(k, slice) and k == slice(None)):
                    fail("indexes its rows")
                e = oi
            if isinstance(k, int):
                yi += 1
                continue
            yi, oi = yi + 1, oi + 1
        if e is None:
            e = oi + (d - yi)
        return self._track(func(t, key), "rows", group, e, fresh=False, kept=entry[5])

    def _setitem(self, func, name, args, kwargs, tracked, group, fail):
        y, key, v = args
        ev = self._get(v)
        if self._get(y) is not None or not isinstance(key, torch.Tensor) or key is not group.mask \
                or ev is None or ev[3] != 0 or group.order != tuple(range(key.dim())):
            fail("writes it into a tensor other than by its own mask")
        full = group.expand(v, 0, ev[5]).reshape(*group.shape, *v.shape[1:])
        m = group.mask.reshape(*group.shape, *[1] * (v.dim() - 1))
        y.copy_(torch.where(m, full.to(y.dtype), y))
        return None

    def _index_add(self, func, name, args, kwargs, tracked, group, fail):
        inplace = name == "index_add_"
        sig = ["input", "dim", "index", "source", "alpha"]
        b = dict(zip(sig, args))
        b.update(kwargs)
        x, dim, index, src = b["input"], b["dim"], b["index"], b["source"]
        ei, es = self._get(index), self._get(src)
        if self._get(x) is not None or ei is None or ei[1] != "index" or es is None or es[1] != "rows" \
                or es[3] != dim % src.dim():
            fail("adds it into a tensor other than at its own coordinates")
        d, j = es[3], ei[3]
        if x.shape[d] != group.shape[j]:
            fail("adds it into a dim whose size is not the mask's")
        src = group.expand(src, d, es[5])
        z = src.masked_fill(~group.valid_at(d, src.dim()), 0)
        if b.get("alpha", 1) != 1:
            z = z * b["alpha"]
        z = z.reshape(*src.shape[:d], *[group.shape[o] for o in group.order], *src.shape[d + 1:])
        others = [d + p for p, o in enumerate(group.order) if o != j]
        z = z.sum(others) if others else z
        return x.add_(z) if inplace else x + z

    def _split(self, func, name, args, kwargs, tracked, group, fail):
        (t, kind, _, d, fresh, kept), = tracked
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        if kind != "rows" or args[0] is not t or dim % t.dim() == d:
            fail("splits its rows")
        return tuple(self._track(o, "rows", group, d, fresh=fresh, kept=kept) for o in func(*args, **kwargs))

    def _unbind(self, func, name, args, kwargs, tracked, group, fail):
        (t, kind, _, _, _, _), = tracked
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if kind != "coords" or dim % 2 != 1:
            fail("unbinds it")
        return tuple(self._track(group.coordinate(j), "index", group, j) for j in range(t.shape[1]))


# handlers that take several padded operands (of one selection) and check them
SEVERAL = {Rules._pointwise, Rules._index, Rules._setitem, Rules._index_add, Rules._loss}
HANDLERS = {
    "getitem": Rules._index, "setitem": Rules._setitem,
    "index_add": Rules._index_add, "index_add_": Rules._index_add,
    "sum": Rules._reduce, "mean": Rules._reduce, "amax": Rules._reduce,
    "cross_entropy": Rules._loss, "nll_loss": Rules._loss, "ctc_loss": Rules._ctc,
    "linear": Rules._linear, "matmul": Rules._linear, "mm": Rules._linear,
    "layer_norm": Rules._norm, "rms_norm": Rules._norm, "softmax": Rules._norm, "log_softmax": Rules._norm,
    "dropout": Rules._dropout, "unbind": Rules._unbind, "chunk": Rules._split, "split": Rules._split,
    **{n: Rules._view for n in VIEWS},
}
