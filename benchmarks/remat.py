"""Activation checkpointing policies measured: peak live bytes per rank (measured by the runtime, exactly, in
emulation) and step time, for no remat, remat(policy="selective") and remat(policy="full"), side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/remat.py [--layers 4 --d 256 --seq 256 --batch 8 --steps 4]

Zoo GPT (SDPA attention), data parallel on 2 emulated ranks, AdamW; the same batch every step. Times are the median
of the steps after the first, interleaved across the three programs; ratios against no remat.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import partir_torch as pt                 # noqa: E402
from examples.models import get           # noqa: E402

T = pt.tactics


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args(argv)
    spec = get("gpt_sdpa", layers=a.layers, d=a.d, heads=a.d // 64, seq=a.seq, vocab=512)
    batch = spec.batch(a.batch)
    progs = {}
    for name, extra in [("none", []), ("selective", [T.remat("layers.*", policy="selective")]),
                        ("full", [T.remat("layers.*")])]:
        model = spec.build()
        progs[name] = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")] + extra,
                                   example_inputs=batch, loss_fn=spec.loss_fn,
                                   optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   options=pt.Options(measure_memory=True))
    times = {n: [] for n in progs}
    losses = {n: [] for n in progs}
    for _ in range(a.steps):
        for n, p in progs.items():
            t = time.perf_counter()
            losses[n].append(float(p.train_step(*batch)))
            times[n].append(time.perf_counter() - t)
    print(f"gpt layers={a.layers} d={a.d} seq={a.seq} batch={a.batch}, BP on 2 emulated ranks, "
          f"load average {os.getloadavg()[0]:.1f}")
    base_mem = max(progs["none"].peak_memory().values())
    base_t = statistics.median(times["none"][1:])
    for n, p in progs.items():
        peak = max(p.peak_memory().values())
        t = statistics.median(times[n][1:])
        print(f"  {n:9s} peak {peak / 2**20:8.2f} MiB ({peak / base_mem:.3f}x)   step {1e3 * t:8.1f} ms "
              f"({t / base_t:.3f}x)   last loss {losses[n][-1]:.7f}")


if __name__ == "__main__":
    main()
