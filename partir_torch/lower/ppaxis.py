"""Collectives on the pipeline axis of a pipelined program (lower/pipeline.py): the sums that span stages.

A value summed over terms computed on several stages (adds, and the linear collectives lowering put on the sum for
the other axes) becomes, per rank of the pipeline axis, a copy of that sum over its own stages' terms; the ranks'
parts meet in an all_reduce on the axis that every rank runs (META_STAGE None), whose result every rank holds:

- tied weights (a parameter read by several stages, PipelineSpec.tied): each holder rank's terms of its gradient,
  over the micro-batches; the owner's update is copied onto a stage of every other holder rank, each updating its
  own copy (action TIED after the last backward; END: each rank's own copy as the step's output);
- clip_grad_norm (capture tags its ops, META_CLIP): each rank's stages' squared gradients (their "N" actions), then
  the norm and the clipping factor on every rank (action NORM before the updates).

Each all_reduce carries a CollectiveRecord (why "tied weight" / "grad norm"); the simulator costs it as any other.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..contract import (META_CLIP, META_COLLECTIVE, META_IN_SHAPE, META_LOCAL_SHAPE, META_NAME, META_SRC, Phase,
                        phase_of)
from ..errors import InternalError, PartitionError
from .records import ALL_REDUCE, GRAD_NORM, TIED as TIED_WHY, CollectiveRecord

# Actions every rank of the axis runs together (nodes with META_STAGE None), after the last backward: TIED, the
# all_reduce of tied weights' gradients; NORM, clip_grad_norm's all_reduce of the ranks' sums of squares (after each
# stage's "N" action, its squares); END, after the updates: each rank's own copy of a tied weight as the output.
TIED, NORM, END = (None, "T", 0), (None, "R", 0), (None, "E", 0)
_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
# ops lowering adds that are linear in their operand (f(a + b) = f(a) + f(b)): a sum split by stage passes them
_LINEAR = (_c10d.all_reduce.default, _c10d.reduce_scatter_tensor.default, _c10d.all_gather_into_tensor.default,
           _c10d.wait_tensor.default)


def pp_select(coord, *parts):
    """The operand of an all_reduce on the pipeline axis: parts[c] is computed by the ranks at coordinate c, and every
    rank contributes its own (coord: the rank's coordinate on the axis, a 0-dim tensor). The emulator runs it on
    every rank with the other coordinates' parts absent (None); real ranks (runtime/p2p.py) read their own; on one
    device, where every rank computes every stage (fake propagation, the LocalTensorMode cross-check), parts[coord].
    As an output of the step (a tied weight), each holder's own copy, None on the ranks that do not hold it."""
    if all(x is not None for x in parts):
        return torch.stack(parts).index_select(0, coord.reshape(1).long()).squeeze(0)
    return next((x for x in parts if x is not None), None)


def clip_tag(node):
    return None if node is None else (node.meta.get("custom") or {}).get(META_CLIP)


def clip_norm(g, stage, spec, cap_nodes, low) -> tuple:
    """clip_grad_norm across stages. The captured total is one running sum of every gradient's squares (with the
    collectives lowering put on it for the other axes, all linear); each rank of the pipeline axis sums its own
    stages' squares, the ranks' partial totals are all-reduced on the pipeline axis, and the norm and the clipping
    factor are computed on every rank, so each stage scales its gradients by the same factor. Returns (the nodes
    every rank runs, the ranks' partial totals); (set(), []) when the step does not clip."""
    tag = lambda n: clip_tag(cap_nodes.get(n.meta.get(META_SRC)))     # noqa: E731
    sqrt = next((n for n in g.nodes if n.op == "call_function" and tag(n) == "coef"), None)
    if sqrt is None:
        return set(), []
    within = lambda x: tag(x) == "sum" or x.target in _LINEAR and META_SRC not in x.meta     # noqa: E731
    every, parts = _sum_over_axis(g, stage, spec, low, sqrt.args[0], within, sqrt,
                                  dict(value="grad_norm", why=GRAD_NORM, phase="optimizer", op=str(sqrt.target),
                                       shape=(), dtype=torch.float32))
    for n in g.nodes:      # the norm and the clipping factor: every rank computes them from the total
        ins = n.all_input_nodes
        if n.op == "call_function" and tag(n) in ("coef", "scale") and any(a in every for a in ins) \
                and all(a in every or a not in stage for a in ins):
            every.add(n)
            stage.pop(n, None)
    return every, parts


def _sum_over_axis(g, stage, spec, low, root, within, before, record: dict) -> tuple:
    """`root`, a sum (adds and the linear collectives lowering put on it: the nodes `within` says) of values computed
    on several stages, as an all_reduce on the pipeline axis of each rank's part: a copy of the sum in which the
    other ranks' terms are left out (a rank with none adds zeros of record's local shape and dtype). Every reader
    of root reads the all_reduce's result instead, which every rank holds (record: what its CollectiveRecord
    says). Returns ({pp_select, all_reduce, wait}, the
    ranks' parts)."""
    region, todo = set(), [root]
    while todo:
        x = todo.pop()
        if x not in region and within(x):
            region.add(x)
            todo.extend(x.all_input_nodes)
    inside = [n for n in g.nodes if n in region]
    leaves = {a for n in inside for a in n.all_input_nodes if a not in region} | ({root} - region)
    if any(x not in stage for x in leaves):
        raise InternalError(f"pipeline: the terms {sorted(x.name for x in leaves if x not in stage)} of "
                            f"{record['value']}'s sum over the stages are on no stage.")
    parts = []
    for c in range(spec.ranks):
        env: dict = {}

        def mine(x, c=c, env=env):
            return env[x] if x in region else x if spec.rank_of(stage[x]) == c else None
        for n in inside:
            xs = [mine(a) for a in n.all_input_nodes]
            if all(x is None for x in xs):
                env[n] = None
            elif n.target is _aten.add.Tensor and None in xs:     # x + (another rank's terms) -> x
                env[n] = next(x for x in xs if x is not None)
            else:
                with g.inserting_before(n):
                    env[n] = cp = g.node_copy(n, mine)
                stage[cp] = max(stage[x] for x in xs if x is not None)
                if META_COLLECTIVE in n.meta:
                    cp.meta[META_COLLECTIVE] = replace(n.meta[META_COLLECTIVE], node=cp.name)
                    low.records.append(cp.meta[META_COLLECTIVE])
        part = mine(root)
        if part is None:            # a rank with no term: it adds zeros
            with g.inserting_before(before):
                part = g.call_function(_aten.new_zeros.default, (_coord(g, spec), list(record["shape"])),
                                       {"dtype": record["dtype"]})      # on the rank's device
            part.meta[META_LOCAL_SHAPE] = tuple(record["shape"])
            stage[part] = c
        parts.append(part)
    with g.inserting_before(before):
        sel = g.call_function(pp_select, (_coord(g, spec),) + tuple(parts))
        ar = g.call_function(_c10d.all_reduce.default, (sel, "sum", f"partir_{spec.axis}"))
        total = g.call_function(_c10d.wait_tensor.default, (ar,))
    shape, dtype = tuple(record["shape"]), record["dtype"]
    for x in (sel, ar, total):
        x.meta[META_LOCAL_SHAPE] = shape
    ar.meta[META_IN_SHAPE] = shape
    nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    ar.meta[META_COLLECTIVE] = rec = CollectiveRecord(
        ALL_REDUCE, spec.axis, spec.ranks, nbytes, str(dtype).replace("torch.", ""), spec.name, record["value"],
        ar.name, reduce_op="sum", phase=record["phase"], family="pipeline", why=record["why"], op=record["op"])
    low.records.append(rec)
    for u in list(root.users):
        if u not in (sel, ar, total) and u not in region:
            u.replace_input_with(root, total)
    for n in reversed(inside):
        if not n.users:
            g.erase_node(n)
            stage.pop(n, None)
    return {sel, ar, total}, parts


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def tied_weights(g, stage, spec, cap_nodes, low, captured) -> dict:
    """Tied weights held on several ranks of the axis (Megatron's shared embedding): each holder rank sums its own
    stages' terms of the weight's gradient (over the micro-batches), the parts are all-reduced on the pipeline axis
    (TIED), and every holder runs the same update (the owner's ops, copied onto one stage of each other holder rank)
    on its own copy of the weight and its optimizer state, which stay identical; the step's output of each is, on
    each rank, its own copy (END). Returns {TIED: nodes, END: nodes} (empty sets when nothing is tied)."""
    out_node = next(n for n in reversed(g.nodes) if n.op == "output")
    outs = dict(zip(captured.output_names, out_node.args[0]))
    phs = [n for n in captured.gm.graph.nodes if n.op == "placeholder"]
    shapes = {n.meta.get(META_NAME): s for n, s in zip(phs, low.local_shapes)}      # local: the other axes' layout
    dtypes = {n.meta.get(META_NAME): n.meta["val"].dtype for n in phs}
    every = {TIED: set(), END: set()}
    fqns = {}
    for name, st in spec.tied.items():
        if name in outs and len(spec.holders(name)) > 1:
            fqns.setdefault(name.split(".", 2)[2] if name.startswith("opt.") else name[len("params."):], []) \
                .append(name)
    for fqn, names in fqns.items():
        _refuse_sharded_tied(g, f"params.{fqn}", spec)
        owner = spec.tied[f"params.{fqn}"][0]
        update, root = _update_of(g, [outs[n] for n in names], stage, cap_nodes)
        like = max(names, key=lambda n: n.startswith("opt."))     # the gradient's layout: the update's (ZeRO-1/2)
        for n in update:
            stage[n] = owner
        copies = {spec.rank_of(owner): {}}
        for h in spec.tied[f"params.{fqn}"]:
            c = spec.rank_of(h)
            if c in copies:
                continue
            env = copies[c] = {}
            for n in update:
                with g.inserting_after(n):
                    env[n] = cp = g.node_copy(n, lambda a, env=env: env.get(a, a))
                stage[cp] = h
                if META_COLLECTIVE in n.meta:         # a gather of the updated shards (ZeRO-1/2) on the holder too
                    cp.meta[META_COLLECTIVE] = replace(n.meta[META_COLLECTIVE], node=cp.name)
                    low.records.append(cp.meta[META_COLLECTIVE])
        nodes, _ = _sum_over_axis(g, stage, spec, low, root, lambda x: _linear_term(x, cap_nodes),
                                  min(update, key=_order(g)),
                                  dict(value=f"params.{fqn}", why=TIED_WHY, phase="backward", op="tied weight",
                                       shape=shapes[like], dtype=dtypes[f"params.{fqn}"]))
        every[TIED] |= nodes
        args = list(out_node.args[0])
        for name in names:
            o = outs[name]
            with g.inserting_before(out_node):
                own = g.call_function(pp_select, (_coord(g, spec),) + tuple(copies[c].get(o, o) if c in copies
                                                                             else None for c in range(spec.ranks)))
            own.meta.update({k: v for k, v in o.meta.items() if k in ("val", META_LOCAL_SHAPE)})
            args[captured.output_names.index(name)] = own
            every[END].add(own)
        out_node.args = (tuple(args),) + tuple(out_node.args[1:])
    return every


def _refuse_sharded_tied(g, name, spec) -> None:
    """A tied weight across ranks whose layout on another axis needs a collective before its use (ZeRO's gather):
    not supported yet (the gathered copy would be one stage's)."""
    ph = next(n for n in g.nodes if n.op == "placeholder" and n.name in spec.stage_of and n.meta.get(META_NAME) == name)
    rec = next((u.meta[META_COLLECTIVE] for u in ph.users if META_COLLECTIVE in u.meta), None)
    if rec is not None:
        raise PartitionError(f"pipeline: {name} is a tied weight, read by stages {', '.join(map(str, spec.tied[name]))} "
                             f"on ranks {', '.join(map(str, spec.holders(name)))} of axis '{spec.axis}' (size "
                             f"{spec.ranks}), and tactic {rec.tactic} shards it on axis '{rec.axis}' (size "
                             f"{rec.group_size}), so it is gathered ({rec.kind}) before its use; a weight tied across "
                             f"pipeline ranks must be whole on the other axes for now. Leave it replicated there "
                             f"(zero(1) or zero(2) instead of zero(3)), or put its readers on one rank.")


def _order(g):
    at = {n: i for i, n in enumerate(g.nodes)}
    return at.__getitem__


def _linear_term(x, cap_nodes) -> bool:
    """A node of a gradient's sum: an add of the backward (micro-batch accumulation, autograd's accumulation of a
    weight used twice) or a linear collective lowering put on it."""
    if x.op != "call_function":
        return False
    if META_SRC not in x.meta:
        return x.target in _LINEAR
    src = cap_nodes.get(x.meta[META_SRC])
    return x.target is _aten.add.Tensor and not x.kwargs and src is not None and phase_of(src) == Phase.BACKWARD


def _update_of(g, outputs, stage, cap_nodes) -> tuple:
    """(the update's nodes, in program order; the gradient they read): the optimizer-phase ops whose results reach
    `outputs` (a parameter's and its optimizer state's new values), with the collectives lowering put after them
    (ZeRO-1/2's gather of the updated shards), clip_grad_norm's shared norm excluded, its scaling of the gradient
    included (a BACKWARD op when the update reads no optimizer state first, as SGD's: the summed gradient is the
    one before scaling, else the sum on the pipeline axis would wait for the norm, which waits for it)."""
    seen, todo, grads = set(), [(o, True) for o in outputs], set()
    while todo:
        x, after = todo.pop()        # after: reached from the outputs through lowering's nodes only
        if x in seen or x.op != "call_function" or x not in stage:    # not staged: free (the step size)
            continue
        src = cap_nodes.get(x.meta.get(META_SRC))
        of_state = src is None and all(a.op == "placeholder" or a not in stage for a in x.all_input_nodes)
        if src is None and (after or of_state) or src is not None and (phase_of(src) == Phase.OPTIMIZER
                                                                      or clip_tag(src) == "scale") \
                and clip_tag(src) not in ("coef", "sum", "square"):     # of_state: ZeRO's slice of the weight
            seen.add(x)
            todo.extend((a, after and src is None) for a in x.all_input_nodes)
        elif clip_tag(src) not in ("coef", "sum", "square"):
            grads.add(x)
    if len(grads) != 1:
        raise InternalError(f"pipeline: a tied weight's update reads {sorted(n.name for n in grads)}, not one "
                            f"gradient.")
    return [n for n in g.nodes if n in seen], grads.pop()


def _coord(g, spec):
    """The rank's coordinate on the pipeline axis (the lowered program's coordinate input)."""
    return next(n for n in g.nodes if n.op == "placeholder" and n.meta.get(META_NAME) == f"coord.{spec.axis}")


def norm_actions(act, parts) -> None:
    """The ranks' partial totals and what of their stage's update they read (the squares) move from the update
    "U" to the stage's "N" action, which runs before the ranks meet in SYNC."""
    todo = list(parts)
    while todo:
        x = todo.pop()
        a = act.get(x)
        if a is not None and a[1] == "U":
            act[x] = (a[0], "N", 0)
            todo.extend(x.all_input_nodes)
