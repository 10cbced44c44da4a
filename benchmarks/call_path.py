"""The runtime's per-call overhead: train_step, eval_step and forward of a tiny MLP (data parallel on 2 emulated ranks),
where the step's math is negligible and what is timed is the call path (runtime/call.py: guard, signature, cache,
arguments, the interpreted run).

    python benchmarks/call_path.py                       # this checkout: microseconds per call
    python benchmarks/call_path.py --against /work/main  # this checkout and another one, alternately in
                                                         # subprocesses (3 rounds), medians and their ratios
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(calls: int) -> dict:
    """Microseconds per call of each kind, after a warm-up (capture, plan and the first call excluded)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import partir_torch as pt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    loss = lambda m, a, b: F.mse_loss(m(a), b)    # noqa: E731
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [pt.tactics.data_parallel("batch")], (x, y), loss_fn=loss,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    runs = {"train_step": lambda: prog.train_step(x, y), "eval_step": lambda: prog.eval_step(x, y),
            "forward": lambda: prog.forward(x)}
    out = {}
    for k, f in runs.items():
        for _ in range(5):
            f()
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        out[k] = (time.perf_counter() - t0) / calls * 1e6
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--against", default=None, help="another checkout of partir_torch to time alternately")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.against is None or args.json:
        got = measure(args.calls)
        print(json.dumps(got) if args.json else "  ".join(f"{k} {v:.0f} us" for k, v in got.items()))
        return
    trees = {"this": ROOT, "against": os.path.abspath(args.against)}
    times: dict = {t: [] for t in trees}
    for _ in range(args.rounds):
        for tag, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--json", "--calls", str(args.calls)],
                                 env=env, cwd=tree, capture_output=True, text=True, check=True)
            times[tag].append(json.loads(res.stdout.strip().splitlines()[-1]))
    for k in times["this"][0]:
        a = statistics.median(r[k] for r in times["this"])
        b = statistics.median(r[k] for r in times["against"])
        print(f"{k}: this {a:.0f} us, against {b:.0f} us per call, ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
