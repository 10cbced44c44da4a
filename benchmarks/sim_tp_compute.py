"""Where a training row's simulated compute goes, per op kind and per transformer block (issue 23 item 2).

For a row of ``sim_reference.py`` (knobs fitted on the calibration half, as the table's), the simulated compute
stream of the row's program at its two shallow depths is split by op kind (matmuls, attention forward / backward,
everything else by aten op) and the per-block difference is printed with its FLOPs and FLOP rate, next to the
FLOPs the standard count gives a block (6 x parameters x tokens for the matmuls; attention as the causal kernel
executes it: half of the full ``4 s^2 h hd`` per forward).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sim_tp_compute.py "GPT-32B h100 TP8" [--top 12]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from examples.zoo import sim_validation as V                                 # noqa: E402
from examples.zoo.sim_reference import ROWS, SPLIT                         # noqa: E402


def kind_of(node) -> str:
    t = str(node.target)
    if "scaled_dot_product" in t:
        return "attention bwd" if "backward" in t else "attention fwd"
    if any(k in t for k in ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")):
        return "matmul"
    return t.replace("aten.", "").split(".")[0]


def split(setup: dict, hw, layers: int) -> dict:
    """{kind: [seconds, flops, count]} of the compute stream of the row's program at ``layers`` blocks."""
    from partir_torch.sim import simulate_graph
    from partir_torch.sim.pipeline import simulate_pipeline

    gm, mesh, recompute, pipelined = V.program(setup, layers)
    rep = (simulate_pipeline(gm, mesh, hw, pipelined, exclude_flops=recompute) if pipelined is not None
           else simulate_graph(gm, mesh, hw, exclude_flops=recompute, issue=V.ISSUE))
    by_name = {n.name: n for n in gm.graph.nodes}
    from partir_torch.sim.simulate import _cost_model, _scan

    nodes = list(gm.graph.nodes)
    facts, cm = _scan(nodes), _cost_model(hw)
    out: dict = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for track, name, _, dur in rep.trace:
        n = by_name.get(name)
        if track != 0 or n is None:
            continue
        cls, info = facts.classes.get(n, (None, None))
        flops = cm.cost(n, n.target, info, facts.sigs, facts.nbytes)[0] if info is not None else 0
        row = out[kind_of(n)]
        row[0] += dur
        row[1] += flops
        row[2] += 1
    return dict(out), rep


def block_flops(setup: dict) -> dict:
    """The standard count of one block's training FLOPs per device (forward + backward, no recompute)."""
    c = setup["model"]
    d, h, s = c["d"], c["heads"], c["seq"]
    hd = c.get("head_dim") or d // h
    kv = c.get("kv_heads") or h
    hidden = c.get("hidden") or 4 * d
    params = d * (h + 2 * kv) * hd + h * hd * d + hidden * d * (3 if c.get("gated") else 2)
    mesh = setup["mesh"]
    tokens = setup["batch"] * s / mesh.get("pp", 1)      # one data-parallel replica's tokens per device group
    if setup.get("pipeline"):
        tokens = setup["batch"] * s                     # every micro-batch of the replica passes every stage
    tp = mesh.get("tp", 1)
    return {"matmul": 6 * params * tokens / tp,
            "attention (causal)": 3 * 2 * s * h * hd * tokens / tp,      # fwd 2 s h hd per token (half of 4), x3
            "attention (full)": 3 * 4 * s * h * hd * tokens / tp}


def show_ops(setup: dict, layers: int, rep, kind: str) -> None:
    gm = V.program(setup, layers)[0]
    by_name = {n.name: n for n in gm.graph.nodes}
    print(f"  nodes of kind {kind!r} at {layers} blocks:")
    for track, name, _, dur in rep.trace:
        n = by_name.get(name)
        if track == 0 and n is not None and kind_of(n) == kind:
            ins = [f"{a.name}{tuple(a.meta['val'].shape)}" for a in n.all_input_nodes if hasattr(a.meta.get("val"), "shape")]
            users = ",".join(kind_of(u) for u in list(n.users)[:3])
            print(f"    {name:28s} {dur * 1e6:8.1f} us  {' '.join(ins)} -> {users}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("row")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--ops", metavar="KIND", help="also list the nodes of this kind (e.g. clone) in the deeper "
                    "program, with shapes and simulated time")
    ap.add_argument("--schedule", help="the row run with another schedule of sim_validation._schedule")
    ap.add_argument("--options", help="partition options as JSON, added to the row's (e.g. '{\"async_tp\": true}')")
    args = ap.parse_args(argv)
    ref = next(r for r in ROWS if r.kind == "training" and args.row in r.name)
    if args.schedule or args.options:
        import dataclasses
        import json
        opts = {**ref.setup.get("options", {}), **json.loads(args.options or "{}")}
        ref = dataclasses.replace(ref, setup={**ref.setup, "schedule": args.schedule or ref.setup["schedule"],
                                              "options": opts})
        print(f"schedule {ref.setup['schedule']}, options {opts}")
    hw = V._hw(ref.setup, V.fit([r for r in ROWS if SPLIT[r.family] == "cal"], {}, passes=1))
    a, b = V._depths(ref.setup)
    (lo, rep_lo), (hi, rep_hi) = split(ref.setup, hw, a), split(ref.setup, hw, b)
    per = (b - a) // (ref.setup.get("pipeline") or {}).get("stages", 1) or 1   # blocks added per stage
    print(f"{ref.name}: sustained_clock {hw.sustained_clock}, mm_efficiency {hw.mm_efficiency}, attn_efficiency "
          f"{hw.attn_efficiency:.3f}, kernel_overhead {hw.kernel_overhead_s * 1e6:g} us")
    print(f"  step at {a} / {b} blocks: {rep_lo.step_time_s * 1e3:.1f} / {rep_hi.step_time_s * 1e3:.1f} ms; "
          f"compute {rep_lo.compute_s * 1e3:.1f} / {rep_hi.compute_s * 1e3:.1f} ms")
    kinds = sorted(set(lo) | set(hi), key=lambda k: -(hi.get(k, [0])[0] - lo.get(k, [0])[0]))
    tot = sum(hi[k][0] - lo.get(k, [0, 0, 0])[0] for k in hi) / per
    print(f"  per block added (summed over the program's ranks' compute streams): {tot * 1e3:.2f} ms")
    print(f"    {'kind':28s} {'ms':>8s} {'share':>6s} {'count':>6s} {'GFLOP':>9s} {'TFLOP/s':>8s}")
    for k in kinds[:args.top]:
        t, f, n = (hi.get(k, [0, 0, 0])[i] - lo.get(k, [0, 0, 0])[i] for i in range(3))
        t, f, n = t / per, f / per, n / per
        rate = f"{f / t / 1e12:8.0f}" if f and t else ""
        print(f"    {k:28s} {t * 1e3:8.3f} {100 * t / tot:5.1f}% {n:6.0f} {f / 1e9:9.1f} {rate}")
    c = ref.setup["model"]
    L = c["layers"]
    at = lambda f: f(rep_lo) + (L - a) * (f(rep_hi) - f(rep_lo)) / (b - a)          # noqa: E731
    print(f"  at {L} blocks: step {at(lambda r: r.step_time_s) * 1e3:.0f} ms, compute "
          f"{at(lambda r: r.compute_s) * 1e3:.0f} ms, exposed communication {at(lambda r: r.exposed_comm_s) * 1e3:.0f} ms"
          + (" (summed over the pipeline's ranks)" if ref.setup.get("pipeline") else ""))
    if ref.unit.startswith("TFLOP"):
        tokens = ref.setup["batch"] * c["seq"] / ref.setup["mesh"].get("tp", 1) / ref.setup["mesh"].get("pp", 1)
        print(f"  measured step: {tokens * V.flops_per_token(c, ref.setup['flops']) / ref.measured / 1e9:.0f} ms")
    else:
        tokens = ref.setup["batch"] * c["seq"] / ref.setup["mesh"].get("tp", 1)
        print(f"  measured step: {tokens / ref.measured * 1e3:.0f} ms")
    if args.ops:
        show_ops(ref.setup, b, rep_hi, args.ops)
    std = block_flops(ref.setup)
    print("  standard count per block: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP" for k, v in std.items()))


if __name__ == "__main__":
    main()
