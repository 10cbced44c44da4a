"""Step time and bytes communicated: partir_torch (eager and compiled) vs hand-written DTensor TP + FSDP2 (eager
and compiled per block), on 4 real gloo ranks; and the cost of emulating the ranks in one process.

    python benchmarks/step_time.py [--steps 10] [--warmup 2] [--models llama,gpt] [--no-compile] [--profile]

One run. Both models, mesh {batch: 2, model: 2}, schedule BP+MP+Z3, AdamW, fp32, 4 CPU processes on gloo with
one thread each; the steps of all implementations of a model are timed interleaved (A, B, C, D, A, B, ...):

  partir eager      data_parallel("batch"), megatron("model"), zero(3, "batch"); the per-device program op by op,
                    its AdamW update as fused multi-tensor kernels (lower/fuse.py)
  partir compiled   the same program, partition(..., compile=True): the whole per-device step compiled by Inductor
                    with its functional collectives
  DTensor eager     parallelize_module (Colwise on the q/k/v and up/gate projections, Rowwise on the output and
                    down projections, PrepareModuleInput on attention and MLP: torchtitan's plan without sequence
                    parallelism) on "model", then fully_shard (FSDP2) of every block and the root on "batch";
                    torch.optim.AdamW (foreach)
  DTensor compiled  the same with torch.compile on each block before fully_shard (torchtitan's apply_compile)

Models: llama = the zoo's Llama-style decoder (RMSNorm, SwiGLU, GQA with rope) d=256, 4 layers, 4 heads (2 kv
heads), vocab 4096, batch 16 x 128; gpt = the zoo's GPT (gpt_sdpa) d=512, 8 layers, 8 heads, vocab 4096, batch
8 x 128 (--gpt-batch).

Bound: the same step (eager, foreach AdamW) of the whole model in one process with one thread, halved: 4 ranks on
2 cores can at best split that work in two.

Emulation (in this process, after the ranks exit): partir's emulated step of the 4 ranks (runtime/interpret.py)
against the sum of the 4 ranks' local steps run as plain eager programs (the same per-device GraphModule called
once per rank, its collectives on a `fake` process group, which moves no data), interleaved.

CPU: each rank's process time per step (gloo's threads included), summed over the ranks: 4 ranks share 2 cores,
so the wall time is at least half of it. --profile adds one profiled step (torch.profiler) of each eager
implementation on every rank, its self CPU time by category.

Bytes are counted by one TorchDispatchMode that sees every collective op the step issues (c10d functional ops from
partir_torch and DTensor, partir_torch's bucket all_gathers and all_reduces, c10d ops from FSDP2), in the nccl-tests convention (the full array an all_reduce reduces,
an all_gather produces or a reduce_scatter consumes), per rank and step.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import traceback
import types
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from partir_torch.lower.bucketops import ALL_GATHER_BUCKET, ALL_REDUCE_BUCKET  # noqa: E402

WORLD, DP, TP = 4, 2, 2
F32 = 4

# -- counting collectives ---------------------------------------------------------------------------------------
funcol = torch.ops._c10d_functional
c10d = torch.ops.c10d


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


# op -> (kind, bytes of the full array from (args, result))
_COUNTED = {
    funcol.all_reduce.default: ("all_reduce", lambda a, r: _nbytes(a[0])),
    funcol.all_reduce_coalesced.default: ("all_reduce", lambda a, r: _nbytes(a[0])),
    funcol.all_gather_into_tensor.default: ("all_gather", lambda a, r: _nbytes(r)),
    funcol.all_gather_into_tensor_coalesced.default: ("all_gather", lambda a, r: _nbytes(r)),
    funcol.reduce_scatter_tensor.default: ("reduce_scatter", lambda a, r: _nbytes(a[0])),
    funcol.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", lambda a, r: _nbytes(a[0])),
    funcol.all_to_all_single.default: ("all_to_all", lambda a, r: _nbytes(a[0])),
    # Inductor's forms of the same collectives (in place / out variants)
    funcol.all_reduce_.default: ("all_reduce", lambda a, r: _nbytes(a[0])),
    funcol.all_reduce_coalesced_.default: ("all_reduce", lambda a, r: _nbytes(a[0])),
    funcol.all_gather_into_tensor_out.default: ("all_gather", lambda a, r: _nbytes(r)),
    c10d.allreduce_.default: ("all_reduce", lambda a, r: _nbytes(a[0])),
    c10d._allgather_base_.default: ("all_gather", lambda a, r: _nbytes(a[0])),
    c10d.allgather_into_tensor_coalesced_.default: ("all_gather", lambda a, r: _nbytes(a[0])),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", lambda a, r: _nbytes(a[1])),
    c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", lambda a, r: _nbytes(a[1])),
    c10d.allgather_.default: ("all_gather", lambda a, r: _nbytes(a[0])),
    c10d.reduce_scatter_.default: ("reduce_scatter", lambda a, r: _nbytes(a[1])),
    # partir's bucket collectives (lower/bucketops.py): one all_gather / all_reduce of a bucket's members, into one
    # buffer. The mode does not see the process-group calls inside them, so they are counted here, once per bucket
    ALL_GATHER_BUCKET: ("all_gather", lambda a, r: _nbytes(r)),
    ALL_REDUCE_BUCKET: ("all_reduce", lambda a, r: _nbytes(a[0])),
}


class CountCollectives(TorchDispatchMode):
    """Counts every collective issued inside the mode: {kind: [calls, bytes]}."""

    def __init__(self):
        super().__init__()
        self.by_kind: dict = {}

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        row = _COUNTED.get(func)
        if row is not None:
            kind, size = row
            n, b = self.by_kind.get(kind, (0, 0))
            self.by_kind[kind] = (n + 1, b + size(args, out))
        return out

    @property
    def total(self) -> int:
        return sum(b for _, b in self.by_kind.values())


# -- the models -----------------------------------------------------------------------------------------------------
def model_spec(name, args):
    from examples.models import get

    if name == "llama":
        return get("llama", vocab=4096, seq=128, d=256, heads=4, kv_heads=2, layers=4), args.llama_batch
    return get("gpt_sdpa", vocab=4096, seq=128, d=512, heads=8, layers=8), args.gpt_batch


def _tp_gpt_attention(self, x):
    """The zoo GPT's Attention.forward with local heads: view(B, T, -1, head_dim) (ColwiseParallel outputs d/tp)."""
    B, T, _ = x.shape
    q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H/tp, T, hd)
    k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H/tp, T, hd)
    v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H/tp, T, hd)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
    y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, d/tp)
    return self.wo(y)


def hand_written(name, model, device_mesh, compile_blocks: bool):
    """Megatron via parallelize_module on the "model" sub-mesh, then FSDP2 on "batch" (torchtitan's order: TP,
    compile each block, FSDP)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    def shared(n_extra=0):   # one Replicate block input shared by the projections: one input all-reduce
        return PrepareModuleInput(input_layouts=(Replicate(),) + (None,) * n_extra,
                                  desired_input_layouts=(Replicate(),) + (None,) * n_extra)

    for block in model.layers:
        if name == "llama":
            plan = {"attention": shared(2), "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                    "feed_forward": shared(), "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()}
            block.attention.heads //= TP
            block.attention.kv_heads //= TP
        else:
            plan = {"attn": shared(), "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                    "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
                    "mlp": shared(), "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel()}
            block.attn.head_dim = block.attn.wq.out_features // block.attn.heads
            block.attn.forward = types.MethodType(_tp_gpt_attention, block.attn)
        parallelize_module(block, device_mesh["model"], plan)
        if compile_blocks:
            block.compile()
    for block in model.layers:
        fully_shard(block, mesh=device_mesh["batch"])
    fully_shard(model, mesh=device_mesh["batch"])
    return model


def make_partir(spec, batch, compile_: bool):
    """(step() -> loss tensor, global loss of a step's result)."""
    import partir_torch as pt

    T = pt.tactics
    model = spec.build()
    prog = pt.partition(model, pt.Mesh({"batch": DP, "model": TP}),
                        [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")], example_inputs=batch,
                        loss_fn=spec.loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                        options=pt.Options(compile=compile_))
    held = lambda: list(prog.executor.state.values())   # noqa: E731 - this rank's shards of the state
    return (lambda: prog.train_step(*batch)), (lambda loss: loss.item()), held


def make_hand_written(name, spec, batch, compile_: bool):
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("batch", "model"))
    model = hand_written(name, spec.build(), device_mesh, compile_)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    b = device_mesh.get_local_rank("batch")     # each rank feeds its rows (replicated over "model")
    per = batch[0].shape[0] // DP
    batch = tuple(t[b * per:(b + 1) * per] for t in batch)

    def step():
        opt.zero_grad()
        loss = spec.loss_fn(model, *batch)
        loss.backward()
        opt.step()
        return loss

    def global_loss(loss):   # the mean over the global batch (outside the timed and counted steps)
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=device_mesh.get_group("batch"))
        return (loss / DP).item()

    def held():              # this rank's shards of parameters and optimizer state, and its rows of the batch
        ts = list(model.parameters()) + [t for st in opt.state.values() for t in st.values()] + list(batch)
        return [t.to_local() if hasattr(t, "to_local") else t for t in ts if isinstance(t, torch.Tensor)]

    return step, global_loss, held


IMPLS = ("partir eager", "partir compiled", "DTensor eager", "DTensor compiled")


def measure(name, args) -> dict:
    """Build every implementation (a compiled one compiles in its first steps), then time their steps interleaved
    so that load changes on the machine hit all alike; finally count the collectives of one more step of each."""
    spec, bsz = model_spec(name, args)
    batch = spec.batch(bsz)
    built, out, holds = {}, {}, {}
    for impl in IMPLS:
        if "compiled" in impl and not args.compile:
            continue
        t0 = time.perf_counter()
        try:
            step, global_loss, held = make_partir(spec, batch, "compiled" in impl) if impl.startswith("partir") \
                else make_hand_written(name, spec, batch, "compiled" in impl)
            loss = global_loss(step())
            built[impl] = step
            holds[impl] = held
            out[impl] = {"loss": loss, "times": [], "first": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - reported in the table
            out[impl] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                         "trace": traceback.format_exc()}
        dist.barrier()
    for _ in range(args.warmup - 1):
        for step in built.values():
            step()
    for _ in range(args.steps):
        for impl, step in built.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            c1 = time.process_time()
            dist.barrier()
            out[impl]["times"].append(time.perf_counter() - t0)
            out[impl].setdefault("cpu", []).append(c1 - c0)
    for impl, step in built.items():
        counter = CountCollectives()
        with counter:
            step()
        r = out[impl]
        r.update(secs=statistics.median(r.pop("times")), cpu=statistics.median(r["cpu"]), bytes=counter.total,
                 by_kind=counter.by_kind)
        if "eager" in impl:       # Inductor allocates out of the tracker's sight: eager programs only
            r["peak"] = _peak(step, holds[impl]())
        if args.profile and "eager" in impl:
            r["profile"] = _profile(step)
    return out


# op name -> category of the profile (the first pattern that the name contains)
_CATEGORIES = (("wait", ("wait_tensor", "wait", "barrier")),
               ("collective issue", ("c10d", "gloo", "all_reduce", "all_gather", "reduce_scatter", "allreduce",
                                     "allgather")),
               ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
                           "scaled_dot_product", "flash_attention")),
               ("optimizer", ("_foreach", "_fused_adam", "adam")),
               ("copies", ("aten::copy_", "aten::cat", "aten::clone", "aten::contiguous", "aten::split",
                           "aten::view", "aten::reshape", "aten::t", "aten::transpose", "aten::permute",
                           "aten::slice", "aten::select", "aten::expand", "aten::_to_copy", "aten::to",
                           "aten::empty", "aten::zeros", "aten::new_", "aten::as_strided", "aten::detach",
                           "aten::unsqueeze", "aten::squeeze", "aten::_unsafe_view", "aten::alias")))


def _profile(step) -> dict:
    """One step under torch.profiler on this rank: self CPU seconds by category, the number of aten ops dispatched,
    and the step's wall and CPU seconds (CPU over wall below 1: the rank waited for the others or for a core)."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    cats, n_aten = {}, 0
    for ev in prof.key_averages():
        name = ev.key
        if name.startswith("aten::"):
            n_aten += ev.count
        cat = next((c for c, pats in _CATEGORIES if any(q in name for q in pats)),
                   "other aten" if name.startswith("aten::") else "python / other")
        cats[cat] = cats.get(cat, 0.0) + ev.self_cpu_time_total / 1e6
    return {"wall": wall, "cpu": cpu, "aten ops": n_aten, "categories": cats}


def _peak(step, held) -> int:
    """This rank's peak of live tensor bytes over one step (partir_torch/runtime/memtrack.py: every storage once;
    the state and the batch it holds from the start)."""
    from partir_torch.runtime.memtrack import MemoryTracker

    tr = MemoryTracker([0])
    with tr.step({0: held}):
        tr.rank = 0
        step()
    return tr.peaks[0]


def _worker(rank, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=args.timeout))
    results = {name: measure(name, args) for name in args.models}
    gathered = [None] * WORLD                  # every rank's CPU seconds and profile, for the table
    dist.all_gather_object(gathered, {name: {impl: {k: r.get(k) for k in ("cpu", "profile")}
                                             for impl, r in res.items()} for name, res in results.items()})
    if rank == 0:
        for name, res in results.items():
            for impl, r in res.items():
                r["ranks"] = [g[name][impl] for g in gathered]
        queue.put(results)
    dist.destroy_process_group()


# -- in this process: the one-process bound and the cost of emulation --------------------------------------------------
def emulation_and_bound(name, args) -> dict:
    """Median seconds of: the whole step in one process (eager, foreach AdamW); partir's emulated step of the 4
    ranks; the 4 ranks' local steps as plain eager programs (collectives on a fake process group), summed."""
    import copy

    import partir_torch as pt
    from partir_torch.lower.lower import bind
    from partir_torch.runtime import call
    from partir_torch.runtime.emulate import _ensure_world

    T = pt.tactics
    spec, bsz = model_spec(name, args)
    batch = spec.batch(bsz)
    model = spec.build()
    one = copy.deepcopy(model)
    one_opt = torch.optim.AdamW(one.parameters(), lr=1e-3, foreach=True)
    prog = pt.partition(model, pt.Mesh({"batch": DP, "model": TP}),
                        [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")], example_inputs=batch,
                        loss_fn=spec.loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    prog.train_step(*batch)
    ex = prog.executor
    # the same per-device program on a fake process group: one plain eager call per rank
    from torch.distributed.device_mesh import init_device_mesh

    _ensure_world(WORLD)
    dm = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("batch", "model"))
    low = bind(prog.plan.lowered(), {a: dm.get_group(a).group_name for a in ("batch", "model")})
    entry, flat = call.program(ex, ex.calls, batch, "train_step")
    per_rank = [[a.ts[r] for a in call.arguments(ex, entry, flat, ex.paths.draws, False, "train_step")]
                for r in range(WORLD)]

    def one_step():
        one_opt.zero_grad()
        spec.loss_fn(one, *batch).backward()
        one_opt.step()

    def local_steps():
        for r in range(WORLD):
            low.gm(*per_rank[r])

    runs = {"one process": one_step, "emulated": lambda: prog.train_step(*batch), "local sum": local_steps}
    times = {k: [] for k in runs}
    for f in runs.values():
        f()
    for _ in range(args.steps):
        for k, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--models", default="llama,gpt")
    ap.add_argument("--llama-batch", type=int, default=16)
    ap.add_argument("--gpt-batch", type=int, default=8)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--timeout", type=float, default=3000)
    ap.add_argument("--verbose", action="store_true", help="print the traceback of an implementation that failed")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one step of each eager implementation on every rank (torch.profiler) and "
                         "print where each rank's time goes")
    args = ap.parse_args(argv)
    args.models = args.models.split(",")
    from tabulate import tabulate

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    t0 = time.perf_counter()
    ctx = mp.start_processes(_worker, args=(port, args, queue), nprocs=WORLD, join=False, start_method="spawn")
    results = queue.get(timeout=args.timeout)
    ctx.join(timeout=120)
    t_ranks = time.perf_counter() - t0
    local = {name: emulation_and_bound(name, args) for name in args.models}

    print(f"4 gloo ranks on 127.0.0.1, mesh batch=2 x model=2, BP+MP+Z3, AdamW, fp32, 1 thread per rank; median of "
          f"{args.steps} interleaved steps after {args.warmup} warm-up; bytes per rank per step (full-array "
          f"convention); bound = one-process step / 2\n")
    rows = []
    for name in args.models:
        spec, bsz = model_spec(name, args)
        n_params = sum(p.numel() for p in spec.build().parameters())
        res, bound = results[name], local[name]["one process"] / 2
        peer = {k: res[k]["secs"] for k in ("DTensor eager", "DTensor compiled") if "secs" in res.get(k, {})}
        for impl in IMPLS:
            r = res.get(impl)
            if r is None:
                continue
            label = f"{name} ({n_params / 1e6:.1f}M, batch {bsz}x128)"
            if "error" in r:
                rows.append([label, impl, "failed", "", "", "", "", "", "", "", r["error"]])
                continue
            kinds = ", ".join(f"{k} x{n}" for k, (n, _) in sorted(r["by_kind"].items()))
            ratio = lambda k: f"{r['secs'] / peer[k]:.2f}" if k in peer else "n/a"  # noqa: E731
            peak = f"{r['peak'] / 2**20:.2f}" if "peak" in r else "n/a"
            rows.append([label, impl, f"{r['loss']:.6f}", f"{r['secs'] * 1e3:.0f}", ratio("DTensor eager"),
                         ratio("DTensor compiled"), f"{r['secs'] / bound:.2f}", f"{r['bytes'] / 1e6:.3f}", peak,
                         f"{r['first']:.0f}", kinds])
    print(tabulate(rows, headers=["model", "implementation", "step-1 loss", "ms/step", "vs DTensor eager",
                                  "vs DTensor compiled", "vs bound", "MB/step", "peak MiB (rank 0)",
                                  "build+1st step s", "collectives per step"], disable_numparse=True), flush=True)
    print("\nemulation (this process, 1 thread): partir's emulated step of the 4 ranks vs the 4 local steps as "
          "plain eager programs, summed")
    rows = []
    for name in args.models:
        t = local[name]
        rows.append([name, f"{t['one process'] * 1e3:.0f}", f"{t['emulated'] * 1e3:.0f}",
                     f"{t['local sum'] * 1e3:.0f}", f"{t['emulated'] / t['local sum']:.2f}"])
    print(tabulate(rows, headers=["model", "one-process step ms", "emulated step ms", "sum of local steps ms",
                                  "emulated / local sum"], disable_numparse=True))
    _print_cpu(results, args)
    for name in args.models:
        for impl, r in results[name].items():
            if "error" in r and args.verbose:
                print(f"\n{name} {impl} failed:\n{r['trace']}")
    print(f"\n(ranks {t_ranks:.0f} s, total wall time {time.perf_counter() - t0:.0f} s)")


def _print_cpu(results, args):
    """CPU seconds per step summed over the ranks (4 ranks share 2 cores: wall >= that sum / 2), and with
    --profile where one profiled step's self CPU time goes, per category, summed over the ranks."""
    from tabulate import tabulate

    rows = []
    for name in args.models:
        for impl, r in results[name].items():
            if "secs" not in r:
                continue
            cpu = sum(x["cpu"] for x in r["ranks"])
            rows.append([name, impl, f"{r['secs'] * 1e3:.0f}", f"{cpu * 1e3:.0f}",
                         " ".join(f"{x['cpu'] * 1e3:.0f}" for x in r["ranks"]), f"{cpu / 2 / r['secs']:.2f}"])
    print("\nCPU per step (process time of each rank, gloo's threads included; median over the timed steps)")
    print(tabulate(rows, headers=["model", "implementation", "wall ms", "CPU ms, 4 ranks", "per rank",
                                  "CPU / (2 cores x wall)"], disable_numparse=True))
    if not args.profile:
        return
    rows, cats = [], []
    for name in args.models:
        for impl, r in results[name].items():
            profs = [x["profile"] for x in r.get("ranks", []) if x.get("profile")]
            if profs:
                c = {}
                for pr in profs:
                    for k, v in pr["categories"].items():
                        c[k] = c.get(k, 0.0) + v
                cats = sorted(set(cats) | set(c))
                rows.append((name, impl, sum(pr["wall"] for pr in profs) / len(profs),
                             sum(pr["cpu"] for pr in profs), sum(pr["aten ops"] for pr in profs) // len(profs), c))
    print("\nOne profiled step (torch.profiler; the profiler's own cost included): self CPU ms per category, summed "
          "over the 4 ranks")
    print(tabulate([[n, i, f"{w * 1e3:.0f}", f"{cpu * 1e3:.0f}", str(a)] + [f"{c.get(k, 0) * 1e3:.0f}" for k in cats]
                    for n, i, w, cpu, a, c in rows],
                   headers=["model", "implementation", "wall ms", "CPU ms", "aten ops / rank"] + list(cats),
                   disable_numparse=True))


if __name__ == "__main__":
    main()
