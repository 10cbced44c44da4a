"""Lowering: the partitioned global graph -> one per-device aten GraphModule with explicit collectives.

Each op runs on local shards under the layout its per-axis decisions imply (lower/layouts below); wherever an
operand's layout differs from what the op needs, reshard.py emits the collectives. Shape arguments are rewritten
to local sizes by localize.py.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from ..propagate.engine import place_axis
from ..rules.factors import stride_of
from ..propagate.state import PARTIAL_OP
from ..errors import PartitionError, internal_error
from ..sharding import Sharding
from . import indexed
from ..capture.graphutil import ancestors, descendants
from .bucket import bucket_collectives
from ..rules.localize import localize_args
from .records import META_NAME, META_ROLE
from .reshard import Emitter, reshard


@dataclass
class Lowered:
    """The per-device program and what it needs to run."""

    gm: fx.GraphModule
    records: list                    # CollectiveRecords, program order
    input_layouts: list              # per captured placeholder: Sharding
    output_layouts: list             # per output: Sharding
    coord_axes: list                 # extra trailing placeholders: the rank's coordinate on each axis
    local_shapes: list = field(default_factory=list)   # per captured placeholder


def _local(shape, sh: Sharding, mesh):
    return sh.local_shape(shape, mesh)


def op_layouts(prog, i: int):
    """(operand layouts, result layouts) op i computes under: built from its per-axis decisions, with each dim's
    axes in the order they were assigned."""
    g, prop = prog.graph, prog.prop
    op = g.ops[i]
    rule = op.rule
    nops, nres = len(op.operands), len(op.results)
    in_dims = [[[] for _ in g.shapes[v]] for v in op.operands]
    in_part = [[] for _ in range(nops)]
    in_strides = [[] for _ in range(nops)]
    out_strides = [[] for _ in range(nres)]
    out_dims = [None if v is None else [[] for _ in g.shapes[v]] for v in op.results]
    out_part = [[] for _ in range(nres)]
    ignored = [rule is not None and rule.operands[j] is None for j in range(nops)]
    if rule is not None:
        for f, axes in prop.op_axes.get(i, {}).items():
            for axis in axes:
                factor = rule.factors[f]
                inner = prop.op_inner.get((i, axis), 1)
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
        for axis in prop.axis_order:
            a = prop.axes[axis].assign.get(i)
            if a is not None and a < 0:
                opname = PARTIAL_OP[a]
                for j, v in enumerate(op.operands):
                    if prop.state(axis, v) == a:
                        in_part[j].append((axis, opname))
                for j in range(nres):
                    out_part[j].append((axis, opname))
    # each dim's axes major to minor, placed as the propagator places them for values (engine.place_axis)
    for dims_list, strides_list in ((in_dims, in_strides), (out_dims, out_strides)):
        for dims, strides in zip(dims_list, strides_list):
            sf = dict(strides)
            for d, axes in enumerate(dims or ()):
                ordered = []
                for a in axes:
                    place_axis(ordered, a, lambda x: sf.get(x, 1), prog.mesh)
                dims[d] = ordered
    ins = [None if ignored[j] else Sharding(in_dims[j], in_part[j], strides=in_strides[j]) for j in range(nops)]
    outs = [None if out_dims[j] is None else Sharding(out_dims[j], out_part[j], strides=out_strides[j])
            for j in range(nres)]
    return ins, outs


def lower(prog, groups: dict) -> Lowered:
    """Build the per-device program. groups: mesh axis -> process group name used by the collectives. Runs of
    parameter all_gathers / gradient reduce_scatters are merged into buckets of prog.bucket_bytes (bucket.py)."""
    g, mesh, cap = prog.graph, prog.mesh, prog.captured
    new = fx.Graph()
    env: dict = {}              # old node -> new node (in the value's recorded layout)
    local_shape: dict = {}      # old node -> local shape under its recorded layout
    layout = {v: prog.sharding_of_vid(v) for v in range(len(g.values))}
    cache: dict = {}
    placeholders = [n for n in g.gm.graph.nodes if n.op == "placeholder"]
    coords = {}
    # placeholders first (captured ones, then one coordinate per axis)
    for n in placeholders:
        p = new.placeholder(n.name)
        p.meta.update({k: v for k, v in n.meta.items() if k != "val"})
        env[n] = p
        v = g.vid.get(n)
        if v is not None:
            local_shape[n] = _local(g.shapes[v], layout[v], mesh)
    for axis in mesh.axes:
        c = new.placeholder(f"coord_{axis}")
        c.meta[META_ROLE], c.meta[META_NAME] = "coord", f"coord.{axis}"
        coords[axis] = c
    em = Emitter(new, mesh, groups, coords)
    out_layouts: list = []
    op_index = {op.node: i for i, op in enumerate(g.ops)}
    phase_of = _phases(g.gm, cap)
    phase = ["forward"]

    def tactic_of(vid):
        def f(axis):
            st = prog.prop.axes.get(axis)
            prov = st.prov.get(g.canon[vid]) if st else None
            return prov.tactic if prov else "-"
        return f

    produced_of: dict = {}     # multi-output node -> result layouts
    layouts_of = [op_layouts(prog, i) for i in range(len(g.ops))]
    wants: dict = {}           # value node -> the layouts its consumers need
    for i, op in enumerate(g.ops):
        for vid, want in zip(op.operands, layouts_of[i][0]):
            if want is not None:
                wants.setdefault(g.values[vid], set()).add(want)

    def settle(node, produced, v):
        """After an op: bring its result from the layout it was computed in to the value's recorded layout; and
        when every consumer needs one same other layout, reshard right here (a gradient is reduced as soon as
        the backward produces it, not when the optimizer first reads it, so the collective can overlap)."""
        want = _strip(layout[v])
        if produced is not None and produced != want:
            em.phase = phase[0]
            x = reshard(em, env[node], local_shape[node], node.meta["val"].dtype, produced, want, g.name(v),
                        tactic_of(v))
            env[node], local_shape[node] = x, _local(g.shapes[v], want, mesh)
        needed = wants.get(node, ())
        if len(needed) == 1 and next(iter(needed)) != want and not node.meta.get("partir_output"):
            fetch(node, next(iter(needed)))

    def fetch(node, want: Sharding | None):
        """node's value in layout `want` (None: as recorded)."""
        v = g.vid[node]
        have = layout[v]
        if want is None or want == _strip(have):
            return env[node], local_shape[node]
        # reshards are shared within a phase: a parameter gathered for the forward is gathered again for the
        # backward instead of being kept alive in between (ZeRO-3's memory saving)
        key = (node, want, phase[0] if node.op == "placeholder" else "")
        if key not in cache:
            em.phase = phase[0]
            src = node.args[0] if node.target in _HOISTABLE and node.args else None
            if (want.is_replicated() and not have.partial and isinstance(src, fx.Node) and src in g.vid
                    and not layout[g.vid[src]].partial):
                # gather the view's source instead (once, shared by all its views: q/k/v of one norm output),
                # then view the whole tensor again
                x_src, _ = fetch(src, Sharding.replicate(len(g.shapes[g.vid[src]])))
                x = new.call_function(node.target, (x_src, *node.args[1:]), dict(node.kwargs))
            else:
                x = reshard(em, env[node], local_shape[node], node.meta["val"].dtype, have, want, g.name(v),
                            tactic_of(v))
            cache[key] = (x, _local(g.shapes[v], want, mesh))
        return cache[key]

    current = [None]
    try:
        for node in g.gm.graph.nodes:
            current[0] = node
            if node.op == "placeholder":
                continue
            phase[0] = phase_of.get(node, "optimizer")
            if node.op == "output":
                outs = []
                for name, o in zip(cap.output_names, node.args[0]):
                    v = g.vid[o]
                    keep = name.startswith(("params.", "opt.", "buffers."))
                    want = _strip(layout[v]) if keep else Sharding.replicate(len(g.shapes[v]))
                    x, _ = fetch(o, want)
                    outs.append(x)
                    out_layouts.append(want)
                new.output(tuple(outs))
                continue
            if node.target is operator.getitem:
                src = env[node.args[0]]
                x = new.call_function(operator.getitem, (src, node.args[1]))
                env[node] = x
                v = g.vid.get(node)
                produced = produced_of[node.args[0]][node.args[1]]
                if v is not None:
                    local_shape[node] = _local(g.shapes[v], produced, mesh)
                    settle(node, produced, v)
                continue
            i = op_index.get(node)
            if i is None:
                raise RuntimeError("the node is neither an op with a rule slot nor a placeholder")
            ins, outs = layouts_of[i]
            op = g.ops[i]
            slot = iter(range(len(op.operands)))
            in_local = []

            def mapped(a):
                if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) and a in g.vid:
                    j = next(slot)
                    x, shp = fetch(a, ins[j])
                    in_local.append(shp)
                    return x
                if isinstance(a, fx.Node):
                    return env[a]
                return a

            args = tree_map(mapped, node.args)
            kwargs = tree_map(mapped, node.kwargs)
            out_local = [None if o is None else _local(g.shapes[v], o, mesh) if v is not None else None
                         for o, v in zip(outs, op.results)]
            if not isinstance(node.meta.get("val"), torch.Tensor):
                vals = node.meta["val"]
                out_local = [None if not isinstance(t, torch.Tensor) else
                             (out_local[k] if out_local[k] is not None else _local(tuple(t.shape), outs[k], mesh))
                             if outs[k] is not None else tuple(t.shape) for k, t in enumerate(vals)]
            args, kwargs = localize_args(node, args, kwargs, in_local, out_local)
            target = _RESHAPE.get(node.target, node.target)
            x = _indexed(em, prog, i, args, kwargs) or new.call_function(target, args, kwargs)
            x.meta["partir_src"] = node.name
            if node.meta.get("partir_recompute"):
                x.meta["partir_recompute"] = node.meta["partir_recompute"]
            env[node] = x
            produced_of[node] = outs
            if isinstance(node.meta.get("val"), torch.Tensor):
                v = g.vid[node]
                local_shape[node] = out_local[0]
                settle(node, outs[0], v)
    except PartitionError:
        raise
    except Exception as e:  # noqa: BLE001 - a bug of ours, reported with the node that hit it
        raise internal_error(current[0], "lowering", e) from e

    cap = getattr(prog, "bucket_bytes", 0)
    records = bucket_collectives(new, em.records, cap) if cap else em.records
    _sink_waits(new)
    gm = fx.GraphModule(torch.nn.Module(), new)
    in_layouts = [layout[g.vid[n]] if n in g.vid else None for n in placeholders]
    return Lowered(gm, records, in_layouts, out_layouts, list(mesh.axes),
                   [local_shape.get(n) for n in placeholders])


# A local shard's strides can differ from the traced tensor's (an operand arrives gathered, a kernel lays out its
# output after its inputs): views are emitted as reshape, which is the same view when the strides allow it and a
# copy otherwise. The graph is functional, so nothing observes the difference.
_RESHAPE = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
            torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}

# pure views with static arguments: a replicated copy of the view is the view of a replicated source
_HOISTABLE = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
              torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
              torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim}


def _indexed(em, prog, i, args, kwargs):
    """The local kernel of an op whose indexed factor (vocabulary, classes) is tiled, else None."""
    rule = prog.graph.ops[i].rule
    for f, axes in prop_axes(prog, i).items():
        factor = rule.factors[f]
        if factor.indexed and axes:
            impl = indexed.IMPLS.get(prog.graph.ops[i].node.target)
            if impl is None:
                raise AssertionError(f"internal: no indexed kernel for {prog.graph.ops[i].node.target}")
            n = factor.size // math.prod(prog.mesh.shape[a] for a in axes)
            return impl(em, args, kwargs, indexed.offset(em, prog.mesh, axes, n), n)
    return None


def prop_axes(prog, i) -> dict:
    return prog.prop.op_axes.get(i, {})


# ops that only unpack a collective's result (a bucket's slices and views, a gathered dim moved back): they move
# down with their wait, so the collective overlaps everything before the first real use of its result
_UNPACK = {torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
           torch.ops.aten._unsafe_view.default, torch.ops.aten.permute.default, torch.ops.aten.clone.default}


def _sink_waits(graph: fx.Graph) -> None:
    """Move each wait_tensor, with the ops that only unpack its result, down to just before the first node that
    really reads it: the collective is issued where its input is ready and compute runs on until the result is
    needed."""
    wait = torch.ops._c10d_functional.wait_tensor.default
    index = {n: i for i, n in enumerate(graph.nodes)}     # moving a wait keeps the other nodes' order
    for node in list(graph.nodes):
        if node.target is not wait or not node.users:
            continue
        chain, readers, stack = [node], [], list(node.users)
        while stack:
            u = stack.pop()
            if u.target in _UNPACK and all(a is node or a in chain for a in u.all_input_nodes):
                if u not in chain:
                    chain.append(u)
                    stack.extend(u.users)
            else:
                readers.append(u)
        if not readers:
            continue
        first = min(readers, key=index.__getitem__)
        for n in sorted(chain, key=index.__getitem__):
            if index[n] < index[first] and n.next is not first:
                first.prepend(n)


def _phases(gm, cap) -> dict:
    """node -> "forward" (an ancestor of the loss), "backward" (an ancestor of a gradient or updated state that is
    not forward), or absent (the optimizer update)."""
    nodes = list(gm.graph.nodes)
    out = nodes[-1]
    if cap.mode == "forward":
        return {n: "forward" for n in nodes}
    loss = out.args[0][0]
    fwd = ancestors([loss])
    phases = {n: "forward" for n in fwd}
    region = descendants([n for n in nodes if n.op == "placeholder"
                           and n.meta.get("partir_role") in ("opt_state", "lr", "step")])
    for n in nodes:
        if n not in fwd and n not in region and n.op != "output":
            phases[n] = "backward"
    return phases


def _strip(sh: Sharding) -> Sharding:
    """The layout part of a sharding (explicitly-replicated markers do not change the data)."""
    return Sharding(sh.dims, sh.partial, strides=sh.strides) if sh.replicated else sh
