"""Train a small GPT on a tiny built-in text with data parallel + Megatron + ZeRO-3 on a 2x2 mesh.

    python examples/train_gpt.py                          # 4 ranks emulated in this process
    torchrun --nproc-per-node 4 examples/train_gpt.py     # 4 real gloo ranks (CPU)

The same program runs either way. Next to the partitioned run, a copy of the model is trained on one device with
torch.optim.AdamW, so the printed curves can be compared step by step; at the end the per-tactic summary of the
partitioned program is printed, then what the simulator predicts for the same per-device program on a GPU system
(4 x H100, NVLink) and a TPU slice (4 x v5p, ICI), next to the measured time of a step here.
"""
from __future__ import annotations

import copy
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import partir_torch as pt  # noqa: E402
from examples.models import get  # noqa: E402

TEXT = """\
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, it was
the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of Darkness, it
was the spring of hope, it was the winter of despair, we had everything before us, we had nothing before us, we were
all going direct to Heaven, we were all going direct the other way.

A mesh is a grid of devices with named axes. A tactic decides how the values of a program are laid out along one
axis: the batch dim of the inputs along "batch", the hidden dim of the feed-forward weights along "model", the first
dim of every parameter and optimizer state along "batch" again. Propagation carries each decision through the
program, op by op, and lowering inserts the collectives that the decisions make necessary, and no others.

Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, and nothing
particular to interest me on shore, I thought I would sail about a little and see the watery part of the world.
"""

STEPS, PRINT_EVERY = 50, 10
BATCH, SEQ = 8, 32                  # global batch: 8 windows of 32 bytes
LR = 3e-3


def encode(text: str):
    """Bytes of the text -> ids over the distinct bytes that occur (the vocabulary)."""
    data = text.encode()
    vocab = sorted(set(data))
    index = {b: i for i, b in enumerate(vocab)}
    return torch.tensor([index[b] for b in data], dtype=torch.int64), len(vocab)


def get_batch(ids: torch.Tensor, step: int):
    """BATCH random windows (same on every rank: seeded by the step). tokens, targets: (BATCH, SEQ) int64."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(ids) - SEQ - 1, (BATCH,), generator=g)
    windows = torch.stack([ids[s:s + SEQ + 1] for s in starts.tolist()])   # (BATCH, SEQ + 1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def init_distributed() -> bool:
    """Under torchrun (RANK and WORLD_SIZE set) join the gloo group; otherwise ranks are emulated."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.is_initialized()


def main():
    torch.set_num_threads(1)
    real = init_distributed()
    rank = dist.get_rank() if real else 0
    say = print if rank == 0 else (lambda *a, **k: None)

    ids, vocab = encode(TEXT)
    spec = get("gpt_sdpa", vocab=vocab, seq=SEQ, d=64, heads=4, layers=2)
    model = spec.build()
    reference = copy.deepcopy(model)                         # trained on one device, for comparison
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)

    mesh = pt.Mesh({"batch": 2, "model": 2})
    schedule = [
        pt.tactics.data_parallel("batch"),     # BP: split the batch
        pt.tactics.megatron("model"),          # MP: column/row-parallel linears in attention and MLP
        pt.tactics.zero(3, "batch"),           # Z3: parameters and optimizer state sharded over "batch"
    ]
    t0 = time.perf_counter()
    prog = pt.partition(model, mesh, schedule, example_inputs=get_batch(ids, 0), loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    say(f"GPT: vocab {vocab} (bytes of a {len(ids)}-byte text), seq {SEQ}, d 64, 2 layers; "
        f"{sum(p.numel() for p in model.parameters()):,} parameters")
    say(f"mesh {mesh}, {'real gloo ranks' if real else 'emulated ranks'}; partitioned in "
        f"{time.perf_counter() - t0:.1f} s")
    say(f"{'step':>5} {'partir_torch':>13} {'one device':>11} {'difference':>11}")

    t0 = time.perf_counter()
    t_steps = 0.0                                            # partir_torch's steps alone
    for step in range(STEPS):
        tokens, targets = get_batch(ids, step)
        t1 = time.perf_counter()
        loss = prog.train_step(tokens, targets).item()
        t_steps += time.perf_counter() - t1
        ref_opt.zero_grad()
        ref_loss = spec.loss_fn(reference, tokens, targets)
        ref_loss.backward()
        ref_opt.step()
        if step % PRINT_EVERY == 0 or step == STEPS - 1:
            say(f"{step:>5} {loss:>13.6f} {ref_loss.item():>11.6f} {loss - ref_loss.item():>11.2e}")
    elapsed = time.perf_counter() - t0

    params = prog.gather_parameters()
    err = max((params[k] - p.detach()).abs().max().item() for k, p in reference.named_parameters())
    # fp32: the partitioned step sums in a different order; AdamW's per-element normalisation amplifies that on
    # gradients near zero, so parameters drift apart slowly while the losses stay equal to ~1e-6.
    say(f"{STEPS} steps in {elapsed:.1f} s ({t_steps:.1f} s in partir_torch's steps); max |parameter - one-device parameter| = {err:.2e}")
    say("")
    say(prog.summary())
    coll = prog.collectives()
    say(f"\n{len(coll)} collectives per step, {sum(r.nbytes for r in coll) / 1e6:.2f} MB (full-array bytes):")
    by: dict = {}
    for r in coll:
        key = (r.tactic, r.kind, r.axis, r.phase)
        n, b = by.get(key, (0, 0))
        by[key] = (n + 1, b + r.nbytes)
    for (tactic, kind, axis, phase), (n, b) in sorted(by.items()):
        say(f"  {tactic:>3} {kind:<15} on {axis:<6} {phase:<9} x{n:<3} {b / 1e3:9.1f} kB")
    where = "4 gloo ranks" if real else "4 ranks emulated in one process"
    say(f"\nmeasured here: {t_steps / STEPS * 1e3:.1f} ms per step ({where}, CPU; {t_steps:.1f} s for {STEPS} "
        f"steps). The simulator's prediction for this program:")
    for hw in (pt.sim.hardware("h100", gpus_per_node=4), pt.sim.hardware("tpu-v5p")):
        say(f"\n{hw.name}:")
        say(prog.simulate(hw).table())
    if real:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
