"""Pipelined lowering: the per-device program of a plan with a pipeline tactic, cut into stages and ordered by the
schedule (MPMD on the pipeline axis).

The whole step is first lowered as usual (the pipeline axis replicated: the tactics on the other axes put their
collectives in every stage's ops). Then:

1. every op gets its stage (tactics/pipeline.py decided it for the captured op it computes; what lowering added, a
   reshard's collective, follows the latest stage among its operands; what reads only the batch, the hyperparameters
   and the rank's coordinates is copied into every stage that reads it);
2. every op gets its action, (stage, "F" | "B", micro-batch) or (stage, "U", 0) for the optimizer update; what
   lowering added follows its latest operand's action in its stage (else its earliest reader's);
3. a value read on another rank of the pipeline axis becomes a `pp_transfer` node at the end of its producer's
   action: sent by the ranks at coordinate src to the ranks at dst with the same coordinates on the other axes
   (the value keeps its layout on them);
4. the program is reordered action by action: each rank's actions in the schedule's order (`rank_orders`: GPipe,
   1F1B, Interleaved1F1B), merged into one order in which every action comes after the actions it receives from
   (the schedule is run round by round: each round, every rank whose next action has all its inputs runs it).

Each node carries META_STAGE (the coordinate on the pipeline axis that runs it) and META_ACTION. The emulator
(runtime/interpret.py) runs each node on the ranks of its coordinate only and a transfer as a hand-off; the
simulator (sim/pipeline.py) times each rank's actions and the transfers between them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..contract import (META_ACTION, META_CLIP, META_COLLECTIVE, META_IN_SHAPE, META_LOCAL_SHAPE, META_MICRO,
                        META_NAME, META_SRC, META_STAGE, Phase, phase_of)
from ..errors import InternalError, PartitionError
from .records import ALL_REDUCE, GRAD_NORM, TIED as TIED_WHY, CollectiveRecord

PIPELINE_AXIS = "partir_pipeline_axis"     # gm.meta key: the pipeline axis of a pipelined program
# Actions every rank of the axis runs together (nodes with META_STAGE None), after the last backward: TIED, the
# all_reduce of tied weights' gradients; NORM, clip_grad_norm's all_reduce of the ranks' sums of squares (after each
# stage's "N" action, its squares); END, after the updates: each rank's own copy of a tied weight as the output.
TIED, NORM, END = (None, "T", 0), (None, "R", 0), (None, "E", 0)
_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
# ops lowering adds that are linear in their operand (f(a + b) = f(a) + f(b)): a sum split by stage passes them
_LINEAR = (_c10d.all_reduce.default, _c10d.reduce_scatter_tensor.default, _c10d.all_gather_into_tensor.default,
           _c10d.wait_tensor.default)


def pp_transfer(x: torch.Tensor, src: int, dst: int, group: str) -> torch.Tensor:
    """`x`, sent by the ranks at coordinate `src` on the pipeline axis (process group `group`) to those at `dst` with
    the same coordinates on the other axes. On one device (fake propagation, the LocalTensorMode cross-check, where
    every rank computes every stage) it is a copy; the emulator (runtime/interpret.py) and real ranks hand it over."""
    return x.clone()


def pp_select(*parts):
    """The operand of an all_reduce on the pipeline axis: parts[c] is computed by the ranks at coordinate c, and every
    rank contributes its own. The emulator runs it on every rank with the other coordinates' parts absent (None);
    real ranks (runtime/p2p.py) read their own; on one device (fake propagation) it is the first. As an output of
    the step (a tied weight), each holder's own copy, None on the ranks that do not hold it."""
    return next((x for x in parts if x is not None), None)


@dataclass(frozen=True)
class Pipelined:
    """The pipeline part of a pipelined Lowered: the spec, each rank's actions in order, and the transfers."""

    spec: object                  # tactics.pipeline.PipelineSpec
    orders: tuple                 # per rank (coordinate on the axis): its actions (stage, kind, micro-batch) in order
    transfers: tuple              # transfer node names, program order

    @property
    def axis(self) -> str:
        return self.spec.axis


def rank_orders(spec, tokens=()) -> list:
    """Per rank of the pipeline axis, its actions in the order the schedule runs them, then the optimizer update
    of each of its stages; `tokens` (of TIED, NORM, END): TIED after the backwards, each stage's "N" action (the
    squared gradients it contributes to the norm) and NORM before the updates, END after them. GPipe: every forward, then every backward. 1F1B (PipeDream-flush, Narayanan et al.
    2021): p - 1 - r forwards to warm up, then one forward and one backward in turn, then the remaining backwards.
    Interleaved1F1B (Megatron-LM's virtual stages, rank r holding stages r, r + p, ...): the same with the
    micro-batches in groups of p, each group through every chunk in turn, warm-up (p - r - 1) * 2 + (v - 1) * p."""
    p, m, v = spec.ranks, spec.microbatches, spec.chunks
    out = []
    for r in range(p):
        if spec.schedule == "GPipe":
            acts = [(r, "F", j) for j in range(m)] + [(r, "B", j) for j in range(m)]
        elif spec.schedule == "1F1B":
            warm = min(p - 1 - r, m)
            fs = [(r, "F", j) for j in range(m)]
            bs = [(r, "B", j) for j in range(m)]
            acts = fs[:warm]
            for i in range(m - warm):
                acts += [fs[warm + i], bs[i]]
            acts += bs[m - warm:]
        else:
            n = v * m

            def fwd(k):
                chunk = (k // p) % v
                return (chunk * p + r, "F", (k // (p * v)) * p + k % p)

            def bwd(k):
                chunk = v - 1 - (k // p) % v
                return (chunk * p + r, "B", (k // (p * v)) * p + k % p)

            warm = min((p - r - 1) * 2 + (v - 1) * p, n)
            acts = [fwd(k) for k in range(warm)]
            for i in range(n - warm):
                acts += [fwd(warm + i), bwd(i)]
            acts += [bwd(k) for k in range(n - warm, n)]
        if TIED in tokens:
            acts.append(TIED)
        if NORM in tokens:
            acts += [(s, "N", 0) for s in range(r, spec.n_stages, p)] + [NORM]
        acts += [(s, "U", 0) for s in range(r, spec.n_stages, p)]
        if END in tokens:
            acts.append(END)
        out.append(acts)
    return out


def pipeline_program(low, spec, captured):
    """The pipelined form of `low` (a Lowered of the whole step, the pipeline axis replicated): see the module
    docstring. Edits low.gm's graph in place; returns low with `pipeline` set."""
    if spec.schedule == "Interleaved1F1B" and spec.microbatches % spec.ranks:
        raise PartitionError(f"pipeline: Interleaved1F1B runs the micro-batches in groups of the axis size "
                             f"{spec.ranks}; {spec.microbatches} micro-batches is not a multiple of it.")
    g = low.gm.graph
    cap_nodes = {n.name: n for n in captured.gm.graph.nodes}
    stage = _stages(g, spec)
    every = _tied_weights(g, stage, spec, cap_nodes, low, captured)      # token -> nodes every rank runs
    _copy_free(g, stage, spec, set().union(*every.values()))
    every[NORM], parts = _clip_norm(g, stage, spec, cap_nodes, low)
    every = {t: ns for t, ns in every.items() if ns}
    orders = rank_orders(spec, tuple(every))
    pos = {a: i for acts in orders for i, a in enumerate(acts)}
    act = _actions(g, stage, cap_nodes, pos)
    _norm_actions(act, parts)
    for t, ns in every.items():
        act.update((n, t) for n in ns)
    transfers = _transfers(g, stage, act, spec)
    order = _merge(g, act, orders, pos, spec)
    prev = next(n for n in reversed(list(g.nodes)) if n.op == "placeholder")
    for n in order:
        prev.append(n)
        prev = n
        n.meta[META_STAGE] = spec.rank_of(stage[n]) if n in stage else None     # None: every rank of the axis
        n.meta[META_ACTION] = act[n]
    g.lint()
    low.gm.recompile()
    low.gm.meta[PIPELINE_AXIS] = spec.axis
    at = {n.name: i for i, n in enumerate(g.nodes)}
    low.records = sorted((r for r in low.records if r.node in at), key=lambda r: at[r.node])
    low.pipeline = Pipelined(spec, tuple(tuple(a) for a in orders), tuple(t.name for t in transfers))
    return low


def _stages(g, spec) -> dict:
    """node -> stage: the captured op's stage, else the latest among its operands'; absent: free (reads no stage)."""
    stage = {}
    for n in g.nodes:
        if n.op == "output":
            continue
        s = spec.stage_of.get(n.name) if n.op == "placeholder" else spec.stage_of.get(n.meta.get(META_SRC))
        if n.meta.get(META_SRC) in spec.views:
            continue             # a view of a tied weight: made on each stage that reads it (_copy_free)
        if s is None and n.op != "placeholder":
            ins = [stage[a] for a in n.all_input_nodes if a in stage]
            s = max(ins) if ins else None
        if s is not None:
            stage[n] = s
    return stage


def _copy_free(g, stage, spec, every=frozenset()) -> None:
    """A free op (it reads only the batch, hyperparameters, coordinates, a tied weight through views or other free
    ops) runs on the stage that reads it, copied once per further stage that does (the micro-batch slices of the
    targets: on the last stage). `every`: the nodes every rank runs (not free: they have no stage)."""
    for n in reversed(list(g.nodes)):
        if n.op in ("placeholder", "output") or n in stage or n in every:
            continue
        readers = sorted({stage[u] for u in n.users if u in stage})
        if not readers:                      # read by the step's output only
            stage[n] = spec.n_stages - 1
            continue
        stage[n] = readers[0]
        for s in readers[1:]:
            with g.inserting_after(n):
                c = g.node_copy(n, lambda a: a)
            stage[c] = s
            for u in list(n.users):
                if stage.get(u) == s:
                    u.replace_input_with(n, c)


def _clip_tag(node):
    return None if node is None else (node.meta.get("custom") or {}).get(META_CLIP)


def _clip_norm(g, stage, spec, cap_nodes, low) -> tuple:
    """clip_grad_norm across stages. The captured total is one running sum of every gradient's squares (with the
    collectives lowering put on it for the other axes, all linear); each rank of the pipeline axis sums its own
    stages' squares, the ranks' partial totals are all-reduced on the pipeline axis, and the norm and the clipping
    factor are computed on every rank, so each stage scales its gradients by the same factor. Returns (the nodes
    every rank runs, the ranks' partial totals); (set(), []) when the step does not clip."""
    tag = lambda n: _clip_tag(cap_nodes.get(n.meta.get(META_SRC)))     # noqa: E731
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
                part = g.call_function(_aten.new_zeros.default, (_scalar_input(g, stage), list(record["shape"])),
                                       {"dtype": record["dtype"]})
            part.meta[META_LOCAL_SHAPE] = tuple(record["shape"])
            stage[part] = c
        parts.append(part)
    with g.inserting_before(before):
        sel = g.call_function(pp_select, tuple(parts))
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


def _tied_weights(g, stage, spec, cap_nodes, low, captured) -> dict:
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
                own = g.call_function(pp_select, tuple(copies[c].get(o, o) if c in copies else None
                                                       for c in range(spec.ranks)))
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
    (ZeRO-1/2's gather of the updated shards), clip_grad_norm's shared norm excluded."""
    seen, todo, grads = set(), [(o, True) for o in outputs], set()
    while todo:
        x, after = todo.pop()        # after: reached from the outputs through lowering's nodes only
        if x in seen or x.op != "call_function" or x not in stage:    # not staged: free (the step size)
            continue
        src = cap_nodes.get(x.meta.get(META_SRC))
        of_state = src is None and all(a.op == "placeholder" or a not in stage for a in x.all_input_nodes)
        if src is None and (after or of_state) or src is not None and phase_of(src) == Phase.OPTIMIZER \
                and _clip_tag(src) not in ("coef", "sum", "square"):     # of_state: ZeRO's slice of the weight
            seen.add(x)
            todo.extend((a, after and src is None) for a in x.all_input_nodes)
        elif _clip_tag(src) not in ("coef", "sum", "square"):
            grads.add(x)
    if len(grads) != 1:
        raise InternalError(f"pipeline: a tied weight's update reads {sorted(n.name for n in grads)}, not one "
                            f"gradient.")
    return [n for n in g.nodes if n in seen], grads.pop()


def _scalar_input(g, stage):
    """An input every rank holds, of shape () (a hyperparameter or the step count)."""
    for n in g.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and n not in stage and isinstance(v, torch.Tensor) and v.dim() == 0:
            return n
    raise InternalError("pipeline: clip_grad_norm found no scalar input for a rank that holds no gradient.")


def _norm_actions(act, parts) -> None:
    """The ranks' partial totals and what of their stage's update they read (the squares) move from the update
    "U" to the stage's "N" action, which runs before the ranks meet in SYNC."""
    todo = list(parts)
    while todo:
        x = todo.pop()
        a = act.get(x)
        if a is not None and a[1] == "U":
            act[x] = (a[0], "N", 0)
            todo.extend(x.all_input_nodes)


def _actions(g, stage, cap_nodes, pos) -> dict:
    """node -> (stage, kind, micro-batch): from the captured op's phase and micro-batch; what lowering added follows
    the latest action among its operands of the same stage, else the earliest among its readers'."""
    act = {}
    nodes = [n for n in g.nodes if n in stage and n.op != "placeholder"]
    for n in nodes:
        src = cap_nodes.get(n.meta.get(META_SRC))
        if src is None:
            continue
        ph, j = phase_of(src), src.meta.get(META_MICRO)
        if ph == Phase.OPTIMIZER:
            act[n] = (stage[n], "U", 0)
        elif j is not None:
            act[n] = (stage[n], "F" if ph == Phase.FORWARD else "B", j)
    for n in nodes:
        if n not in act:
            ins = [act[a] for a in n.all_input_nodes if a in act and act[a][0] == stage[n]]
            if ins:
                act[n] = max(ins, key=pos.__getitem__)
    for n in reversed(nodes):
        if n not in act:
            outs = [act[u] for u in n.users if u in act and act[u][0] == stage[n]]
            if outs:
                act[n] = min(outs, key=pos.__getitem__)
    for n in nodes:
        if n not in act:     # read by nothing of its stage (the step's output): at the end of the stage
            act[n] = (stage[n], "U", 0)
    return act


def _transfers(g, stage, act, spec) -> list:
    """A pp_transfer for each (value, reading rank) where a value is read on another coordinate of the axis."""
    group = f"partir_{spec.axis}"
    made, out = {}, []
    for n in list(g.nodes):
        if n not in stage or n.op == "placeholder":
            continue
        dst = spec.rank_of(stage[n])
        for a in list(n.all_input_nodes):
            if a.op == "placeholder" or a not in stage or spec.rank_of(stage[a]) == dst:
                continue
            key = (a, stage[n])
            if key not in made:
                with g.inserting_after(a):
                    t = g.call_function(pp_transfer, (a, spec.rank_of(stage[a]), dst, group))
                t.meta.update({k: v for k, v in a.meta.items() if k in ("val", "partir_local_shape")})
                t.meta["partir_transfer_to"] = stage[n]
                stage[t], act[t] = stage[a], act[a]
                made[key] = t
                out.append(t)
            n.replace_input_with(a, made[key])
    return out


def _merge(g, act, orders, pos, spec) -> list:
    """The nodes in one program order: each rank's actions in its schedule's order, merged so that an action comes
    after every action it reads from (round by round; TIED, NORM and END once every rank has reached them); within
    an action, the lowered order."""
    deps: dict = {a: set() for acts in orders for a in acts}
    members: dict = {a: [] for a in deps}
    for n in g.nodes:
        if n not in act:
            continue
        a = act[n]
        members[a].append(n)
        for x in n.all_input_nodes:
            b = act.get(x)
            if b is None or b == a:
                continue
            if a[0] is not None and b[0] is not None and spec.rank_of(b[0]) == spec.rank_of(a[0]):
                if pos[b] > pos[a]:
                    raise InternalError(f"pipeline: {n.name} in action {a} reads {x.name} of the later action {b} "
                                        f"on the same rank ({spec.schedule}).")
                continue
            deps[a].add(b)
    done, ptr, out = set(), [0] * len(orders), []
    while any(ptr[r] < len(orders[r]) for r in range(len(orders))):
        heads = {r: orders[r][ptr[r]] for r in range(len(orders)) if ptr[r] < len(orders[r])}
        ready = [a for a in heads.values() if a[0] is not None and deps[a] <= done]
        token = heads.get(0)
        if not ready and token is not None and token[0] is None and len(heads) == len(orders) \
                and all(a == token for a in heads.values()) and deps[token] <= done:
            out.extend(members[token])         # every rank has reached it
            ptr = [p + 1 for p in ptr]
            done.add(token)
            continue
        if not ready:
            raise InternalError(f"pipeline: the {spec.schedule} schedule deadlocks at {heads}.")
        for a in ready:
            out.extend(members[a])
            ptr[spec.rank_of(a[0])] += 1
        done.update(ready)
    return out
