"""What a new input shape costs (issue 22): train_step at a new sequence length captures, plans and lowers the step
again (runtime/shapes.py). Prints, from prog.shapes(), each program's capture / plan / lowering seconds and its
total relative to the first partition's (the example inputs' program), measured in one run.

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
    for n in (32, 48, 40, 64):
        prog.train_step(*spec.batch(8, seq=n, layers=args.layers, d=args.d))
    rows = {r.signature[0][0]: r for r in prog.shapes()}
    first = rows[(8, 32)].seconds
    print(f"gpt layers={args.layers} d={args.d}, BP+MP+Z3 on 2x2 (emulated), nodes in the step: "
          f"{len(prog.captured.gm.graph.nodes)}")
    for shape, r in rows.items():
        print(f"  {shape}: capture {r.capture_s:.2f} s, plan {r.plan_s:.2f} s, lower {r.lower_s:.2f} s = "
              f"{r.seconds:.2f} s ({r.seconds / first:.0%} of the first)")


if __name__ == "__main__":
    main()
