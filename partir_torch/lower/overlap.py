"""Tensor-parallel overlap: a matmul whose partial result is all-reduced, split into row chunks so that each chunk's
all_reduce runs while the next chunk's matmul computes (Options.tp_chunks; Megatron's row-parallel linears).

    y = mm(a, w); r = all_reduce(reshape(y))          ->   y_i = mm(a[rows_i], w); r_i = all_reduce(y_i)  (i < k)
                                                           r = reshape(cat([wait(r_0), ..., wait(r_{k-1})]))

Each chunk is reduced exactly as its rows were before (an all_reduce sums element by element), so the step computes
the same values; the bytes on the wire are the same, in k collectives; only the last chunk's reduction is left
exposed when the matmul of a chunk takes as long as its reduction. The scheduling pass (schedule.py) then waits for
each chunk where the concatenation reads it. Only the pattern above is rewritten (an all_reduce whose why is
"tactic", of a matmul's result or a view of it, that nothing else reads); sequence parallelism's reduce_scatter and
all_gather are not decomposed here.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx

from ..contract import META_COLLECTIVE, META_LOCAL_SHAPE
from ..rules import tags
from .records import ALL_REDUCE, TACTIC

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_VIEWS = tags.ops("reshape")


def chunk_tp(graph: fx.Graph, records: list, chunks: int) -> list:
    """Rewrite every matching all_reduce in place; returns the record list with each rewritten record replaced by
    its chunks' records (bytes split by rows)."""
    if chunks < 2:
        return records
    replaced: dict = {}
    for ar in [n for n in graph.nodes if n.op == "call_function" and META_COLLECTIVE in n.meta]:
        rec = ar.meta[META_COLLECTIVE]
        if rec.kind != ALL_REDUCE or rec.why != TACTIC:
            continue
        found = _pattern(ar)
        if found is not None:
            replaced[rec.node] = _split(graph, ar, rec, *found, chunks)
    return [r for rec in records for r in replaced.get(rec.node, [rec])]


def _pattern(ar):
    """(mm node, view node or None, wait node) when `ar` all-reduces a matmul's 2-D result (or one view of it) that
    nothing else reads, with a known local shape; else None."""
    waits = list(ar.users)
    if ar.target is not c10d.all_reduce.default or len(waits) != 1 or waits[0].target is not c10d.wait_tensor.default:
        return None
    x, view = ar.args[0], None
    if x.target in _VIEWS and len(x.users) == 1:
        x, view = x.args[0], x
    if x.target is not aten.mm.default or len(x.users) != 1:
        return None
    shape = x.meta.get(META_LOCAL_SHAPE)
    if shape is None and view is not None:
        out = view.meta.get(META_LOCAL_SHAPE) or ar.meta.get(META_LOCAL_SHAPE)
        shape = None if out is None else (math.prod(out[:-1]), out[-1])
    if shape is None or len(shape) != 2:
        return None
    return x, view, waits[0], shape


def _split(graph, ar, rec, mm, view, wait, shape, chunks) -> list:
    rows = shape[0]
    k = min(chunks, rows)
    bounds = [rows * i // k for i in range(k + 1)]
    a, w = mm.args
    reduce_op, group = ar.args[1], ar.args[-1]
    parts, recs = [], []
    with graph.inserting_before(mm):
        for i in range(k):
            lo, hi = bounds[i], bounds[i + 1]
            ai = graph.call_function(aten.slice.Tensor, (a, 0, lo, hi))
            yi = graph.call_function(aten.mm.default, (ai, w))
            yi.meta.update({key: v for key, v in mm.meta.items() if key != META_LOCAL_SHAPE})
            yi.meta[META_LOCAL_SHAPE] = (hi - lo, shape[1])
            ci = graph.call_function(c10d.all_reduce.default, (yi, reduce_op, group))
            nbytes = rec.nbytes * hi // rows - rec.nbytes * lo // rows          # the chunks sum to the whole
            ri = dataclasses.replace(rec, nbytes=nbytes, node=ci.name)
            ci.meta[META_COLLECTIVE] = ri
            ci.meta[META_LOCAL_SHAPE] = (hi - lo, shape[1])
            parts.append(graph.call_function(c10d.wait_tensor.default, (ci,)))
            recs.append(ri)
    with graph.inserting_before(wait):
        out = graph.call_function(aten.cat.default, (parts, 0))
        if view is not None:
            out = graph.call_function(view.target, (out, *view.args[1:]))
    wait.replace_all_uses_with(out)
    for n in (wait, ar) + ((view,) if view is not None else ()) + (mm,):
        graph.erase_node(n)
    return recs
