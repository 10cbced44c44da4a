"""Every zoo model through the torch-xla backend: BP + ZeRO-3 on 8 devices, 2 AdamW steps next to one device, and
compare() of partir's collectives with those of XLA's partitioned HLO (issue 12).

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 OMP_NUM_THREADS=1 .venv-xla/bin/python benchmarks/xla_zoo.py [model ...]
"""
from __future__ import annotations

import copy
import os
import sys
import time
import warnings

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import partir_torch as pt  # noqa: E402
import partir_torch.xla  # noqa: E402,F401  (before the first XLA tensor)
from examples.models import ZOO, get  # noqa: E402

T = pt.tactics


def run(name: str) -> list:
    spec = get(name)
    model = spec.build()
    ref = copy.deepcopy(model)
    batch = spec.batch(8)
    dims = {i: d for i, d in enumerate(spec.batch_dims) if d != 0}     # GNS: the edge list is tiled on its edges
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"partir_torch: ")   # partir's notes (ops without a rule)
        prog = pt.partition(model, pt.Mesh({"batch": 8}), [T.data_parallel("batch", dims=dims), T.zero(3, "batch")],
                            example_inputs=batch, loss_fn=spec.loss_fn,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
    xprog = prog.to_xla()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-5)
    err = 0.0
    for _ in range(2):
        got = float(xprog.train_step(*batch))
        opt.zero_grad()
        want = spec.loss_fn(ref, *batch)
        want.backward()
        opt.step()
        err = max(err, abs(got - want.item()) / abs(want.item()))
    params = xprog.gather_parameters()
    perr = max(float((params[k] - p.detach()).abs().max()) for k, p in ref.named_parameters())
    cmp = xprog.compare()
    (p, x), = cmp.axis_bytes.values()
    return [name, f"{err:.1e}", f"{perr:.1e}", f"{p:,}", f"{x:,}", f"{100 * cmp.axis_errors()['batch']:.1f}%",
            f"{cmp.extra_bytes:,}", ", ".join(cmp.host_ops) or "-", "yes" if cmp.ok else "NO",
            f"{time.perf_counter() - t0:.0f} s"]


def main(names):
    torch.set_num_threads(1)
    rows = [run(n) for n in names or list(ZOO)]
    print(tabulate(rows, headers=["model", "loss rel. err", "max param err", "partir bytes", "xla bytes", "diff",
                                  "xla extra B", "ops on host", "plan carried out", "time"], tablefmt="simple"))


if __name__ == "__main__":
    main(sys.argv[1:])
