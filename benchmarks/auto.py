"""The automatic tactic against expert schedules on large models (issue 13).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/auto.py                 # all models
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/auto.py llama3-8b moe   # some of them

Models built on `meta` (nothing allocated), AdamW, bf16 compute with fp32 master weights (mixed_precision), mesh
{"batch": 8, "model": 8} on 8 nodes of 8 H100 ("model" inside a node, on NVLink). For each model the step is
captured once and partitioned with:

- expert: torchtitan's FSDP + TP + SP recipe, [data_parallel(batch), megatron(model), sequence_parallel(model),
  zero(3, batch)]; for the MoE, expert parallelism on "model" instead of TP: [data_parallel(batch),
  expert_parallel(model), zero(3, batch)];
- auto-model: [data_parallel(batch), automatic("model")];
- auto-both: [automatic(["batch", "model"])];
- llama3-70b+remat: Llama3-70B again with every layer checkpointed (remat("layers.*"), at capture, for the expert and
  the searches alike);

each automatic schedule at memory limits of 80 GB and 40 GB. ``--partition NAME``: instead, pt.partition() of the
model with [mixed_precision, automatic(["batch", "model"])] at 80 GB and nothing else (no remat from the
user: partition() recomputes where no plan fits, tactics/recompute.py), printing its search report. Printed per case: simulated step time of auto and of
the expert and their ratio, peak memory against the limit, search wall time, candidates estimated and lowered, the
rank correlation of the fast estimate with the simulator over the lowered candidates, and the plan chosen.
"""
from __future__ import annotations

import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import partir_torch as pt                                             # noqa: E402
from partir_torch import tactics as T                                 # noqa: E402
from partir_torch.api import partition                                # noqa: E402
from partir_torch.capture import capture                              # noqa: E402
from partir_torch.capture.graphutil import no_gc                      # noqa: E402
from partir_torch.plan import plan                                    # noqa: E402
from partir_torch.program import Program                              # noqa: E402
from partir_torch.propagate.graph import PartGraph                    # noqa: E402
from partir_torch.rules.registry import default_registry              # noqa: E402

from examples.zoo import sim_decoder as M                                             # noqa: E402

MESH = {"batch": 8, "model": 8}
LIMITS = (80e9, 40e9)


def models() -> dict:
    """name -> (build(), global batch, seq): dense models one sequence per batch group, the MoE one per device (its
    token groups are tiled on both axes under expert parallelism)."""
    from examples.models.moe import MoELM, MoEConfig

    def dense(**c):
        return lambda: M.build(M.DecoderConfig(**c))

    def moe():
        with torch.device("meta"):
            return MoELM(MoEConfig(vocab=32000, seq=2048, d=2048, heads=16, layers=16, experts=8, top_k=2,
                                   hidden=8192, dispatch="capacity"))
    return {
        "gpt-39b": (dense(vocab=51200, seq=2048, d=8192, heads=64, layers=48), 8, 2048),
        "llama3-8b": (dense(vocab=128256, seq=8192, d=4096, heads=32, kv_heads=8, layers=32, hidden=14336,
                            gated=True, tied=False), 8, 8192),
        "llama3-70b": (dense(vocab=128256, seq=8192, d=8192, heads=64, kv_heads=8, layers=80, hidden=28672,
                             gated=True, tied=False), 8, 8192),
        # the same with every layer checkpointed (torchtitan's 70B recipe uses full activation checkpointing):
        # without it no plan of these two axes holds the activations of seq 8192 (the expert needs 104 GB)
        "llama3-70b+remat": (dense(vocab=128256, seq=8192, d=8192, heads=64, kv_heads=8, layers=80, hidden=28672,
                                   gated=True, tied=False), 8, 8192),
        "moe-16x8": (moe, 64, 2048),
    }


def run_schedule(captured, model, opt, mesh, schedule, rewrites=()) -> Program:
    """partition() on an already captured step: the step is captured once per model (with `rewrites`, the capture
    rewrites every schedule of the model shares) and planned per schedule."""
    return Program(plan(captured, mesh, list(rewrites) + list(schedule)), model, opt, M.loss_fn)


def simulate_last(prog, hw):
    from partir_torch.sim import simulate_graph

    low = prog.plan.annotated_lowered()
    return simulate_graph(low.gm, prog.mesh, hw)


def breakdown(rep) -> str:
    """The simulator's memory at the peak by category (sim/memory.py), largest first."""
    parts = sorted(rep.memory_breakdown.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in parts if v >= 0.05e9)


def main(names) -> None:
    warnings.simplefilter("ignore")
    hw = pt.sim.hardware("h100", nodes=8)
    mesh = pt.Mesh(MESH)
    rows, pairs = [], []
    print(f"mesh {MESH} on {hw.describe()}; AdamW, bf16 compute / fp32 master (mixed_precision); memory limits "
          f"{', '.join(f'{x / 1e9:.0f} GB' for x in LIMITS)}; budget 60 s per search", flush=True)
    for name, (build, batch, seq) in models().items():
        if names and name not in names:
            continue
        model = build()
        nparams = sum(p.numel() for p in model.parameters())
        tokens = torch.zeros(batch, seq, dtype=torch.int64, device="meta")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        t0 = time.perf_counter()
        rewrites = [T.mixed_precision(torch.bfloat16)] + ([T.remat("layers.*")] if name.endswith("+remat") else [])
        captured = capture(model, (tokens, tokens), M.loss_fn, opt, rewrites, {})
        with no_gc():
            graph = PartGraph(captured.gm, default_registry(), captured.names, captured.ties)
        print(f"\n{name}: {nparams / 1e9:.1f}B parameters, batch {batch} x seq {seq}, {len(graph.values)} values; "
              f"captured in {time.perf_counter() - t0:.1f} s", flush=True)
        if hasattr(model, "layers") and hasattr(model.layers[0], "moe"):
            expert = [T.data_parallel("batch"), T.expert_parallel("model"), T.zero(3, "batch")]
            expert_name = "BP+Z3[batch] EP[model]"
        else:
            expert = [T.data_parallel("batch"), T.megatron("model"), T.sequence_parallel("model"),
                      T.zero(3, "batch")]
            expert_name = "BP+Z3[batch] MP+SP[model]"
        t0 = time.perf_counter()
        eprog = run_schedule(captured, model, opt, mesh, expert, rewrites)
        erep = simulate_last(eprog, hw)
        print(f"  expert {expert_name}: step {erep.step_time_s * 1e3:.1f} ms, peak "
              f"{erep.peak_memory_bytes / 1e9:.1f} GB (partition + lowering + simulation "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
        print(f"    memory at the peak: {breakdown(erep)}", flush=True)
        # the schedule-1 reference with the same fixed prefix as the search (no ZeRO on "batch")
        if expert_name.endswith("MP+SP[model]"):
            same = [T.data_parallel("batch"), T.megatron("model"), T.sequence_parallel("model")]
        else:
            same = [T.data_parallel("batch"), T.expert_parallel("model")]
        srep = simulate_last(run_schedule(captured, model, opt, mesh, same, rewrites), hw)
        print(f"  same prefix as BP[batch] + auto[model] ({' + '.join(t.name for t in same)}): step "
              f"{srep.step_time_s * 1e3:.1f} ms, peak {srep.peak_memory_bytes / 1e9:.1f} GB", flush=True)
        for sched_name, make in (("BP[batch] + auto[model]",
                                  lambda lim: [T.data_parallel("batch"),
                                               T.automatic("model", hardware=hw, memory_limit=lim)]),
                                 ("auto[batch,model]",
                                  lambda lim: [T.automatic(["batch", "model"], hardware=hw, memory_limit=lim)])):
            for lim in LIMITS:
                t0 = time.perf_counter()
                prog = run_schedule(captured, model, opt, mesh, make(lim), rewrites)
                wall = time.perf_counter() - t0
                rep = prog.search_reports[-1]
                c = rep.chosen
                r = c.sim
                ratio = r.step_time_s / erep.step_time_s
                rho = "-" if rep.rank_correlation is None else f"{rep.rank_correlation:.2f}"
                row = [name, sched_name, f"{lim / 1e9:.0f}", f"{r.step_time_s * 1e3:.1f}",
                       f"{erep.step_time_s * 1e3:.1f}", f"{ratio:.3f}",
                       f"{r.peak_memory_bytes / 1e9:.1f}", f"{erep.peak_memory_bytes / 1e9:.1f}",
                       "yes" if r.peak_memory_bytes <= lim else "NO",
                       f"{rep.seconds['total']:.1f}", rep.evaluated, len(rep.lowered), rho, c.label()]
                row.insert(6, f"{r.step_time_s / srep.step_time_s:.3f}" if sched_name.startswith("BP") else "-")
                rows.append(row)
                pairs += [(x.est_step_s, x.sim.step_time_s) for x in rep.lowered]
                print("  " + " | ".join(str(x) for x in row), flush=True)
                print(f"    memory at the peak: {breakdown(r)}", flush=True)
                print("    " + rep.table(top=4).replace("\n", "\n    "), flush=True)
    from tabulate import tabulate

    print()
    print(tabulate(rows, headers=["model", "schedule", "limit GB", "auto ms", "expert ms", "auto/expert",
                                  "auto/same prefix", "auto GB", "expert GB", "fits", "search s", "estimated",
                                  "lowered", "rho", "plan"], tablefmt="github"))
    from partir_torch.tactics.auto import _spearman

    rho = _spearman([p[0] for p in pairs], [p[1] for p in pairs])
    print(f"fast estimate vs simulator over all {len(pairs)} lowered candidates of the run (Spearman): "
          f"{'n/a' if rho is None else f'{rho:.2f}'}")
    ok_ratio = all(float(r[5]) <= 1.0 for r in rows)
    ok_mem = all(r[9] == "yes" for r in rows)
    ok_time = all(float(r[10]) <= 60 for r in rows)
    print(f"ratio <= 1.00 in every case: {'met' if ok_ratio else 'missed'}; no memory violation: "
          f"{'met' if ok_mem else 'missed'}; search <= 60 s: {'met' if ok_time else 'missed'}")


def no_help(name: str, limit: float = 80e9) -> None:
    """pt.partition() as a user calls it: the automatic tactic over both axes, recomputation left to it."""
    warnings.simplefilter("ignore")
    build, batch, seq = models()[name]
    model = build()
    tokens = torch.zeros(batch, seq, dtype=torch.int64, device="meta")
    hw = pt.sim.hardware("h100", nodes=8)
    t0 = time.perf_counter()
    prog = partition(model, pt.Mesh(MESH), [T.mixed_precision(torch.bfloat16),
                                            T.automatic(["batch", "model"], hardware=hw, memory_limit=limit,
                                                        progress=False)],
                     example_inputs=(tokens, tokens), loss_fn=M.loss_fn,
                     optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    rep = prog.search_reports[-1]
    print(f"{name}: partition() in {time.perf_counter() - t0:.1f} s; chose {rep.chosen.label()}: step "
          f"{rep.chosen.sim.step_time_s * 1e3:.1f} ms, peak {rep.chosen.sim.peak_memory_bytes / 1e9:.1f} GB of "
          f"{limit / 1e9:.0f} GB ({'fits' if rep.within_limit else 'DOES NOT FIT'})")
    print(rep.table(top=4))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--partition"]:
        no_help(sys.argv[2])
    else:
        main(sys.argv[1:])
