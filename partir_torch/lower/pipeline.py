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
                        META_SRC, META_STAGE, Phase, phase_of)
from ..errors import InternalError, PartitionError
from .records import ALL_REDUCE, GRAD_NORM, CollectiveRecord

PIPELINE_AXIS = "partir_pipeline_axis"     # gm.meta key: the pipeline axis of a pipelined program
SYNC = (None, "R", 0)      # the action every rank of the axis runs together: the all_reduces on the pipeline axis
_c10d = torch.ops._c10d_functional
_LINEAR = (_c10d.all_reduce.default, _c10d.wait_tensor.default)


def pp_transfer(x: torch.Tensor, src: int, dst: int, group: str) -> torch.Tensor:
    """`x`, sent by the ranks at coordinate `src` on the pipeline axis (process group `group`) to those at `dst` with
    the same coordinates on the other axes. On one device (fake propagation, the LocalTensorMode cross-check, where
    every rank computes every stage) it is a copy; the emulator (runtime/interpret.py) and real ranks hand it over."""
    return x.clone()


def pp_select(*parts):
    """The operand of an all_reduce on the pipeline axis: parts[c] is computed by the ranks at coordinate c, and every
    rank contributes its own. The emulator runs it on every rank with the other coordinates' parts absent (None);
    real ranks (runtime/p2p.py) read their own; on one device (fake propagation) it is the first."""
    return next(x for x in parts if x is not None)


@dataclass(frozen=True)
class Pipelined:
    """The pipeline part of a pipelined Lowered: the spec, each rank's actions in order, and the transfers."""

    spec: object                  # tactics.pipeline.PipelineSpec
    orders: tuple                 # per rank (coordinate on the axis): its actions (stage, kind, micro-batch) in order
    transfers: tuple              # transfer node names, program order

    @property
    def axis(self) -> str:
        return self.spec.axis


def rank_orders(spec, sync: bool = False) -> list:
    """Per rank of the pipeline axis, its actions in the order the schedule runs them (then the optimizer update
    of each of its stages; sync: first each stage's "N" action, the squared gradients it contributes to the norm,
    and SYNC, the all_reduces on the pipeline axis that every rank runs together). GPipe: every forward, then every backward. 1F1B (PipeDream-flush, Narayanan et al.
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
        if sync:
            acts += [(s, "N", 0) for s in range(r, spec.n_stages, p)] + [SYNC]
        acts += [(s, "U", 0) for s in range(r, spec.n_stages, p)]
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
    _copy_free(g, stage, spec)
    everywhere, parts = _clip_norm(g, stage, spec, cap_nodes, low)
    orders = rank_orders(spec, sync=bool(everywhere))
    pos = {a: i for acts in orders for i, a in enumerate(acts)}
    act = _actions(g, stage, cap_nodes, pos)
    _norm_actions(act, parts)
    act.update((n, SYNC) for n in everywhere)
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
        if s is None and n.op != "placeholder":
            ins = [stage[a] for a in n.all_input_nodes if a in stage]
            s = max(ins) if ins else None
        if s is not None:
            stage[n] = s
    return stage


def _copy_free(g, stage, spec) -> None:
    """A free op (it reads only the batch, hyperparameters, coordinates or other free ops) runs on the stage that
    reads it, copied once per further stage that does (the micro-batch slices of the targets: on the last stage)."""
    for n in reversed(list(g.nodes)):
        if n.op in ("placeholder", "output") or n in stage:
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
    collectives lowering put on it for the other axes: adds and all_reduces, all linear); here each rank of the
    pipeline axis sums its own stages' squares (a copy of that running sum in which the other ranks' squares are
    left out), the ranks' partial totals are all-reduced on the pipeline axis, and the norm and the clipping factor
    are computed on every rank, so each stage scales its gradients by the same factor. Returns (the nodes every rank
    runs, the ranks' partial totals); ((), ()) when the step does not clip."""
    tag = lambda n: _clip_tag(cap_nodes.get(n.meta.get(META_SRC)))     # noqa: E731
    sqrt = next((n for n in g.nodes if n.op == "call_function" and tag(n) == "coef"), None)
    if sqrt is None:
        return set(), []
    root = sqrt.args[0]
    region, todo = set(), [root]
    while todo:
        x = todo.pop()
        if x not in region and (tag(x) == "sum" or x.target in _LINEAR and META_SRC not in x.meta):
            region.add(x)
            todo.extend(x.all_input_nodes)
    inside = [n for n in g.nodes if n in region]
    leaves = {a for n in inside for a in n.all_input_nodes if a not in region} | ({root} - region)
    if any(x not in stage for x in leaves):
        raise InternalError(f"pipeline: clip_grad_norm's squared gradients {sorted(x.name for x in leaves)} are not "
                            f"all on a stage.")
    parts = []
    for c in range(spec.ranks):
        env: dict = {}

        def mine(x, c=c, env=env):
            return env[x] if x in region else x if spec.rank_of(stage[x]) == c else None
        for n in inside:
            xs = [mine(a) for a in n.all_input_nodes]
            if all(x is None for x in xs):
                env[n] = None
            elif n.target is torch.ops.aten.add.Tensor and None in xs:     # x + (another rank's squares) -> x
                env[n] = next(x for x in xs if x is not None)
            else:
                with g.inserting_before(n):
                    env[n] = cp = g.node_copy(n, mine)
                stage[cp] = max(stage[x] for x in xs if x is not None)
                if META_COLLECTIVE in n.meta:
                    cp.meta[META_COLLECTIVE] = replace(n.meta[META_COLLECTIVE], node=cp.name)
                    low.records.append(cp.meta[META_COLLECTIVE])
        part = mine(root)
        if part is None:            # a rank whose stages have no gradient: it adds zero
            with g.inserting_before(sqrt):
                part = g.call_function(torch.ops.aten.zeros_like.default, (_scalar_input(g, stage),),
                                       {"dtype": root.meta["val"].dtype})
            part.meta.update({k: v for k, v in root.meta.items() if k in ("val", META_LOCAL_SHAPE)})
            stage[part] = c
        parts.append(part)
    with g.inserting_before(sqrt):
        sel = g.call_function(pp_select, tuple(parts))
        ar = g.call_function(_c10d.all_reduce.default, (sel, "sum", f"partir_{spec.axis}"))
        total = g.call_function(_c10d.wait_tensor.default, (ar,))
    v = root.meta.get("val")
    for x in (sel, ar, total):
        x.meta.update({k: v for k, v in root.meta.items() if k in ("val", META_LOCAL_SHAPE)})
    ar.meta[META_IN_SHAPE] = tuple(v.shape) if v is not None else ()
    nbytes = v.numel() * v.element_size() if v is not None else 4
    ar.meta[META_COLLECTIVE] = rec = CollectiveRecord(
        ALL_REDUCE, spec.axis, spec.ranks, nbytes, str(v.dtype if v is not None else "float32").replace("torch.", ""),
        spec.name, "grad_norm", ar.name, reduce_op="sum", phase="optimizer", family="pipeline", why=GRAD_NORM,
        op=str(sqrt.target))
    low.records.append(rec)
    sqrt.replace_input_with(root, total)
    for n in reversed(inside):
        if not n.users:
            g.erase_node(n)
            stage.pop(n, None)
    every = {sel, ar, total}
    for n in g.nodes:      # the norm and the clipping factor: every rank computes them from the total
        ins = n.all_input_nodes
        if n.op == "call_function" and tag(n) in ("coef", "scale") and any(a in every for a in ins) \
                and all(a in every or a not in stage for a in ins):
            every.add(n)
            stage.pop(n, None)
    return every, parts


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
    after every action it reads from (round by round; SYNC once every rank has reached it); within an action, the
    lowered order."""
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
            if SYNC not in (a, b) and spec.rank_of(b[0]) == spec.rank_of(a[0]):
                if pos[b] > pos[a]:
                    raise InternalError(f"pipeline: {n.name} in action {a} reads {x.name} of the later action {b} "
                                        f"on the same rank ({spec.schedule}).")
                continue
            deps[a].add(b)
    done, ptr, out = set(), [0] * len(orders), []
    while any(ptr[r] < len(orders[r]) for r in range(len(orders))):
        heads = {r: orders[r][ptr[r]] for r in range(len(orders)) if ptr[r] < len(orders[r])}
        ready = [a for a in heads.values() if a != SYNC and deps[a] <= done]
        if not ready and len(heads) == len(orders) and all(a == SYNC for a in heads.values()) \
                and deps[SYNC] <= done:
            out.extend(members[SYNC])
            ptr = [p + 1 for p in ptr]
            done.add(SYNC)
            continue
        if not ready:
            raise InternalError(f"pipeline: the {spec.schedule} schedule deadlocks at {heads}.")
        for a in ready:
            out.extend(members[a])
            ptr[spec.rank_of(a[0])] += 1
        done.update(ready)
    return out
