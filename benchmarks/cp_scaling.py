"""Simulated context-parallel scaling of a Llama-3-8B-shaped decoder: the step time, peak memory per GPU and CP's
bytes per step that prog.simulate prices, for sequence lengths from 8K up, with and without CP, on H100 / B200
nodes. The model is built on the meta device (no weights), captured with fake tensors; batch 1.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cp_scaling.py [--layers 32 --seqs 8192,32768 --cp 8 --hw h100]

The schedule is context_parallel on "cp" (attention="ring" or "allgather") against the same mesh without CP
(every GPU computes the whole sequence: the no-CP row's time and memory are one GPU's).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import partir_torch as pt                 # noqa: E402

T = pt.tactics


def llama8b(layers: int, seq: int):
    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                   max_position_embeddings=seq, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)


def loss_fn(m, x):
    return m(input_ids=x, labels=x).loss


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seqs", default="8192,32768")
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--hw", default="h100")
    ap.add_argument("--attention", default="ring")
    a = ap.parse_args(argv)
    hw = pt.sim.hardware(a.hw, nodes=max(1, a.cp // 8))
    print(f"llama-8B shape, {a.layers} layers, batch 1, bf16, {a.hw} x {a.cp}, attention={a.attention}, "
          f"load average {os.getloadavg()[0]:.1f}")
    for seq in (int(s) for s in a.seqs.split(",")):
        tokens = torch.zeros(1, seq, dtype=torch.long)
        for name, schedule in (("no CP", []), (f"CP={a.cp}", [T.context_parallel("cp", attention=a.attention)])):
            t0 = time.perf_counter()
            prog = pt.partition(llama8b(a.layers, seq), pt.Mesh({"cp": a.cp}), schedule, example_inputs=(tokens,),
                                loss_fn=loss_fn)
            rep = prog.simulate(hw)
            cp_bytes = sum(r.nbytes for r in prog.collectives() if r.tactic == "CP" and r.why == "tactic")
            print(f"  seq {seq:8d} {name:6s} step {rep.step_time_s * 1e3:10.1f} ms  exposed comm "
                  f"{rep.exposed_comm_s * 1e3:8.1f} ms  MFU {100 * rep.mfu:5.1f}%  peak/GPU {rep.peak_memory_bytes / 2**30:8.2f} GiB  "
                  f"CP bytes/step {cp_bytes / 2**30:7.2f} GiB  ({time.perf_counter() - t0:.0f} s to partition "
                  f"and simulate)")


if __name__ == "__main__":
    main()
