"""Lowering: the partitioned global graph -> one per-device aten GraphModule with explicit collectives.

Each op runs on local shards under the layout its per-axis decisions imply (op_layouts); wherever an operand's
layout differs from what the op needs, reshard.py emits the collectives. Shape arguments are rewritten to local
sizes by rules/localize.py. The input is the captured graph and its Decisions (propagate/decisions.py), nothing
else of the Program:

    low = Lowerer(graph, decisions, mesh, captured, groups, options).run()
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.node import map_arg

from ..contract import META_NAME, META_OUTPUT, META_RECOMPUTE, META_ROLE, META_SAVED, META_SRC, STATE_PREFIXES, \
    Role, phase_of
from ..errors import PartitionError, internal_error
from ..options import Options
from ..propagate.decisions import Decisions
from ..propagate.engine import place_axis
from ..rules.factors import minor_of, stride_of
from ..rules import tags
from ..rules.localize import localize_args
from ..sharding import Sharding, chunk_size
from . import cp, indexed
from .bucket import bucket_collectives
from .overlap import chunk_tp
from .fakeprop import annotate_graph
from .pipeline import Pipelined, bucket_parts
from .ppspec import NO_PIPELINE, NoPipeline, PipelineSpec
from .ring import async_tp
from .schedule import Scheduled, schedule
from .fuse import fuse_optimizer
from .reshard import Emitter, call_function, reshard
from .zigzag import zigzag_axis
from .uneven import FILL_FROM_ARG, fill_padding, identity
from .why import SAME_VALUE, Causes


@dataclass
class Lowered:
    """The per-device program and what it needs to run."""

    gm: fx.GraphModule
    records: list                    # CollectiveRecords, program order
    input_layouts: list              # per captured placeholder: Sharding
    output_layouts: list             # per output: Sharding
    coord_axes: list                 # extra trailing placeholders: the rank's coordinate on each axis
    local_shapes: list = field(default_factory=list)   # per captured placeholder
    annotated: bool = False          # every node's meta["val"] holds its local shape as a meta tensor (fakeprop.py)
    scheduled: Scheduled | None = None   # where collectives are issued and waited for (schedule.py)
    pipeline: Pipelined | None = None    # pipeline.Pipelined: the stages' actions and transfers (pipelined programs)
    # captured parameter placeholders whose forward gathered copy the backward reads (Lowerer._tail_of_forward)
    kept_to_backward: frozenset = frozenset()

    @property
    def pipeline_spec(self) -> PipelineSpec | NoPipeline:
        """The pipeline this program runs (NO_PIPELINE: every rank runs the whole step)."""
        return self.pipeline.spec if self.pipeline is not None else NO_PIPELINE


def _local(shape, sh: Sharding, mesh):
    return sh.local_shape(shape, mesh)


def op_layouts(decisions: Decisions, i: int):
    """(operand layouts, result layouts) op i computes under: built from its per-axis decisions, with each dim's
    axes in the order they were assigned."""
    d = decisions
    g, mesh = d.graph, d.mesh
    op = g.ops[i]
    rule = op.rule
    tiled = d.op_factor_axes(i) if rule is not None and d.axes else {}
    partial = [(a, p) for a in d.axes if (p := d.op_partial(i, a)) is not None] if rule is not None else []
    if not tiled and not partial:     # nothing decided for this op on any axis: every operand and result whole
        ins = [None if rule is not None and rule.operands[j] is None else Sharding.interned([[] for _ in g.shapes[v]])
               for j, v in enumerate(op.operands)]
        return ins, [None if v is None else Sharding.interned([[] for _ in g.shapes[v]]) for v in op.results]
    nops, nres = len(op.operands), len(op.results)
    in_dims = [[[] for _ in g.shapes[v]] for v in op.operands]
    in_part = [[] for _ in range(nops)]
    in_strides = [[] for _ in range(nops)]
    out_strides = [[] for _ in range(nres)]
    in_blocks = [[] for _ in range(nops)]      # uneven tilings in blocks (Sharding.blocks)
    out_blocks = [[] for _ in range(nres)]
    out_dims = [None if v is None else [[] for _ in g.shapes[v]] for v in op.results]
    out_part = [[] for _ in range(nres)]
    ignored = [rule is not None and rule.operands[j] is None for j in range(nops)]
    for f, axes in tiled.items():
        for axis in axes:
            _place_factor(rule, f, axis, d.op_inner(i, axis), in_dims, in_strides, out_dims, out_strides, out_part)
            block = d.op_uneven(i, axis)
            if block is not None:
                _place_blocks(rule, f, axis, block, in_blocks, out_blocks, out_dims)
    for axis, opname in partial:
        for j, v in enumerate(op.operands):
            if d.state(axis, v).op == opname:
                in_part[j].append((axis, opname))
        for j in range(nres):
            out_part[j].append((axis, opname))
    # each dim's axes major to minor, placed as the propagator places them for values (engine.place_axis); one
    # axis is its own order
    for dims_list, strides_list in ((in_dims, in_strides), (out_dims, out_strides)):
        for dims, strides in zip(dims_list, strides_list):
            sf = dict(strides)
            for dd, axes in enumerate(dims or ()):
                if len(axes) > 1:
                    ordered = []
                    for a in axes:
                        place_axis(ordered, a, lambda x: sf.get(x, 1), mesh)
                    dims[dd] = ordered
    ins = [None if ignored[j] else Sharding.interned(in_dims[j], in_part[j], (), _strides(in_strides[j]),
                                                     _strides(in_blocks[j])) for j in range(nops)]
    outs = [None if out_dims[j] is None else Sharding.interned(out_dims[j], out_part[j], (), _strides(out_strides[j]),
                                                               _strides(out_blocks[j])) for j in range(nres)]
    return ins, outs


class StageShare:
    """What the lowerings of one plan's stages share (Plan.lowered): the ops' and values' layouts of the stage
    lowered last, reused for each op or value whose decisions the next stage left as they were
    (Decisions.ops_differing, values_differing), the meta run's memo (fakeprop.py; its entries are functions of
    their keys alone) and the captured graph's state and gradient nodes (why.Causes). One plan: one graph and
    mesh."""

    def __init__(self):
        self.layouts = None              # (Decisions, [op_layouts(d, i) per op]) of the stage lowered last
        self.values = None               # (Decisions, [Sharding per value]) of the stage lowered last
        self.meta_memo: dict = {}        # fakeprop._MetaProp's memo, kept across the plan's programs
        self.roles = None                # why.Causes.roles: the captured graph's state and gradient nodes
        self.roles_of = None             # the (graph, captured) they were read from


def stage_layouts(decisions: Decisions, share: StageShare | None = None) -> list:
    """op_layouts of every op; with `share`, the layouts of the stage lowered before are kept for the ops whose
    decisions are the same (op_layouts reads nothing else that differs between stages), and these become it."""
    n = len(decisions.graph.ops)
    prev = share.layouts if share is not None else None
    changed = decisions.ops_differing(prev[0]) if prev is not None else None
    if changed is None:
        out = [op_layouts(decisions, i) for i in range(n)]
    else:
        old = prev[1]
        out = [op_layouts(decisions, i) if i in changed else old[i] for i in range(n)]
    if share is not None:
        share.layouts = (decisions, out)
    return out


def stage_value_layouts(decisions: Decisions, share: StageShare | None = None) -> list:
    """Every value's Sharding; with `share`, those of the stage lowered before are kept for the values whose
    decisions are the same (Decisions.values_differing), and these become it."""
    prev = share.values if share is not None else None
    changed = decisions.values_differing(prev[0]) if prev is not None else None
    canon = decisions.graph.canon
    if changed is None:
        out = [decisions.sharding(v) for v in range(len(decisions.graph.values))]
    else:
        old = prev[1]
        out = [decisions.sharding(v) if canon[v] in changed else old[v] for v in range(len(old))]
    if share is not None:
        share.values = (decisions, out)
    return out


def _strides(pairs) -> tuple:
    """Sharding's normal form of (axis, split) pairs (strides, blocks): one per axis (the last given), splits > 1,
    sorted."""
    return tuple(sorted((a, int(k)) for a, k in dict(pairs).items() if int(k) > 1)) if pairs else ()


def _place_blocks(rule, f, axis, block, in_blocks, out_blocks, out_dims) -> None:
    """`axis` tiles factor f unevenly by blocks of `block` of its positions: each dim holding f (its major part)
    is split by block x its minor factors' positions (propagate/engine.py records the same for values)."""
    for blocks, slots in ((in_blocks, rule.operands), (out_blocks, rule.results)):
        for j, dims in enumerate(slots):
            if dims is None or (blocks is out_blocks and out_dims[j] is None):
                continue
            fs = next((fs for fs in dims if f in fs), None)
            if fs is not None:
                blocks[j].append((axis, block * minor_of(rule, fs, f)))


def _place_factor(rule, f, axis, inner, in_dims, in_strides, out_dims, out_strides, out_part) -> None:
    """Record that `axis` tiles factor f of the rule: on every operand and result dim holding f; a result
    without a REDUCE factor becomes partial."""
    factor = rule.factors[f]
    for j, dims in enumerate(rule.operands):
        for d, fs in enumerate(dims or ()):
            if f in fs:
                in_dims[j][d].append(axis)
                in_strides[j].append((axis, stride_of(rule, fs, f) * inner))
    for j, dims in enumerate(rule.results):
        if dims is None or out_dims[j] is None:
            continue
        where = [d for d, fs in enumerate(dims) if f in fs]
        if where:
            out_dims[j][where[0]].append(axis)
            out_strides[j].append((axis, stride_of(rule, dims[where[0]], f) * inner))
        elif factor.kind == "reduce":
            out_part[j].append((axis, factor.reduce_op))


class Lowerer:
    """Builds the per-device program from a captured graph and its decisions. groups: mesh axis -> process group
    name used by the collectives. Runs of parameter all_gathers / gradient reduce_scatters are merged into
    buckets of options.bucket_bytes (bucket.py). share: what a plan's stages share (StageShare), or None."""

    def __init__(self, graph, decisions: Decisions, mesh, captured, groups: dict, options: Options | None = None,
                 families: dict | None = None, kept: frozenset = frozenset(), pipelined=None,
                 share: StageShare | None = None, ring: frozenset = frozenset()):
        self.g, self.d, self.mesh, self.cap = graph, decisions, mesh, captured
        self.ring = ring                 # axes whose attention runs as a ring (context_parallel(attention="ring"))
        # pipelined: the PipelineSpec of a program cut into stages after lowering (lower/pipeline.py): no bucket or
        # fused update may mix the values of two stages, so buckets are made per stage (gradient reductions and
        # state gathers only, pipeline.bucket_parts) and no fused update
        self.pipelined = pipelined
        self.kept = kept                 # tactics whose gathered state is shared by forward and backward
        self.options = options or Options()
        self.new = fx.Graph()
        self.env: dict = {}              # captured node -> lowered node (in the value's recorded layout)
        self.local_shape: dict = {}      # captured node -> local shape under its recorded layout
        self.layout = stage_value_layouts(decisions, share)   # per value: its recorded Sharding
        self.cache: dict = {}            # (node, layout, phase) -> (lowered node, local shape): shared reshards
        self.fwd_uses: dict = {}         # (state key, layout) -> (index of the last forward op reading it, cache key)
        self.tail = None                 # (state key, layout) -> forward cache key, read last (_tail_of_forward)
        self.kept_to_backward: set = set()  # their placeholders' names, when the backward reads them
        self.phase = "forward"
        self.produced_of: dict = {}      # multi-output node -> result layouts
        self.out_layouts: list = []
        self.op_index = {op.node: i for i, op in enumerate(graph.ops)}
        self.layouts_of = stage_layouts(decisions, share)
        self.wants: dict = {}            # value node -> {layout its consumers need: the first such consumer}
        for i, op in enumerate(graph.ops):
            for vid, want in zip(op.operands, self.layouts_of[i][0]):
                if want is not None:
                    self.wants.setdefault(graph.values[vid], {}).setdefault(want, op.node)
        if self.ring:
            cp.drop_ring_wants(self)
        same = share is not None and share.roles_of is not None and all(
            a is b for a, b in zip(share.roles_of, (graph, captured)))
        known = share.roles if same else None
        self.causes = Causes(graph, decisions, captured, known)
        if share is not None:
            share.roles, share.roles_of = self.causes.roles, (graph, captured)
        self.placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
        coords = self._emit_placeholders(groups)
        self.em = Emitter(self.new, mesh, groups, coords, families)   # families: tactic name -> declared family

    def run(self) -> "Lowered":
        current = None
        try:
            for node in self.g.gm.graph.nodes:
                current = node
                if node.op == "placeholder":
                    continue
                self.phase = str(phase_of(node))
                if node.op == "output":
                    self._output(node)
                elif node.target is operator.getitem:
                    self._getitem(node)
                else:
                    self._op(node)
        except PartitionError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug of ours, reported with the node that hit it
            raise internal_error(current, "lowering", e) from e
        cap = self.options.bucket_bytes
        parts = bucket_parts(self.new, self.pipelined) if self.pipelined is not None and cap else None
        records = bucket_collectives(self.new, self.em.records, cap, parts) if cap else self.em.records
        records = chunk_tp(self.new, records, self.options.tp_chunks)
        if self.options.async_tp:
            annotate_graph(self.new, self._meta_args())
            records = async_tp(self.new, records, self.em.coords)
        # a pipelined program's reductions are not bounded (Options): waited for where its update reads them
        bound = self.options.reduce_in_flight if self.pipelined is None else 0
        scheduled = schedule(self.new, self.options.prefetch, bound)
        if not self.options.compile and self.pipelined is None:   # eager: the optimizer update as fused kernels (Inductor fuses its own)
            fuse_optimizer(self.new, self.cap)
        at = {n.name: i for i, n in enumerate(self.new.nodes)}
        records = sorted(records, key=lambda r: at[r.node])   # program order, as scheduled
        # lazy: its code is generated when first called or read (real ranks); emulation runs segments of its graph
        gm = _LazyGraphModule(torch.nn.Module(), self.new)
        in_layouts = [self.layout[self.g.vid[n]] if n in self.g.vid else None for n in self.placeholders]
        return Lowered(gm, records, in_layouts, self.out_layouts, list(self.mesh.axes),
                       [self.local_shape.get(n) for n in self.placeholders], scheduled=scheduled,
                       kept_to_backward=frozenset(self.kept_to_backward))

    def _meta_args(self) -> list:
        """Meta tensors with the local shapes of the program's placeholders (captured ones, then coordinates)."""
        out = []
        for n in self.placeholders:
            val, shape = n.meta["val"], self.local_shape.get(n)
            out.append(torch.empty(tuple(shape) if shape is not None else tuple(val.shape), dtype=val.dtype,
                                   device="meta"))
        return out + [torch.zeros((), dtype=torch.int64, device="meta") for _ in self.mesh.axes]

    # -- steps ---------------------------------------------------------------------------------------------------
    def _emit_placeholders(self, groups) -> dict:
        """The captured placeholders, then one coordinate per mesh axis (the rank's index on it)."""
        for n in self.placeholders:
            p = self.new.placeholder(n.name)
            p.meta.update({k: v for k, v in n.meta.items() if k != "val"})
            self.env[n] = p
            v = self.g.vid.get(n)
            if v is not None:
                self.local_shape[n] = _local(self.g.shapes[v], self.layout[v], self.mesh)
        coords = {}
        for axis in self.mesh.axes:
            c = self.new.placeholder(f"coord_{axis}")
            c.meta[META_ROLE], c.meta[META_NAME] = Role.COORD, f"coord.{axis}"
            coords[axis] = c
        return coords

    def _output(self, node) -> None:
        """State outputs keep their recorded layout (the next step's input); the rest is returned whole."""
        outs = []
        for name, o in zip(self.cap.output_names, node.args[0]):
            v = self.g.vid[o]
            keep = name.startswith(STATE_PREFIXES)
            want = _strip(self.layout[v]) if keep else Sharding.replicate(len(self.g.shapes[v]))
            x, _ = self.fetch(o, want, None)
            outs.append(x)
            self.out_layouts.append(want)
        self.new.output(tuple(outs))

    def _getitem(self, node) -> None:
        self.env[node] = call_function(self.new, operator.getitem, (self.env[node.args[0]], node.args[1]))
        v = self.g.vid.get(node)
        produced = self.produced_of[node.args[0]][node.args[1]]
        if v is not None:
            self.local_shape[node] = _local(self.g.shapes[v], produced, self.mesh)
            self.settle(node, produced, v)

    def _op(self, node) -> None:
        """One captured op on local shards: its operands fetched in the layouts it computes under, its shape
        arguments localised, its result settled into the value's recorded layout."""
        g, mesh = self.g, self.mesh
        i = self.op_index.get(node)
        if i is None:
            raise RuntimeError("the node is neither an op with a rule slot nor a placeholder")
        ins, outs = self.layouts_of[i]
        if self.ring and node.target in cp.RING_OPS:      # context parallelism's ring attention (lower/cp.py)
            axis = cp.ring_axis(self, i)
            if axis is not None and cp.ring_attention(self, node, i, ins, outs, axis):
                return
        op = g.ops[i]
        slot = iter(range(len(op.operands)))
        in_local = []

        tiled = self.d.op_factor_axes(i)         # factor -> axes tiling it (read once: both steps below need it)
        padded = self._padded_reductions(i, tiled) if tiled else {}

        def mapped(a):            # a node argument (map_arg passes nodes only)
            if a in g.vid and isinstance(a.meta.get("val"), torch.Tensor):
                j = next(slot)
                x, shp = self.fetch(a, ins[j], node)
                in_local.append(shp)
                for d, (parent, axis, m, op_) in padded.get(j, {}).items():
                    fill = _fill(node, j, op_, a.meta["val"].dtype)
                    x = fill_padding(self.em, x, shp, d, parent, axis, m, fill, a.meta["val"].dtype)
                return x
            return self.env[a]

        args, kwargs = map_arg(node.args, mapped), map_arg(node.kwargs, mapped)
        out_local = [None if o is None else _local(g.shapes[v], o, mesh) if v is not None else None
                     for o, v in zip(outs, op.results)]
        if not isinstance(node.meta.get("val"), torch.Tensor):
            out_local = [None if not isinstance(t, torch.Tensor) else
                         (out_local[k] if out_local[k] is not None else _local(tuple(t.shape), outs[k], mesh))
                         if outs[k] is not None else tuple(t.shape) for k, t in enumerate(node.meta["val"])]
        args, kwargs = localize_args(node, args, kwargs, in_local, out_local)
        x = (tiled and self._indexed(i, tiled, args, kwargs)) or call_function(
            self.new, _RESHAPE.get(node.target, node.target), args, kwargs)
        x.meta[META_SRC] = node.name
        for key in (META_RECOMPUTE, META_SAVED):
            if node.meta.get(key):
                x.meta[key] = node.meta[key]
        self.env[node] = x
        self.produced_of[node] = outs
        if isinstance(node.meta.get("val"), torch.Tensor):
            self.local_shape[node] = out_local[0]
            self.settle(node, outs[0], g.vid[node])

    def settle(self, node, produced, v) -> None:
        """After an op: bring its result from the layout it was computed in to the value's recorded layout; and
        when every consumer needs one same other layout, reshard right here (a gradient is reduced as soon as
        the backward produces it, not when the optimizer first reads it, so the collective can overlap)."""
        want = _strip(self.layout[v])
        if produced is not None and produced != want:
            self.em.phase, self.em.cause = self.phase, self._cause(node, node)
            x = reshard(self.em, self.env[node], self.local_shape[node], node.meta["val"].dtype, produced, want,
                        self.g.name(v), self._tactic_of(v), self.g.shapes[v])
            self.env[node], self.local_shape[node] = x, _local(self.g.shapes[v], want, self.mesh)
        needed = self.wants.get(node, {})
        if len(needed) == 1 and next(iter(needed)) != want and not node.meta.get(META_OUTPUT):
            self.fetch(node, *next(iter(needed.items())))

    def fetch(self, node, want: Sharding | None, consumer=None):
        """node's value in layout `want` (None: as recorded), for captured op node `consumer` (None: an output of
        the step)."""
        g = self.g
        v = g.vid[node]
        have = self.layout[v]
        if want is None or want == _strip(have):
            return self.env[node], self.local_shape[node]
        # reshards are shared within a phase: a parameter gathered for the forward is gathered again for the
        # backward instead of being kept alive in between (ZeRO-3's memory saving), unless its tactic keeps it
        kept = self._kept(v)
        key = (_state_key(node) if kept else node, want, self.phase if node.op == "placeholder" and not kept else "")
        self._note_forward_use(node, want, key, consumer)
        tail = self._tail_of_forward(node, want) if key not in self.cache else None
        if tail is not None:
            self.cache[key] = self.cache[tail]
            self.kept_to_backward.add(_state_key(node)[0].name)
        if key not in self.cache:
            self.em.phase = self.phase
            src = node.args[0] if node.target in _HOISTABLE and node.args else None
            if (want.is_replicated() and not have.partial and isinstance(src, fx.Node) and src in g.vid
                    and not self.layout[g.vid[src]].partial):
                # gather the view's source instead (once, shared by all its views: q/k/v of one norm output),
                # then view the whole tensor again
                x_src, _ = self.fetch(src, Sharding.replicate(len(g.shapes[g.vid[src]])), consumer)
                x = self.new.call_function(_RESHAPE.get(node.target, node.target), (x_src, *node.args[1:]),
                                           dict(node.kwargs))
            else:
                self.em.cause = self._cause(node, consumer)
                x = reshard(self.em, self.env[node], self.local_shape[node], node.meta["val"].dtype, have, want,
                            g.name(v), self._tactic_of(v), g.shapes[v])
            self.cache[key] = (x, _local(g.shapes[v], want, self.mesh))
        return self.cache[key]

    def _kept(self, vid) -> bool:
        return bool(self.kept) and any(self.d.tactic_of(vid, a) in self.kept for a in self.mesh.axes)

    # -- the forward's last gathered parameter serves the backward (FSDP2 does not reshard its root after the
    # forward, torchtitan not its last block): the backward reads it first, so gathering it again would only move
    # its bytes a second time while the forward's copy could still be alive
    def _note_forward_use(self, node, want, key, consumer) -> None:
        """Record, in the forward, the last op reading each gathered parameter (or a cast or view of one)."""
        if self.phase != "forward" or self.pipelined is not None or consumer is None:
            return
        skey = _state_key(node)
        if isinstance(skey, tuple) and skey[0].meta.get(META_ROLE) == Role.PARAM:
            self.fwd_uses[(skey, want)] = (self.op_index.get(consumer, -1), key)

    def _tail_of_forward(self, node, want):
        """The forward's cache key of `node` in layout `want` when, fetched in the backward, it is a parameter
        (or a cast or view of one) that the forward's last parameter-reading op read gathered; else None."""
        if self.phase != "backward" or not self.fwd_uses:
            return None
        if self.tail is None:
            last = max(i for i, _ in self.fwd_uses.values())
            self.tail = {sk: key for sk, (i, key) in self.fwd_uses.items() if i == last}
        key = self.tail.get((_state_key(node), want))
        return key if key in self.cache else None

    def _cause(self, value, op):
        """(kind, axis) -> (why, source, op) of a collective moving captured node `value` for op node `op`."""
        return lambda kind, axis: self.causes.of(kind, axis, value, op)

    def _tactic_of(self, vid):
        return lambda axis: self.d.tactic_of(vid, axis)

    def _padded_reductions(self, i, tiled: dict) -> dict:
        """operand slot -> {dim: (parent size, axis, block, reduce op)} for the dims op i reduces over (a REDUCE factor of
        its rule) that an axis tiles unevenly: their padding must hold the reduction's identity (lower/uneven.py).
        An indexed factor (embedding's vocabulary) needs none: no position addresses the padding. tiled: factor ->
        axes (Decisions.op_factor_axes(i))."""
        op, g = self.g.ops[i], self.g
        out: dict = {}
        ins = self.layouts_of[i][0]
        for f, axes in tiled.items():
            factor = op.rule.factors[f]
            if factor.kind != "reduce" or factor.indexed or not axes:
                continue
            for j, dims in enumerate(op.rule.operands):
                if dims is None or ins[j] is None:
                    continue
                uneven = ins[j].uneven_dims(g.shapes[op.operands[j]], self.mesh)
                for d, fs in enumerate(dims):
                    if f in fs and d in uneven:
                        out.setdefault(j, {})[d] = (*uneven[d], factor.reduce_op)
        return out

    def _indexed(self, i, tiled: dict, args, kwargs):
        """The local kernel of an op whose indexed factor (vocabulary, classes) is tiled (tiled: factor -> axes),
        else None."""
        op = self.g.ops[i]
        for f, axes in tiled.items():
            factor = op.rule.factors[f]
            if factor.indexed and axes:
                impl = indexed.IMPLS.get(op.node.target)
                if impl is None:
                    raise RuntimeError(f"no indexed kernel for {op.node.target}")
                n = chunk_size(factor.size, [self.mesh.shape[a] for a in axes])
                size = {"size": factor.size} if impl in indexed.SIZED else {}
                if size and zigzag_axis(self.cap) is not None:      # load balancing (tactics/cpbalance.py)
                    size["zigzag"] = tuple(axes) == (zigzag_axis(self.cap),)
                return impl(self.em, args, kwargs, indexed.offset(self.em, self.mesh, axes, factor.size), n, **size)
        return None


def canonical_groups(mesh) -> dict:
    """The process-group names a plan is lowered with, one per mesh axis ("partir_<axis>"). The emulated runtime
    runs them as they are; a runtime with real process groups binds the program to its own names (bind)."""
    return {a: f"partir_{a}" for a in mesh.axes}


def bind(lowered: "Lowered", groups: dict) -> "Lowered":
    """The same per-device program with its collectives on `groups` (mesh axis -> process group name) instead of
    canonical_groups: a copy of the graph with those arguments replaced (no lowering); records and layouts are
    shared. Returns `lowered` itself when the names already agree."""
    rename = {f"partir_{a}": g for a, g in groups.items() if g != f"partir_{a}"}
    if not rename:
        return lowered
    graph = fx.Graph()
    rv, old_out = graph.graph_copy(lowered.gm.graph, {}, return_output_node=True)
    graph.output(rv).meta.update(old_out.meta)
    for node in graph.nodes:
        if node.op == "call_function" and any(isinstance(a, str) and a in rename for a in node.args):
            node.args = tuple(rename.get(a, a) if isinstance(a, str) else a for a in node.args)
    gm = _LazyGraphModule(torch.nn.Module(), graph)
    gm.meta.update(lowered.gm.meta)
    return Lowered(gm, lowered.records, lowered.input_layouts, lowered.output_layouts, lowered.coord_axes,
                   lowered.local_shapes, scheduled=lowered.scheduled, pipeline=lowered.pipeline)


# A local shard's strides can differ from the traced tensor's (an operand arrives gathered, a kernel lays out its
# output after its inputs): views are emitted as reshape, which is the same view when the strides allow it and a
# copy otherwise. The graph is functional, so nothing observes the difference.
_RESHAPE = tags.EMITTED_AS

# pure views with static arguments: a replicated copy of the view is the view of a replicated source
_HOISTABLE = tags.ops("view") - tags.ops("broadcast")


def _state_key(node):
    """A kept state value's identity for sharing its gathered copy: the placeholder and the chain of casts and views
    that lead from it (a mixed-precision cast traced again in the backward is the forward's value), else the node."""
    chain, n = [], node
    while n.op == "call_function" and n.target in SAME_VALUE and n.args and isinstance(n.args[0], fx.Node):
        chain.append((n.target, repr(n.args[1:]), repr(sorted(n.kwargs.items()))))
        n = n.args[0]
    return (n, tuple(chain)) if n.op == "placeholder" else node


def _fill(node, slot: int, op: str, dtype):
    """What the padding of operand `slot` of `node` holds when the op reduces over it: the reduction's identity,
    or an argument of the op (nll_loss's ignore_index for its target)."""
    arg = FILL_FROM_ARG.get(node.target, {}).get(slot)
    if arg is not None:
        return node.args[arg] if len(node.args) > arg else -100
    return identity(op, dtype)


def _strip(sh: Sharding) -> Sharding:
    """The layout part of a sharding (explicitly-replicated markers do not change the data)."""
    return Sharding(sh.dims, sh.partial, strides=sh.strides, blocks=sh.blocks) if sh.replicated else sh
