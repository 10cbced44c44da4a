"""The memory a kept program holds, per node of its graphs (runtime/shapes.py FULL_NODE_BYTES and
INSTANCE_NODE_BYTES, the units of Options.shape_cache_bytes), measured with tracemalloc (issue 40).

For the zoo's GPT and a tiny Hugging Face GPT-2 under DP x MP on an emulated 2x2 mesh, partitioned (not measured),
then measured: the Python memory still held after

- full: train_step at a second length, which makes the length and the batch dim symbols and partitions the fit's
  grid (4 programs besides the first: runtime/dims.py), each program then run once (its segments generated,
  runtime/interpret.py); over the nodes of those programs' captured steps and lowered programs;
- instance: train_step at new lengths (each an instance of the fit, run once); over their lowered programs' nodes;
- bounded: the same two phases again with shape_cache_bytes=1 (every program but the example inputs' dropped as
  the next one comes): what stays held, the family's base program and the template included.

tracemalloc sees Python's allocations (graphs, meta, fake tensors, plans, generated code), not tensor storage (the
state and the captured constants, a few small tensors here). Prints bytes per node and the constants.

    OMP_NUM_THREADS=1 python benchmarks/program_bytes.py
"""
from __future__ import annotations

import gc
import os
import sys
import tracemalloc
import warnings

import torch

import partir_torch as pt
from partir_torch.runtime.shapes import FULL_NODE_BYTES, INSTANCE_NODE_BYTES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dynamic_loop import gpt2, loss_fn as hf_loss  # noqa: E402

T = pt.tactics
LENGTHS = [24, 28, 40, 44, 52, 56]


def held() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def nodes(prog, full: bool) -> int:
    """Nodes of the kept programs besides the example inputs': full ones' captured + lowered, instances' lowered."""
    ex = prog.executor
    entries = [e for e in ex.shapes.entries.values() if e is not ex.first and (e.canonical is None) == full]
    if full:
        return sum(len(e.plan.captured.gm.graph.nodes) + len(e.plan.lowered().gm.graph.nodes) for e in entries)
    return sum(len(e.canonical.gm.graph.nodes) for e in entries)


def phases(model, loss_fn, batch, options):
    """(bytes held after the full programs, after the instances, the program)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), [T.data_parallel("batch"), T.megatron("model")],
                        example_inputs=batch(8, 32), loss_fn=loss_fn, optimizer=opt, options=options)
    prog.train_step(*batch(8, 32))
    t0 = held()
    prog.train_step(*batch(8, 48))                                  # the length and the batch become symbols
    for e in list(prog.executor.shapes.entries.values()):
        if e.calls == 0:
            b, n = e.signature[0][0]
            prog.train_step(*batch(b, n))
    t1 = held()
    for n in LENGTHS:
        prog.train_step(*batch(8, n))
    return t1 - t0, held() - t1, prog


def measure(name, model, loss_fn, batch):
    import copy

    tracemalloc.start()
    full, inst, prog = phases(copy.deepcopy(model), loss_fn, batch, pt.Options())
    nf, ni = nodes(prog, True), nodes(prog, False)
    del prog
    b_full, b_inst, bounded = phases(model, loss_fn, batch, pt.Options(shape_cache_bytes=1))
    kept = len(bounded.executor.shapes)
    tracemalloc.stop()
    print(f"{name}: 4 full programs {full / 2 ** 20:.1f} MiB / {nf} nodes = {full / nf:.0f} B per node; "
          f"{len(LENGTHS)} instances {inst / 2 ** 20:.1f} MiB / {ni} nodes = {inst / ni:.0f} B per node; "
          f"shape_cache_bytes=1: {b_full / 2 ** 20:.1f} MiB, then {b_inst / 2 ** 20:+.1f} MiB, {kept} program(s) kept")


def main():
    warnings.simplefilter("ignore")
    from examples.models import get

    spec = get("gpt")
    measure("zoo gpt (seq 64)", spec.build(seq=64), spec.loss_fn, lambda b, n: spec.batch(b, seq=n, seed=n))
    g = torch.Generator().manual_seed(0)

    def hf_batch(b, n):
        ids = torch.randint(0, 512, (b, n), generator=g)
        return ids, ids.clone()
    measure("HF GPT-2 d=256 layers=2", gpt2(256, 2), hf_loss, hf_batch)
    print(f"FULL_NODE_BYTES = {FULL_NODE_BYTES}, INSTANCE_NODE_BYTES = {INSTANCE_NODE_BYTES} (runtime/shapes.py); "
          f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
