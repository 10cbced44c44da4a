"""Train a Llama-style decoder with pipeline parallelism composed with data parallel and Megatron.

    python examples/train_pipeline.py                          # {pp: 2, dp: 2, tp: 2}: 8 ranks emulated here
    python examples/train_pipeline.py --schedule GPipe         # or 1F1B (default), Interleaved1F1B, ZBVZeroBubble
    python examples/train_pipeline.py --clip 0.5               # clip_grad_norm: the norm summed over the stages
    torchrun --nproc-per-node 4 examples/train_pipeline.py     # {pp: 2, dp: 2} on 4 real gloo ranks (CPU)

The step is cut into two stages at the decoder's blocks (pt.tactics.pipeline: the balanced cut, or give module
globs per stage as torchtitan's module_fqns_per_model_part); each stage's ops are partitioned by the tactics on the
other axes. Next to it a copy of the model trains on one device with the same global batch; the losses agree step
by step (with --clip, both clip the gradients by their global norm: the stages' sums of squares are all-reduced on
pp). At the end: eval_step (real ranks: each rank runs its stages' forwards), the summary (its stage table), and
the simulated schedule on 8 H100s (bubble, slowest stage).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import partir_torch as pt  # noqa: E402
from examples.models import get  # noqa: E402

STEPS, BATCH, LR = 6, 16, 3e-3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="1F1B", choices=["GPipe", "1F1B", "Interleaved1F1B",
                                                                     "ZBVZeroBubble"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--clip", type=float, default=None, help="clip_grad_norm (max norm)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    real = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if real and not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank() if real else 0
    say = print if rank == 0 else (lambda *a, **k: None)

    spec = get("llama", layers=4, d=64, heads=4, kv_heads=2, hidden=128, vocab=128, seq=32)
    model = spec.build()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)

    stages = 4 if args.schedule in ("Interleaved1F1B", "ZBVZeroBubble") else 2     # two stages per rank (ZB-V: a V)
    if real:                                                       # 4 processes: {pp: 2, dp: 2}
        mesh = pt.Mesh({"pp": 2, "dp": 2})
        schedule = [pt.tactics.pipeline("pp", stages, args.schedule, args.microbatches),
                    pt.tactics.data_parallel("dp")]
    else:
        mesh = pt.Mesh({"pp": 2, "dp": 2, "tp": 2})
        schedule = [pt.tactics.pipeline("pp", stages, args.schedule, args.microbatches),
                    pt.tactics.data_parallel("dp"), pt.tactics.megatron("tp")]
    batch = spec.batch(BATCH)
    prog = pt.partition(model, mesh, schedule, example_inputs=batch, loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                        step=pt.StepOptions(clip_grad_norm=args.clip))
    say(f"{'real' if real else 'emulated'} ranks, mesh {dict(mesh.shape)}, {args.schedule}, "
        f"{args.microbatches} micro-batches; stages: {prog.plan.pipeline.modules}")
    for step in range(STEPS):
        batch = spec.batch(BATCH, seed=step)
        loss = prog.train_step(*batch)
        ref_opt.zero_grad()
        want = spec.loss_fn(reference, *batch)
        want.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), args.clip) if args.clip else None
        ref_opt.step()
        say(f"step {step}: loss {loss.item():.6f}   one device {want.item():.6f}"
            + (f"   grad norm {prog.last_grad_norm.item():.6f} / {norm.item():.6f}" if norm is not None else ""))
    params = prog.gather_parameters()
    err = max((params[k] - p.detach()).abs().max().item() for k, p in reference.named_parameters())
    say(f"largest parameter difference to one device after {STEPS} steps: {err:.2e}")
    with torch.no_grad():
        want = spec.loss_fn(reference.eval(), *batch)
    say(f"eval_step: {prog.eval_step(*batch).item():.6f}   one device {want.item():.6f}")
    say(prog.summary())
    if not real:
        say(prog.simulate(pt.sim.hardware("h100", gpus_per_node=8)).table())


if __name__ == "__main__":
    main()
