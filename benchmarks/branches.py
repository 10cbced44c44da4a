"""Issue 26: what a branch on a tensor value costs per step once its path is cached.

Two models, each partitioned (data_parallel on 2 emulated ranks, AdamW) with and without its branch, timed side by
side, interleaved, in one process:
- layerdrop: M2M100's `if self.training and torch.rand([]) < self.layerdrop:` before each of the layers (residual
  blocks with dropout inside them, `h = layer(h)` as in HF): gated in one program (capture/gates.py), every layer
  computed at every step; the reference is the same model without the draw and the `if`; `--paths`: with the gates
  disabled, one program per combination of skipped layers (capture/branches.py; at layerdrop 0.0 one path);
- padding: FSMT's `if not padding_mask.any():` on the batch's mask (padding in every batch: one path); the
  reference has no `if`.
The branch's cost is its guard programs (paths.py; the gates' draws, gates.py): on one device, every step.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/branches.py [--steps 30] [--d 256] [--layers 6]
    ... benchmarks/branches.py --layerdrop 0.1           # gated: one program whatever the layers skipped
    ... benchmarks/branches.py --layerdrop 0.1 --paths   # paths keep coming: what a capture per new path costs
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import torch
import torch.nn as nn

import partir_torch as pt
from partir_torch.capture import gates


class Residual(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, h):
        return h + self.f(h)


class Net(nn.Module):
    def __init__(self, d, layers, branch, layerdrop=0.0):
        super().__init__()
        self.emb = nn.Linear(d, d)
        self.layers = nn.ModuleList(Residual(d) for _ in range(layers))
        self.head = nn.Linear(d, 1)
        self.drop = nn.Dropout(0.1)
        self.branch, self.layerdrop = branch, layerdrop

    def forward(self, x, mask):
        h = self.drop(self.emb(x))
        if self.branch == "padding" and not mask.any():
            h = h * 2
        for layer in self.layers:
            if self.branch == "layerdrop":
                if self.training and torch.rand([]) < self.layerdrop:
                    continue
            h = layer(h)
        return self.head(h).pow(2).mean()


def _prog(branch, args, batch):
    torch.manual_seed(0)
    model = Net(args.d, args.layers, branch, args.layerdrop)
    with warnings.catch_warnings(), (gates.disabled() if args.paths else contextlib.nullcontext()):
        warnings.simplefilter("ignore")     # each new path says so once
        return pt.partition(model, pt.Mesh({"batch": 2}), [pt.tactics.data_parallel("batch")], example_inputs=batch,
                            loss_fn=lambda m, x, k: m(x, k), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layerdrop", type=float, default=0.0, help="> 0: new paths keep coming (2^layers of them)")
    ap.add_argument("--paths", action="store_true", help="layerdrop as paths (the gates disabled)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")         # a new path says so once per path: counted below instead
    x = torch.randn(args.batch, args.seq, args.d)
    mask = torch.zeros(args.batch, args.seq, dtype=torch.bool)
    mask[0, -3:] = True
    batch = (x, mask)
    print(f"d={args.d} layers={args.layers} batch={args.batch}x{args.seq}, data_parallel on 2 emulated ranks, "
          f"{args.steps} timed steps each (interleaved, after 2 warm-up steps); median per step")
    for branch in ("layerdrop", "padding") if args.layerdrop == 0 else ("layerdrop",):
        progs = {"with branch": _prog(branch, args, batch), "without": _prog("none", args, batch)}
        times = {k: [] for k in progs}
        for p in progs.values():
            for _ in range(2):
                p.train_step(*batch)
        for _ in range(args.steps):
            for k, p in progs.items():
                t0 = time.perf_counter()
                p.train_step(*batch)
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        total = {k: sum(v) for k, v in times.items()}
        n_paths = len(progs["with branch"].shapes())
        cap = progs["with branch"].captured
        how = f"{len(cap.gates.gates)} gate(s)" if cap.gates is not None else f"{len(cap.guards)} guard(s)"
        print(f"{branch:10s} with branch {med['with branch'] * 1e3:7.1f} ms  without {med['without'] * 1e3:7.1f} ms  "
              f"ratio {med['with branch'] / med['without']:.3f}  ({how}, {n_paths} program(s)); "
              f"all {args.steps} steps {total['with branch']:.1f} s vs {total['without']:.1f} s")


if __name__ == "__main__":
    main()
