"""The simulator against published measurements it was not fitted on (examples/zoo/sim_reference.py).

1. Every reference row is rebuilt and predicted: collectives through ``sim.estimate``, kernels through the cost
   model's roofline (``sim.compute.kernel_time``), training runs as a model built on ``meta``, partitioned with the
   run's schedule and simulated (``simulate_graph`` on the final stage's lowered program, collectives issued as a
   prefetching runtime issues them: ``issue="prefetch"``).
2. ``fit`` tunes a few physical knobs (``KNOBS``) on the calibration half only, the kernel knobs on kernel and
   collective rows, then the training knobs on training rows; every quoted error comes from rows the fit did not
   see: the validation half, and leave-one-family-out (refit without the family, then predict it).
3. Ranking cases (several configurations of one model on one system) report Kendall's tau; rows that publish peak
   memory report its error.
4. ``--write-confidence`` stores each family's held-out error in ``partir_torch/sim/confidence.py``, which
   ``SimReport.table()`` shows as its confidence column.

Deep models are simulated at two shallow depths and extrapolated linearly to the run's depth (every transformer
block costs the same time and memory; the embedding, head, optimizer start and first gather are the intercept).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sim_validation.py [--quick] [--write-confidence]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sim_validation.py --pipelined          # the pipelined rows only
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sim_validation.py --breakdown "GPT-70B"  # where one row's time goes
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import operator
import os
import statistics
import sys
import time
import warnings

from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.zoo import sim_decoder as M                                 # noqa: E402
from examples.zoo.sim_reference import RANKING, ROWS, SPLIT, Ref, check     # noqa: E402
from partir_torch.mesh import Mesh                                        # noqa: E402
from partir_torch.sim import estimate, hardware                           # noqa: E402
from partir_torch.sim.hardware import KNOBS as HW_KNOBS, with_knobs       # noqa: E402
from partir_torch.sim.compute import elem_bytes, kernel_time, memory_time, val_sig   # noqa: E402

DEPTHS = (2, 4)            # shallow depths simulated; deeper runs are extrapolated linearly in the layer count
# Every training run in the table was measured with a runtime that overlaps communication (FSDP/FSDP2 prefetch,
# Megatron's --overlap-grad-reduce/--overlap-param-gather, XLA's async collectives): collectives are simulated as
# such a runtime issues them (sim/timeline.py, "prefetch").
ISSUE = "program"

# Physical knobs the fit may move, each a Hardware field with the grid it searches (multiplicative on the preset
# value where "scale", absolute otherwise) and the rows that measure it. They act on every chip alike (or, named in
# hardware.KNOBS, on every chip of one kind): the fit learns physics shared across families, never a per-row constant.
# Kernel benchmarks measure the kernel knobs (how efficient fused attention is relative to its peak, how much of HBM
# bandwidth a copy sees, the small-GEMM fall-off, fp8 GEMM efficiency); training runs then measure what only shows
# in a whole step with those fixed (the clock a GPU sustains through a step, per-launch overhead, how much a
# collective in flight slows compute, the TPU MXU's best-shape efficiency, for which no MAMF-style measurement is
# published).
KNOBS = {      # knob -> (grid, the rows that measure it); its field, mode (abs / scale) and scope: hardware.KNOBS
    "attn_efficiency": ((0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3), "kernels"),
    "hbm_efficiency": ((0.70, 0.75, 0.80, 0.85, 0.90, 0.95), "kernels"),
    "mm_half_time_s": ((0.4, 0.5, 0.6, 0.8, 1.0), "kernels"),
    "fp8_efficiency": ((0.60, 0.65, 0.70, 0.75, 0.80), "kernels"),
    "roofline_p": ((1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 64.0), "kernels"),   # 1: no overlap (sum), 64: max()
    "sustained_clock": ((0.75, 0.8, 0.85, 0.9, 0.95, 1.0), "training"),
    "overlap_slowdown": ((0.0, 0.1, 0.2, 0.3, 0.4, 0.5), "training"),
    "kernel_overhead_s": ((1e-6, 2e-6, 4e-6, 8e-6), "training"),
    "tpu_mm_efficiency": ((0.80, 0.85, 0.90, 0.95), "training"),
}
assert set(KNOBS) == set(HW_KNOBS)
TRAINING_KNOBS = ("attn_efficiency", "hbm_efficiency", "kernel_overhead_s", "mm_half_time_s", "overlap_slowdown",
                  "tpu_mm_efficiency", "sustained_clock", "roofline_p")             # what bf16 training runs depend on


# Families predicted but never fitted on, in any fit (the halves' or leave-one-family-out's): pipelined runs, whose
# programs hold every micro-batch (16 for the 119B row) and take seconds per simulation, and the FlashAttention-2
# forward + backward kernel rows (priced by the simulator's own attention cost, which charges a causal kernel the
# full square: README, "FlashAttention-2 forward + backward rows"); their error is always a held-out one.
HELD_OUT_ONLY = {"h100/tp+pp", "a100/attention-fwd+bwd", "h100/attention-fwd+bwd"}

# ----------------------------------------------------------------------------------------------------- programs
_PROGRAMS: dict = {}


def _schedule(kind: str, remat, cfg):
    import torch

    from partir_torch import tactics as T

    mp = T.mixed_precision(torch.bfloat16)
    tp = T.megatron("tp", plan=M.plan_for(cfg))
    s = {"fsdp": [mp, T.data_parallel("dp"), T.zero(3, "dp")],
         "zero2": [mp, T.data_parallel("dp"), T.zero(2, "dp")],
         "dcn+fsdp": [mp, T.data_parallel("dcn", name="BP-dcn"), T.data_parallel("dp"), T.zero(3, "dp")],
         "dp": [mp, T.data_parallel("dp")],
         "tp": [T.data_parallel("dp"), tp, mp],
         # Megatron's distributed optimizer with --overlap-param-gather: the updated shards are gathered ahead of
         # their use in the next forward, the gathered copy kept for the backward (one gather per step, as ZeRO-1)
         "dp+zero1-overlap": [mp, T.data_parallel("dp"), T.zero(3, "dp", reshard_after_forward=False)],
         "tp+zero1-overlap": [T.data_parallel("dp"), tp, mp, T.zero(3, "dp", reshard_after_forward=False)],
         "fsdp+tp": [T.data_parallel("dp"), tp, mp, T.zero(3, "dp")],
         # what Megatron ran with --tp-comm-overlap (sequence parallelism); what-ifs for --breakdown
         "tp+sp": [T.data_parallel("dp"), tp, T.sequence_parallel("tp"), mp],
         "tp+sp+zero1-overlap": [T.data_parallel("dp"), tp, T.sequence_parallel("tp"), mp,
                                 T.zero(3, "dp", reshard_after_forward=False)],
         # torchtitan's tensor parallelism: sequence parallel norms by default (enable_sequence_parallel=True)
         "fsdp+tp+sp": [T.data_parallel("dp"), tp, T.sequence_parallel("tp"), mp, T.zero(3, "dp")]}[kind]
    # remat: False, True (full) or "selective" (torchtitan's per-op policy)
    return s + ([T.remat("layers.*", policy="selective" if remat == "selective" else "full")] if remat else [])


def program(setup: dict, layers: int):
    """(lowered per-device GraphModule, mesh, recomputed node names) of a training row at ``layers`` blocks."""
    key = (repr(sorted(setup["model"].items())), repr(setup["mesh"]), setup["batch"], setup["schedule"],
           setup["remat"], layers, repr(sorted(setup.get("options", {}).items())), repr(setup.get("pipeline")))
    if key not in _PROGRAMS:
        import torch

        import partir_torch as pt

        warnings.simplefilter("ignore")
        cfg = M.DecoderConfig(**{**setup["model"], "layers": layers})
        model = M.build(cfg)
        mesh = pt.Mesh(setup["mesh"])
        data = math.prod(v for a, v in setup["mesh"].items() if a not in ("tp", "pp"))
        tokens = torch.zeros(setup["batch"] * data, cfg.seq, dtype=torch.int64, device="meta")
        prog = pt.partition(model, mesh, _pipeline(setup, layers) + _schedule(setup["schedule"], setup["remat"], cfg),
                            example_inputs=(tokens, tokens), loss_fn=M.loss_fn,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                            options=pt.Options(**setup.get("options", {})))
        low = prog.plan.annotated_lowered()
        recompute = {n.name for n in low.gm.graph.nodes if n.meta.get("partir_recompute")}
        _PROGRAMS[key] = (low.gm, mesh, recompute, low.pipeline)
    return _PROGRAMS[key]


def _pipeline(setup: dict, layers: int) -> list:
    """The pipeline tactic of a pipelined row (on mesh axis "pp"), cut as Megatron cuts: layers / stages blocks per
    stage, the embedding with the first and the final norm and head with the last."""
    pp = setup.get("pipeline")
    if not pp:
        return []
    from partir_torch import tactics as T

    p = pp["stages"]
    k = layers // p
    globs = [[f"layers.{j}" for j in range(i * k, (i + 1) * k)] for i in range(p)]
    globs[0].insert(0, "emb")
    globs[-1] += ["norm", "head"]
    return [T.pipeline("pp", stages=globs, schedule=pp["schedule"], microbatches=pp["microbatches"])]


def _depths(setup: dict) -> tuple:
    """The shallow depths simulated: DEPTHS, or 1 and 2 blocks per stage of a pipelined row."""
    p = (setup.get("pipeline") or {}).get("stages")
    return (p, 2 * p) if p else DEPTHS


def _hw(setup: dict, knobs: dict):
    """The row's machine, from the preset's datasheet figures (not the presets' own fit), with ``knobs`` applied."""
    return with_knobs(hardware(setup["preset"], calibrated=False, **setup.get("hw", {})), knobs)


# ---------------------------------------------------------------------------------------------------- predict
def flops_per_token(c: dict, formula: str) -> float:
    """Training FLOPs per token as the source counts them (forward + backward = 3x forward; no recompute)."""
    d, L, s, V = c["d"], c["layers"], c["seq"], c["vocab"]
    if formula == "megatron":      # Narayanan et al. 2021, eq. 3: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) / (B s)
        return 72 * L * d * d * (1 + s / (6 * d) + V / (12 * L * d))
    # MaxText calculate_tflops_training_per_device (2023-2024): gated MLP, q/k/v/o, non-causal attention, unembed
    h, kv = c["heads"], c.get("kv_heads") or c["heads"]
    hd = c.get("head_dim") or d // h
    ffn = 2 * c["hidden"] * d * (2 if c.get("gated") else 1) + 2 * c["hidden"] * d
    qkv, proj, attn = 2 * d * (h + 2 * kv) * hd, 2 * d * h * hd, 4 * s * h * hd
    return 3 * (L * (ffn + qkv + proj + attn) + 2 * d * V)


def _extrapolate(setup, hw, what):
    """``what(report)`` at the run's depth, from the two shallow depths."""
    from partir_torch.sim import simulate_graph

    from partir_torch.sim.pipeline import simulate_pipeline

    vals = []
    for L in _depths(setup):
        gm, mesh, recompute, pipelined = program(setup, L)
        if pipelined is not None:
            rep = simulate_pipeline(gm, mesh, hw, pipelined, exclude_flops=recompute)
        else:
            rep = simulate_graph(gm, mesh, hw, exclude_flops=recompute, issue=ISSUE)
        vals.append(what(rep))
    a, b = _depths(setup)
    return vals[0] + (setup["model"]["layers"] - a) * (vals[1] - vals[0]) / (b - a)


def predict(ref: Ref, knobs: dict | None = None) -> float:
    """The simulator's figure for ``ref``, in the row's unit."""
    s, hw = ref.setup, _hw(ref.setup, knobs or {})
    if ref.kind == "collective":
        n = s["n"]
        est = estimate(hw, s["kind"], s["bytes"], Mesh({"dp": n}), "dp", algorithm=s.get("algorithm"))
        f = 2 * (n - 1) / n if s["kind"] == "all_reduce" else (n - 1) / n
        return s["bytes"] / est.time_s * f / 1e9
    if ref.kind == "gemm":
        m, n, k = s["m"], s["n"], s["k"]
        import torch
        size = getattr(torch, s["dtype"]).itemsize
        return 2 * m * n * k / kernel_time(hw, 2 * m * n * k, (m * k + k * n + m * n) * size, s["dtype"]) / 1e12
    if ref.kind == "attention":
        return _attention_rate(s, hw)
    if ref.kind == "hbm":
        return 2 * s["bytes"] / memory_time(hw, 2 * s["bytes"]) / 1e12
    step = _extrapolate(s, hw, lambda r: r.step_time_s)
    # a tensor-parallel group shares its batch, and a pipeline's ranks share theirs
    tokens = s["batch"] * s["model"]["seq"] / s["mesh"].get("tp", 1) / s["mesh"].get("pp", 1)
    if ref.unit.startswith("tokens"):
        return tokens / step
    return tokens * flops_per_token(s["model"], s["flops"]) / step / 1e12


def _attention_rate(s: dict, hw) -> float:
    """TFLOP/s of an attention kernel row as its source counts FLOPs (FlashAttention's benchmark: 4 b s^2 h d
    forward, 2.5x that backward, halved when causal) over the time the simulator's own cost model gives the
    training programs' attention nodes (the CPU flash kernels' forward and backward, ``is_causal`` as the row)."""
    import torch

    from partir_torch.sim.compute import CostModel, op_class
    from partir_torch.sim.synthetic import GraphBuilder

    b, T, h, hd, causal = s["batch"], s["seq"], s["heads"], s["head_dim"], s["causal"]
    g = GraphBuilder()
    q, k, v = (g.input(x, (b, h, T, hd), dtype=torch.bfloat16) for x in "qkv")
    fwd = g.call(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, 0.0, causal)
    nodes = [fwd]
    if s.get("mode") == "fwd+bwd":
        out, lse = g.call(operator.getitem, fwd, 0), g.call(operator.getitem, fwd, 1)
        nodes.append(g.call(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                            out, q, k, v, out, lse, 0.0, causal))
    every = list(g.graph.nodes)
    sigs = {n: val_sig(n.meta.get("val")) for n in every}
    nbytes = {n: sum(elem_bytes(n.meta.get("val"))) for n in every}
    cm = CostModel(dataclasses.replace(hw, sustained_clock=1.0))   # a kernel benchmark runs at its own clock
    t = sum(cm.cost(n, n.target, op_class(n.target)[1], sigs, nbytes)[1] for n in nodes)
    counted = 4 * b * T * T * h * hd / (2 if causal else 1) * (3.5 if len(nodes) == 2 else 1)
    return counted / t / 1e12


def predict_memory(ref: Ref, kind: str | None = None) -> float:
    """Peak memory per device in GiB (no knob changes memory), of the kind the row publishes (ref.mem_kind):
    "allocated" (live tensor bytes, sim/memory.py) or "reserved" (the CUDA caching allocator's segments,
    sim/allocator.py)."""
    if (kind or ref.mem_kind) != "reserved":
        return _extrapolate(ref.setup, _hw(ref.setup, {}), lambda r: r.peak_memory_bytes) / 2 ** 30
    # the allocator's segments are not linear in the depth (a block freed by one layer is reused by the next):
    # the program at the run's own depth
    from partir_torch.sim import simulate_graph

    gm, mesh, recompute, _ = program(ref.setup, ref.setup["model"]["layers"])
    rep = simulate_graph(gm, mesh, _hw(ref.setup, {}), exclude_flops=recompute, issue=ISSUE)
    # the buffers as the runtime that ran the row holds them (eager PyTorch: FSDP2's streams and held modules,
    # torch.utils.checkpoint's cache)
    runtime, held = ref.setup.get("runtime", "partir"), ref.setup.get("fsdp_held", ())
    return rep.allocator.reserved_bytes(runtime, held) / 2 ** 30


def memory_table(mem: list) -> None:
    print("\nPeak memory per device (GiB): reference vs simulator, of the kind the source publishes "
          "(allocated: live tensors; reserved: the CUDA caching allocator's segments, sim/allocator.py)")
    mrows = [(r.name, r.mem_kind, r.mem_gib, predict_memory(r, "allocated"), predict_memory(r)) for r in mem]
    print(tabulate([(n, k, f"{m:g}", f"{a:.1f}", f"{p:.1f}", f"{100 * err(p, m):+.1f}%") for n, k, m, a, p in mrows],
                   headers=["row", "published", "ref", "sim allocated", "sim of that kind", "err"]))


def err(pred: float, ref: float) -> float:
    return (pred - ref) / ref


# -------------------------------------------------------------------------------------------------------- fit
def _loss(rows, knobs, cache) -> float:
    errs = []
    for r in rows:
        used = {k: v for k, v in knobs.items() if r.kind != "training" or k in TRAINING_KNOBS}
        key = (r.name, tuple(sorted(used.items())))
        if key not in cache:
            cache[key] = err(predict(r, knobs), r.measured)
        errs.append(abs(math.log1p(cache[key])))
    return statistics.median(errs) + 0.25 * statistics.mean(errs)


def fit(rows, cache, passes: int = 2) -> dict:
    """Coordinate descent over ``KNOBS`` minimising median + mean/4 of |log(sim/ref)|: the kernel knobs on the
    kernel and collective rows of ``rows``, then the training knobs on its training rows."""
    start = {k: getattr(hardware("tpu-v5e" if HW_KNOBS[k][2] == "tpu" else "h100", calibrated=False),
                        HW_KNOBS[k][0]) for k in KNOBS}
    knobs = {k: (1.0 if HW_KNOBS[k][1] == "scale" else start[k]) for k in KNOBS}
    knobs = {k: (v if v in KNOBS[k][0] else KNOBS[k][0][len(KNOBS[k][0]) // 2]) for k, v in knobs.items()}
    rows = [r for r in rows if r.family not in HELD_OUT_ONLY]
    for stage in ("kernels", "training"):
        part = [r for r in rows if (r.kind == "training") == (stage == "training")]
        if not part:
            continue
        for _ in range(passes):
            for k, (grid, measured_by) in KNOBS.items():
                if measured_by == stage:
                    knobs[k] = min(grid, key=lambda v: _loss(part, {**knobs, k: v}, cache))
    return knobs


def kendall_tau(a, b) -> float:
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += math.copysign(1, a[i] - a[j]) * math.copysign(1, b[i] - b[j]) if a[i] != a[j] and b[i] != b[j] \
                else 0
    return s / (n * (n - 1) / 2)


# ------------------------------------------------------------------------------------------------------ report
def _stats(es) -> str:
    if not es:
        return "n/a"
    a = sorted(abs(e) for e in es)
    return f"median |err| {100 * statistics.median(a):.1f}%, mean {100 * statistics.mean(a):.1f}%, " \
           f"max {100 * a[-1]:.1f}% ({len(a)} rows)"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="collectives and kernels only")
    ap.add_argument("--write-confidence", action="store_true")
    ap.add_argument("--breakdown", metavar="ROW", help="where one training row's time goes (a row name substring), "
                    "at the two shallow depths the row is extrapolated from, knobs fitted on the calibration half")
    ap.add_argument("--schedule", help="with --breakdown: the row run with another schedule of _schedule")
    ap.add_argument("--options", help="with --breakdown: partition options as JSON, added to the row's "
                                      "(e.g. '{\"async_tp\": true}')")
    ap.add_argument("--memory", action="store_true", help="only the rows that publish peak memory")
    ap.add_argument("--rows", metavar="SUBSTR", help="only the rows whose name contains SUBSTR, predicted with the "
                    "calibration half's fit (the table's); no leave-one-family-out")
    ap.add_argument("--pipelined", action="store_true", help="only the pipelined training rows (held out from every "
                    "fit), knobs fitted on the calibration half as in the full table")
    args = ap.parse_args(argv)
    check()
    if args.breakdown:
        breakdown(args.breakdown, args.schedule, json.loads(args.options) if args.options else None)
        return
    if args.pipelined:
        some_rows([r for r in ROWS if r.kind == "training" and r.setup.get("pipeline")])
        return
    if args.memory:
        memory_table([r for r in ROWS if r.mem_gib])
        return
    if args.rows:
        some_rows([r for r in ROWS if args.rows in r.name])
        return
    t0 = time.process_time()
    rows = [r for r in ROWS if not (args.quick and r.kind == "training")]
    cal = [r for r in rows if SPLIT[r.family] == "cal"]
    val = [r for r in rows if SPLIT[r.family] == "val"]
    cache: dict = {}
    knobs = fit(cal, cache, passes=1)
    print("fitted on the calibration half:", ", ".join(f"{k}={v:g}" for k, v in knobs.items()))
    pred = {r.name: predict(r, knobs) for r in rows}
    e = {r.name: err(pred[r.name], r.measured) for r in rows}
    table = [(SPLIT[r.family], r.family, r.name, r.unit, f"{r.measured:g}", f"{pred[r.name]:.4g}",
              f"{100 * e[r.name]:+.1f}%", r.source[:48]) for r in rows]
    print(tabulate(table, headers=["half", "family", "row", "unit", "ref", "sim", "err", "source"]))
    print(f"\ncalibration half: {_stats([e[r.name] for r in cal])}")
    print(f"validation half:  {_stats([e[r.name] for r in val])}")
    worst = max(val, key=lambda r: abs(e[r.name]))
    print(f"worst validation row: {worst.name} ({100 * e[worst.name]:+.1f}%)")
    for kind in ("collective", "gemm", "attention", "hbm", "training"):
        vs = [e[r.name] for r in val if r.kind == kind]
        if vs:
            print(f"  validation {kind}: {_stats(vs)}")

    # leave one family out: refit without it, predict it
    fams = sorted({r.family for r in rows})
    lofo = {}
    for f in fams:
        k = fit([r for r in rows if r.family != f], cache, passes=1)
        lofo[f] = [err(predict(r, k), r.measured) for r in rows if r.family == f]
    print("\nLeave-one-family-out (fit on every other family, predict this one)")
    print(tabulate([(f, SPLIT[f], _stats(lofo[f])) for f in fams], headers=["family", "half", "error"]))
    print(f"all families held out: {_stats([x for f in fams for x in lofo[f]])}")

    cases = [(c, names) for c, names in RANKING.items() if all(n in pred for n in names)]
    if cases:
        print("\nRanking cases: Kendall's tau between measured and simulated order")
        byname = {r.name: r for r in rows}
        for c, names in cases:
            tau = kendall_tau([byname[n].measured for n in names], [pred[n] for n in names])
            print(f"  {c}: tau {tau:+.2f} ({len(names)} configurations)")

    mem = [r for r in rows if r.mem_gib]
    if mem:
        memory_table(mem)

    conf = {f: statistics.median(abs(x) for x in (lofo[f] if SPLIT[f] == "cal" else
                                                  [e[r.name] for r in val if r.family == f])) for f in fams}
    if args.write_confidence and not args.quick:
        _write_confidence(conf, knobs)
    print(f"\n{time.process_time() - t0:.0f} s CPU")


def some_rows(rows) -> None:
    """Some rows' predictions and errors, with the knobs the full table fits on the calibration half."""
    knobs = fit([r for r in ROWS if SPLIT[r.family] == "cal"], {}, passes=1)
    print(tabulate([(SPLIT[r.family], r.family, r.name, r.unit, f"{r.measured:g}", f"{p:.4g}",
                     f"{100 * err(p, r.measured):+.1f}%") for r in rows for p in [predict(r, knobs)]],
                   headers=["half", "family", "row", "unit", "ref", "sim", "err"]))


def breakdown(name: str, schedule: str | None = None, options: dict | None = None) -> None:
    """Print, at each shallow depth of a training row, the simulated step, compute and exposed communication, and
    per collective kind and axis its count, bytes, time and exposed time (knobs fitted on the calibration half)."""
    from partir_torch.sim import simulate_graph
    from partir_torch.sim.pipeline import simulate_pipeline

    ref = next(r for r in ROWS if r.kind == "training" and name in r.name)
    setup = {**ref.setup, **({"schedule": schedule} if schedule else {})}
    setup["options"] = {**setup.get("options", {}), **(options or {})}
    hw = _hw(setup, fit([r for r in ROWS if SPLIT[r.family] == "cal"], {}, passes=1))   # the table's fit
    print(f"{ref.name}, schedule {setup['schedule']}, {setup.get('options', {})}")
    splits = []
    for L in _depths(setup):
        gm, mesh, recompute, pipelined = program(setup, L)
        rep = (simulate_pipeline(gm, mesh, hw, pipelined, exclude_flops=recompute) if pipelined is not None
               else simulate_graph(gm, mesh, hw, exclude_flops=recompute, issue=ISSUE))
        print(f"  {L} blocks: step {1e3 * rep.step_time_s:.1f} ms, compute {1e3 * rep.compute_s:.1f} ms, exposed "
              f"communication {1e3 * rep.exposed_comm_s:.1f} ms")
        rows: dict = {}
        for c in rep.collectives:
            n, b, t, e = rows.get((c.kind, c.axis), (0, 0, 0.0, 0.0))
            rows[(c.kind, c.axis)] = (n + 1, b + c.nbytes, t + c.time_s, e + c.exposed_s)
        for (kind, axis), (n, b, t, e) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
            print(f"    {kind}[{axis}] x{n}: {b / 2**20:.0f} MiB, {1e3 * t:.1f} ms, exposed {1e3 * e:.1f} ms")
        if pipelined is not None:
            print("    " + "\n    ".join(rep.pipeline.lines()))
            splits.append(_rank_split(rep, gm))
    if splits:
        _extrapolated_split(ref, setup, splits)


def _rank_split(rep, gm) -> list:
    """Per rank of a pipelined row's report: its step, compute, exposed communication and idle seconds, and its
    exposed seconds per collective kind and axis."""
    from partir_torch.contract import META_STAGE

    stage = {n.name: n.meta.get(META_STAGE) for n in gm.graph.nodes}
    sim, out = rep.pipeline, []
    for r in range(sim.ranks):
        d = {"step": sim.step_s[r], "compute": sim.compute_s[r], "exposed": sim.exposed_s[r],
             "idle": sim.step_s[r] - sim.compute_s[r] - sim.exposed_s[r]}
        for c in rep.collectives:
            if stage.get(c.node) == r:
                d[f"exposed {c.kind}[{c.axis}]"] = d.get(f"exposed {c.kind}[{c.axis}]", 0.0) + c.exposed_s
        out.append(d)
    return out


def _extrapolated_split(ref, setup, splits) -> None:
    """The rank whose step is the longest, its split extrapolated to the row's depth, next to the measured step."""
    a, b = _depths(setup)
    L = setup["model"]["layers"]
    r = max(range(len(splits[1])), key=lambda q: splits[1][q]["step"])
    lo, hi = splits[0][r], splits[1][r]
    parts = ", ".join(f"{k} {1e3 * (lo.get(k, 0.0) + (L - a) * (v - lo.get(k, 0.0)) / (b - a)):.0f} ms"
                      for k, v in hi.items())
    print(f"  at {L} blocks (extrapolated), rank {r}: {parts}")
    if ref.unit.startswith("TFLOP"):
        tokens = setup["batch"] * setup["model"]["seq"] / setup["mesh"].get("tp", 1) / setup["mesh"].get("pp", 1)
        step = tokens * flops_per_token(setup["model"], setup["flops"]) / (ref.measured * 1e12)
        print(f"  measured step ({ref.measured:g} {ref.unit}): {1e3 * step:.0f} ms")


def _write_confidence(conf: dict, knobs: dict) -> None:
    """The held-out family errors into sim/confidence.py, and the calibration half's fit they are the errors of into
    sim/fitted.py (the presets carry it: hardware(name))."""
    sim = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "partir_torch", "sim")
    for name, var, items in (("confidence.py", "FAMILY_ERROR", [(f, f"{v:.3f}") for f, v in sorted(conf.items())]),
                             ("fitted.py", "FITTED", [(k, f"{v!r}") for k, v in sorted(knobs.items())])):
        path = os.path.join(sim, name)
        text = open(path).read()
        start, end = text.index(f"{var} = {{"), text.index(f"}}  # end {var}") + 1
        body = f"{var} = {{\n" + "".join(f"    \"{k}\": {v},\n" for k, v in items) + "}"
        open(path, "w").write(text[:start] + body + text[end:])
    print(f"wrote {len(conf)} family errors to confidence.py and the fit to fitted.py in {sim}")


if __name__ == "__main__":
    main()
