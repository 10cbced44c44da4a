"""Measured peak (prog.peak_memory(), partition(..., measure_memory=True)) of ZeRO-1/2/3 against data parallelism
on the zoo's small gpt and llama (0.4 MB of parameters), with the default buckets and with bucket_bytes=0, on 2 and
4 emulated ranks (issue 37). Printed per row: model, ranks, BP's peak in bytes, then (ZeRO stage, bucket_bytes,
peak / BP's peak).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/zero_buckets.py gpt llama
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import partir_torch as pt                                             # noqa: E402
from examples.models import get                                       # noqa: E402

T = pt.tactics


def peak(name, tactics, n, **kw) -> int:
    spec = get(name)
    torch.manual_seed(0)
    model, data = spec.build(), spec.batch(4)
    prog = pt.partition(model, pt.Mesh({"batch": n}), tactics, example_inputs=data, loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                        options=pt.Options(measure_memory=True, **kw))
    prog.train_step(*data)
    prog.train_step(*data)
    return max(prog.peak_memory().values())


def main(names) -> None:
    warnings.simplefilter("ignore")
    for name in names:
        for n in (2, 4):
            bp = peak(name, [T.data_parallel("batch")], n)
            row = [name, n, bp]
            for stage in (1, 2, 3):
                for bb in (64 * 2 ** 20, 0):
                    z = peak(name, [T.data_parallel("batch"), T.zero(stage, "batch")], n, bucket_bytes=bb)
                    row.append((stage, bb, round(z / bp, 3)))
            print(*row, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["gpt", "llama"])
