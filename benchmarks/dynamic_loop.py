"""A training loop over batches of changing shapes against one at a fixed shape (issue 40, third goal).

Stock Hugging Face GPT-2 from a tiny config, called its documented way (`model(input_ids=..., labels=...).loss`),
data parallel x Megatron on an emulated 2x2 mesh, SGD. Four loops of 100 steps in one process:

- fixed: partir_torch, 100 batches of 8 x T_mean tokens.
- dynamic: partir_torch, 100 batches of 8 x T, T cycling over 20 distinct lengths whose mean is T_mean, the last
  batch of 4; partition(..., options=pt.Options(dynamic={"inputs.0": {1: "seq"}, "inputs.1": {1: "seq"}})) (the
  batch dim is a symbol by default), or with --learned no declaration (each dim becomes a symbol at its second size).
- eager fixed, eager dynamic: the model itself with torch.optim.SGD on the same batches (the references: the
  model's own work at those shapes; attention is quadratic in T, so the dynamic batches cost E[T^2] / T_mean^2 more).

The loops run interleaved, `--rounds` rounds of 100 / rounds steps of each, the order rotated every round, so that
the load of a shared machine falls on all four alike; the two partition() calls alternate `--partitions` times and
the median of each (by CPU time) is counted. Each is timed in wall seconds and in this process's CPU seconds
(single-threaded torch: the CPU time is the work, whatever else the machine runs). A partir_torch total is its
partition() plus its steps. Every dynamic step's loss is checked against eager's, and the parameters after the loop.

    OMP_NUM_THREADS=1 python benchmarks/dynamic_loop.py [--learned] [--d 256] [--layers 2] [--t-mean 96] [--rounds 10]
        [--partitions 3]
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


class Clock:
    """Wall and CPU seconds, summed over the spans timed."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def __enter__(self):
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self._w
        self.cpu += time.process_time() - self._c


def partitioned(model, data0, options, clock):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with clock:
        return pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), [T.data_parallel("batch"), T.megatron("model")],
                            example_inputs=data0, loss_fn=loss_fn, optimizer=opt, options=options)


class Eager:
    def __init__(self, model):
        self.model, self.opt = model, torch.optim.SGD(model.parameters(), lr=0.05)

    def train_step(self, *b):
        self.opt.zero_grad()
        loss = loss_fn(self.model, *b)
        loss.backward()
        self.opt.step()
        return loss.detach()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--learned", action="store_true", help="no dynamic= declaration")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--t-mean", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--partitions", type=int, default=3)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    lengths20 = [args.t_mean + 4 * k + 2 for k in range(-10, 10)]  # 20 lengths, 4 apart, mean t_mean
    order = [lengths20[(7 * i) % 20] for i in range(100)]          # each length 5 times, in a scattered order
    sizes = [8] * 99 + [4]                                         # the last batch smaller
    data = {"fixed": batches([args.t_mean] * 100, [8] * 100, seed=2), "dynamic": batches(order, sizes, seed=1)}
    base = gpt2(args.d, args.layers)
    declared = pt.Options(dynamic={"inputs.0": {1: "seq"}, "inputs.1": {1: "seq"}})
    opts = {"fixed": pt.Options(), "dynamic": pt.Options() if args.learned else declared}
    clocks = {k: Clock() for k in ("fixed", "dynamic", "eager fixed", "eager dynamic")}
    tries = {k: [] for k in ("fixed", "dynamic")}
    runs = {}
    for _ in range(args.partitions):            # alternated too; the median of each is counted, the last one runs
        for k in ("fixed", "dynamic"):
            c = Clock()
            runs[k] = partitioned(copy.deepcopy(base), data[k][0], opts[k], c)
            tries[k].append(c)
    parts = {k: sorted(v, key=lambda c: c.cpu)[len(v) // 2] for k, v in tries.items()}
    runs.update({f"eager {k}": Eager(copy.deepcopy(base)) for k in ("fixed", "dynamic")})
    losses = {k: [] for k in runs}
    per = 100 // args.rounds
    for r in range(args.rounds):
        names = list(runs)
        for k in names[r % 4:] + names[:r % 4]:
            batch = data[k.split()[-1]][r * per:(r + 1) * per]
            with clocks[k]:
                losses[k] += [float(runs[k].train_step(*b)) for b in batch]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["dynamic"], losses["eager dynamic"]))
    got = runs["dynamic"].gather_parameters()
    pworst = max((got[k] - p.detach()).abs().max().item() for k, p in runs["eager dynamic"].model.named_parameters())
    rows = runs["dynamic"].shapes()
    captured = [r for r in rows if r.capture_s is not None]
    inst = [r for r in rows if r.instance_of is not None]
    sq = sum(b[0].shape[0] * b[0].shape[1] ** 2 for b in data["dynamic"]) / (100 * 8 * args.t_mean ** 2)
    print(f"HF GPT2LMHeadModel d={args.d} layers={args.layers}, DP x MP on 2x2 (emulated), SGD; "
          f"{'learned' if args.learned else 'declared dynamic seq (batch by default)'}; {args.rounds} rounds "
          f"interleaved; load {os.getloadavg()[0]:.2f}")
    print(f"  dynamic batches: 20 lengths {min(order)}..{max(order)} (mean {sum(order) / 100:.0f}), last (4, "
          f"{order[-1]}); sum B*T^2 / (100*8*{args.t_mean}^2) = {sq:.3f}")
    print("                  partition (wall / cpu s)   100 steps (wall / cpu s)   total (wall / cpu s)")
    total = {}
    for k, c in clocks.items():
        p = parts.get(k, Clock())
        total[k] = (p.wall + c.wall, p.cpu + c.cpu)
        print(f"  {k:14s}  {p.wall:8.2f} / {p.cpu:6.2f}         {c.wall:8.2f} / {c.cpu:6.2f}           "
              f"{total[k][0]:7.2f} / {total[k][1]:6.2f}")
    ratio = [d / f for d, f in zip(total["dynamic"], total["fixed"])]
    loop = [clocks["dynamic"].wall / clocks["fixed"].wall, clocks["dynamic"].cpu / clocks["fixed"].cpu]
    eager = [clocks["eager dynamic"].wall / clocks["eager fixed"].wall,
             clocks["eager dynamic"].cpu / clocks["eager fixed"].cpu]
    print(f"  ratio dynamic / fixed, totals: {ratio[0]:.2f} wall, {ratio[1]:.2f} cpu (goal <= 1.3); steps alone: "
          f"{loop[0]:.2f} wall, {loop[1]:.2f} cpu; eager dynamic / eager fixed: {eager[0]:.2f} wall, {eager[1]:.2f} cpu")
    print(f"  programs partitioned (captures): {len(captured)}, instances: {len(inst)}")
    print(f"  losses vs eager: max relative difference {worst:.1e}; parameters after 100 steps: max abs "
          f"difference {pworst:.1e}")


if __name__ == "__main__":
    main()
