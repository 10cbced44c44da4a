"""Simulated context-parallel scaling of a Llama-3-8B-shaped decoder from 8K to 1M tokens on H100 and B200 clusters,
with and without CP, next to NVIDIA's published NeMo long-sequence runs; and the memory model's activation bytes per
GPU as the CP axis grows. The model is built on the meta device (no weights) and captured with fake tensors; batch 1
(one sequence per model replica: data parallelism adds replicas, not per-GPU throughput); bf16; no optimizer.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cp_scaling.py [--layers 32 --hw h100,b200 --seqs 8K,...,1M]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cp_scaling.py --memory 131072 --cps 1,2,4,8,16,32

Scaling rows: for each sequence length, the tensor- and context-parallel sizes of NeMo's CP configuration for that
length (the tables below), as T.context_parallel("cp", attention="ring", load_balance=True) + T.megatron("tp",
vocab=True) + T.sequence_parallel("tp") on
{tp, cp}, against the same TP without CP ({tp}: every GPU of the TP group holds the whole sequence). prog.simulate
prices each (step time, MFU = model FLOPs / (GPUs x bf16 peak x step time), peak memory per GPU); "fits" compares
the peak with the GPU's HBM.

Published reference (the configurations used here; FP8 there, bf16 here, so compare speedups and trends, not
TFLOPS): NVIDIA NeMo Framework, "Long Sequence Performance",
- NeMo 24.12, LLAMA2-7B FP8 on DGX-H100 (docs.nvidia.com/nemo-framework/user-guide/24.12/nemotoolkit/performance/
  performance_long_sequence.html): GPUs = sequence length in K; with CP (TP, CP; PP 1 but 2 at 8K) and TFLOPS/GPU
  without -> with CP: 8K (1, 1) 730 -> 730; 16K (2, 1) 660; 32K (2, 2) 595 -> 610; 64K (4, 2) 534 -> 574; 128K
  (4, 4) 424 -> 555 (1.31x); 256K (4, 8) 392 -> 549 (1.40x); 512K (8, 16) 104 -> 549 (5.28x); 1M (8, 32) 26.5 -> 536
  (20.2x);
- NeMo 25.04, LLAMA3-8B FP8 on DGX-B200 (the same page, performance_long_sequence.md of that release): 8K (1, 1)
  1671; 16K (1, 1) 1717; 32K (1, 2) 1549 -> 1624 (1.05x); 64K (1, 4) 1481 -> 1600 (1.08x); 128K (2, 4) 1438 -> 1588
  (1.10x); 256K (4, 4) 1162 -> 1590 (1.37x); 512K (4, 8) 607 -> 1619 (2.67x); 1M (4, 16) - -> 1608 (no configuration
  without CP fits: TP stops at the 8 query groups).
- Llama 3 paper (Dubey et al. 2024, arXiv 2407.21783, Table 4): 405B at 131072 tokens on 16,384 H100s with TP 8,
  CP 16, PP 16, DP 4: 380 TFLOPS/GPU bf16, 38% MFU (against 400-430 at 8K without CP); all-gather CP (K/V of
  grouped-query attention are small), our attention="allgather".
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
K = 1024
# sequence length -> (TP, CP) of NeMo's configuration with CP (module docstring)
NEMO = {"h100": {8 * K: (1, 1), 16 * K: (2, 1), 32 * K: (2, 2), 64 * K: (4, 2), 128 * K: (4, 4), 256 * K: (4, 8),
                 512 * K: (8, 16), 1024 * K: (8, 32)},
        "b200": {8 * K: (1, 1), 16 * K: (1, 1), 32 * K: (1, 2), 64 * K: (1, 4), 128 * K: (2, 4), 256 * K: (4, 4),
                 512 * K: (4, 8), 1024 * K: (4, 16)}}
HBM = {"h100": 80e9, "b200": 180e9}


def llama8b(layers: int, seq: int):
    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                   max_position_embeddings=seq, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)


def loss_fn(m, x):
    return m(input_ids=x, labels=x).loss


def run(hw_name: str, layers: int, seq: int, tp: int, cp: int, attention: str, lb: bool, remat: bool = False) -> dict:
    """Partition and simulate one configuration; cp == 1: no CP. TP is Megatron with the vocabulary tiled and sequence
    parallelism (NeMo's); remat: full recomputation of every decoder layer."""
    mesh = {"tp": tp} | ({"cp": cp} if cp > 1 else {})
    # CP before SP: the sequence dim is then tiled cp-major, each CP rank's tile split by SP; in the other order
    # (tp-major) CP gathers every SP activation on its axis (256 MiB per layer boundary at 32K)
    sched = ([T.context_parallel("cp", attention=attention, load_balance=lb)] if cp > 1 else []) + (
        [T.megatron("tp", vocab=True), T.sequence_parallel("tp")] if tp > 1 else []) + (
        [T.remat("model.layers.*")] if remat else [])
    gpus = tp * cp
    hw = pt.sim.hardware(hw_name, nodes=max(1, gpus // 8), **({"gpus_per_node": gpus} if gpus < 8 else {}))
    t0 = time.perf_counter()
    model = llama8b(layers, seq)
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters()) // tp     # bf16 params + grads
    prog = pt.partition(model, pt.Mesh(mesh), sched, example_inputs=(torch.zeros(1, seq, dtype=torch.long),),
                        loss_fn=loss_fn)
    rep = prog.simulate(hw, stages=False)
    cp_bytes = sum(r.nbytes for r in prog.collectives() if r.tactic == "CP" and r.why == "tactic")
    return dict(step=rep.step_time_s, exposed=rep.exposed_comm_s, mfu=rep.mfu, peak=rep.peak_memory_bytes,
                act=rep.peak_memory_bytes - state, cp_bytes=cp_bytes, secs=time.perf_counter() - t0)


def scaling(a) -> None:
    print(f"llama-8B shape, {a.layers} layers, batch 1, bf16, ring attention with load balancing; NeMo's (TP, CP) "
          f"per length; remat={a.remat}; load average {os.getloadavg()[0]:.1f}")
    print("  hw    seq      TP  CP  no-CP step   MFU  peak/GPU (fits) | CP step    MFU  peak/GPU (fits)  "
          "CP bytes/step  exposed  speedup")
    for hw_name in a.hw.split(","):
        for seq in (int(s) for s in a.seqs.split(",")):
            tp, cp = NEMO[hw_name][seq]
            base = run(hw_name, a.layers, seq, tp, 1, a.attention, False, a.remat)
            row = base if cp == 1 else run(hw_name, a.layers, seq, tp, cp, a.attention, not a.no_lb, a.remat)
            fits = lambda r: "yes" if r["peak"] <= HBM[hw_name] else "no"     # noqa: E731
            print(f"  {hw_name}  {seq // K:5d}K  {tp:2d}  {cp:2d}  {base['step']:9.2f} s {100 * base['mfu']:5.1f}% "
                  f"{base['peak'] / 2**30:8.1f} GiB ({fits(base):3s}) | {row['step']:7.2f} s {100 * row['mfu']:5.1f}% "
                  f"{row['peak'] / 2**30:7.1f} GiB ({fits(row):3s})  {row['cp_bytes'] / 2**30:9.2f} GiB  "
                  f"{1e3 * row['exposed']:6.1f} ms  {base['step'] / row['step'] * (1 if cp == 1 else 1 / cp):5.2f}x "
                  f"per GPU  ({base['secs'] + (row['secs'] if cp > 1 else 0):.0f} s)")


def memory(a) -> None:
    seq = a.memory
    print(f"activation memory per GPU against the CP axis: llama-8B shape, {a.layers} layers, seq {seq}, batch 1, "
          f"bf16, {a.hw.split(',')[0]}, ring attention, load_balance={not a.no_lb}; load average "
          f"{os.getloadavg()[0]:.1f}")
    first = None
    for cp in (int(c) for c in a.cps.split(",")):
        r = run(a.hw.split(",")[0], a.layers, seq, 1, cp, a.attention, not a.no_lb and cp > 1)
        first = first or r["act"] * cp
        print(f"  CP={cp:3d}  peak/GPU {r['peak'] / 2**30:8.2f} GiB  activations (peak - bf16 params and grads) "
              f"{r['act'] / 2**30:8.2f} GiB  x CP = {r['act'] * cp / first:.3f} of CP=1's  step {r['step']:8.2f} s  "
              f"({r['secs']:.0f} s)")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seqs", default=",".join(str(s) for s in NEMO["h100"]))
    ap.add_argument("--hw", default="h100,b200")
    ap.add_argument("--attention", default="ring")
    ap.add_argument("--no-lb", action="store_true", help="CP without load balancing")
    ap.add_argument("--remat", action="store_true", help="full recomputation of the decoder layers in every row")
    ap.add_argument("--memory", type=int, default=0, help="the memory table at this sequence length instead")
    ap.add_argument("--cps", default="1,2,4,8,16,32")
    a = ap.parse_args(argv)
    memory(a) if a.memory else scaling(a)


if __name__ == "__main__":
    main()
