"""async_tp on real ranks: Megatron + sequence parallelism with its all_gathers and reduce_scatters as collectives
(plain) against the same program with them as rings of point-to-point steps (async_tp=True, lower/ring.py).

    python benchmarks/async_tp.py [--steps 8] [--warmup 2] [--tp 4]

One run: 4 CPU processes on gloo, one thread each, mesh {model: tp} (tp = 4) or {batch: 4 / tp, model: tp}; the zoo's
Llama-style decoder d=256, 4 layers, 4 heads (4 kv heads), vocab 4096, batch 16 x 128, AdamW, fp32; the two
programs' steps interleaved (A, B, A, B, ...), median step time per program on rank 0, and the largest difference
of their losses. Both programs move the same bytes; on 2 shared CPU cores there is no idle core for the transfers
to overlap with, so this measures the rings' overhead (more, smaller transfers and the index_selects), not the
overlap a GPU gets; the simulator's figures for GPUs are in benchmarks/notes/async_tp.md
(sim_validation.py --breakdown).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
WORLD = 4


def _worker(rank, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import partir_torch as pt
    from examples.models import get

    T = pt.tactics
    spec = get("llama", vocab=4096, seq=128, d=256, heads=4, kv_heads=4, layers=4)
    mesh = {"model": args.tp} if args.tp == WORLD else {"batch": WORLD // args.tp, "model": args.tp}
    batch = spec.batch(16)
    progs = {}
    for name, ring in (("plain", False), ("async_tp", True)):
        torch.manual_seed(0)
        model = spec.build()
        sched = ([T.data_parallel("batch")] if "batch" in mesh else []) + [T.megatron("model"),
                                                                              T.sequence_parallel("model")]
        progs[name] = pt.partition(model, pt.Mesh(mesh), sched, example_inputs=batch, loss_fn=spec.loss_fn,
                                   optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                   options=pt.Options(async_tp=ring))
    times = {k: [] for k in progs}
    losses = {k: [] for k in progs}
    for step in range(args.warmup + args.steps):
        for name, prog in progs.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = prog.train_step(*batch)
            losses[name].append(loss.item())
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        kinds = {k: sorted({(r.kind, r.axis) for r in p.collectives()}) for k, p in progs.items()}
        queue.put((times, losses, kinds))
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tp", type=int, default=4, choices=(2, 4))
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    times, losses, kinds = queue.get(timeout=1800)
    for p in procs:
        p.join()
    base = statistics.median(times["plain"])
    for name in times:
        med = statistics.median(times[name])
        print(f"{name:9s} median step {1e3 * med:8.1f} ms  ({med / base:.3f}x plain)  collectives {kinds[name]}")
    diff = max(abs(a - b) for a, b in zip(losses["plain"], losses["async_tp"]))
    print(f"largest loss difference between the programs over {len(losses['plain'])} steps: {diff:.2e}")
    print(f"load average: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
