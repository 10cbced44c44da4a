"""Issue 26 item 2: what a step costs whose data-dependent count changes every step (capture/counts.py).

Two models, each partitioned (data_parallel on 2 emulated ranks, AdamW) with and without the selection, timed side
by side, interleaved, in one process, on batches whose counts differ at every step:
- loss: `cross_entropy(logits[mask != 0], labels[mask != 0])` (Qwen2-Audio / Granite Speech), the mask a random
  amount of right padding per sequence; the reference computes the loss over every position (no selection);
- moe: HF's eager experts loop (`idx, top_x = torch.where(expert_mask[e])`, `experts[e](x[top_x]) * w[top_x, idx,
  None]`, `index_add_`) over E experts, top-k routing; the reference is the same MoE written densely by hand (each
  expert on every token, times its routing weight or 0). The padded selection runs each expert on its k x tokens
  candidate rows, k times the dense reference's rows: the ratio shows that price.
`--before N`: the same selection step with counts.py switched off (a count guard: a capture per new count), N steps.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/counts.py [--steps 20] [--d 256] [--before 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import partir_torch as pt
from partir_torch.capture import counts


class LossNet(nn.Module):
    def __init__(self, d, vocab, select):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab)
        self.select = select

    def forward(self, tokens, labels, mask):
        h = self.emb(tokens)
        logits = self.head(h + self.mlp(h))                                  # (B, T, V)
        if self.select:
            return F.cross_entropy(logits[mask != 0], labels[mask != 0])
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class MoENet(nn.Module):
    def __init__(self, d, vocab, experts, top_k, select):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))
                                     for _ in range(experts))
        self.head = nn.Linear(d, vocab)
        self.n, self.top_k, self.select = experts, top_k, select

    def forward(self, tokens, labels, mask):
        B, T = tokens.shape
        h = self.emb(tokens).reshape(B * T, -1)
        w, selected = torch.topk(self.router(h).softmax(-1), self.top_k, dim=-1)   # (tokens, k)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        if self.select:                 # HF's eager loop
            expert_mask = F.one_hot(selected, num_classes=self.n).permute(2, 1, 0)  # (E, k, tokens)
            for e in range(self.n):
                idx, top_x = torch.where(expert_mask[e])
                out.index_add_(0, top_x, self.experts[e](h[top_x]) * w[top_x, idx, None])
        else:                           # dense: every expert on every token, weighted by its routing weight or 0
            for e in range(self.n):
                out = out + self.experts[e](h) * (w * (selected == e)).sum(-1, keepdim=True)
        logits = self.head(h + out).reshape(B, T, -1)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _batches(args, n, seed=0):
    """n batches; each sequence padded at its end by a random amount, so the count changes every step."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        lengths = torch.randint(args.seq // 2, args.seq + 1, (args.batch,), generator=g)
        mask = (torch.arange(args.seq)[None, :] < lengths[:, None]).long()
        out.append((tokens, torch.randint(0, args.vocab, (args.batch, args.seq), generator=g), mask))
    return out


def _prog(model, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pt.partition(model, pt.Mesh({"batch": 2}), [pt.tactics.data_parallel("batch")],
                            example_inputs=batch, loss_fn=lambda m, x, y, k: m(x, y, k),
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))


def _build(kind, args, select):
    torch.manual_seed(0)
    if kind == "loss":
        return LossNet(args.d, args.vocab, select)
    return MoENet(args.d, args.vocab, args.experts, args.top_k, select)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--before", type=int, default=3, help="steps of the selection step as a count guard (0: skip)")
    ap.add_argument("--only", choices=("loss", "moe"), default=None)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    batches = _batches(args, args.steps + 2)
    print(f"d={args.d} vocab={args.vocab} batch={args.batch}x{args.seq}, experts={args.experts} top-{args.top_k}, "
          f"data_parallel on 2 emulated ranks, {args.steps} timed steps each (interleaved, after 2 warm-up steps, "
          f"a new count every step); median per step; load average before: {os.getloadavg()[0]:.1f}")
    for kind in (args.only,) if args.only else ("loss", "moe"):
        progs = {"selection": _prog(_build(kind, args, True), batches[0]),
                 "without": _prog(_build(kind, args, False), batches[0])}
        times = {k: [] for k in progs}
        for p in progs.values():
            for b in batches[:2]:
                p.train_step(*b)
        for b in batches[2:]:
            for k, p in progs.items():
                t0 = time.perf_counter()
                p.train_step(*b)
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        sel = progs["selection"]
        print(f"{kind:5s} selection {med['selection'] * 1e3:7.1f} ms  without {med['without'] * 1e3:7.1f} ms  "
              f"ratio {med['selection'] / med['without']:.3f}  ({len(sel.captured.padded)} padded selection(s), "
              f"{len(sel.captured.guards)} guard(s), {len(sel.shapes())} program(s) after {args.steps + 2} steps)")
        if args.before:
            with counts.disabled():
                old = _prog(_build(kind, args, True), batches[0])
                t0 = time.perf_counter()
                for b in batches[1:1 + args.before]:
                    old.train_step(*b)
                per = (time.perf_counter() - t0) / args.before
            print(f"{kind:5s} as a count guard (before): {per * 1e3:7.1f} ms per step over {args.before} steps, "
                  f"{len(old.shapes())} program(s): ratio {per / med['without']:.1f} to the step without selection")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
