"""A training loop over batches of changing shapes against one at a fixed shape (issue 40, third goal).

Stock Hugging Face GPT-2 from a tiny config, called its documented way (`model(input_ids=..., labels=...).loss`),
data parallel x Megatron on an emulated 2x2 mesh, SGD. Two loops of 100 steps in one process, each timed from
partition() to the last step's loss:

- fixed: 100 batches of 8 x T_mean tokens.
- dynamic: 100 batches of 8 x T, T cycling over 20 distinct lengths whose mean is T_mean (the same tokens in
  all), the last batch of 4; partition(..., options=pt.Options(dynamic={"inputs.0": {1: "seq"}, "inputs.1":
  {1: "seq"}})) (the batch dim is a symbol by default), or with --learned no declaration (each dim becomes a
  symbol at its second size).

Every dynamic step's loss is checked against eager's (a copy of the model with torch.optim.SGD, the same batches)
and the parameters after the loop too. Prints both totals, their ratio (goal <= 1.3), the programs partitioned
(captures) and instantiated, and where the dynamic loop's extra time went.

    OMP_NUM_THREADS=1 python benchmarks/dynamic_loop.py [--learned] [--d 256] [--layers 2] [--t-mean 96]
"""
from __future__ import annotations

import argparse
import copy
import os
import time
import warnings

import torch

import partir_torch as pt

T = pt.tactics


def gpt2(d: int, layers: int):
    import transformers

    cfg = transformers.GPT2Config(vocab_size=512, n_positions=512, n_embd=d, n_layer=layers, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()


def loss_fn(m, ids, labels):
    return m(input_ids=ids, labels=labels).loss


def batches(lengths, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for t, b in zip(lengths, sizes):
        ids = torch.randint(0, 512, (b, t), generator=g)
        out.append((ids, ids.clone()))
    return out


def run(model, data, options):
    """(seconds from partition to the last loss, losses, the program)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    t0 = time.perf_counter()
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), [T.data_parallel("batch"), T.megatron("model")],
                        example_inputs=data[0], loss_fn=loss_fn, optimizer=opt, options=options)
    t_part = time.perf_counter() - t0
    losses = [float(prog.train_step(*b)) for b in data]
    return time.perf_counter() - t0, t_part, losses, prog


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--learned", action="store_true", help="no dynamic= declaration")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--t-mean", type=int, default=96)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    lengths20 = [args.t_mean + 4 * k for k in range(-10, 10)]      # 20 lengths, multiples of 4, mean t_mean - 2
    lengths20 = [t + 2 for t in lengths20]                         # mean t_mean
    order = [lengths20[(7 * i) % 20] for i in range(100)]          # each length 5 times, in a scattered order
    sizes = [8] * 99 + [4]                                         # the last batch smaller
    dyn_data = batches(order, sizes, seed=1)
    fixed_data = batches([args.t_mean] * 100, [8] * 100, seed=2)
    base = gpt2(args.d, args.layers)

    t_fixed, p_fixed, _, _ = run(copy.deepcopy(base), fixed_data, pt.Options())
    opts = pt.Options() if args.learned else pt.Options(dynamic={"inputs.0": {1: "seq"}, "inputs.1": {1: "seq"}})
    model = copy.deepcopy(base)
    t_dyn, p_dyn, losses, prog = run(model, dyn_data, opts)

    ref = copy.deepcopy(base)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
    t0 = time.perf_counter()
    want = []
    for b in dyn_data:
        ropt.zero_grad()
        loss = loss_fn(ref, *b)
        loss.backward()
        ropt.step()
        want.append(float(loss))
    t_eager = time.perf_counter() - t0
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
    got = prog.gather_parameters()
    pworst = max((got[k] - p.detach()).abs().max().item() for k, p in ref.named_parameters())
    rows = prog.shapes()
    captured = [r for r in rows if r.capture_s is not None]
    inst = [r for r in rows if r.instance_of is not None]
    print(f"HF GPT2LMHeadModel d={args.d} layers={args.layers}, DP x MP on 2x2 (emulated), SGD; "
          f"{'learned' if args.learned else 'declared dynamic seq (batch by default)'}; load "
          f"{os.getloadavg()[0]:.2f}")
    print(f"  fixed   100 x (8, {args.t_mean}): {t_fixed:.2f} s (partition {p_fixed:.2f} s)")
    print(f"  dynamic 100 batches, 20 lengths {min(order)}..{max(order)} (mean {sum(order) / 100:.0f}), last (4, "
          f"{order[-1]}): {t_dyn:.2f} s (partition {p_dyn:.2f} s)")
    print(f"  ratio dynamic / fixed: {t_dyn / t_fixed:.2f} (goal <= 1.3)")
    print(f"  programs partitioned (captures): {len(captured)}, instances: {len(inst)}; eager loop {t_eager:.2f} s")
    print(f"  losses vs eager: max relative difference {worst:.1e}; parameters after 100 steps: max abs "
          f"difference {pworst:.1e}")


if __name__ == "__main__":
    main()
