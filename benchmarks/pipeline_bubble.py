"""Simulated pipeline bubble of uniform stages per schedule (issue 24): 1F1B, Interleaved1F1B (2 stages per rank) and
ZBVZeroBubble (2 stages per rank in a V, backwards split into B and W) at the same p and m, next to the textbook
figure ((p - 1) / (v m + p - 1); ZB-V: 0 when F = B = W).

The model: equal residual blocks x + tanh(x W) of width d (each block's input-gradient matmul and weight-gradient
matmul cost the same, so B = W; 4 p blocks), on the meta device, rows per micro-batch large enough that a stage's compute
dwarfs its transfers; simulated on H100s (gpus_per_node = p, NVLink transfers).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/pipeline_bubble.py [--p 2 4] [--m 8 16] [--actions]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import partir_torch as pt

T = pt.tactics


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Stack(nn.Module):
    """Equal blocks; the scale in front makes the first block compute its input gradient as the others do."""

    def __init__(self, d, n):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        x = x * self.scale
        for b in self.blocks:
            x = b(x)
        return x


def simulated(p: int, m: int, schedule: str, d: int = 4096, rows: int = 1024):
    """The PipelineSim of `schedule` on {pp: p} with m micro-batches of `rows` rows; 4 p blocks whatever the
    schedule (so each rank's work is the same)."""
    stages = p if schedule in ("GPipe", "1F1B") else 2 * p
    with torch.device("meta"):
        model = Stack(d, 4 * p)
        x, y = torch.randn(m * rows, d), torch.randn(m * rows, d)
    prog = pt.partition(model, pt.Mesh({"pp": p}), [T.pipeline("pp", stages, schedule, m)], example_inputs=(x, y),
                        loss_fn=lambda mod, x, y: F.mse_loss(mod(x), y),
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return prog.simulate(pt.sim.hardware("h100", gpus_per_node=p)).pipeline


def action_means(sim) -> str:
    """Per stage, the mean simulated time of its F, B and W actions (an empty action has no span)."""
    by: dict = {}
    for (stage, kind, _), (_, t0, t1) in sim.spans.items():
        if stage is not None and kind in ("F", "B", "W"):
            by.setdefault((stage, kind), []).append(t1 - t0)
    rows = []
    for stage in sorted({s for s, _ in by}):
        cells = [f"{k} {1e3 * sum(by[(stage, k)]) / len(by[(stage, k)]):.3f} ({len(by[(stage, k)])})"
                 if (stage, k) in by else f"{k} -" for k in "FBW"]
        rows.append(f"  stage {stage}: " + ", ".join(cells))
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--m", type=int, nargs="+", default=[8])
    ap.add_argument("--actions", action="store_true", help="ZB-V's mean F / B / W time per stage instead")
    args = ap.parse_args()
    if args.actions:
        for p in args.p:
            for m in args.m:
                print(f"p {p}, m {m}, ZBVZeroBubble: mean ms per stage and action (n actions)")
                print(action_means(simulated(p, m, "ZBVZeroBubble")))
        return
    print(f"{'p':>2} {'m':>3}  {'schedule':<16} {'bubble':>7}  {'textbook':>8}  busy per rank (ms)")
    for p in args.p:
        for m in args.m:
            for schedule in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
                sim = simulated(p, m, schedule)
                busy = ", ".join(f"{1e3 * b:.2f}" for b in sim.busy_s)
                print(f"{p:>2} {m:>3}  {schedule:<16} {100 * sim.bubble:6.1f}%  {100 * sim.formula:7.1f}%  {busy}")


if __name__ == "__main__":
    main()
