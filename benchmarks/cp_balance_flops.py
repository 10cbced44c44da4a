"""Causal attention FLOPs of one rank's lowered program (forward kernels, tests/test_cp.py attention_flops), CP=4 with
and without load_balance=True, at long_context.py's shape (2 layers, d=64, sequence 8192):

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python benchmarks/cp_balance_flops.py
"""
import os
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(here, "..", "tests"), here, os.path.join(here, "..")]

import partir_torch as pt                        # noqa: E402
from test_cp import attention_flops              # noqa: E402
from long_context import llama, loss_fn          # noqa: E402

T = pt.tactics
tokens = torch.randint(0, 256, (1, 8192))
f = {}
for name, kw in [("CP=4", {}), ("CP=4 lb", {"load_balance": True}), ("ring=4", {"attention": "ring"}), ("ring=4 lb", {"attention": "ring", "load_balance": True})]:
    p = pt.partition(llama(8192, 2, 64), pt.Mesh({"cp": 4}), [T.context_parallel("cp", **kw)], example_inputs=(tokens,), loss_fn=loss_fn)
    f[name] = attention_flops(p)
    print(f"{name:9s} forward attention GFLOPs per rank {f[name] / 1e9:.3f}")
print(f"lb / unbalanced: allgather {f['CP=4 lb'] / f['CP=4']:.3f}, ring {f['ring=4 lb'] / f['ring=4']:.3f}")
