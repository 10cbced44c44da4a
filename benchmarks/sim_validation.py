"""Simulator vs published measurements (/work/shared/reference/hardware.md).

Collectives: all-reduce bus bandwidth, busbw = algbw x 2(n-1)/n (nccl-tests PERFORMANCE.md), for every calibration
row. Training runs: step throughput of four published runs, reconstructed as models and schedules
(``training_rows``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sim_validation.py
"""
from __future__ import annotations

import statistics

import os
import sys

from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from partir_torch.mesh import Mesh
from partir_torch.sim import estimate, hardware

MiB, GiB = 2 ** 20, 2 ** 30
SIZES = [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB, 8 * GiB]
LARGE = 8 * GiB            # size used for the "large-message" rows (nccl-tests' usual maximum)

# (setup, hardware, overrides, forced algorithm or None, {size: measured busbw GB/s}, source)
COLLECTIVE_ROWS = [
    ("8xA100-80G", "a100-80g", {}, None,
     dict(zip(SIZES, [36.2, 71.4, 109.2, 166.6, 213.9, 228.1, 231.6])), "Azure ND A100 v4, NCCL 2.18"),
    ("8xH200 (NVLS)", "h200", {}, None,
     dict(zip(SIZES, [53.0, 138.4, 240.4, 368.1, 432.2, 467.6, 480.0])), "Azure ND H200 v5, NCCL 2.20"),
    ("8xA100", "a100-80g", {}, None, {LARGE: 232}, "GTC'25 S72583"),
    ("8xH100 SHARP", "h100", {}, "nvls", {LARGE: 480}, "GTC'25 S72583"),
    ("8xH100 ring", "h100", {}, "ring", {LARGE: 370}, "GTC'25 S72583"),
    ("32xH100 (4 DGX)", "h100", {"nodes": 4}, None, {LARGE: 370}, "GTC'25 S72583"),
    ("32xH100 SHARP", "h100", {"nodes": 4, "ib_sharp": True}, None, {LARGE: 480}, "GTC'25 S72583"),
]


def collective_rows() -> list:
    """[(setup, size, ref GB/s, sim GB/s, delta %, algorithm, source)] for every all-reduce calibration point."""
    rows = []
    for setup, name, overrides, algorithm, points, source in COLLECTIVE_ROWS:
        hw = hardware(name, **overrides)
        n = hw.num_devices
        mesh = Mesh({"dp": n})
        for size, ref in points.items():
            est = estimate(hw, "all_reduce", size, mesh, "dp", algorithm=algorithm)
            busbw = size / est.time_s * 2 * (n - 1) / n / 1e9
            rows.append((setup, size, ref, busbw, 100 * (busbw - ref) / ref, est.tactic, source))
    return rows


# (run, model builder name, config, hardware, overrides, mesh size, global batch, unit, measured, notes, source)
TRAINING_RUNS = [
    ("MPT-7B FSDP", "gpt", dict(vocab=50368, seq=2048, d=4096, heads=32, layers=32, attention="sdpa"),
     "h100", {}, 8, 48, "tokens/s/GPU", 10643, "micro-batch 6, bf16, no AC", "llm-foundry benchmarking"),
    ("Llama-2-13B FSDP", "llama", dict(vocab=32000, seq=4096, d=5120, heads=40, kv_heads=40, layers=40,
                                       hidden=13824),
     "a100-80g", {"nodes": 8}, 64, 128, "tokens/s/GPU", 2162, "local batch 2, bf16, no AC", "torchtitan"),
    ("GPT-1.7B DP48", "gpt", dict(vocab=131072, seq=4096, d=2048, heads=16, layers=24, attention="sdpa"),
     "h100", {"nodes": 6}, 48, 192, "TFLOP/s/GPU", 408.8, "TP1, global batch 192", "Megatron-LM README"),
    ("MaxText-16B FSDP", "llama", dict(vocab=32000, seq=2048, d=4096, heads=64, kv_heads=64, layers=32,
                                       hidden=28672),
     "tpu-v5e", {"topology": (16, 16)}, 256, 1536, "TFLOP/s/chip", 120.0,
     "per-device batch 6, full remat",
     "maxtext v5e README"),
]


def training_rows() -> list:
    """End-to-end training runs of hardware.md, each reconstructed as a model (built on `meta`) and a schedule
    (bf16 mixed precision; data parallel + ZeRO-3 = FSDP, or plain data parallel; remat where the run used it),
    partitioned and simulated.
    Returns rows like collective_rows(): (run, unit, ref, sim, delta %, notes, source)."""
    import warnings

    import torch

    import partir_torch as pt
    from partir_torch import tactics as T
    from examples.models import get

    warnings.simplefilter("ignore")
    rows = []
    for run, model, cfg, hw_name, overrides, n, batch, unit, ref, notes, source in TRAINING_RUNS:
        spec = get(model, **cfg)
        m = spec.build(device="meta")
        tokens = torch.zeros(batch, cfg["seq"], dtype=torch.int64, device="meta")
        sched = [T.mixed_precision(torch.bfloat16), T.data_parallel("dp")]
        sched += [T.zero(3, "dp")] if "FSDP" in run else []
        sched += [T.remat("layers.*")] if "remat" in notes and "without" not in notes else []
        prog = pt.partition(m, pt.Mesh({"dp": n}), sched, example_inputs=(tokens, tokens), loss_fn=spec.loss_fn,
                            optimizer=torch.optim.AdamW(m.parameters(), lr=1e-4))
        r = prog.simulate(hardware(hw_name, **overrides))
        local_tokens = batch // n * cfg["seq"]
        sim = local_tokens / r.step_time_s if unit.startswith("tokens") else r.model_flops / r.step_time_s / 1e12
        rows.append((run, unit, ref, sim, 100 * (sim - ref) / ref, notes, source))
    return rows


def _size(b: int) -> str:
    return f"{b // GiB} GiB" if b >= GiB else f"{b // MiB} MiB"


def _stats(deltas) -> str:
    if not deltas:
        return "n/a"
    absd = [abs(d) for d in deltas]
    return f"mean |d| {statistics.mean(absd):.1f}%, max |d| {max(absd):.1f}% ({len(absd)} rows)"


def main():
    rows = collective_rows()
    table = [(s, _size(b), f"{r:.1f}", f"{m:.1f}", f"{d:+.1f}%", a, src) for s, b, r, m, d, a, src in rows]
    print("All-reduce bus bandwidth (GB/s): reference vs simulator")
    print(tabulate(table, headers=["setup", "size", "Ref", "Sim", "Δ%", "algorithm", "source"]))
    print(f"\nall sizes:   {_stats([d for *_, d, _, _ in rows])}")
    print(f"size >= 16 MiB: {_stats([d for _, b, _, _, d, _, _ in rows if b >= 16 * MiB])}")
    train = training_rows()
    print("\nEnd-to-end training runs: reference vs simulator")
    print(tabulate([(r, u, f"{ref:.1f}", f"{sim:.1f}", f"{d:+.1f}%", n, src) for r, u, ref, sim, d, n, src in train],
                   headers=["run", "unit", "Ref", "Sim", "Δ%", "notes", "source"]))
    print(f"training: {_stats([r[4] for r in train])}")


if __name__ == "__main__":
    main()
