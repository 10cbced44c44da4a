"""What a new input shape costs (issue 22): train_step at a second sequence length captures, plans and lowers the
step again (runtime/shapes.py), and makes the length and the batch dim symbols (runtime/dims.py: one symbolic trace
for the guards, programs partitioned at the other corners of a grid of two sizes per symbol and one point off it,
fitted as one program); every later length is an instance of it.
Prints, from prog.shapes(), each program's capture / plan / lowering (instances: instantiation) seconds, the
symbolic dim's one-off cost, and each total relative to the first partition's and to the first capture's (the
example inputs' program), measured in one run.

    OMP_NUM_THREADS=1 python benchmarks/new_shape.py [--layers 2] [--d 32]
"""
from __future__ import annotations

import argparse
import warnings

import torch

import partir_torch as pt
from examples.models import get

T = pt.tactics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d", type=int, default=32)
    args = ap.parse_args()
    spec = get("gpt")
    model = spec.build(seq=64, layers=args.layers, d=args.d)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warnings.simplefilter("ignore")
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}),
                        [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")],
                        example_inputs=spec.batch(8, seq=32, layers=args.layers, d=args.d), loss_fn=spec.loss_fn,
                        optimizer=opt)
    for n in (32, 48, 40, 64, 56, 24, 36, 60):
        prog.train_step(*spec.batch(8, seq=n, layers=args.layers, d=args.d))
    rows = {r.signature[0][0]: r for r in prog.shapes()}
    first, cap = rows[(8, 32)].seconds, rows[(8, 32)].capture_s
    print(f"gpt layers={args.layers} d={args.d}, BP+MP+Z3 on 2x2 (emulated), nodes in the step: "
          f"{len(prog.captured.gm.graph.nodes)}")
    t = lambda x: "-" if x is None else f"{x:.2f} s"   # noqa: E731
    for shape, r in rows.items():
        kind = "instance" if r.instance_of is not None else "partitioned"
        extra = f" + symbolic dim {r.symbolic_s:.2f} s" if r.symbolic_s else ""
        own = r.seconds - (r.symbolic_s or 0)
        print(f"  {shape} {kind}: capture {t(r.capture_s)}, plan {t(r.plan_s)}, lower {t(r.lower_s)} = {own:.3f} s "
              f"({own / first:.1%} of the first partition, {own / cap:.1%} of its capture){extra}")


if __name__ == "__main__":
    main()
