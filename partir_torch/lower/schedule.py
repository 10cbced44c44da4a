"""Scheduling: where each collective of the per-device program is issued and waited for.

The lowered program lists a collective where its input becomes ready and its wait_tensor right after it. This
pass places them as the best runtimes do (FSDP2's prefetch and reduce-scatter streams, Megatron's overlapped
gradient reduction), and the runtime then executes exactly this order (eager CUDA and gloo issue a functional
collective asynchronously and block only at its wait), which is also the order the simulator replays
(sim/timeline.py, issue="program"):

- every wait (with the ops that only unpack its result: a bucket's slices and views) moves down to just before
  the first node that really reads it, so compute runs on while the collective is in flight (tensor and sequence
  parallel collectives overlap whatever independent compute the program has before their first reader), and the
  independent compute listed just before such a collective (a weight-gradient matmul next to the input-gradient
  matmul whose partial sum it reduces) moves after its issue;
- state gathers (ZeRO-3's parameter all_gathers, and the casts and bucket copies that only prepare their input)
  on one mesh axis are issued ``prefetch`` gathers ahead of their use: gather i is issued when compute starts
  using gather i - prefetch (its wait), the next unit's gather while the current unit computes, as FSDP2 does;
  the gathered copy is freed after its last use (the program deletes a value after its last reader);
- gradient reductions (reduce_scatter / all_reduce whose why is "gradient") on one axis keep at most
  ``reduce_in_flight`` in flight: the reduction j is waited for just before reduction j + reduce_in_flight is
  issued, so its unsharded input is freed then, not at the end of the backward.

The new order is a topological sort by priority (lower/order.py), so it is valid whatever the moves.

    info = schedule(graph, prefetch=1, reduce_in_flight=1)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..contract import META_COLLECTIVE, META_ROLE, STATE_ROLES
from ..rules import tags
from .order import reorder
from .records import ALL_GATHER, ALL_REDUCE, COLLECTIVE_PERMUTE, GRADIENT, REDUCE_SCATTER

c10d = torch.ops._c10d_functional
WAIT = c10d.wait_tensor.default
aten = torch.ops.aten

# ops that only unpack a collective's result (a bucket's slices and views, a gathered dim moved back): they move
# down with their wait, so the collective overlaps everything before the first real use of its result
_UNPACK = tags.ops("unpacks_collective")

# ops that only prepare a state gather's input from the state itself (a bucket's copy-in, a mixed-precision cast
# of the shard): they move up with the gather
_PREPARE = tags.ops("prepares_gather")


@dataclass
class Scheduled:
    """What the pass decided, for reports and tests: per collective node name, its role ("state", "gradient",
    "overlap" or "ring") and, for state gathers, how many gathers ahead it is issued."""

    roles: dict = field(default_factory=dict)
    prefetch: int = 0
    reduce_in_flight: int = 0


def schedule(graph: fx.Graph, prefetch: int = 1, reduce_in_flight: int = 1) -> Scheduled:
    """Reorder `graph` in place (see the module docstring); prefetch 0 gathers state where it is used,
    reduce_in_flight 0 puts no bound on gradient reductions in flight (each is waited for at its first reader)."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    prio = {n: float(i) for i, n in enumerate(nodes)}
    out = Scheduled(prefetch=prefetch, reduce_in_flight=reduce_in_flight)
    colls = [n for n in nodes if n.op == "call_function" and META_COLLECTIVE in n.meta]
    waits = {}
    for c in colls:
        w = next((u for u in c.users if u.target is WAIT), None)
        if w is not None:
            waits[c] = w
            _sink(w, index, prio)
    state, grads = {}, {}
    for c in colls:
        rec = c.meta[META_COLLECTIVE]
        if rec.kind == ALL_GATHER and c in waits:
            chain = _prep_chain(c)
            if chain is not None:
                state.setdefault(rec.axis, []).append((c, chain))
                out.roles[c.name] = "state"
                continue
        if rec.why == GRADIENT and rec.kind in (REDUCE_SCATTER, ALL_REDUCE) and c in waits:
            grads.setdefault(rec.axis, []).append(c)
            out.roles[c.name] = "gradient"
            continue
        # a ring step (lower/ring.py) already has its chunk's matmul between its issue and its wait: moving the
        # compute before it after it would put the previous step's matmul behind the next transfer
        out.roles[c.name] = "ring" if rec.kind == COLLECTIVE_PERMUTE else "overlap"
    for run in state.values():
        _prefetch(run, waits, prio, prefetch)
    if reduce_in_flight:
        for run in grads.values():
            _bound(run, waits, prio, reduce_in_flight)
    for c in colls:
        if out.roles[c.name] == "overlap" and c in waits:
            _overlap(c, waits[c], nodes, index, prio)
    reorder(graph, prio)
    return out


def _sink(wait, index, prio) -> None:
    """The wait and the ops that only unpack its result: just before the first node that really reads it."""
    chain, readers, stack = [wait], [], list(wait.users)
    while stack:
        u = stack.pop()
        if u.target in _UNPACK and all(a is wait or a in chain for a in u.all_input_nodes):
            if u not in chain:
                chain.append(u)
                stack.extend(u.users)
        else:
            readers.append(u)
    if not readers:
        return
    first = index[min(readers, key=index.__getitem__)]
    chain.sort(key=index.__getitem__)
    for k, n in enumerate(chain):
        prio[n] = first - 0.5 + k / (2 * len(chain) + 2)


def _prep_chain(c) -> list | None:
    """The ops between the program's state placeholders and state gather `c` (casts, a bucket's copy-in), or None
    when the gather's input depends on anything else (then it is not a gather of state). Moving them earlier costs
    at most a shard-sized copy, even when another node reads them too."""
    chain, stack, seen = [], list(c.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n.meta.get(META_ROLE) not in STATE_ROLES:
                return None
            continue
        if n.op != "call_function" or n.target not in _PREPARE:
            return None
        chain.append(n)
        stack.extend(n.all_input_nodes)
    return chain


def _prefetch(run, waits, prio, depth) -> None:
    """Gathers of one axis in the order compute uses them (their waits): gather i issued right after the wait of
    gather i - depth, the first `depth` where the first one is issued; depth 0: each just before its wait."""
    run = sorted(run, key=lambda cc: prio[waits[cc[0]]])
    first = min(prio[c] for c, _ in run)
    for i, (c, chain) in enumerate(run):
        # later than lowering emitted it too: a mixed-precision cast's gather is emitted right after the cast, at
        # the start of the forward, which would put the whole model's gathered weights in flight at once;
        # depth 0: just before its own wait (gathered where it is used)
        if depth == 0:
            at = prio[waits[c]] - 1e-2
        else:
            at = first if i < depth else prio[waits[run[i - depth][0]]]
        members = sorted(chain, key=prio.__getitem__) + [c]
        for k, n in enumerate(members):
            prio[n] = at + (k + 1) / (2 * len(members) + 2) * 1e-3 + i * 1e-6


def _overlap(c, wait, nodes, index, prio, window: int = 24) -> None:
    """Compute the program lists just before collective `c` that `c` does not depend on (the weight-gradient matmul
    next to the input-gradient one whose partial sum `c` reduces) runs after `c` is issued, so the two overlap.
    Looks back at most `window` nodes, not past another collective or wait."""
    lo = index[c]
    start = lo
    while start > 0 and lo - start < window:
        n = nodes[start - 1]
        if n.op != "call_function" or META_COLLECTIVE in n.meta or n.target is WAIT:
            break
        start -= 1
    span = set(nodes[start:lo])
    needed, stack = set(), list(c.all_input_nodes)
    while stack:                          # what c reads, within the span
        n = stack.pop()
        if n in span and n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    movable = [n for n in nodes[start:lo] if n not in needed and prio[n] < prio[c]]
    if not movable or prio[wait] <= prio[c]:
        return
    step = min(prio[wait] - prio[c], 1.0) / (2 * len(movable) + 2)
    for k, n in enumerate(movable):       # after c, before its wait, in their own order
        prio[n] = prio[c] + (k + 1) * step


def _bound(run, waits, prio, depth) -> None:
    """Gradient reductions of one axis, in issue order: reduction j waited for just before j + depth is issued."""
    run = sorted(run, key=prio.__getitem__)
    for j in range(len(run) - depth):
        w, nxt = waits[run[j]], prio[run[j + depth]]
        if prio[w] > nxt:
            prio[w] = nxt - 1e-4
