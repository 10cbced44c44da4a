"""Simulate one step of a per-device program: a compute stream and one communication stream per mesh axis.

The timeline (compute in program order, one stream per mesh axis, and when each collective is issued: ``"ready"``,
``"program"`` or ``"prefetch"``) is described in :mod:`.timeline`; the memory sweep in :mod:`.memory`.

>>> report = simulate_graph(gm, pt.Mesh({"dp": 8}), hardware("h100"))      # doctest: +SKIP
>>> print(report.table())                                                   # doctest: +SKIP
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from functools import lru_cache

from ..errors import PartitionError
from .comm import check_mesh
from .compute import COMPUTE, CostModel, _freeze, formula_flops, op_class, val_facts, val_sig
from .confidence import closest_family, strategy_of
from .fusion import fused_kernels
from .hardware import Hardware
from .memory import analyze_memory
from .report import SimReport
from .timeline import ISSUE, Timeline


@lru_cache(maxsize=16)
def _cost_model(hw: Hardware) -> CostModel:
    return CostModel(hw)


def simulate_graph(gm, mesh, hw: Hardware, axis_map=None, stage_name: str = "", exclude_flops=None,
                   issue: str = "program", prefetch: int = 1, model_flops: float | None = None,
                   compiled: bool = False) -> SimReport:
    """Predict step time, memory and communication of the per-device program ``gm`` on ``mesh`` laid on ``hw``.

    ``exclude_flops``: node names whose FLOPs are not model FLOPs (rematerialised recompute); they still take time.
    ``model_flops``: the model's FLOPs per device per step (the unpartitioned step's, divided by the devices), what
    MFU counts; None: this program's executed FLOPs less ``exclude_flops`` (noted in the report: a plan that
    computes redundantly then shows its redundant work as model work).
    ``axis_map``: TPU only, mesh axis -> torus dims, e.g. ``{"model": ("z",), "data": ("x", "y")}``.
    ``issue``: when a collective starts. "program" (the default) is what partir's runtime executes: each collective
    issued where the program lists it, waited for at its wait_tensor (the order lowering's scheduling pass chose,
    lower/schedule.py). "ready" and "prefetch" are what-ifs for another runtime (see :mod:`.timeline`) and the report
    says so in its notes; ``prefetch``: how many state gathers per axis a "prefetch" runtime keeps in flight ahead
    of the one in use. ``compiled``: the program runs compiled by TorchInductor (Options(compile=True)): its
    elementwise ops between extern kernels are priced as the fused kernels Inductor makes of them (sim/fusion.py).
    """
    if issue not in ISSUE:
        raise PartitionError(f"simulate_graph: issue must be one of {', '.join(map(repr, ISSUE))}, got {issue!r}.")
    if not isinstance(prefetch, int) or prefetch < 1:
        raise PartitionError(f"simulate_graph: prefetch must be an int >= 1 (gathers in flight ahead of the one "
                             f"in use), got {prefetch!r}.")
    hw = check_mesh(hw, mesh)
    enabled = gc.isenabled()
    gc.disable()                          # the passes allocate many small objects; collector passes cost ~2x
    try:
        return _simulate(gm, mesh, hw, axis_map, stage_name, set(exclude_flops or ()), issue, prefetch, model_flops,
                         compiled)
    finally:
        if enabled:
            gc.enable()


def _simulate(gm, mesh, hw, axis_map, stage_name, exclude, issue, prefetch, model_flops, compiled) -> SimReport:
    # what does not depend on the hardware (per-node facts, buffer liveness) is read once per program, so a search
    # over hardware, axis mappings or issue policies re-simulates a program for the cost of its timeline only
    cached = getattr(gm, "_partir_sim_facts", None)
    if cached is None or cached[0] != len(gm.graph.nodes):
        nodes = list(gm.graph.nodes)
        facts = _scan(nodes)
        cached = (len(nodes), nodes, facts, analyze_memory(nodes, facts.elems, facts.inputs, facts.classes))
        gm._partir_sim_facts = cached
    _, nodes, facts, mem = cached
    if compiled and facts.fused is None:
        facts.fused = fused_kernels(nodes, facts)
    line = Timeline(hw, mesh, axis_map, facts, exclude, issue, _cost_model(hw), prefetch,
                    facts.fused if compiled else None)
    for node in nodes:
        line.step(node)
    line.finish()
    notes = line.notes
    if compiled:
        kernels = sum(1 for b in facts.fused.values() if b)
        notes.append(f"compiled (TorchInductor): {kernels} fused elementwise kernels of {len(facts.fused)} ops, each "
                     f"priced as one memory-bound kernel (sim/fusion.py); the peak memory is the eager program's "
                     f"liveness (Inductor's memory planning is not modelled).")
    if issue != "program":
        notes.append(f"what-if: collectives issued as a {issue!r} runtime would issue them (sim/timeline.py); "
                     f"partir's runtime executes the program's own order (issue='program').")
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
    executed = sum(by_dtype.values())
    if model_flops is None:
        model_flops = line.model_flops
        if executed:
            notes.append("MFU counts this program's executed FLOPs less recomputation (no unpartitioned step was "
                         "given: simulate_graph(..., model_flops=)); prog.simulate counts the model's.")
    declared = {c.tactic: c.family for c in line.timings if c.family}
    family, conf = closest_family(hw.name, strategy_of([c.tactic for c in line.timings], declared))
    return SimReport(
        step_time_s=step, compute_s=line.compute_s, comm_s=line.comm_s, exposed_comm_s=line.exposed,
        peak_memory_bytes=mem.peak_bytes, memory_breakdown=mem.breakdown, model_flops=model_flops,
        mfu=model_flops / (step * peak) if step > 0 else 0.0, hardware_flops=executed,
        hfu=executed / (step * peak) if step > 0 else 0.0, hbm_bytes=hw.hbm_bytes, collectives=line.timings, notes=notes,
        stage_name=stage_name, hardware=hw.describe(), peak_flops=peak, trace=line.trace, confidence=conf,
        confidence_family=family, allocator=mem if hw.kind == "gpu" else None)


def step_flops(gm, hw: Hardware, exclude=()) -> float:
    """FLOPs of one run of ``gm`` as the cost model counts them (matmuls, convolutions, attention), less the nodes
    named in ``exclude``. On the captured (unpartitioned) step: the model's FLOPs per step, what MFU counts.
    FLOPs do not depend on the hardware (only the seconds do): the total is kept with ``gm`` per ``exclude``, so
    simulating the program again on other hardware does not walk the captured step again."""
    key = frozenset(exclude)
    memo = getattr(gm, "_partir_step_flops", None)
    if memo is None or memo[0] != len(gm.graph.nodes):
        memo = gm._partir_step_flops = (len(gm.graph.nodes), {})
    if key not in memo[1]:
        memo[1][key] = _formula_flops(gm, key)
    return memo[1][key]


class _Sigs(dict):
    """node -> val_sig of its meta val, read on first use (only the operands of FLOP-carrying nodes are read)."""

    def __missing__(self, node):
        sig = self[node] = val_sig(node.meta.get("val"))
        return sig


def _formula_flops(gm, exclude: frozenset) -> float:
    """The FLOPs CostModel.cost counts, summed in program order over the nodes with a FLOP formula, less `exclude`:
    each (op, operand signatures, other arguments) is counted by its formula once (the cost model's cache key)."""
    sigs, seen, total = _Sigs(), {}, 0.0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.name in exclude:
            continue
        cls, formula = op_class(n.target)
        if cls != COMPUTE or formula is None:
            continue
        key = (id(n.target), sigs[n], _freeze(n.args, sigs), _freeze(tuple(n.kwargs.items()), sigs))
        flops = seen.get(key)
        if flops is None:
            flops = seen[key] = max(formula_flops(n, formula), 0)
        total += flops
    return total


@dataclass
class _Facts:
    """Per-node facts read once from the graph: val signature, per-tensor bytes, inputs, op class."""

    sigs: dict = field(default_factory=dict)
    elems: dict = field(default_factory=dict)
    nbytes: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    classes: dict = field(default_factory=dict)
    prep: tuple | None = None      # timeline.prep_chains, read when a "prefetch" timeline first needs it
    fused: dict | None = None      # fusion.fused_kernels, read when a compiled program is first simulated


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


