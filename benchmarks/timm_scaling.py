"""Simulated strong scaling of timm convnets under data parallelism (issue 20's goal): one step of a global batch
of 64 images at 224 px, AdamW, fp32, on 1 H100 and on 8 H100 (one NVSwitch node) with data_parallel; speed-up =
step(1) / step(8) (8 is ideal). Depthwise and grouped convolutions used to gather the whole batch before their rule
existed (efficientnet_b0 1.56x, convnext_tiny 1.5x, resnet50 4.7x).

    OMP_NUM_THREADS=1 .venv-timm/bin/python benchmarks/timm_scaling.py [efficientnet_b0,convnext_tiny,resnet50]
"""
from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import timm  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import partir_torch as pt  # noqa: E402

BATCH, PX = 64, 224


def loss_fn(m, x, y):
    return F.cross_entropy(m(x), y)


def step(name: str, n: int):
    model = timm.create_model(name, pretrained=False, num_classes=1000).train()
    x, y = torch.randn(BATCH, 3, PX, PX, device="meta"), torch.zeros(BATCH, dtype=torch.int64, device="meta")
    prog = pt.partition(model, pt.Mesh({"batch": n}), [pt.tactics.data_parallel("batch")], example_inputs=(x, y),
                        loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    r = prog.simulate(pt.sim.hardware("h100", gpus_per_node=n), stages=False)
    moved = sum(c.nbytes for c in prog.collectives() if c.why != "gradient")
    return r, moved


def main(names):
    warnings.simplefilter("ignore")
    for name in names:
        (r1, _), (r8, moved) = step(name, 1), step(name, 8)
        print(f"{name:16s} step 1xH100 {r1.step_time_s * 1e3:7.2f} ms, 8xH100 {r8.step_time_s * 1e3:6.2f} ms "
              f"(exposed comm {r8.exposed_comm_s * 1e3:.2f} ms): speed-up {r1.step_time_s / r8.step_time_s:.2f}x; "
              f"non-gradient collective bytes per step {moved}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["efficientnet_b0", "convnext_tiny", "resnet50"])
