"""Simulate one step of a per-device program: a compute stream and one communication stream per mesh axis.

Compute nodes run one after another in program order on the compute stream. Collectives over one mesh axis run one
after another on that axis's stream (NCCL runs each communicator on its own stream, so collectives of different
axes, e.g. tensor-parallel activations and data-parallel gradients, proceed concurrently; that they then share
links is not modelled). A collective is issued on its stream when its input is ready and the stream is free
(``issue="ready"``), or when the compute stream reaches it in program order (``issue="program"``, what eager CUDA
does: ProcessGroupNCCL makes the comm stream wait for all work enqueued before the call). Compute runs on until a
``wait_tensor`` needs the result; the time it then waits is exposed communication.

>>> report = simulate_graph(gm, pt.Mesh({"dp": 8}), hardware("h100"))      # doctest: +SKIP
>>> print(report.table())                                                   # doctest: +SKIP
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from functools import lru_cache

from ..errors import PartitionError
from ..lower.records import META_COLLECTIVE
from .comm import check_mesh, estimate
from .compute import COLLECTIVE, COMPUTE, FREE, CostModel, op_class, val_facts
from .confidence import closest_family, strategy_of
from .hardware import Hardware
from .memory import analyze_memory
from .report import CollectiveTiming, SimReport


@lru_cache(maxsize=16)
def _cost_model(hw: Hardware) -> CostModel:
    return CostModel(hw)


def simulate_graph(gm, mesh, hw: Hardware, axis_map=None, stage_name: str = "", exclude_flops=None,
                   issue: str = "ready") -> SimReport:
    """Predict step time, memory and communication of the per-device program ``gm`` on ``mesh`` laid on ``hw``.

    ``exclude_flops``: node names whose FLOPs are not model FLOPs (rematerialised recompute); they still take time.
    ``axis_map``: TPU only, mesh axis -> torus dims, e.g. ``{"model": ("z",), "data": ("x", "y")}``.
    """
    if issue not in ("ready", "program"):
        raise PartitionError(f"simulate_graph: issue must be 'ready' or 'program', got {issue!r}.")
    check_mesh(hw, mesh)
    enabled = gc.isenabled()
    gc.disable()                          # the passes allocate many small objects; collector passes cost ~2x
    try:
        return _simulate(gm, mesh, hw, axis_map, stage_name, set(exclude_flops or ()), issue)
    finally:
        if enabled:
            gc.enable()


def _simulate(gm, mesh, hw, axis_map, stage_name, exclude, issue) -> SimReport:
    # what does not depend on the hardware (per-node facts, buffer liveness) is read once per program, so a search
    # over hardware, axis mappings or issue policies re-simulates a program for the cost of its timeline only
    cached = getattr(gm, "_partir_sim_facts", None)
    if cached is None or cached[0] != len(gm.graph.nodes):
        nodes = list(gm.graph.nodes)
        facts = _scan(nodes)
        cached = (len(nodes), nodes, facts, analyze_memory(nodes, facts.elems, facts.inputs, facts.classes))
        gm._partir_sim_facts = cached
    _, nodes, facts, mem = cached
    line = _Timeline(hw, mesh, axis_map, facts, exclude, issue)
    for node in nodes:
        line.step(node)
    notes = line.notes
    t_m = max(line.t_m.values(), default=0.0)
    step = max(line.t_c, t_m)
    if t_m > line.t_c:
        notes.append(f"{(t_m - line.t_c) * 1e3:.3f} ms of communication is never waited on before the step "
                     f"ends.")
        line.exposed += t_m - line.t_c
    if mem.peak_bytes > hw.hbm_bytes:
        notes.append(f"peak memory {mem.peak_bytes / 2**30:.2f} GiB exceeds the {hw.hbm_bytes / 2**30:.2f} GiB "
                     f"of HBM per device on {hw.name} (peak at node {mem.peak_node}).")
    by_dtype = line.flops_by_dtype
    peak = hw.peak_flops(max(by_dtype, key=by_dtype.get) if by_dtype else "bfloat16")   # the dominant dtype
    family, conf = closest_family(hw.name, strategy_of(c.tactic for c in line.timings))
    return SimReport(
        step_time_s=step, compute_s=line.compute_s, comm_s=line.comm_s, exposed_comm_s=line.exposed,
        peak_memory_bytes=mem.peak_bytes, memory_breakdown=mem.breakdown, model_flops=line.model_flops,
        mfu=line.model_flops / (step * peak) if step > 0 else 0.0, collectives=line.timings, notes=notes,
        stage_name=stage_name, hardware=hw.describe(), peak_flops=peak, trace=line.trace, confidence=conf,
        confidence_family=family)


@dataclass
class _Facts:
    """Per-node facts read once from the graph: val signature, per-tensor bytes, inputs, op class."""

    sigs: dict = field(default_factory=dict)
    elems: dict = field(default_factory=dict)
    nbytes: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    classes: dict = field(default_factory=dict)


def _scan(nodes) -> _Facts:
    f = _Facts()
    sigs, elems, nbytes, inputs, classes = f.sigs, f.elems, f.nbytes, f.inputs, f.classes   # hot loop: locals
    for n in nodes:
        sigs[n], eb = val_facts(n.meta.get("val"))
        elems[n] = eb
        nbytes[n] = eb[0] if len(eb) == 1 else sum(eb)
        inputs[n] = list(n._input_nodes)
        if n.op == "call_function":
            classes[n] = op_class(n.target)
    return f


class _Timeline:
    """The streams. t_c: compute stream clock; t_m: comm stream clock per mesh axis; done: when each value is
    ready."""

    def __init__(self, hw, mesh, axis_map, facts, exclude, issue):
        self.hw, self.mesh, self.axis_map, self.f, self.exclude, self.issue = hw, mesh, axis_map, facts, exclude, issue
        self.cm = _cost_model(hw)
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

    def step(self, node):
        if node.op != "call_function":
            self.done[node] = 0.0
            return
        cls, info = self.f.classes[node]
        if cls == COMPUTE:
            self.compute(node, info)
        elif cls == FREE:                 # a view is ready when its base is
            self.done[node] = max([self.done[a] for a in self.f.inputs[node]], default=0.0)
        elif cls == COLLECTIVE:
            self.collective(node, info)
        else:
            self.wait(node)

    def compute(self, node, formula):
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
        t = est.time_s if est else 0.0
        if self.issue == "ready":         # as soon as its input exists and the comm stream is free
            ready = max([self.done[a] for a in self.f.inputs[node]], default=0.0)
        else:                             # when the compute stream reaches it
            ready = self.t_c
        start = max(ready, self.t_m.get(axis, 0.0))
        end = self.t_m[axis] = start + t
        self.comm_s += t
        self.trace.append((1, f"{kind}[{axis}] {node.name}", start, t))
        self.coll_end[node] = (end, len(self.timings))
        self.timings.append(CollectiveTiming(
            kind, axis or "?", getattr(rec, "group_size", 0), int(size), getattr(rec, "dtype", ""),
            getattr(rec, "tactic", ""), getattr(rec, "value", ""), node.name, t,
            est.tactic if est else "unknown", start, end, 0.0))
        self.done[node] = end

    def wait(self, node):
        end, idx = self.coll_end.get(node.args[0] if node.args else None, (0.0, -1))
        if end > self.t_c:                # compute stalls: exposed communication
            self.exposed += end - self.t_c
            self.timings[idx].exposed_s += end - self.t_c
            self.t_c = end
        self.done[node] = self.t_c


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
