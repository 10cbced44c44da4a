"""Simulator vs published measurements (/work/shared/reference/hardware.md).

Collectives: all-reduce bus bandwidth, busbw = algbw x 2(n-1)/n (nccl-tests PERFORMANCE.md), for every calibration
row. Training runs: step throughput of four published runs; they need the partitioner (``training_rows``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sim_validation.py
"""
from __future__ import annotations

import statistics

from tabulate import tabulate

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


def training_rows() -> list:
    """End-to-end training runs of hardware.md (MPT-7B on 8xH100 FSDP, Llama-2-13B on 64xA100 FSDP, GPT-1.7B on
    48xH100 DP, MaxText 16B on 256 TPU v5e FSDP with full remat).

    TODO(lead): partition each model with the listed strategy, ``prog.simulate(hardware(...))``, convert step time
    to the measured unit (tokens/s/GPU or TFLOP/s/chip) and return rows like collective_rows():
    (run, unit, ref, sim, delta %, notes, source). Needs the partitioner, so it is empty for now.
    """
    return []


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
    if not train:
        print("\ntraining runs: pending partitioner")
    else:
        print(tabulate(train, headers=["run", "unit", "Ref", "Sim", "Δ%", "notes", "source"]))
        print(f"training: {_stats([r[4] for r in train])}")


if __name__ == "__main__":
    main()
