"""Selections traced at a static size (issue 26 item 2): a data-dependent count that only sizes a selection.

`x[mask]`, `torch.where(mask)`, `nonzero`, `masked_select` have as many rows as the mask has true elements, a count
that changes with nearly every batch (non-padding tokens, tokens routed to an expert). As a guard (branches.py)
every new count is a new path, captured and planned again. `Padding`, a TorchFunctionMode above autograd during the
Recorder's trace, traces such a selection instead as all N candidates (N = the mask's size), each row valid or
padding, and rewrites its consumers so that padding never reaches a result:

    x[mask]                   x.reshape(N, ...) (a view: no gather, so a batch split stays local), valid = mask
    torch.where(m) / nonzero  per mask dim, the coordinate of each of the N positions (static), valid = m; the
                              positions are enumerated with the mask's largest dim major (the token dim of HF's
                              (top_k, tokens) expert masks), so indexing by them is a view of the token dim
    y[i, j, None]             y's indexed dims permuted to that enumeration, expanded and flattened to N rows
    row-wise ops              pointwise (by name, broadcasting that leaves the row dim alone), linear / matmul
                              with the rows as the first operand, norms and softmax over other dims, views that
                              keep the row dim whole: the result is padded likewise
    sum, mean                 over the rows: padding reads 0; the mean divides by the runtime count
    cross_entropy, nll_loss   a padded target becomes ignore_index (the mean divides by the valid rows)
    index_add(0, i, v)        padding rows of v read 0, summed into the coordinate i indexes
    y[mask] = v               torch.where(mask, v, y)

Autograd differentiates the rewritten forward, so the backward is the static-shape one. Padding rows hold the data
of unselected positions (real rows, computed like the valid ones), so every value they produce is one eager
computes for some position; the masking makes their gradient exactly zero.

Anything else that reads a padded value (an op without such a rule, the count as a Python int: `len(v)`,
`v.shape[0]`, iterating, a step output) raises `Unpadded` naming the selection's line: capture traces the step
again with that selection kept as a count guard (today's behaviour: one path per count). Never a wrong result.

    with Padding(refused) as pad:     # inside the Recorder's trace (capture.py)
        ... the step ...
    pad.selections                    # [(line, N)] traced padded
"""
from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ..contract import draws_random
from .branches import _OURS, _TORCH, _frames

ENABLED = True            # tests switch it off to see the count guards come back


@contextlib.contextmanager
def disabled():
    """Selections as count guards again (one path per count), as before issue 26 item 2."""
    global ENABLED
    was, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = was


class Unpadded(Exception):
    """A padded selection reached a consumer that is not known to read padding correctly."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


class Group:
    """One selection's N candidates: the mask (shape S), enumerated with `order` (mask dims, major first), which
    of them are selected (`valid`, (N,) bool) and their number (`count`, traced)."""

    def __init__(self, mask, order, where):
        self.mask, self.order, self.where = mask, tuple(order), where
        self.shape = tuple(mask.shape)
        self.n = math.prod(self.shape)
        self.valid = mask.permute(self.order).reshape(self.n) if self.order else mask.reshape(1)
        self._count = None

    def count(self):
        if self._count is None:
            self._count = self.valid.sum()
        return self._count

    def coordinate(self, j: int):
        """(N,) int64: mask dim j's coordinate of every position, in enumeration order (a static value)."""
        perm = [self.shape[o] for o in self.order]
        view = [1] * len(perm)
        view[self.order.index(j)] = self.shape[j]
        return torch.arange(self.shape[j], device=self.mask.device).reshape(view).expand(perm).reshape(self.n)

    def rows(self, kept) -> int:
        """Rows of a value over the candidates' coordinates `kept` (the others broadcast)."""
        return math.prod(self.shape[o] for o in kept)

    def expand(self, t, d: int, kept, to=None):
        """t (its dim d: rows over `kept`) with dim d over the coordinates `to` (default: all), the missing ones
        broadcast: the same value at every candidate that differs only in them."""
        to = self.order if to is None else tuple(to)
        if tuple(kept) == to:
            return t
        per = [self.shape[o] if o in kept else 1 for o in to]
        full = [self.shape[o] for o in to]
        t = t.reshape(*t.shape[:d], *per, *t.shape[d + 1:]).expand(*t.shape[:d], *full, *t.shape[d + 1:])
        return t.reshape(*t.shape[:d], self.rows(to), *t.shape[d + len(to):])

    def valid_at(self, d: int, ndim: int):
        return self.valid.reshape([1] * d + [self.n] + [1] * (ndim - d - 1))


class _Size(tuple):
    """The shape of a padded value read by user code: reading the padded dim is reading the count (torch.Size
    cannot be subclassed; a tuple serves where sizes are taken)."""

    def __new__(cls, shape, d, fail):
        s = super().__new__(cls, shape)
        s._d, s._fail = d, fail
        return s

    def __getitem__(self, i):
        if isinstance(i, int) and i % len(self) == self._d:
            self._fail("reads its size (the count) as a Python int")
        if isinstance(i, slice) and self._d in range(len(self))[i]:
            self._fail("reads its size (the count) as Python ints")
        return super().__getitem__(i)

    def __iter__(self):
        self._fail("reads its size (the count) as Python ints")

    def numel(self):
        self._fail("reads its number of elements")


# Elementwise functions and methods (by name, in-place and reflected forms included): the result is padded like
# its padded operands.
POINTWISE = frozenset("""abs add bfloat16 clamp clamp_max clamp_min clip clone contiguous cos detach div double
eq erf exp expm1 float floor ge gelu gt half hardsigmoid hardswish le leaky_relu log log1p log_sigmoid logical_and
logical_not logical_or lt masked_fill maximum minimum mish mul ne neg pow reciprocal relu relu6 rsqrt rsub selu sigmoid
sign silu sin softplus sqrt square sub tanh to truediv type type_as where""".split())
VIEWS = frozenset("reshape view squeeze unsqueeze flatten".split())
METADATA = frozenset("size numel len nelement stride storage_offset is_contiguous data_ptr untyped_storage".split())
SAFE_ATTRS = frozenset("dim ndim dtype device is_floating_point requires_grad is_cuda layout is_complex "
                       "element_size get_device grad_fn is_leaf names".split())


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


def _name(func) -> str:
    n = getattr(func, "__name__", "")
    if n == "__get__":
        return "get:" + getattr(getattr(func, "__self__", None), "__name__", "")
    if n.startswith("__") and n.endswith("__"):
        n = n[2:-2]
    if n.startswith(("r", "i")) and n[1:] in ("add", "sub", "mul", "truediv", "div", "pow"):
        n = n[1:] if n[0] == "i" or n[1:] != "sub" else "rsub"
    return n


_WRAPPERS = (os.path.join("torch", "_tensor.py"), os.path.join("torch", "overrides.py"))


def _user(frame) -> bool:
    """Whether the code reading a padded value's metadata is the user's (not torch's, not ours); torch's Python
    wrappers that only forward the call (Tensor.__len__) are skipped."""
    while frame is not None and frame.f_code.co_filename.endswith(_WRAPPERS):
        frame = frame.f_back
    if frame is None:
        return False
    fn = frame.f_code.co_filename
    return not (fn.startswith(_TORCH) or fn.startswith(_OURS))


class Padding(TorchFunctionMode):
    """See the module docstring. refused: the source lines whose selections stay count guards."""

    def __init__(self, refused=frozenset(), node_of=None):
        super().__init__()
        self.refused = set(refused)
        self.node_of = node_of      # tensor -> its traced fx node (the Recorder's), to find equal masks
        self.groups: list = []
        # id(tensor) -> (tensor, kind "rows" | "index" | "coords", Group, dim | coord, fresh, kept): rows over the
        # candidates' coordinates `kept` (h[top_x] of a (top_k, tokens) mask: the tokens only, the same row for
        # every top-k slot; broadcast to all candidates where a value or a reduction needs them)
        self.info: dict = {}
        self.selections: list = []  # (where, N)

    # -- bookkeeping --------------------------------------------------------------------------------------------
    def _get(self, t):
        e = self.info.get(id(t)) if isinstance(t, torch.Tensor) else None
        return e if e is not None and e[0] is t else None

    def _track(self, t, kind, group, at, fresh=True, kept=None):
        self.info[id(t)] = (t, kind, group, at, fresh, group.order if kept is None else tuple(kept))
        return t

    def _full(self, t):
        """A padded value over all candidates (the coordinates it broadcast over made explicit)."""
        e = self._get(t)
        return e[2].expand(t, e[3], e[5])

    def _new_group(self, mask, order):
        _, where = _frames()
        where = where or f"selection {len(self.selections)}"
        if where in self.refused or not ENABLED:
            return None
        for g in self.groups:             # `logits[mask != 0]`, `labels[mask != 0]`: one selection, two reads
            if g.order == tuple(order) and g.shape == tuple(mask.shape) and self._same(g.mask, mask):
                return g
        g = Group(mask, order, where)
        self.groups.append(g)
        self.selections.append((where, g.n))
        return g

    def _same(self, a, b, depth=4) -> bool:
        """Whether traced tensors a and b are the same value: one tensor, or the same op on the same arguments."""
        if a is b:
            return True
        if self.node_of is None:
            return False
        na, nb = self.node_of(a), self.node_of(b)
        return na is not None and nb is not None and _same_node(na, nb, depth)

    # -- dispatch -----------------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tracked = [e for e in map(self._get, flat) if e is not None]
        name = _name(func)
        if not tracked:
            made = self._create(func, name, args, kwargs)
            return func(*args, **kwargs) if made is None else made
        group = tracked[0][2]
        if any(e[2] is not group for e in tracked):
            raise Unpadded(group.where, f"{name} mixes it with another selection")

        def fail(why):
            raise Unpadded(group.where, f"{why} ({name})")
        user = _user(sys._getframe(1))
        row_dim = tracked[0][3] if tracked[0][1] == "rows" else 0      # coordinates: one per candidate
        if name.startswith("get:"):
            attr = name[4:]
            if attr == "shape" and user:
                return _Size(func(*args, **kwargs), row_dim, fail)
            if attr in SAFE_ATTRS or attr == "shape" or not user:
                return func(*args, **kwargs)
            fail(f"reads .{attr}")
        if name in SAFE_ATTRS or (name in METADATA and not user):
            return func(*args, **kwargs)
        if name == "size":
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim is None:
                return _Size(func(*args, **kwargs), row_dim, fail)
            if dim % args[0].dim() != row_dim:
                return func(*args, **kwargs)
            fail("reads its size (the count) as a Python int")
        handler = _HANDLERS.get(name)
        kinds = {e[1] for e in tracked}
        if kinds == {"rows"} and handler is None and name.rstrip("_") in POINTWISE:
            handler = Padding._pointwise
        if handler is None:
            fail("an op without a padding rule reads it")
        if handler not in _SEVERAL and len(tracked) != 1:
            fail("reads it in more than one operand")
        return handler(self, func, name, args, kwargs, tracked, group, fail)

    def _create(self, func, name, args, kwargs):
        """A selection on plain tensors: its padded form, or None (not one, or kept as a count guard)."""
        if name == "getitem" and len(args) == 2:
            x, key = args
            if isinstance(key, torch.Tensor) and key.dtype == torch.bool and key.dim() >= 1 \
                    and tuple(x.shape[:key.dim()]) == tuple(key.shape):
                g = self._new_group(key, range(key.dim()))
                if g is None:
                    return None
                return self._track(x.reshape(g.n, *x.shape[key.dim():]), "rows", g, 0, fresh=False)
            return None
        if name == "where" and len(args) == 1 and not kwargs:
            return self._coords(args[0], tuple_=True)
        if name == "nonzero" and len(args) == 1:
            return self._coords(args[0], tuple_=kwargs.get("as_tuple", False))
        if name == "masked_select" and len(args) == 2 and not kwargs:
            x, m = args
            shape = torch.broadcast_shapes(x.shape, m.shape)
            if m.dtype != torch.bool or not shape:
                return None
            g = self._new_group(m.expand(shape), range(len(shape)))
            if g is None:
                return None
            return self._track(x.expand(shape).reshape(g.n), "rows", g, 0, fresh=False)
        return None

    def _coords(self, m, tuple_):
        if not isinstance(m, torch.Tensor) or m.dim() == 0:
            return None
        order = sorted(range(m.dim()), key=lambda d: -m.shape[d])      # the largest dim major (stable)
        g = self._new_group(m != 0 if m.dtype != torch.bool else m, order)
        if g is None:
            return None
        idx = tuple(self._track(g.coordinate(j), "index", g, j) for j in range(m.dim()))
        if tuple_:
            return idx
        return self._track(torch.stack(idx, 1), "coords", g, None)

    def check_outputs(self, outs) -> None:
        """A padded value returned by the step would have N rows where eager's has the count."""
        for o in tree_flatten(outs)[0]:
            e = self._get(o)
            if e is not None:
                raise Unpadded(e[2].where, "is an output of the step (its rows would be the padded size)")

    # -- consumers ----------------------------------------------------------------------------------------------
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
        (t, _, _, d, fresh, kept), = tracked
        if args[0] is not t:
            fail("reads it")
        out = func(*args, **kwargs)
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
_SEVERAL = {Padding._pointwise, Padding._index, Padding._setitem, Padding._index_add, Padding._loss}
_HANDLERS = {
    "getitem": Padding._index, "setitem": Padding._setitem,
    "index_add": Padding._index_add, "index_add_": Padding._index_add,
    "sum": Padding._reduce, "mean": Padding._reduce, "amax": Padding._reduce,
    "cross_entropy": Padding._loss, "nll_loss": Padding._loss,
    "linear": Padding._linear, "matmul": Padding._linear, "mm": Padding._linear,
    "layer_norm": Padding._norm, "rms_norm": Padding._norm, "softmax": Padding._norm, "log_softmax": Padding._norm,
    "dropout": Padding._dropout, "unbind": Padding._unbind, "chunk": Padding._split, "split": Padding._split,
    **{n: Padding._view for n in VIEWS},
}


def describe(cap) -> list:
    """Lines for summary() and the simulator's notes: the selections padded (their cost is the N rows'), and
    those kept as count guards with why."""
    lines = []
    if cap.padded:
        sites: dict = {}
        for where, n in cap.padded:
            sites.setdefault(where, []).append(n)
        text = "; ".join(f"{w} ({len(ns)}x, {'/'.join(map(str, sorted(set(ns))))} rows)" for w, ns in
                         list(sites.items())[:4])
        lines.append(f"{len(cap.padded)} data-dependent selection(s) traced at a static size: padded to all their "
                     f"candidate rows, so one program serves every count, and each costs (here and in the simulator) "
                     f"what its N rows cost, not the selected rows': {text}{' ...' if len(sites) > 4 else ''}")
    for where, why in cap.unpadded:
        lines.append(f"selection kept as a count guard (one path per count): {where}: it {why}")
    return lines
