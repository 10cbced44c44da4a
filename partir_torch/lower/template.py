"""A per-device program as a function of one input dim: one program for every sequence length (issue 22).

The step captured, planned and lowered at sequence lengths 32, 48 and 40 gives three per-device programs that are
the same graph: the same ops on the same operands, the same collectives on the same axes, in the same order. They
differ only in integer arguments: a view's sizes, an expand's, a slice's end, an arange's length, the bytes of a
collective. Each such integer is a function of the length s, and for the programs partir emits it is affine
(`s`, `4*s`, `s/2` on a sequence-parallel axis): every size is a sum of products of one input dim with constants
(the model's widths, the mesh's axis sizes).

`DimTemplate.fit` reads that function off the programs: an integer that differs between them is a + b*s, with a
and b exact fractions from two of the programs, checked on every other one (at least three in all, so a size that
is not affine, s*s, is caught). Anything else that differs (an op, an operand, a float, a dtype, the number of
nodes) means the programs are not one graph, and fit says where. `instantiate(s)` writes every integer at a new s
into a copy of the graph: no capture, no propagation, no lowering. A size that comes out fractional there (s/2 at
an odd s: a dim the mesh no longer divides) refuses the instance, and the step is partitioned for that s as any
new shape is.

Fitting is exact on the programs it read and affine between them; what the model's Python decides from s (a slice
clamped at a table's length, a branch on s == 1) is not in these integers: runtime/shapes.py instantiates only
where the guards of a symbolic trace of the step hold (capture.dim_guards).

    t = DimTemplate.fit([(32, low32), (48, low48), (40, low40)])    # canonical Lowered programs
    low56 = t.instantiate(56)                                        # Lowered, or a str: why not
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
class Affine:
    """a + b*s, exact."""

    a: Fraction
    b: Fraction

    @staticmethod
    def through(s0: int, v0: int, s1: int, v1: int) -> "Affine":
        b = Fraction(v1 - v0, s1 - s0)
        return Affine(Fraction(v0) - b * s0, b)

    def at(self, s: int) -> Fraction:
        return self.a + self.b * s

    def __str__(self):
        return f"{self.a} + {self.b}*s"


class NotOneGraph(Exception):
    """The programs differ in more than integers (fit's reason)."""


def _fit_values(ss: list, vals: list, where: str):
    """None when all of vals are equal, else the Affine through them; raises NotOneGraph otherwise."""
    if all(v == vals[0] for v in vals[1:]):
        return None
    if not all(_is_int(v) for v in vals):
        raise NotOneGraph(f"{where}: {vals!r} at s = {ss} (not an integer that varies)")
    f = Affine.through(ss[0], vals[0], ss[1], vals[1])
    if any(f.at(s) != v for s, v in zip(ss[2:], vals[2:])):
        raise NotOneGraph(f"{where}: {vals} at s = {ss} is not affine in s")
    return f


@dataclass
class DimTemplate:
    """The per-device program at any s: a graph (the first point's) and, per integer that varies, its Affine."""

    base: Lowered
    points: tuple                  # the s values fitted
    args: dict                     # (node index, leaf index) -> Affine
    shapes: dict                   # (placeholder index, dim) -> Affine: Lowered.local_shapes
    records: dict                  # (record index, member index or -1) -> Affine of nbytes

    @classmethod
    def fit(cls, points: list) -> "DimTemplate | str":
        """points: [(s, canonical Lowered)], at least three distinct s. The template, or why the programs are not
        one graph in s."""
        points = sorted(points, key=lambda p: p[0])
        ss = [s for s, _ in points]
        if len(set(ss)) < 3:
            return f"fitting needs programs at three lengths (have {sorted(set(ss))})"
        lows = [low for _, low in points]
        try:
            for what in ("input_layouts", "output_layouts", "coord_axes"):
                if any(getattr(low, what) != getattr(lows[0], what) for low in lows[1:]):
                    raise NotOneGraph(f"the programs' {what.replace('_', ' ')} differ at s = {ss}")
            args = _fit_graphs(ss, [list(low.gm.graph.nodes) for low in lows])
            shapes = _fit_shapes(ss, [low.local_shapes for low in lows])
            records = _fit_records(ss, [low.records for low in lows])
        except NotOneGraph as e:
            return str(e)
        return cls(lows[0], tuple(ss), args, shapes, records)

    def instantiate(self, s: int) -> "Lowered | str":
        """The program at s (canonical groups, as plan.lowered()), or why not: a size that is not a whole
        non-negative number at s."""
        with no_gc():     # a bulk copy of the graph (capture/graphutil.py)
            return self._instantiate(s)

    def _instantiate(self, s: int) -> "Lowered | str":
        vals = {}
        for key, f in list(self.args.items()) + list(self.shapes.items()) + list(self.records.items()):
            v = f.at(s)
            if v.denominator != 1 or v < 0:
                return (f"a size of the program, {f}, is {v} at s = {s}: the mesh does not divide this length as "
                        f"it divides {', '.join(map(str, self.points))}")
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


def _fit_graphs(ss: list, graphs: list) -> dict:
    """(node index, leaf index) -> Affine for the integers that vary; NotOneGraph where the graphs differ."""
    if len({len(g) for g in graphs}) != 1:
        raise NotOneGraph(f"the programs have {[len(g) for g in graphs]} nodes at s = {ss}")
    index = [{n: i for i, n in enumerate(g)} for g in graphs]
    out = {}
    for i, nodes in enumerate(zip(*graphs)):
        first = nodes[0]
        if any((n.op, n.target) != (first.op, first.target) for n in nodes[1:]):
            raise NotOneGraph(f"node {i} is {[n.format_node() for n in nodes]} at s = {ss}")
        leaves = [list(_leaves((n.args, n.kwargs))) for n in nodes]
        if len({len(lv) for lv in leaves}) != 1:
            raise NotOneGraph(f"{first.format_node()}: its arguments differ in number at s = {ss}")
        for j, vals in enumerate(zip(*leaves)):
            if isinstance(vals[0], fx.Node):
                if any(not isinstance(v, fx.Node) or ix[v] != index[0][vals[0]] for v, ix in zip(vals, index)):
                    raise NotOneGraph(f"{first.format_node()}: operand {j} differs at s = {ss}")
                continue
            f = _fit_values(ss, list(vals), first.format_node())
            if f is not None:
                out[(i, j)] = f
    return out


def _fit_shapes(ss: list, shapes: list) -> dict:
    out = {}
    for p, per in enumerate(zip(*shapes)):
        if per[0] is None:
            continue
        if len({len(x) for x in per}) != 1:
            raise NotOneGraph(f"placeholder {p} has ranks {[len(x) for x in per]} at s = {ss}")
        for d, vals in enumerate(zip(*per)):
            f = _fit_values(ss, list(vals), f"placeholder {p} dim {d}")
            if f is not None:
                out[(p, d)] = f
    return out


def _fit_records(ss: list, records: list) -> dict:
    if len({len(r) for r in records}) != 1:
        raise NotOneGraph(f"the programs have {[len(r) for r in records]} collectives at s = {ss}")
    out = {}
    for k, recs in enumerate(zip(*records)):
        if any((r.kind, r.axis, r.node, len(r.members)) != (recs[0].kind, recs[0].axis, recs[0].node,
                                                            len(recs[0].members)) for r in recs):
            raise NotOneGraph(f"collective {k} is {[str(r) for r in recs]} at s = {ss}")
        for j, vals in [(-1, [r.nbytes for r in recs])] + [
                (j, [r.members[j].nbytes for r in recs]) for j in range(len(recs[0].members))]:
            f = _fit_values(ss, vals, f"collective {recs[0].node}'s bytes")
            if f is not None:
                out[(k, j)] = f
    return out
