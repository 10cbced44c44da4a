"""Context parallelism at long sequence length: measured peak memory per rank and step time, CP=4 (allgather and ring) against the
same 4 emulated ranks without CP (every rank computes the whole sequence), and both CP forms with causal load
balancing (load_balance=True: rank r holds chunks r and 7-r), side by side in one run; and the simulated step of
each program on H100s.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/long_context.py [--seq 8192 --layers 2 --d 64 --steps 3]

A tiny stock HF Llama (SDPA, grouped-query heads, vocabulary 256) so that the state is small next to the
activations: "state" below is parameters + gradients + AdamW moments, and activations = peak - state. Times are
the median of the steps after the first, interleaved.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import partir_torch as pt                 # noqa: E402

T = pt.tactics


def llama(seq, layers, d):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                                   bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def loss_fn(m, x):
    return m(input_ids=x, labels=x).loss


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)
    tokens = torch.randint(0, 256, (1, a.seq), generator=torch.Generator().manual_seed(0))
    progs = {}
    for name, schedule in [("no CP", []), ("CP=4", [T.context_parallel("cp")]),
                           ("ring=4", [T.context_parallel("cp", attention="ring")]),
                           ("CP=4 lb", [T.context_parallel("cp", load_balance=True)]),
                           ("ring=4 lb", [T.context_parallel("cp", attention="ring", load_balance=True)])]:
        model = llama(a.seq, a.layers, a.d)
        state = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
        progs[name] = pt.partition(model, pt.Mesh({"cp": 4}), schedule, example_inputs=(tokens,), loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), options=pt.Options(measure_memory=True))
    times = {n: [] for n in progs}
    losses = {n: [] for n in progs}
    for _ in range(a.steps):
        for n, p in progs.items():
            t = time.perf_counter()
            losses[n].append(float(p.train_step(tokens)))
            times[n].append(time.perf_counter() - t)
    print(f"llama layers={a.layers} d={a.d} seq={a.seq} batch=1 on 4 emulated ranks, state {state / 2**20:.2f} MiB "
          f"per rank, load average {os.getloadavg()[0]:.1f}")
    base = None
    hw = pt.sim.hardware("h100")
    for n, p in progs.items():
        peak = max(p.peak_memory().values())
        act = peak - state
        t = statistics.median(times[n][1:])
        base = base or (act, t)
        sim = p.simulate(hw)
        print(f"  {n:9s} peak {peak / 2**20:8.2f} MiB  activations {act / 2**20:8.2f} MiB ({act / base[0]:.3f}x)  "
              f"step {1e3 * t:8.1f} ms ({t / base[1]:.3f}x)  losses {' '.join(f'{x:.6f}' for x in losses[n])}  "
              f"simulated h100 step {1e3 * sim.step_time_s:.3f} ms")
    for n in ("CP=4", "ring=4", "CP=4 lb", "ring=4 lb"):
        kinds = {}
        for r in progs[n].collectives():
            if r.tactic == "CP":
                kinds.setdefault(r.kind, []).append(r.nbytes)
        print(f"  {n} collectives: " + ", ".join(f"{k} x{len(v)} ({sum(v) / 2**20:.2f} MiB)" for k, v in kinds.items()))


if __name__ == "__main__":
    main()
