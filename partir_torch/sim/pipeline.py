"""Simulate one step of a pipelined program (lower/pipeline.py): one timeline per rank of the pipeline axis.

Each rank runs its own nodes in the program's order on its own compute stream and collective streams (timeline.py's
Timeline, the SPMD simulator's model of one device), action after action. An action starts when its rank is free and
every transfer it reads has arrived; a transfer (pp_transfer) leaves when its producer is done, on the sending rank's
link (one send at a time), and takes latency + bytes / bandwidth of the link between the two ranks (NVLink inside a
node, the NIC across nodes, ICI / DCN on TPUs). Then:

- the bubble: 1 - sum over ranks of their forward/backward busy time / (ranks x the span of the forward/backward
  part; the zero-bubble schedule's W actions count as backward); with equal stages and free transfers this is the
  schedule's textbook bubble (Schedule.bubble, lower/ppschedules.py: (p - 1) / (v m + p - 1) after Narayanan et al.
  2021, section 2.2; close to 0 for ZB-V when F = B = W, Qi et al. 2024, section 6);
- the slowest stage (the most busy time), each rank's peak memory (the liveness of its own nodes), the transfers;
- the nodes every rank runs (META_STAGE None: the all_reduces on the pipeline axis of clip_grad_norm and tied
  weights) start when the last rank reaches them, then each rank costs them as the SPMD timeline costs a collective.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..contract import META_ACTION, META_STAGE
from ..lower.pipeline import pp_transfer
from ..lower.ppschedules import Schedule
from .comm import check_mesh, gpu_group
from .confidence import closest_family, pipelined, strategy_of
from .hardware import Hardware
from .memory import analyze_memory
from .report import SimReport
from .simulate import _cost_model, _scan
from .timeline import Timeline


@dataclass
class PipelineSim:
    """What the pipeline simulation adds to a SimReport (report.pipeline)."""

    schedule: Schedule               # lower/ppschedules.py (str(): its name)
    ranks: int
    microbatches: int
    chunks: int
    bubble: float                    # fraction of the forward/backward span the ranks sit idle
    formula: float                   # the schedule's textbook bubble (Schedule.bubble)
    busy_s: list                     # per rank: seconds of forward/backward work
    step_s: list                     # per rank: when its step ends (update included)
    peak_bytes: list                 # per rank: peak live bytes of its own program
    transfer_bytes: int              # bytes sent per step, all transfers of one rank pair summed
    transfers: int                   # transfers per step
    spans: dict = field(default_factory=dict, repr=False)   # action -> (rank, start_s, end_s)
    # per rank, where its step goes: compute (contention with collectives in flight included), of which contention,
    # and the communication it waited for (exposed); the rest of step_s is idle (the bubble, waits for transfers)
    compute_s: list = field(default_factory=list)
    contention_s: list = field(default_factory=list)
    exposed_s: list = field(default_factory=list)
    # report.trace: rank r's compute on track 2 r, its collectives and sends on track 2 r + 1

    @property
    def slowest(self) -> int:
        return max(range(self.ranks), key=self.busy_s.__getitem__)

    def lines(self) -> list:
        per = ", ".join(f"{r}: {t * 1e3:.3f} ms" for r, t in enumerate(self.busy_s))
        mem = ", ".join(f"{r}: {b / 2**20:.1f} MiB" for r, b in enumerate(self.peak_bytes))
        book = self.schedule.bubble_text
        return [f"pipeline {self.schedule}: {self.ranks} ranks x {self.chunks} stage(s), {self.microbatches} "
                f"micro-batches; bubble {100 * self.bubble:.1f}% (textbook {book} = "
                f"{100 * self.formula:.1f}%); slowest stage rank {self.slowest}",
                f"pipeline busy (forward/backward) per rank: {per}",
                f"pipeline peak memory per rank: {mem}",
                f"pipeline transfers: {self.transfers} per step, {self.transfer_bytes / max(self.microbatches, 1) / 2**20:.3f} "
                f"MiB per micro-batch"] + [
                f"pipeline rank {r}: step {1e3 * t:.1f} ms = compute {1e3 * c:.1f} ms (contention {1e3 * k:.1f}) + "
                f"exposed communication {1e3 * e:.1f} ms + idle {1e3 * (t - c - e):.1f} ms"
                for r, (t, c, k, e) in enumerate(zip(self.step_s, self.compute_s, self.contention_s, self.exposed_s))]


def p2p_time(hw: Hardware, mesh, axis: str, nbytes: float) -> float:
    """One point-to-point send of `nbytes` between neighbouring ranks of `axis`: latency + bytes / link bandwidth."""
    if hw.kind == "tpu":
        if hw.slices > 1 and hw.dcn_bw:
            return hw.dcn_latency_s + nbytes / (hw.dcn_efficiency * hw.dcn_bw)
        return hw.ici_base_latency_s + hw.ici_hop_latency_s + nbytes / (hw.ici_efficiency * hw.ici_link_bw)
    _, nodes, _ = gpu_group(hw, mesh, axis)
    if nodes > 1 and hw.nic_bw:
        return 10e-6 + nbytes / (hw.nic_efficiency * hw.nic_bw)      # one IB hop (assumed 10 us fixed cost)
    bw = hw.nvlink_efficiency * hw.nvlink_bw if hw.nvlink_bw else hw.hbm_bw
    return 5e-6 + nbytes / bw                                        # NVLink p2p (assumed 5 us fixed cost)


def simulate_pipeline(gm, mesh, hw: Hardware, pipelined, axis_map=None, stage_name: str = "",
                      exclude_flops=None) -> SimReport:
    """SimReport of a pipelined per-device program; report.pipeline holds the PipelineSim (see the module doc)."""
    hw = check_mesh(hw, mesh)
    spec = pipelined.spec
    p = spec.ranks
    nodes = list(gm.graph.nodes)
    facts = _scan(nodes)
    cm = _cost_model(hw)
    lines = [Timeline(hw, mesh, axis_map, facts, set(exclude_flops or ()), "program", cm) for _ in range(p)]
    reads: dict = {}                 # action -> transfers it reads
    for n in nodes:
        a = n.meta.get(META_ACTION)
        if a is not None:
            for x in n.all_input_nodes:
                if x.target is pp_transfer:
                    reads.setdefault(a, set()).add(x)
    arrive, spans, cur, link_free = {}, {}, [None] * p, [0.0] * p
    sent, n_sent = 0, 0
    for n in nodes:
        if n.op == "placeholder":
            for line in lines:
                line.done[n] = 0.0
            continue
        if n.op == "output":
            continue
        r, a = n.meta[META_STAGE], n.meta[META_ACTION]
        if r is None:        # every rank runs it (an all_reduce on the axis): they meet there, then each steps it
            if cur[0] != a:
                t = max(line.t_c for line in lines)
                for q, line in enumerate(lines):
                    if cur[q] is not None:
                        spans[cur[q]] = (q, spans[cur[q]][1], line.t_c)
                    line.t_c, cur[q] = t, a
                spans[a] = (None, t, t)
            for line in lines:
                for x in n.all_input_nodes:
                    line.done.setdefault(x, line.t_c)      # another rank's part of the all_reduce
                line.step(n)
            continue
        line = lines[r]
        if cur[r] != a:
            if cur[r] is not None:
                spans[cur[r]] = (r, spans[cur[r]][1], line.t_c)
            line.t_c = max([line.t_c] + [arrive[t] for t in reads.get(a, ())])
            cur[r] = a
            spans[a] = (r, line.t_c, line.t_c)
        if n.target is pp_transfer:
            nbytes = facts.nbytes.get(n, 0)
            start = max(line.t_c, link_free[r])
            end = start + p2p_time(hw, mesh, spec.axis, nbytes)
            link_free[r] = end
            arrive[n] = end
            line.done[n] = line.t_c
            lines[n.args[2]].done[n] = end
            line.trace.append((1, f"send {n.name} -> {n.args[2]}", start, end - start))
            sent += nbytes
            n_sent += 1
        else:
            line.step(n)
    for r in range(p):
        if cur[r] is not None:
            spans[cur[r]] = (r, spans[cur[r]][1], lines[r].t_c)
    for line in lines:
        line.finish()
    return _report(lines, spans, spec, nodes, facts, hw, sent, n_sent, stage_name)


def _report(lines, spans, spec, nodes, facts, hw, sent: int, n_sent: int, stage_name: str) -> SimReport:
    """The SimReport of the ranks' timelines: the slowest rank's figures, the PipelineSim (bubble, stages)."""
    p = spec.ranks
    fb = {a: v for a, v in spans.items() if a[1] in ("F", "B", "W")}
    busy = [sum(e - s for rr, s, e in fb.values() if rr == r) for r in range(p)]
    span = (max(e for _, _, e in fb.values()) - min(s for _, s, _ in fb.values())) if fb else 0.0
    bubble = 1.0 - sum(busy) / (p * span) if span > 0 else 0.0
    v, m = spec.chunks, spec.microbatches
    peaks = [_rank_peak(nodes, r, facts) for r in range(p)]
    ends = [max(line.t_c, max(line.t_m.values(), default=0.0)) for line in lines]
    textbook = spec.schedule.bubble(p, m, v)
    sim = PipelineSim(spec.schedule, p, m, v, bubble, textbook, busy, ends, peaks, sent, n_sent,
                      spans, [line.compute_s for line in lines], [line.contention_s for line in lines],
                      [line.exposed for line in lines])
    slow = lines[max(range(p), key=ends.__getitem__)]
    step = max(ends)
    flops = sum(line.model_flops for line in lines) / p
    by_dtype: dict = {}
    for line in lines:
        for k, f in line.flops_by_dtype.items():
            by_dtype[k] = by_dtype.get(k, 0) + f
    peak_flops = hw.peak_flops(max(by_dtype, key=by_dtype.get) if by_dtype else "bfloat16")
    timings = [c for line in lines for c in line.timings]
    declared = {c.tactic: c.family for c in timings if c.family}
    family, conf = closest_family(hw.name, pipelined(strategy_of([c.tactic for c in timings], declared)))
    notes = [n for line in lines for n in line.notes] + sim.lines()
    rep = SimReport(step_time_s=step, compute_s=slow.compute_s, comm_s=slow.comm_s, exposed_comm_s=slow.exposed,
                    peak_memory_bytes=max(peaks), memory_breakdown={}, model_flops=flops,
                    mfu=flops / (step * peak_flops) if step > 0 else 0.0, collectives=timings, notes=notes,
                    stage_name=stage_name, hardware=hw.describe(), peak_flops=peak_flops,
                    trace=[(2 * r + k, name, t0, dt) for r, line in enumerate(lines) for k, name, t0, dt in line.trace],
                    confidence=conf, confidence_family=family)
    rep.pipeline = sim
    return rep


def _rank_peak(nodes, r: int, facts) -> int:
    """Peak live bytes of rank r's own program: its nodes, the transfers it receives and the inputs it reads."""
    mine = [n for n in nodes if n.op == "call_function" and (n.args[2] == r if n.target is pp_transfer
                                                           else n.meta.get(META_STAGE) in (r, None))]
    used = {x for n in mine for x in n.all_input_nodes if x.op == "placeholder"}
    order = [n for n in nodes if n in used] + mine
    keep = set(order)
    inputs = {n: [x for x in facts.inputs.get(n, ()) if x in keep] for n in order}
    return analyze_memory(order, facts.elems, inputs, facts.classes).peak_bytes
