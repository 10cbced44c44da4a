"""Propagation: one worklist loop per tactic, on that tactic's axis, forward and backward to a fixed point.

A node is decided once per axis: either one factor of its rule is tiled on the axis (every unknown neighbour that
holds the factor becomes tiled; results without a REDUCE factor become partial), or a partial operand flows
through it (the op is linear in it). Nodes decided by earlier tactics never change. Each value is set at most once
per axis, so the loop is linear in the graph size.

A closed run (expert parallelism) decides only ops whose every operand and result holds the seeded factor and then
seals the values it set: later tactics on that axis treat sealed values as free (they decide the ops around them
from their other neighbours) and lowering reshards at the boundary, e.g. token buffers tiled(groups) ->
tiled(experts) by one all_to_all.
"""
from __future__ import annotations

import math
from collections import deque

import torch

from .. import contract
from ..contract import META_NO_PARTIAL_PASS, META_OUTPUT, META_PARTIAL_FANOUT
from ..errors import ShardingConflictError
from ..sharding import REPLICATED
from ..rules.factors import PASS, REDUCE, minor_of, stride_of
from ..rules import tags
from . import uneven
from .graph import no_gc
from ..mesh import Mesh
from .graph import PartGraph
from .record import DecisionRecord, place_axis  # noqa: F401 - place_axis: lowering imports it from here
from .state import PARTIAL, PARTIAL_OP, WHOLE, UNKNOWN, AxisState, Conflict, Provenance, state_str


aten = torch.ops.aten
# ops that only re-view their operand: where a closed region ends in one, the region is cut back to its source
VIEW_OPS = tags.ops("reviews")


class Propagator:
    """Applies tactics' seeds one after another to a DecisionRecord (record.py: the tables, their queries and
    copies), which it owns as `rec`; everything that only reads decisions reads the record (or a Decisions of it).

        prop = Propagator(graph, mesh)
        prop.seed("batch", vid, 0, "BP"); prop.run("batch", "BP", [vid])
        prop.rec.value_states("batch")
    """

    def __init__(self, graph: PartGraph, mesh: Mesh, record: DecisionRecord | None = None, uneven: bool = True):
        self.g, self.mesh = graph, mesh
        self.rec = record if record is not None else DecisionRecord(graph, mesh)
        # a dim an axis does not divide may be tiled unevenly (torch.chunk sizes, as DTensor's Shard); False:
        # Options.strict, the divisibility error of old
        self.uneven = uneven

    def snapshot(self) -> "Propagator":
        """A propagator over a full copy of the decisions so far."""
        return Propagator(self.g, self.mesh, self.rec.snapshot(), self.uneven)

    def trial(self, axes) -> "Propagator":
        """A propagator over a copy-on-write copy that may decide `axes` (DecisionRecord.trial)."""
        return Propagator(self.g, self.mesh, self.rec.trial(axes), self.uneven)

    # -- seeding -------------------------------------------------------------------------------------------------
    def seed(self, axis: str, vid: int, state, tactic: str, stride: int = 1) -> None:
        """Seed one value on `axis`: tiled on dim `state` (an int), or pt.REPLICATED."""
        if state is REPLICATED:
            state = WHOLE
        st = self.rec.axis_state(axis)
        c = self.g.canon[vid]
        cur = st.value[c]
        name = self.g.name(vid)
        if cur == state:
            return
        if cur != UNKNOWN:
            by = st.prov[c].tactic
            raise ShardingConflictError(
                f"{tactic}: cannot make {name} {state_str(state)} on axis '{axis}' (size {self.mesh.shape[axis]}): "
                f"tactic {by} already made it {state_str(cur)} on that axis. Decisions of earlier tactics are "
                f"fixed; seed a different axis, or drop one of the two seeds.")
        if state >= 0:
            shape = self.g.shapes[vid]
            if state >= len(shape):
                raise ShardingConflictError(f"{tactic}: {name} has shape {tuple(shape)}; there is no dim {state} to "
                                            f"tile on axis '{axis}'. Use a dim in 0..{len(shape) - 1}.")
            size, k = self.rec.local_dim(vid, state), self.mesh.shape[axis]
            before = uneven.uneven_axis(self.rec, c, state)
            if before is not None:
                raise ShardingConflictError(
                    f"{tactic}: dim {state} of {name} (size {shape[state]}) is tiled unevenly on axis '{before}' "
                    f"(size {self.mesh.shape[before]}), so it cannot also be tiled on axis '{axis}' (size {k}): an "
                    f"unevenly tiled dim takes no further axis. Tile another dim on '{axis}'.")
            if size % k and (not self.uneven or stride > 1):
                raise ShardingConflictError(
                    f"{tactic}: dim {state} of {name} (size {size}{' after earlier tilings' if size != shape[state] else ''}) "
                    f"cannot be tiled on axis '{axis}' (size {k}): {k} does not divide {size}"
                    f"{' (strict=True asks for divisible dims)' if not self.uneven else ' and the tiling is strided'}. "
                    f"Use a size divisible by {k}, or tile another dim"
                    f"{', or drop strict=True to tile it unevenly' if not self.uneven else ''}.")
        if stride > 1:
            self.rec.strides[(c, axis)] = stride
        self.rec.set_state(st, c, state, Provenance(tactic))

    # -- the loop ------------------------------------------------------------------------------------------------
    def run(self, axis: str, tactic: str, seeded: list, region: set | None = None, closed: bool = False) -> list:
        """Propagate on `axis` from the values just seeded (vids) to a fixed point. `region` (op indices), when
        given, confines the tactic to those ops (ZeRO decides the optimizer update only). `closed`: decide only
        ops whose every operand and result (of rank >= 1) holds the tiled factor, and seal the values set, so
        that later tactics compute around them (see `sealed`). Returns the canonical values set."""
        with no_gc():
            before = set(self.rec.axes[axis].assign) if closed and axis in self.rec.axes else set()
            changed = self._run(axis, tactic, seeded, region, closed)
            if closed:
                st = self.rec.axes[axis]
                changed = self._retract_sink_views(st, changed, set(st.assign) - before)
                self.rec.sealed.update((c, axis) for c in changed)
        return changed

    def _retract_sink_views(self, st: AxisState, changed: list, mine: set) -> list:
        """A closed region does not end in views: a view decided by the closed run whose result only feeds ops
        outside it is undone (repeatedly, up a chain of views), so the later tactic decides it and reads the
        view's source, exchanged once for all of its views (an expert output used by the combine and, transposed,
        by the combine's backward). `mine`: the ops the closed run decided."""
        g = self.g
        keep = set(changed)
        work = [i for i in mine if g.ops[i].node.target in VIEW_OPS]
        while work:
            i = work.pop()
            op = g.ops[i]
            if i not in st.assign or not op.results or op.results[0] is None:
                continue
            c = g.canon[op.results[0]]
            if c not in keep or any(u in st.assign for v in g.tied[c] for u in g.users[v]) or \
                    any(g.values[v].meta.get(META_OUTPUT) for v in g.tied[c]):
                continue
            self.rec.undo_op(st, i, c)
            keep.discard(c)
            for v in op.operands:       # the view's source may now be a sink view itself
                p = g.producer[v]
                if p >= 0 and p in mine and g.ops[p].node.target in VIEW_OPS:
                    work.append(p)
        return [c for c in changed if c in keep]

    def _run(self, axis: str, tactic: str, seeded: list, region: set | None = None, closed: bool = False) -> list:
        st = self.rec.axis_state(axis)
        g = self.g
        queue = deque()
        queued = set()

        def push_value(vid):
            for v in g.tied[g.canon[vid]]:
                for i in ((g.producer[v],) if g.producer[v] >= 0 else ()) + tuple(g.users[v]):
                    if i not in queued and i not in st.assign and (region is None or i in region):
                        queued.add(i)
                        queue.append(i)

        changed = [g.canon[v] for v in seeded]
        for vid in sorted(seeded):
            push_value(vid)
        while queue:
            i = queue.popleft()
            queued.discard(i)
            if i in st.assign:
                continue
            for vid in self._visit(st, i, tactic, closed):
                changed.append(vid)
                push_value(vid)
        return changed

    def _visit(self, st: AxisState, i: int, tactic: str, closed: bool = False) -> list:
        """Decide op i on st.axis if its neighbours allow exactly one decision. Returns the values it set."""
        g, op = self.g, self.g.ops[i]
        rule = op.rule
        if rule is None:
            return []
        # sealed values do not constrain the op: lowering reshards them at the boundary
        sealed, axis = self.rec.sealed, st.axis
        slots = [(False, j, dims, vid) for j, (dims, vid) in enumerate(zip(rule.operands, op.operands))
                 if dims is not None]
        slots += [(True, j, dims, vid) for j, (dims, vid) in enumerate(zip(rule.results, op.results))
                  if dims is not None and vid is not None]
        if sealed:
            slots = [sl for sl in slots if (g.canon[sl[3]], axis) not in sealed]
        cands: dict = {}
        blockers = []
        partial_ops = []
        for is_res, j, dims, vid in slots:
            s = st.value[g.canon[vid]]
            if s >= 0 and is_res and rule.sliced_results:
                continue
            if s >= 0:
                fs = dims[s] if s < len(dims) else ()
                f, inner = _factor_at(rule, fs, self.rec.strides.get((g.canon[vid], st.axis), 1))
                if f is not None and rule.factors[f].gathered:
                    continue          # gathered by lowering, whatever the op decides (rules/factors.py)
                if f is None or rule.factors[f].kind not in (PASS, REDUCE):
                    blockers.append(vid)
                else:
                    cands.setdefault((f, inner), []).append(vid)
            elif s in PARTIAL_OP and not is_res:
                partial_ops.append((j, vid, s))
        if len(cands) == 1 and not blockers:
            (f, inner), = cands
            if closed and any(dims and not any(f in fs for fs in dims) for _, _, dims, _ in slots):
                return []     # the op leaves the closed region (a value without the factor)
            return self._tile(st, i, f, slots, tactic, cands[(f, inner)][0], inner)
        if cands:
            others = blockers + [v for vs in cands.values() for v in vs]
            self._conflict(st, i, tactic, others, "neighbours are tiled on different factors" if len(cands) > 1
                           else "a neighbour is tiled on a dim this op needs whole")
            return []
        if partial_ops and not blockers:
            return self._pass_partial(st, i, partial_ops, tactic)
        if blockers:
            self._conflict(st, i, tactic, blockers, "a neighbour is tiled on a dim this op needs whole")
        return []

    def _tile(self, st, i, f, slots, tactic, source, inner: int = 1) -> list:
        g, rule = self.g, self.g.ops[i].rule
        k = self.mesh.shape[st.axis]
        factor = rule.factors[f]
        done = math.prod(self.mesh.shape[a] for a in self.rec.op_axes.get(i, {}).get(f, ()))
        # a strided tiling (inner > 1) splits the minor part of (inner, size / inner); earlier axes split the major
        fits = factor.size % (done * k) == 0 if inner == 1 else \
            (factor.size // inner) % k == 0 and inner % done == 0 and factor.size % inner == 0
        # uneven (propagate/uneven.py): split by whole blocks of `block` of the factor's positions
        block, why = uneven.factor_block(self.g, self.rec, st.axis, i, f, slots, source, inner, done)
        odd = block > 1 or not fits
        if odd and (not self.uneven or why is not None):     # a conflict, as at any: lowering gathers the value
            self._conflict(st, i, tactic, [source], why if self.uneven else
                           f"factor of size {factor.size} (already split {done} ways) is not divisible by axis "
                           f"'{st.axis}' (size {k})")
            return []
        # every slot holding f gets it tiled (strided when f is a minor factor of its dim); a slot already set
        # otherwise is a conflict
        targets = []
        for is_res, j, dims, vid in slots:
            where = [d for d, fs in enumerate(dims) if f in fs]
            if not where:
                continue
            d = where[0]
            c = g.canon[vid]
            s = st.value[c]
            stride = stride_of(rule, dims[d], f) * inner
            if s == d and self.rec.strides.get((c, st.axis), 1) != stride:
                self._conflict(st, i, tactic, [vid, source], f"dim {d} is tiled with another split factor")
                return []
            slot_block = block * minor_of(rule, dims[d], f) if odd else 1
            why = uneven.slot_refusal(self.rec, c, d, st.axis, s, slot_block)
            if why is not None:
                self._conflict(st, i, tactic, [vid, source], why)
                return []
            if s == UNKNOWN and self.rec.dim_axes.get((c, d)) and any(
                    _minor_clash(self.rec.strides.get((c, a), 1), stride, k) for a in self.rec.dim_axes[(c, d)]):
                # an axis may tile a more major part of a dim than an earlier axis only where its chunks hold
                # whole blocks of that axis's part (heads tiled first, then the batch in (B*H))
                self._conflict(st, i, tactic, [vid, source], f"dim {d} is already tiled on a more minor factor "
                                                             f"that the chunks of axis '{st.axis}' would split")
                return []
            if s == UNKNOWN:
                if self.rec.local_dim(vid, d) % k and not odd:
                    self._conflict(st, i, tactic, [vid, source], f"dim {d} (local size {self.rec.local_dim(vid, d)}) is "
                                                                 f"not divisible by axis '{st.axis}' (size {k})")
                    return []
                targets.append((c, d, stride, slot_block))
            elif s != d and not (s in PARTIAL_OP and not is_res) and s != WHOLE:
                # a partial operand is no obstacle (lowering reduce-scatters it into the tiling), nor is an
                # explicitly replicated one (sliced locally as an operand, gathered once as a result)
                self._conflict(st, i, tactic, [vid, source], "a neighbour demands another state")
                return []
        st.assign[i] = f
        st.assign_tactic[i] = tactic
        if inner > 1:
            self.rec.op_inner[(i, st.axis)] = inner
        if odd:
            self.rec.op_uneven[(i, st.axis)] = block
        self.rec.op_axes.setdefault(i, {}).setdefault(f, []).append(st.axis)
        prov = Provenance(tactic, i, source)
        changed = []
        for c, d, stride, slot_block in targets:
            if st.value[c] == UNKNOWN:
                if stride > 1:
                    self.rec.strides[(c, st.axis)] = stride
                if slot_block > 1:
                    self.rec.blocks[(c, st.axis)] = slot_block
                self.rec.set_state(st, c, d, prov)
                changed.append(c)
        if factor.kind == REDUCE:
            p = PARTIAL[factor.reduce_op]
            for is_res, j, dims, vid in slots:
                if is_res and not any(f in fs for fs in dims):
                    c = g.canon[vid]
                    if st.value[c] == UNKNOWN and len(g.tied[c]) == 1:     # state is reduced, never partial
                        self.rec.set_state(st, c, p, prov)
                        changed.append(c)
        return changed

    def _pass_partial(self, st, i, partial_ops, tactic) -> list:
        """A partial operand flows through a linear op, if that op is its only consumer (otherwise it is reduced
        once where it is produced, and every consumer reads the reduced value), or if it is marked
        META_PARTIAL_FANOUT and every consumer is linear in it (a LoRA adapter's rank-r gradient, tactics/lora.py:
        each consumer's result is reduced where it joins a reduction that happens anyway)."""
        g, op = self.g, self.g.ops[i]
        pslots = {j for j, _, _ in partial_ops}
        kinds = {s for _, _, s in partial_ops}
        if len(kinds) != 1:
            return []
        p = kinds.pop()
        if op.node.meta.get(META_NO_PARTIAL_PASS):
            return []
        for j, vid, _ in partial_ops:
            if g.values[vid].meta.get(META_OUTPUT) or len(g.users[vid]) != 1 and not _fans_out(g, vid, p):
                return []
        if any(vid is not None and len(g.tied[g.canon[vid]]) > 1 for vid in op.results):
            return []     # state (a running statistic and its update) keeps one layout: it is never partial
        for slots, ops in op.rule.linear:
            if slots == pslots and PARTIAL_OP[p] in ops:
                st.assign[i] = p
                st.assign_tactic[i] = tactic
                prov = Provenance(tactic, i, partial_ops[0][1])
                changed = []
                for vid in op.results:
                    if vid is not None and st.value[g.canon[vid]] == UNKNOWN:
                        self.rec.set_state(st, g.canon[vid], p, prov)
                        changed.append(g.canon[vid])
                return changed
        return []

    def _conflict(self, st, i, tactic, vids, reason) -> None:
        g = self.g
        states = []
        for v in dict.fromkeys(vids):
            c = g.canon[v]
            prov = st.prov.get(c)
            states.append((g.name(v), state_str(st.value[c]), prov.tactic if prov else "-"))
        node = g.ops[i].node
        self.rec._conflicts[(i, st.axis)] = Conflict(node.name, str(node.target), st.axis, tactic, tuple(states), reason)


def _fans_out(g, vid: int, p: int) -> bool:
    """Is `vid` marked META_PARTIAL_FANOUT, and is each op using it linear in it (partial `p` passes)?"""
    if not g.values[vid].meta.get(META_PARTIAL_FANOUT):
        return False
    for u in g.users[vid]:
        op = g.ops[u]
        slots = {j for j, v in enumerate(op.operands) if v == vid}
        if op.rule is None or op.node.meta.get(META_NO_PARTIAL_PASS) or not any(
                s == slots and PARTIAL_OP[p] in ops for s, ops in op.rule.linear):
            return False
    return True


def _factor_at(rule, fs, stride: int) -> tuple:
    """(factor, inner split factor) that a tiling of a dim with this split factor lands on; (None, 0) if none.
    A split factor inside a factor (a (B*H) dim of bmm whose H part is tiled) gives inner > 1."""
    s = 1
    for x in fs:
        size = rule.factors[x].size
        if stride % s == 0 and stride // s < size and size % (stride // s) == 0:
            return x, stride // s
        s *= size
    return None, 0


def _minor_clash(existing: int, new: int, k: int) -> bool:
    """Does a new axis of size k tiling the dim's part of split factor `new` clash with an axis already tiling
    the part of split factor `existing`? Equal strided parts clash; a more major new part must chunk whole blocks
    of the existing part (new * k divides existing)."""
    if existing <= 1 or existing < new:
        return False
    return existing == new or existing % (new * k) != 0
