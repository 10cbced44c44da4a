"""The step's timeline: one compute stream and one communication stream per mesh axis.

Compute nodes run one after another in program order on the compute stream. Collectives over one mesh axis run one
after another on that axis's stream (NCCL runs each communicator on its own stream, so collectives of different
axes proceed concurrently; that they then share links is not modelled). When a collective is issued:

- ``"program"``: when the compute stream reaches it (eager CUDA: ProcessGroupNCCL makes the comm stream wait for
  all work enqueued before the call);
- ``"ready"``: as soon as its input exists;
- ``"prefetch"``: as a runtime that overlaps communication issues it (FSDP2, DDP and Megatron's bucket hooks,
  XLA's async collectives): the ops that only move its input into its buffer (casts, views, a bucket's
  concatenation: FSDP2's copy-in, Megatron's main-grad copy) run on the collective's stream as soon as their
  sources exist, and a gather of state (parameters) is issued ``prefetch`` gathers ahead of its use on that axis:
  the next one when compute starts using the current one, as FSDP2's and Megatron's parameter prefetch do. The
  program may list a collective after others the runtime issues later (a gradient's up-cast placed after the
  backward): it takes the first idle interval of its stream after its issue time.

Compute runs on until a ``wait_tensor`` needs the result; the time it then waits is exposed communication. Compute
that runs while a collective is in flight is slowed by ``hw.overlap_slowdown`` (the collective's kernels share the
chip): the step grows by that fraction of the overlapped time (:func:`overlap_s`, first order: the stretched compute
does not move the collectives).
"""
from __future__ import annotations

import bisect
import math

from ..contract import META_COLLECTIVE
from ..rules import tags
from .comm import estimate
from .compute import COLLECTIVE, COMPUTE, FREE, CostModel, memory_time
from .report import CollectiveTiming

ISSUE = ("ready", "program", "prefetch")

# ops that only move or cast data into a collective's buffer (aten schema names)
# (views are FREE ops, counted by their class; these names cover every overload of lowering's list)
_PREP_OPS = tags.schema_names("prepares_gather")


def prep_chains(nodes, classes: dict, inputs: dict) -> tuple:
    """(member -> the collective it only feeds, collective -> True when every source of its input is a placeholder,
    i.e. it gathers state). A member is a view or data-movement op whose every user is the collective or another
    member."""
    member_of: dict = {}
    state: dict = {}
    for c in nodes:
        if c.op != "call_function" or classes[c][0] != COLLECTIVE:
            continue
        stack, seen, sources = list(inputs[c]), set(), []
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n not in member_of and _moves_data(n, classes) and \
                    all(u is c or member_of.get(u) is c for u in n.users):
                member_of[n] = c
                stack.extend(inputs[n])
            else:
                sources.append(n)
        state[c] = bool(sources) and all(s.op == "placeholder" for s in sources)
    return member_of, state


def overlap_s(trace) -> float:
    """Seconds during which the compute stream and at least one communication stream are both busy (``trace``:
    (track, name, start, duration), track 0 compute, 1 communication)."""
    comm = sorted((s, s + d) for track, _, s, d in trace if track == 1 and d > 0)
    busy: list = []                                 # union of the communication intervals
    for s, e in comm:
        if busy and s <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], e)
        else:
            busy.append([s, e])
    total, i = 0.0, 0
    for track, _, s, d in trace:                    # compute intervals are in time order
        if track != 0 or d <= 0:
            continue
        e = s + d
        while i < len(busy) and busy[i][1] <= s:
            i += 1
        j = i
        while j < len(busy) and busy[j][0] < e:
            total += min(e, busy[j][1]) - max(s, busy[j][0])
            j += 1
    return total


def _moves_data(n, classes) -> bool:
    if n.op != "call_function":
        return False
    cls, info = classes[n]
    if cls == FREE:
        return info == "view"
    schema = getattr(n.target, "_schema", None)
    return cls == COMPUTE and info is None and schema is not None and schema.name in _PREP_OPS


class Timeline:
    """t_c: compute stream clock; t_m: comm stream clock per mesh axis; done: when each value is ready."""

    def __init__(self, hw, mesh, axis_map, facts, exclude, issue, cost_model: CostModel, prefetch: int = 1,
                 fused: dict | None = None):
        self.hw, self.mesh, self.axis_map, self.f, self.exclude, self.issue = hw, mesh, axis_map, facts, exclude, issue
        self.cm = cost_model
        self.fused = fused or {}          # compiled: op -> bytes of the fused kernel it starts (0: a later member)
        self.prefetch = prefetch
        if issue == "prefetch" and facts.prep is None:
            facts.prep = prep_chains(list(facts.classes), facts.classes, facts.inputs)
        self.member_of, self.state = facts.prep if issue == "prefetch" else ({}, {})
        self.comm_cache: dict = {}
        self.done: dict = {}
        self.coll_end: dict = {}          # collective node -> (end time, index in timings)
        self.timings: list = []
        self.trace: list = []
        self.notes: list = []
        self.flops_by_dtype: dict = {}
        self.t_m: dict = {}
        self.t_c = self.compute_s = self.comm_s = self.exposed = 0.0
        self.model_flops = 0
        self.prep_s: dict = {}            # collective -> seconds of its input preparation (prefetch)
        self.busy: dict = {}              # axis -> sorted (start, end) of its collectives ("prefetch")
        self.gathers: dict = {}           # axis -> state gathers met so far, program order
        self.gated: dict = {}             # gate collective -> [(held collective, ready, facts)]
        self.held: dict = {}              # collective -> the gate whose wait issues it
        self.waited: dict = {}            # collective -> compute time at its wait
        self.contention_s = 0.0

    def step(self, node):
        if node.op != "call_function":
            self.done[node] = 0.0
            return
        cls, info = self.f.classes[node]
        if node in self.member_of:        # runs on the collective's stream, when its sources exist
            ready = max([self.done[a] for a in self.f.inputs[node]], default=0.0)
            self.done[node] = ready
            if cls == COMPUTE:
                c = self.member_of[node]
                self.prep_s[c] = self.prep_s.get(c, 0.0) + self.cm.cost(node, node.target, info, self.f.sigs,
                                                                         self.f.nbytes)[1]
        elif cls == COMPUTE:
            self.compute(node, info)
        elif cls == FREE:                 # a view is ready when its base is
            self.done[node] = max([self.done[a] for a in self.f.inputs[node]], default=0.0)
        elif cls == COLLECTIVE:
            self.collective(node, info)
        else:
            self.wait(node)

    def compute(self, node, formula):
        if node in self.fused:            # a compiled program's fused kernel, charged at its first op
            nbytes = self.fused[node]
            flops, dt, dtype = 0, memory_time(self.hw, nbytes) if nbytes else 0.0, None
        else:
            flops, dt, dtype = self.cm.cost(node, node.target, formula, self.f.sigs, self.f.nbytes)
        self.trace.append((0, node.name, self.t_c, dt))
        self.t_c += dt
        self.compute_s += dt
        if flops:
            self.flops_by_dtype[dtype] = self.flops_by_dtype.get(dtype, 0) + flops
            if node.name not in self.exclude:
                self.model_flops += flops
        self.done[node] = self.t_c

    def collective(self, node, kind):
        kind, axis, size, rec = _collective_facts(node, kind, self.mesh, self.f.nbytes, self.notes)
        key = (kind, axis, size)
        est = self.comm_cache.get(key)
        if est is None and axis:
            est = self.comm_cache[key] = estimate(self.hw, kind, size, self.mesh, axis, self.axis_map)
        t = (est.time_s if est else 0.0) + self.prep_s.pop(node, 0.0)
        facts = (kind, axis, size, rec, est, t)
        if self.issue == "program":       # when the compute stream reaches it
            self._serve(node, self.t_c, facts)
            return
        ready = max([self.done[a] for a in self.f.inputs[node]], default=0.0)
        if self.issue == "ready":
            self._serve(node, ready, facts)
            return
        self.done[node] = ready
        gate = None
        if self.state.get(node):          # a state gather waits for its prefetch slot
            issued = self.gathers.setdefault(axis, [])
            gate = issued[-self.prefetch] if len(issued) >= self.prefetch else None
            issued.append(node)
        if gate is None or gate in self.waited:
            self._place(node, max(ready, self.waited.get(gate, 0.0)), facts)
        else:                             # issued when compute reaches the gate's wait
            self.gated.setdefault(gate, []).append((node, ready, facts))
            self.held[node] = gate

    def wait(self, node):
        c = node.args[0] if node.args else None
        if c in self.held:                # waited before its prefetch slot opened: issued now
            self._release(c)
        end, idx = self.coll_end.get(c, (0.0, -1))
        if end > self.t_c:                # compute stalls: exposed communication
            self.exposed += end - self.t_c
            self.timings[idx].exposed_s += end - self.t_c
            self.t_c = end
        self.done[node] = self.t_c
        self.waited[c] = self.t_c
        for held, ready, facts in self.gated.pop(c, ()):
            if held in self.held:
                del self.held[held]
                self._place(held, max(ready, self.t_c), facts)

    def finish(self) -> None:
        """Issue the collectives whose prefetch slot never opened (when compute ends), then charge compute for the
        time it shared the chip with collectives."""
        for c in list(self.held):
            self._release(c)
        if self.hw.overlap_slowdown:
            self.contention_s = self.hw.overlap_slowdown * overlap_s(self.trace)
            self.t_c += self.contention_s
            self.compute_s += self.contention_s

    def _release(self, c) -> None:
        gate = self.held.pop(c)
        entry = next(e for e in self.gated[gate] if e[0] is c)
        self._place(c, max(entry[1], self.t_c), entry[2])

    def _place(self, node, issued, facts) -> None:
        """Put a collective on its axis's stream at the first idle interval after ``issued`` that holds it (the
        program may list it after collectives that the runtime issues later)."""
        busy = self.busy.setdefault(facts[1], [])
        t, start = facts[5], issued
        i = bisect.bisect_right(busy, (issued, math.inf))
        if i and busy[i - 1][1] > start:
            start = busy[i - 1][1]
        while i < len(busy) and busy[i][0] < start + t:
            start = max(start, busy[i][1])
            i += 1
        busy.insert(i, (start, start + t))
        self._serve(node, start, facts)

    def _serve(self, node, issued, facts) -> None:
        kind, axis, size, rec, est, t = facts
        start = max(issued, self.t_m.get(axis, 0.0)) if self.issue != "prefetch" else issued
        end = start + t
        self.t_m[axis] = max(self.t_m.get(axis, 0.0), end)
        self.comm_s += t
        self.trace.append((1, f"{kind}[{axis}] {node.name}", start, t))
        self.coll_end[node] = (end, len(self.timings))
        # a collective lowering did not record (a hand-built graph) has no group, dtype, tactic, value nor family
        group, dtype, tactic, value, family = (0, "", "", "", "") if rec is None else \
            (rec.group_size, rec.dtype, rec.tactic, rec.value, rec.family)
        self.timings.append(CollectiveTiming(kind, axis or "?", group, int(size), dtype, tactic, value, node.name, t,
                                             est.tactic if est else "unknown", start, end, 0.0, family))
        self.done[node] = end


def _collective_facts(node, kind, mesh, nbytes, notes) -> tuple:
    """(kind, axis, full bytes, record) from the lowering record, or inferred when the record is missing."""
    rec = node.meta.get(META_COLLECTIVE)
    if rec is not None:
        if rec.axis in mesh.shape and rec.group_size != mesh.axis_size(rec.axis):
            notes.append(f"{node.name}: record says group size {rec.group_size} but mesh axis {rec.axis!r} has "
                         f"size {mesh.axis_size(rec.axis)}; costed with the mesh axis.")
        return rec.kind, rec.axis, rec.nbytes, rec
    inp = node.all_input_nodes[0] if node.all_input_nodes else None
    size = nbytes.get(node, 0) if kind in ("all_reduce", "all_gather") else nbytes.get(inp, 0)
    axes = list(mesh.axes)
    if len(axes) > 1:
        group = next((a for a in node.args if isinstance(a, int) and not isinstance(a, bool)), None)
        axes = [a for a in axes if mesh.axis_size(a) == group] if group else []
    if len(axes) == 1:
        return kind, axes[0], size, None
    notes.append(f"{node.name}: {kind} has no {META_COLLECTIVE!r} record and its mesh axis is ambiguous; "
                 f"costed as free.")
    return kind, None, size, None
