"""Pipelined lowering: the per-device program of a plan with a pipeline tactic, cut into stages and ordered by the
schedule (MPMD on the pipeline axis).

The whole step is first lowered as usual (the pipeline axis replicated: the tactics on the other axes put their
collectives in every stage's ops). Then:

1. every op gets its stage (tactics/pipeline.py decided it for the captured op it computes; what lowering added, a
   reshard's collective, follows the latest stage among its operands; what reads only the batch, the hyperparameters
   and the rank's coordinates is copied into every stage that reads it);
2. every op gets its action, (stage, "F" | "B", micro-batch) or (stage, "U", 0) for the optimizer update; what
   lowering added follows its latest operand's action in its stage (else its earliest reader's); under
   a schedule with Schedule.split_backward (ZB-V) each backward is split into "B" and "W" (split_backward);
3. a value read on another rank of the pipeline axis becomes a `pp_transfer` node at the end of its producer's
   action: sent by the ranks at coordinate src to the ranks at dst with the same coordinates on the other axes
   (the value keeps its layout on them);
4. the program is reordered action by action: each rank's actions in its schedule's order (`rank_orders`; the
   schedules are lower/ppschedules.py's classes), merged into one order in which every action comes after the
   actions it receives from (the schedule is run round by round: each round, every rank whose next action has all
   its inputs runs it).

Between 1 and 2, the sums that span stages become all_reduces on the pipeline axis that every rank runs (nodes with
META_STAGE None, in the actions TIED, NORM, END that every rank reaches together; lower/ppaxis.py): a tied weight's
gradient (each holder rank's own terms; its update copied onto every holder) and clip_grad_norm's sum of squares
(each rank's stages'; the norm and the clipping factor then on every rank).

Each node carries META_STAGE (the coordinate on the pipeline axis that runs it) and META_ACTION. The emulator
(runtime/interpret.py) runs each node on the ranks of its coordinate only and a transfer as a hand-off; the
simulator (sim/pipeline.py) times each rank's actions and the transfers between them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract import META_ACTION, META_COLLECTIVE, META_MICRO, META_NAME, META_SRC, META_STAGE, Phase, \
    phase_of
from ..errors import InternalError
from ..rules import tags
from .ppschedules import schedule_of
from .ppspec import PipelineSpec
from .ppaxis import END, NORM, TIED, clip_norm, norm_actions, pp_select, tied_weights  # noqa: F401 (pp_select: API)
from .records import GRADIENT, STATE

PIPELINE_AXIS = "partir_pipeline_axis"     # gm.meta key: the pipeline axis of a pipelined program


def pp_transfer(x: torch.Tensor, src: int, dst: int, group: str) -> torch.Tensor:
    """`x`, sent by the ranks at coordinate `src` on the pipeline axis (process group `group`) to those at `dst` with
    the same coordinates on the other axes. On one device (fake propagation, the LocalTensorMode cross-check, where
    every rank computes every stage) it is a copy; the emulator (runtime/interpret.py) and real ranks hand it over."""
    return x.clone()


@dataclass(frozen=True)
class Pipelined:
    """The pipeline part of a pipelined Lowered: the spec, each rank's actions in order, and the transfers."""

    spec: PipelineSpec
    orders: tuple                 # per rank (coordinate on the axis): its actions (stage, kind, micro-batch) in order
    transfers: tuple              # transfer node names, program order

    @property
    def axis(self) -> str:
        return self.spec.axis


def rank_orders(spec, tokens=()) -> list:
    """Per rank of the pipeline axis, its forward/backward actions in the order its schedule runs them
    (Schedule.order, lower/ppschedules.py), then the optimizer update of each of its stages; `tokens` (of TIED,
    NORM, END): TIED after the backwards, each stage's "N" action (the squared gradients it contributes to the
    norm) and NORM before the updates, END after them."""
    p, m, v = spec.ranks, spec.microbatches, spec.chunks
    schedule = schedule_of(spec.schedule)
    out = []
    for r in range(p):
        acts = schedule.order(r, p, m, v)
        if TIED in tokens:
            acts.append(TIED)
        mine = spec.stages_on(r)
        if NORM in tokens:
            acts += [(s, "N", 0) for s in mine] + [NORM]
        acts += [(s, "U", 0) for s in mine]
        if END in tokens:
            acts.append(END)
        out.append(acts)
    return out


def pipeline_program(low, spec, captured):
    """The pipelined form of `low` (a Lowered of the whole step, the pipeline axis replicated): see the module
    docstring. Edits low.gm's graph in place; returns low with `pipeline` set."""
    spec.schedule.check_stages(spec.n_stages, spec.ranks, spec.microbatches, spec.axis, "pipeline")
    g = low.gm.graph
    cap_nodes = {n.name: n for n in captured.gm.graph.nodes}
    stage = _stages(g, spec)
    every = tied_weights(g, stage, spec, cap_nodes, low, captured)      # token -> nodes every rank runs
    _copy_free(g, stage, spec, set().union(*every.values()))
    every[NORM], parts = clip_norm(g, stage, spec, cap_nodes, low)
    every = {t: ns for t, ns in every.items() if ns}
    orders = rank_orders(spec, tuple(every))
    pos = {a: i for acts in orders for i, a in enumerate(acts)}
    act = _actions(g, stage, cap_nodes, pos)
    if spec.schedule.split_backward:
        split_backward(g, stage, act)
    norm_actions(act, parts)
    for t, ns in every.items():
        act.update((n, t) for n in ns)
        for a in {a for n in ns for a in n.all_input_nodes if a in stage}:
            acts = orders[spec.rank_of(stage[a])]        # a rank's part (its zeros): before the rank reaches t
            if pos[act[a]] > acts.index(t):
                act[a] = acts[acts.index(t) - 1]
    _after_tokens(g, stage, act, orders, spec, every)
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


def _after_tokens(g, stage, act, orders, spec, every) -> None:
    """What a stage computes from a value every rank computes at a token (a tied weight's summed gradient after
    TIED, the clipping factor after NORM) runs in the stage's first action after the token (its norm part "N" or
    its update "U"), and so do its readers on that rank that came earlier. (SGD's gradient scaled by the clipping
    factor was left in the last backward, which every rank runs before NORM: the schedule deadlocked.)"""
    at = {n: t for t, ns in every.items() for n in ns}
    index = [{a: i for i, a in enumerate(acts)} for acts in orders]      # per rank: action -> its place
    moved: set = set()
    for n in g.nodes:
        if n not in stage or n not in act or act[n][0] is None:
            continue
        r = spec.rank_of(stage[n])
        due = max([index[r][at[a]] for a in n.all_input_nodes if a in at]
                  + [index[r][act[a]] for a in n.all_input_nodes if a in moved and spec.rank_of(stage[a]) == r],
                  default=-1)
        if index[r][act[n]] < due:
            act[n] = next((a for a in orders[r][due:] if a[0] == stage[n] and a[1] in ("N", "U")),
                          (stage[n], "U", 0))
            moved.add(n)


def bucket_parts(g, spec) -> dict:
    """The collectives lowering may bucket in a pipelined program (bucket.py), each with its stage, the bucket key:
    a stage's gradient reductions (its gradients are final in its last micro-batch's backward, ZB-V's: its last W
    action, so its buckets are issued there as they fill, as Megatron-LM's --overlap-grad-reduce does in the last backward) and its state
    gathers (in its first micro-batch's forward, one bucket ahead: lower/schedule.py). No bucket mixes two stages.
    The reductions are not bounded in flight (lowering schedules them with reduce_in_flight 0): each is waited for
    where the stage's update reads it, so no wait in the last backward holds back the gradient the previous stage
    is waiting for (Megatron's buckets are waited for in finalize_model_grads, after the backward), and the
    accumulated gradients live through the step anyway.
    Left unbucketed: a gradient whose terms are summed on several ranks of the axis, a tied weight's gathers and
    the gathers of updated state after the update (ZeRO-1/2): ppaxis.py follows a tied weight's gradient sum,
    update and gathers through their ops and collectives, which a bucket would merge with other parameters'."""
    stage = _stages(g, spec)
    out = {}
    for n in g.nodes:
        rec = n.meta.get(META_COLLECTIVE)
        if rec is None or rec.why not in (GRADIENT, STATE) or rec.phase == "optimizer" or n not in stage:
            continue
        if rec.why == GRADIENT and len(_term_ranks(n.args[0], stage, spec)) > 1 \
                or rec.why == STATE and _reads_tied(n, spec):
            continue
        out[n] = stage[n]
    return out


def _reads_tied(n, spec) -> bool:
    """Whether collective `n` reads a tied weight or its optimizer state (a placeholder PipelineSpec.tied names)."""
    todo, seen = list(n.all_input_nodes), set()
    while todo:
        y = todo.pop()
        if y in seen:
            continue
        seen.add(y)
        if y.op == "placeholder":
            if y.meta.get(META_NAME) in spec.tied:
                return True
        elif y.meta.get(META_SRC) in spec.views:
            return True
        elif y.op == "call_function" and META_COLLECTIVE not in y.meta:
            todo.extend(y.all_input_nodes)
    return False


_SUM_OPS = tags.ops("carries_sum")


def _term_ranks(x, stage, spec) -> set:
    """The ranks of the axis whose values a gradient `x` sums (through adds, casts, views and all_reduces)."""
    ranks, todo, seen = set(), [x], set()
    while todo:
        y = todo.pop()
        if y in seen:
            continue
        seen.add(y)
        if y.op == "call_function" and y.target in _SUM_OPS:
            todo.extend(y.all_input_nodes)
        elif y in stage:
            ranks.add(spec.rank_of(stage[y]))
    return ranks


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


def split_backward(g, stage, act) -> None:
    """Zero-bubble backwards (Qi et al. 2024, section 2): each backward action (s, "B", j) keeps what the input
    gradient sent to the previous stage needs, the ancestors inside the action of every value a node of another stage
    reads (with the collectives lowering put among them: tensor parallelism's all_reduce of the input gradient); the
    rest, the weight gradients with their accumulation over the micro-batches, their casts and their reductions on
    the other axes, moves to (s, "W", j), which no other stage waits for. The first stage sends nothing back: its
    whole backward is W."""
    members: dict = {}
    for n in g.nodes:
        a = act.get(n)
        if a is not None and a[1] == "B":
            members.setdefault(a, []).append(n)
    for a, ns in members.items():
        inside = set(ns)
        todo = [n for n in ns if any(u in stage and stage[u] != a[0] for u in n.users)]
        keep: set = set()
        while todo:
            x = todo.pop()
            if x in inside and x not in keep:
                keep.add(x)
                todo.extend(x.all_input_nodes)
        for n in ns:
            if n not in keep:
                act[n] = (a[0], "W", a[2])


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
