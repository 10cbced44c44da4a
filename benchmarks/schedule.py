"""What lowering's scheduling does to a large plan (issue 19): Llama3-70B with every layer rematerialised, the
expert schedule of benchmarks/auto.py (BP + ZeRO-3 on "batch", Megatron + SP + ZeRO-3 on "model", bf16 compute /
fp32 master), mesh {batch: 8, model: 8} on 8 nodes of 8 H100, simulated (the model is built on `meta`).

One row per scheduling option set (partition's prefetch / reduce_in_flight, lower/schedule.py): the simulator's
peak memory per device and its breakdown, and the step time under each issue policy: "program" (what partir's
runtime executes: the program's own order, the default of prog.simulate), "ready" and "prefetch" (what-ifs for
another runtime, sim/timeline.py). prefetch=0 reduce_in_flight=0 is the program before scheduling: gathers at their
use, gradient reductions waited for where the update reads them.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/schedule.py            # ~2.5 min on 2 CPU cores
"""
from __future__ import annotations

import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import partir_torch as pt                                       # noqa: E402
from partir_torch import tactics as T                           # noqa: E402
from partir_torch.capture import capture                        # noqa: E402
from partir_torch.options import Options                        # noqa: E402
from partir_torch.plan import plan                              # noqa: E402
from partir_torch.sim import simulate_graph                     # noqa: E402

import auto as A                                                # noqa: E402
from examples.zoo import sim_decoder as M                                       # noqa: E402

VARIANTS = ((0, 0), (1, 0), (0, 1), (1, 1), (2, 2))


def main() -> None:
    warnings.simplefilter("ignore")
    build, batch, seq = A.models()["llama3-70b+remat"]
    model = build()
    tokens = torch.zeros(batch, seq, dtype=torch.int64, device="meta")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rewrites = [T.mixed_precision(torch.bfloat16), T.remat("layers.*")]
    captured = capture(model, (tokens, tokens), M.loss_fn, opt, rewrites, {})
    hw = pt.sim.hardware("h100", nodes=8)
    mesh = pt.Mesh(A.MESH)
    expert = rewrites + [T.data_parallel("batch"), T.megatron("model"), T.sequence_parallel("model"),
                         T.zero(3, "batch")]
    print(f"llama3-70b+remat, batch {batch} x seq {seq}, {A.MESH} on {hw.describe()}; expert schedule "
          f"BP+Z3[batch] MP+SP[model]", flush=True)
    for pf, rif in VARIANTS:
        t0 = time.perf_counter()
        low = plan(captured, mesh, expert, Options(prefetch=pf, reduce_in_flight=rif)).annotated_lowered()
        steps = {}
        for issue in ("program", "ready", "prefetch"):
            rep = simulate_graph(low.gm, mesh, hw, issue=issue)
            steps[issue] = (rep.step_time_s, rep.exposed_comm_s)
        print(f"prefetch={pf} reduce_in_flight={rif}: peak {rep.peak_memory_bytes / 1e9:.1f} GB "
              f"[{A.breakdown(rep)}]; step ms (exposed) " +
              ", ".join(f"{k} {s * 1e3:.0f} ({e * 1e3:.0f})" for k, (s, e) in steps.items()) +
              f"   [{time.perf_counter() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
