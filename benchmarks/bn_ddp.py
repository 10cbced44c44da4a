"""BatchNorm nets at DDP speed (issue 37, item 4): torchvision resnet18 on 4 gloo ranks, partir_torch's
data_parallel with batchnorm="local" (per-rank statistics, as DDP) and "global" (statistics over the whole batch,
as one device) against torch DDP (its defaults: 25 MiB buckets, broadcast_buffers=True), SGD with momentum, fp32.

    OMP_NUM_THREADS=1 .venv-timm/bin/python benchmarks/bn_ddp.py [--steps 10] [--warmup 2] [--batch 32] [--px 64]

One run: the three are built in each rank, then their steps timed interleaved (DDP, local, global, DDP, ...), a
barrier before and after each step; median seconds per step, and the ratio to DDP's. Collectives per step: partir's
from its program (prog.collectives(): each bucket once), DDP's gradient buckets from its logging data (after the
rebuild of its first step) plus the one coalesced broadcast of its buffers before each forward.
Also printed: the step-1 loss of each (DDP's averaged over the ranks; partir's is the global batch's mean, the
same number for "local", a different one for "global").
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORLD = 4
IMPLS = ("DDP", "partir local", "partir global")


def loss_fn(m, x, y):
    return F.cross_entropy(m(x), y)


def _model():
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=100)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def make_ddp(batch, rank):
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = _sgd(model.parameters())
    per = batch[0].shape[0] // WORLD
    x, y = (t[rank * per:(rank + 1) * per] for t in batch)

    def step():
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        return loss

    def loss_of(loss):
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        return (loss / WORLD).item()

    def collectives():
        sizes = str(model._get_ddp_logging_data().get("bucket_sizes", "")).split(", ")
        return f"all_reduce x{len(sizes)} (gradient buckets), broadcast x1 (buffers)"
    return step, loss_of, collectives


def make_partir(batch, batchnorm):
    import partir_torch as pt

    model = _model()
    prog = pt.partition(model, pt.Mesh({"batch": WORLD}), [pt.tactics.data_parallel("batch", batchnorm=batchnorm)],
                        example_inputs=batch, loss_fn=loss_fn, optimizer=_sgd(model.parameters()))

    def collectives():
        by: dict = {}
        for r in prog.collectives():
            by[(r.kind, r.why)] = by.get((r.kind, r.why), 0) + 1
        return ", ".join(f"{k} x{n} ({why})" for (k, why), n in sorted(by.items()))
    return (lambda: prog.train_step(*batch)), (lambda loss: float(loss)), collectives


def measure(rank, args) -> dict:
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(args.batch, 3, args.px, args.px, generator=g), torch.randint(0, 100, (args.batch,), generator=g))
    built, out = {}, {}
    for impl in IMPLS:
        t0 = time.perf_counter()
        step, loss_of, coll = make_ddp(batch, rank) if impl == "DDP" else \
            make_partir(batch, impl.split()[1])
        out[impl] = {"loss": loss_of(step()), "first": time.perf_counter() - t0, "times": []}
        built[impl] = (step, coll)
        dist.barrier()
    for _ in range(args.warmup - 1):
        for step, _ in built.values():
            step()
    for _ in range(args.steps):
        for impl, (step, _) in built.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            out[impl]["times"].append(time.perf_counter() - t0)
    for impl, (_, coll) in built.items():
        out[impl]["secs"] = statistics.median(out[impl].pop("times"))
        out[impl]["collectives"] = coll()
    return out


def _worker(rank, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=args.timeout))
    res = measure(rank, args)
    if rank == 0:
        queue.put(res)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32, help="global batch (split over the 4 ranks)")
    ap.add_argument("--px", type=int, default=64, help="image side")
    ap.add_argument("--timeout", type=float, default=3000)
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    t0 = time.perf_counter()
    ctx = mp.start_processes(_worker, args=(port, args, queue), nprocs=WORLD, join=False, start_method="spawn")
    res = queue.get(timeout=args.timeout)
    ctx.join(timeout=120)
    print(f"resnet18 (torchvision, 100 classes), 4 gloo ranks x 1 thread, global batch {args.batch} at {args.px} px, "
          f"SGD momentum, fp32; median of {args.steps} interleaved steps after {args.warmup} warm-up")
    ddp = res["DDP"]["secs"]
    for impl in IMPLS:
        r = res[impl]
        print(f"{impl:14s} {r['secs'] * 1e3:8.1f} ms/step  {r['secs'] / ddp:5.2f}x DDP  step-1 loss "
              f"{r['loss']:.6f}  build+1st {r['first']:.1f} s  {r['collectives']}")
    print(f"(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
