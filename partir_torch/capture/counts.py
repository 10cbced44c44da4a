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
    x.split(c.tolist())       (JetMoE's experts: the sizes are counts read from a traced tensor c) chunk i is all N
                              rows of x, valid where cumsum(c)[i] - c[i] <= row < cumsum(c)[i]; `torch.cat` of
                              all the chunks of one split, in order, is the sum of each chunk's valid rows (a plain
                              tensor again); the list of counts is good for nothing else (`SplitSizes`). The
                              counts are taken to sum to x's rows, as split requires (eager raises otherwise)

The rules live in padrules.py. Autograd differentiates the rewritten forward, so the backward is the static-shape one. Padding rows hold the data
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
import math
import os
import sys

import torch
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .branches import _frames
from .sources import library_code
from .padrules import HANDLERS, POINTWISE, SEVERAL, Rules, _same_node

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
        self.split = None       # a chunk of x.split(counts): (id of the sizes, chunk index, chunks)

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


class SplitSizes(list):
    """`c.tolist()` of a traced integer vector c (a count per expert) under Padding: passed to `split` it gives
    padded chunks; any other use (iterating, indexing, arithmetic) raises Unpadded, and the step is traced again
    with the counts read as guards (one path per set of counts)."""

    def __init__(self, counts, where, fail):
        super().__init__()
        self.counts, self.where, self._fail = counts, where, fail

    def __len__(self):
        return int(self.counts.shape[0])

    def __iter__(self):
        self._fail("reads the counts as Python ints")

    def __getitem__(self, i):
        self._fail("reads a count as a Python int")

    __eq__ = __add__ = __radd__ = __contains__ = __getitem__

    __hash__ = None


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


METADATA = frozenset("size numel len nelement stride storage_offset is_contiguous data_ptr untyped_storage".split())
SAFE_ATTRS = frozenset("dim ndim dtype device is_floating_point requires_grad is_cuda layout is_complex "
                       "element_size get_device grad_fn is_leaf names".split())


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
    return not library_code(frame.f_code.co_filename)


class Padding(Rules, TorchFunctionMode):
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
        if name == "cat" and group.split is not None:
            return self._cat_split(args, kwargs, tracked)
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
        handler = HANDLERS.get(name)
        kinds = {e[1] for e in tracked}
        if kinds == {"rows"} and handler is None and name.rstrip("_") in POINTWISE:
            handler = Rules._pointwise
        if handler is None:
            fail("an op without a padding rule reads it")
        if handler not in SEVERAL and len(tracked) != 1:
            fail("reads it in more than one operand")
        return handler(self, func, name, args, kwargs, tracked, group, fail)

    def _create(self, func, name, args, kwargs):
        """A selection on plain tensors: its padded form, or None (not one, or kept as a count guard)."""
        if name == "split" and len(args) >= 2 and isinstance(args[1], SplitSizes):
            return self._split_by_counts(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("dim", 0))
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

    def _cat_split(self, args, kwargs, tracked):
        """torch.cat of the chunks of one split by counts, in order, along their rows: each row from its chunk."""
        parts = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        where = tracked[0][2].where
        ok = isinstance(parts, (list, tuple)) and len(tracked) == len(parts) and dim % parts[0].dim() == 0
        if ok:
            ids = [e[2].split for e in (self._get(t) for t in parts)]
            ok = all(i == (ids[0][0], k, len(parts)) for k, i in enumerate(ids)) and all(
                e[1] == "rows" and e[3] == 0 for e in tracked)
        if not ok:
            raise Unpadded(where, "is concatenated otherwise than with all the other chunks of its split, in order")
        out = None
        for t in parts:
            g = self._get(t)[2]
            part = torch.where(g.valid_at(0, t.dim()), t, torch.zeros((), dtype=t.dtype, device=t.device))
            out = part if out is None else out + part
        return out

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

    def __enter__(self):
        # FunctionalTensor.tolist reads each element with .item() in Python, below any torch function: wrapped
        self._tolist = FunctionalTensor.tolist
        FunctionalTensor.tolist = lambda t: self._counts(t, self._tolist)
        return super().__enter__()

    def __exit__(self, *exc):
        FunctionalTensor.tolist = self._tolist
        return super().__exit__(*exc)

    def _counts(self, t, tolist):
        """`c.tolist()` of a traced integer vector: SplitSizes (what split reads), else the plain list."""
        if t.dim() != 1 or t.is_floating_point() or t.is_complex() or self.node_of is None \
                or self.node_of(t) is None:
            return tolist(t)
        _, where = _frames()
        if where in self.refused or not ENABLED:
            return tolist(t)

        def fail(why):
            raise Unpadded(where, why)
        return SplitSizes(t, where, fail)

    def _split_by_counts(self, x, sizes, dim):
        """x.split(c.tolist(), dim): each chunk all of x's rows along dim, valid on its own stretch."""
        if dim % x.dim() != 0:
            sizes._fail("splits another dim than the first")
        n = x.shape[0]
        ends = sizes.counts.cumsum(0)
        rows = torch.arange(n, device=x.device)
        chunks = []
        for i in range(len(sizes)):
            valid = (rows >= ends[i] - sizes.counts[i]) & (rows < ends[i])
            g = Group(valid, (0,), sizes.where)
            g.split = (id(sizes), i, len(sizes))
            self.groups.append(g)
            self.selections.append((sizes.where, n))
            chunks.append(self._track(x.view(x.shape), "rows", g, 0, fresh=False))
        return tuple(chunks)

    def check_outputs(self, outs) -> None:
        """A padded value returned by the step would have N rows where eager's has the count."""
        for o in tree_flatten(outs)[0]:
            e = self._get(o)
            if e is not None:
                raise Unpadded(e[2].where, "is an output of the step (its rows would be the padded size)")



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
