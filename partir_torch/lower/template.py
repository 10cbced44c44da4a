"""A per-device program as a function of one input dim: one program for every sequence length (issue 22).

The step captured, planned and lowered at sequence lengths 32, 48 and 40 gives three per-device programs that are
the same graph: the same ops on the same operands, the same collectives on the same axes, in the same order. They
differ only in integer arguments: a view's sizes, an expand's, a slice's end, an arange's length, the bytes of a
collective. Each such integer is a function of the length s, and for the programs partir emits it is affine
(`s`, `4*s`, `s/2` on a sequence-parallel axis): every size is a sum of products of one input dim with constants
(the model's widths, the mesh's axis sizes).

Several dims may vary at once (the batch and the sequence length: issue 40): s is then a tuple (B, T), and an
integer is multilinear in them (a view that flattens (B, T) to B*T). `DimTemplate.fit` reads that function off the
programs built on a Grid: the 2^k corners of two sizes per symbol determine it (exact fractions; one symbol: a + b*s
through two programs), and every other point checks it (at least one, so a size that is not affine, s*s, is
caught; with k >= 2 one point off the grid in every symbol at once checks all of them). Anything else that differs (an op, an operand, a float, a dtype, the number of
nodes) means the programs are not one graph, and fit says where. `instantiate(s)` writes every integer at a new s
into a copy of the graph: no capture, no propagation, no lowering. A size that comes out fractional there (s/2 at
an odd s: a dim the mesh no longer divides) refuses the instance, and the step is partitioned for that s as any
new shape is.

Fitting is exact on the programs it read and affine between them; what the model's Python decides from s (a slice
clamped at a table's length, a branch on s == 1) is not in these integers: runtime/shapes.py instantiates only
where the guards of a symbolic trace of the step hold (capture.dim_guards).

    t = DimTemplate.fit([((32,), low32), ((48,), low48), ((40,), low40)], Grid((32,), (48,)))   # canonical Lowered
    low56 = t.instantiate((56,))                                     # Lowered, or a str: why not
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from ..capture.graphutil import no_gc
from ..contract import META_COLLECTIVE, META_IN_SHAPE, META_LOCAL_SHAPE
from .lower import Lowered

# node meta that holds shapes at the fitted programs' s: dropped from an instance, never stale there
_SHAPE_META = ("val", "tensor_meta", META_IN_SHAPE, META_LOCAL_SHAPE)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _leaves(x):
    """The non-container leaves of a node's (args, kwargs), in a fixed order."""
    if isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    else:
        yield x


def _rebuild(x, new):
    """x with each leaf replaced by next(new), containers kept."""
    if isinstance(x, (list, tuple)):
        out = [_rebuild(v, new) for v in x]
        return out if isinstance(x, list) else tuple(out)
    if isinstance(x, dict):
        return {k: _rebuild(v, new) for k, v in x.items()}
    return next(new)


@dataclass(frozen=True)
class Multilinear:
    """An integer of the program as a function of the symbols s = (s0, s1, ...): a sum of terms c * prod(s_i for
    i in the term), each symbol at most once per term (one symbol: a + b*s; two: a + b*B + c*T + d*B*T, the size of
    a view that flattens (B, T)). Exact fractions."""

    terms: tuple                   # ((symbol indices), Fraction), sorted
    symbols: int = 1               # how many symbols s has

    @staticmethod
    def through(grid: "Grid", corner_values: list) -> "Multilinear":
        """The multilinear function that takes corner_values at grid.corners (interpolation on the 2^k grid)."""
        poly: dict = {}
        for corner, v in zip(grid.corners(), corner_values):
            term = {(): Fraction(v)}          # v * prod_i (the 1-d basis function of corner i's value in s_i)
            for i, (at_hi, lo, hi) in enumerate(zip(corner, grid.lo, grid.hi)):
                w = Fraction(1, hi - lo)       # at hi: (s_i - lo) / (hi - lo); at lo: (hi - s_i) / (hi - lo)
                a, b = (-lo * w, w) if at_hi else (hi * w, -w)
                nxt: dict = {}
                for m, c in term.items():
                    nxt[m] = nxt.get(m, 0) + c * a
                    nxt[m + (i,)] = nxt.get(m + (i,), 0) + c * b
                term = nxt
            for m, c in term.items():
                poly[m] = poly.get(m, 0) + c
        return Multilinear(tuple(sorted((m, c) for m, c in poly.items() if c != 0)), len(grid.lo))

    def at(self, s: tuple) -> Fraction:
        total = Fraction(0)
        for m, c in self.terms:
            for i in m:
                c = c * s[i]
            total += c
        return total

    def __str__(self):
        one = self.symbols == 1           # one symbol: written s, as a + b*s; several: s0, s1, ...
        parts = [f"{c}" + "".join("*s" if one else f"*s{i}" for i in m) for m, c in self.terms]
        return " + ".join(parts) or "0"


@dataclass(frozen=True)
class Grid:
    """Where the programs of a fit were built: the 2^k corners of lo/hi per symbol (they determine a multilinear
    function) and the other points (each checks it: a size that is not multilinear, s*s, fails there)."""

    lo: tuple
    hi: tuple

    def corners(self) -> list:
        k = len(self.lo)
        return [tuple(bool(c >> i & 1) for i in range(k)) for c in range(2 ** k)]

    def corner_points(self) -> list:
        return [tuple(h if up else lo for up, lo, h in zip(c, self.lo, self.hi)) for c in self.corners()]


class NotOneGraph(Exception):
    """The programs differ in more than integers (fit's reason)."""


def _fit_values(ss: list, vals: list, where: str, grid: Grid):
    """None when all of vals (at the points ss, the grid's corners first) are equal, else the Multilinear through
    the corners, checked at every other point; raises NotOneGraph otherwise."""
    if all(v == vals[0] for v in vals[1:]):
        return None
    if not all(_is_int(v) for v in vals):
        raise NotOneGraph(f"{where}: {vals!r} at s = {_pts(ss)} (not an integer that varies)")
    n = 2 ** len(grid.lo)
    f = Multilinear.through(grid, vals[:n])
    if any(f.at(s) != v for s, v in zip(ss[n:], vals[n:])):
        raise NotOneGraph(f"{where}: {vals} at s = {_pts(ss)} is not {'affine' if n == 2 else 'multilinear'} in s")
    return f


def _pts(ss) -> str:
    return str([s[0] if len(s) == 1 else s for s in ss])


@dataclass
class DimTemplate:
    """The per-device program at any s (a tuple: one size per symbol): a graph (the grid's first corner's) and, per
    integer that varies, its Multilinear."""

    base: Lowered
    points: tuple                  # the s tuples fitted (the grid's corners first)
    args: dict                     # (node index, leaf index) -> Multilinear
    shapes: dict                   # (placeholder index, dim) -> Multilinear: Lowered.local_shapes
    records: dict                  # (record index, member index or -1) -> Multilinear of nbytes

    @classmethod
    def fit(cls, points: list, grid: Grid) -> "DimTemplate | str":
        """points: [(s tuple, canonical Lowered)]: every corner of the grid and at least one other point. The
        template, or why the programs are not one graph in s."""
        by = dict(points)
        corners = grid.corner_points()
        missing = [c for c in corners if c not in by]
        rest = sorted(s for s in by if s not in corners)
        if missing or not rest:
            return f"fitting needs programs at the grid's corners {corners} and one more point (have {sorted(by)})"
        ss = corners + rest
        points = [(s, by[s]) for s in ss]
        fit = lambda where, vals: _fit_values(ss, vals, where, grid)   # noqa: E731
        lows = [low for _, low in points]
        try:
            for what in ("input_layouts", "output_layouts", "coord_axes"):
                if any(getattr(low, what) != getattr(lows[0], what) for low in lows[1:]):
                    raise NotOneGraph(f"the programs' {what.replace('_', ' ')} differ at s = {_pts(ss)}")
            args = _fit_graphs(ss, [list(low.gm.graph.nodes) for low in lows], fit)
            shapes = _fit_shapes(ss, [low.local_shapes for low in lows], fit)
            records = _fit_records(ss, [low.records for low in lows], fit)
        except NotOneGraph as e:
            return str(e)
        return cls(lows[0], tuple(ss), args, shapes, records)

    def instantiate(self, s: tuple) -> "Lowered | str":
        """The program at s (canonical groups, as plan.lowered()), or why not: a size that is not a whole
        non-negative number at s."""
        with no_gc():     # a bulk copy of the graph (capture/graphutil.py)
            return self._instantiate(s)

    def _instantiate(self, s: tuple) -> "Lowered | str":
        vals = {}
        for key, f in list(self.args.items()) + list(self.shapes.items()) + list(self.records.items()):
            v = f.at(s)
            if v.denominator != 1 or v < 0:
                return (f"a size of the program, {f}, is {v} at s = {_pts([s])[1:-1]}: the mesh does not divide "
                        f"this length as it divides {_pts(self.points)[1:-1]}")
            vals[key] = int(v)
        graph = fx.Graph()
        env: dict = {}
        sized = {i for i, _ in self.args}
        for i, node in enumerate(self.base.gm.graph.nodes):
            if node.op == "output":
                graph.output(fx.map_arg(node.args[0], lambda n: env[n]))
                continue
            new = graph.node_copy(node, lambda n: env[n])
            if i in sized:   # the few nodes with sizes: rewrite their leaves
                leaves = iter([vals.get((i, j), v) for j, v in enumerate(_leaves((new.args, new.kwargs)))])
                new.args, new.kwargs = _rebuild((new.args, new.kwargs), leaves)
            for k in _SHAPE_META:
                new.meta.pop(k, None)
            env[node] = new
        records = [self._record(r, k, vals) for k, r in enumerate(self.base.records)]
        by_node = {r.node: r for r in records}
        for n in graph.nodes:
            if META_COLLECTIVE in n.meta and n.name in by_node:
                n.meta[META_COLLECTIVE] = by_node[n.name]
        gm = _LazyGraphModule(self.base.gm, graph)
        gm.meta.update(self.base.gm.meta)
        shapes = [None if shp is None else tuple(vals.get((p, d), v) for d, v in enumerate(shp))
                  for p, shp in enumerate(self.base.local_shapes)]
        return Lowered(gm, records, self.base.input_layouts, self.base.output_layouts, self.base.coord_axes,
                       shapes, scheduled=self.base.scheduled)

    @staticmethod
    def _record(r, k: int, vals: dict):
        members = tuple(dataclasses.replace(m, nbytes=vals.get((k, j), m.nbytes)) for j, m in enumerate(r.members))
        return dataclasses.replace(r, nbytes=vals.get((k, -1), r.nbytes), members=members)


def _fit_graphs(ss: list, graphs: list, fit) -> dict:
    """(node index, leaf index) -> Affine for the integers that vary; NotOneGraph where the graphs differ."""
    if len({len(g) for g in graphs}) != 1:
        raise NotOneGraph(f"the programs have {[len(g) for g in graphs]} nodes at s = {_pts(ss)}")
    index = [{n: i for i, n in enumerate(g)} for g in graphs]
    out = {}
    for i, nodes in enumerate(zip(*graphs)):
        first = nodes[0]
        if any((n.op, n.target) != (first.op, first.target) for n in nodes[1:]):
            raise NotOneGraph(f"node {i} is {[n.format_node() for n in nodes]} at s = {_pts(ss)}")
        leaves = [list(_leaves((n.args, n.kwargs))) for n in nodes]
        if len({len(lv) for lv in leaves}) != 1:
            raise NotOneGraph(f"{first.format_node()}: its arguments differ in number at s = {_pts(ss)}")
        for j, vals in enumerate(zip(*leaves)):
            if isinstance(vals[0], fx.Node):
                if any(not isinstance(v, fx.Node) or ix[v] != index[0][vals[0]] for v, ix in zip(vals, index)):
                    raise NotOneGraph(f"{first.format_node()}: operand {j} differs at s = {_pts(ss)}")
                continue
            f = fit(first.format_node(), list(vals))
            if f is not None:
                out[(i, j)] = f
    return out


def _fit_shapes(ss: list, shapes: list, fit) -> dict:
    out = {}
    for p, per in enumerate(zip(*shapes)):
        if per[0] is None:
            continue
        if len({len(x) for x in per}) != 1:
            raise NotOneGraph(f"placeholder {p} has ranks {[len(x) for x in per]} at s = {_pts(ss)}")
        for d, vals in enumerate(zip(*per)):
            f = fit(f"placeholder {p} dim {d}", list(vals))
            if f is not None:
                out[(p, d)] = f
    return out


def _fit_records(ss: list, records: list, fit) -> dict:
    if len({len(r) for r in records}) != 1:
        raise NotOneGraph(f"the programs have {[len(r) for r in records]} collectives at s = {_pts(ss)}")
    out = {}
    for k, recs in enumerate(zip(*records)):
        if any((r.kind, r.axis, r.node, len(r.members)) != (recs[0].kind, recs[0].axis, recs[0].node,
                                                            len(recs[0].members)) for r in recs):
            raise NotOneGraph(f"collective {k} is {[str(r) for r in recs]} at s = {_pts(ss)}")
        for j, vals in [(-1, [r.nbytes for r in recs])] + [
                (j, [r.members[j].nbytes for r in recs]) for j in range(len(recs[0].members))]:
            f = fit(f"collective {recs[0].node}'s bytes", vals)
            if f is not None:
                out[(k, j)] = f
    return out
