"""Expert parallelism on a GShard MoE: what each schedule costs, from the partitioned program and the simulator.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/moe_ep.py

A zoo MoE LM with capacity dispatch (`moe_capacity`) built on `meta`, 8 devices on one axis "data", AdamW, fp32.
Schedules compared side by side in one run: experts replicated (DP), fully sharded (DP + ZeRO-3), expert parallel
(experts and token groups on "data", buffers exchanged by all_to_all) and expert parallel + ZeRO-3 for the dense
parameters. Bytes are read off the lowered program's collective records (per device, full-array convention) and
checked against the analytic all_to_all volume: 4 per MoE layer (dispatch and combine, forward and backward), each
moving the local buffer (B/8, E, C, d). Step time and peak memory are the simulator's, on 8xH100 (NVLink).
"""
from __future__ import annotations

import math
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import partir_torch as pt  # noqa: E402
from partir_torch import tactics as T  # noqa: E402
from examples.models import get  # noqa: E402

CFG = dict(d=1024, heads=16, hidden=4096, experts=8, top_k=2, layers=4, seq=1024, vocab=32768)
BATCH, N = 16, 8
SCHEDULES = {
    "DP": lambda: [T.data_parallel("data")],
    "DP+Z3": lambda: [T.data_parallel("data"), T.zero(3, "data")],
    "EP": lambda: [T.expert_parallel("data")],
    "EP+Z3": lambda: [T.expert_parallel("data"), T.zero(3, "data")],
}


def main():
    warnings.simplefilter("ignore")
    spec = get("moe_capacity", **CFG)
    E, K, T_, d, L = CFG["experts"], CFG["top_k"], CFG["seq"], CFG["d"], CFG["layers"]
    C = min(T_, math.ceil(1.25 * K * T_ / E))
    a2a_analytic = 4 * L * (BATCH // N) * E * C * d * 4
    hw = pt.sim.hardware("h100")
    rows = []
    for name, schedule in SCHEDULES.items():
        model = spec.build(device="meta")
        prog = pt.partition(model, pt.Mesh({"data": N}), schedule(), example_inputs=spec.batch(BATCH, device="meta"),
                            loss_fn=spec.loss_fn, optimizer=torch.optim.AdamW(model.parameters()))
        recs = prog.plan.lowered().records
        by = {}
        for r in recs:
            by[r.kind] = by.get(r.kind, 0) + r.nbytes
        a2a = by.get("all_to_all", 0)
        rep = prog.simulate(hw)
        rows.append([name, f"{sum(by.values()) / 2**20:.1f}",
                     ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(by.items())),
                     f"{a2a / a2a_analytic:.3f}" if a2a else "-",
                     f"{rep.step_time_s * 1e3:.2f}", f"{rep.exposed_comm_s * 1e3:.2f}",
                     f"{rep.peak_memory_bytes / 2**30:.2f}"])
    n_params = sum(p.numel() for p in spec.build(device="meta").parameters())
    print(f"MoE (capacity dispatch) {CFG}, {n_params / 1e6:.0f}M params, global batch {BATCH}, AdamW fp32, "
          f"mesh data={N}; capacity C={C}; simulated on 8x{hw.name}")
    print(tabulate(rows, headers=["schedule", "MiB/step", "by kind (MiB)", "all_to_all / analytic",
                                  "step ms (sim)", "exposed comm ms", "peak GiB/device"]))


if __name__ == "__main__":
    main()
