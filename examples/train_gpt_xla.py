"""The demo's GPT and schedule (BP + MP + Z3) as a torch-xla SPMD program on 8 XLA devices.

    .venv-xla/bin/python examples/train_gpt_xla.py        # 8 virtual CPU devices (PJRT_DEVICE=CPU CPU_NUM_DEVICES=8)

partir_torch partitions the step as in examples/train_gpt.py, on a 4 x 2 mesh; `prog.to_xla()` runs the global step
on XLA tensors with partir's shardings as XLA sharding annotations, so XLA's SPMD partitioner carries out partir's
plan. Printed: the loss next to a copy trained on one device with torch.optim.AdamW, the collectives of XLA's
partitioned HLO next to partir's own (compare()), and the TPU simulator's table for the same program on a v5p
2x2x2 slice. On a TPU VM the same script runs with PJRT_DEVICE=TPU on 8 chips.
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

import partir_torch as pt  # noqa: E402
import partir_torch.xla  # noqa: E402,F401  (before the first XLA tensor: SPMD mode and HLO dumps)
from examples.models import get  # noqa: E402
from examples.train_gpt import LR, SEQ, encode, get_batch, TEXT  # noqa: E402

STEPS, PRINT_EVERY = 20, 5


def main():
    torch.set_num_threads(1)
    ids, vocab = encode(TEXT)
    spec = get("gpt_sdpa", vocab=vocab, seq=SEQ, d=64, heads=4, layers=2)
    model = spec.build()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)

    mesh = pt.Mesh({"batch": 4, "model": 2})
    schedule = [pt.tactics.data_parallel("batch"), pt.tactics.megatron("model"), pt.tactics.zero(3, "batch")]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"partir_torch: MP left .* replicated")   # the tied LM head
        prog = pt.partition(model, mesh, schedule, example_inputs=get_batch(ids, 0), loss_fn=spec.loss_fn,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    xprog = prog.to_xla()
    print(f"GPT: vocab {vocab}, seq {SEQ}, d 64, 2 layers; mesh {mesh} on 8 XLA devices "
          f"({os.environ['PJRT_DEVICE']})")
    print(f"{'step':>5} {'torch-xla':>11} {'one device':>11} {'difference':>11}")
    t0 = time.perf_counter()
    for step in range(STEPS):
        tokens, targets = get_batch(ids, step)
        loss = xprog.train_step(tokens, targets).item()
        ref_opt.zero_grad()
        ref_loss = spec.loss_fn(reference, tokens, targets)
        ref_loss.backward()
        ref_opt.step()
        if step % PRINT_EVERY == 0 or step == STEPS - 1:
            print(f"{step:>5} {loss:>11.6f} {ref_loss.item():>11.6f} {loss - ref_loss.item():>11.2e}")
    params = xprog.gather_parameters()
    err = max((params[k] - p.detach()).abs().max().item() for k, p in reference.named_parameters())
    print(f"{STEPS} steps in {time.perf_counter() - t0:.1f} s (the first compiles); "
          f"max |parameter - one-device parameter| = {err:.2e}\n")
    print("collectives per step, partir's lowered program vs XLA's partitioned HLO (bytes: full array per axis):")
    print(xprog.compare().table())
    print("\nTPU v5p 2x2x2, simulated (the same program, partir's collectives):")
    print(prog.simulate(pt.sim.hardware("tpu-v5p", topology=(2, 2, 2))).table())


if __name__ == "__main__":
    main()
