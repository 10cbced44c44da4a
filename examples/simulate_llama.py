"""Predict step time, memory and communication of a 7B-class Llama for several schedules, before running anything.

The model is built on the `meta` device (no memory), captured and partitioned for 8 devices, then simulated on
8xH100 (one NVSwitch node) and on a TPU v5p slice (2x2x2). Run: python examples/simulate_llama.py [layers]
"""
from __future__ import annotations

import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import partir_torch as pt  # noqa: E402
from partir_torch import tactics as T  # noqa: E402
from examples.models import llama  # noqa: E402

LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 32
CFG = dict(vocab=32000, seq=2048, d=4096, heads=32, kv_heads=32, layers=LAYERS, hidden=11008)
BATCH = 8   # global sequences per step


def schedules():
    return {
        "FSDP (8)": (pt.Mesh({"batch": 8}), [T.data_parallel("batch"), T.zero(3, "batch")]),
        "FSDP (4) + TP (2)": (pt.Mesh({"batch": 4, "model": 2}),
                              [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")]),
        "DP (4) + TP (2) + SP": (pt.Mesh({"batch": 4, "model": 2}),
                                 [T.data_parallel("batch"), T.megatron("model"), T.sequence_parallel("model")]),
    }


def main():
    warnings.simplefilter("ignore")
    hws = {"8xH100": pt.sim.hardware("h100"), "TPU v5p 2x2x2": pt.sim.hardware("tpu-v5p", topology=(2, 2, 2))}
    rows = []
    for name, (mesh, sched) in schedules().items():
        t0 = time.time()
        model = llama.build(device="meta", **CFG).to(torch.bfloat16)
        tokens = torch.zeros(BATCH, CFG["seq"], dtype=torch.int64, device="meta")
        prog = pt.partition(model, mesh, sched, example_inputs=(tokens, tokens), loss_fn=llama.loss_fn,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4))
        for hw_name, hw in hws.items():
            r = prog.simulate(hw)
            kinds = ", ".join(f"{k} {n}" for k, (n, _, _) in sorted(r.collectives_by_kind().items()))
            rows.append([name, hw_name, f"{r.step_time_s * 1e3:.0f}", f"{r.compute_s * 1e3:.0f}",
                         f"{r.exposed_comm_s * 1e3:.0f}", f"{r.peak_memory_bytes / 2**30:.1f}", f"{r.mfu * 100:.1f}",
                         kinds])
        print(f"{name}: partitioned and simulated in {time.time() - t0:.1f} s", flush=True)
        print(r.table())
    print(f"\nLlama {LAYERS} layers, d 4096, seq 2048, global batch {BATCH}, bf16, AdamW")
    print(tabulate(rows, headers=["schedule", "hardware", "step ms", "compute ms", "exposed comm ms",
                                  "peak GiB/device", "MFU %", "collectives"]))


if __name__ == "__main__":
    main()
