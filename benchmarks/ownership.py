"""What write-through costs (runtime/owner.py, issue 37 item 1): after every train_step of an emulated program the
held state (parameters, buffers, optimizer moments and step) is written into the eager module and optimizer, so
the module reads as the program holds it (state_dict, deepcopy, torch.save, eager calls).

    python benchmarks/ownership.py [--d 256] [--layers 4] [--steps 6]

The zoo's Llama-style decoder (width d, `layers` blocks, vocab 4096, seq 64, batch 8), AdamW, BP + MP + Z3 on an
emulated {batch: 2, model: 2} mesh. Each round times one train_step (which includes its write-through) and, right
after, the write-through alone (HeldState._write: every state value assembled from its shards into the module and
optimizer in place), interleaved; prints the medians and their ratio: the share of a step the write-through costs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    import partir_torch as pt
    from examples.models import get

    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    torch.manual_seed(0)
    spec = get("llama", d=a.d, layers=a.layers, hidden=2 * a.d, heads=4, kv_heads=2, vocab=4096, seq=64)
    model = spec.build()
    batch = spec.batch(8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    T = pt.tactics
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}),
                        [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")],
                        example_inputs=batch, loss_fn=spec.loss_fn, optimizer=opt)
    prog.train_step(*batch)                                   # warm-up
    held = prog.executor.held()
    step_s, write_s = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        prog.train_step(*batch)
        t1 = time.perf_counter()
        held._write(model, opt)
        t2 = time.perf_counter()
        step_s.append(t1 - t0)
        write_s.append(t2 - t1)
    n = sum(p.numel() for p in model.parameters())
    s, w = statistics.median(step_s), statistics.median(write_s)
    print(f"llama d={a.d} layers={a.layers}: {n / 1e6:.2f} M parameters, BP+MP+Z3 on 2x2 emulated, AdamW; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"train_step {s * 1e3:.1f} ms (median of {a.steps}), write-through {w * 1e3:.1f} ms: {w / s:.1%} of a step")


if __name__ == "__main__":
    main()
