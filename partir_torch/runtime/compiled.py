"""partition(..., compile=True): the per-device program compiled by TorchInductor.

Real ranks: the whole per-device step (forward, backward, optimizer update and its functional collectives) is one
Inductor graph; the collectives stay `_c10d_functional` ops, so Inductor's comm passes (reordering, bucketing)
apply, and they run on the process group of their axis (gloo on CPU, NCCL on GPU).

Emulated ranks: the interpreter (interpret.py) cuts the program at its collectives; each segment of local ops is
compiled once and called for every rank (the rank's coordinate is an input, so one compiled segment serves all
ranks). Collectives are computed by the interpreter, so Inductor's comm passes do not apply there.

Random draws (dropout) use the eager generator (`fallback_random`), so that a compiled step draws what the eager
step draws: every rank the same whole mask, equal to the single-device step's.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..rules.tags import draws_random


def _has_random(gm: fx.GraphModule) -> bool:
    return any(draws_random(n) for n in gm.graph.nodes)


def _compile(gm: fx.GraphModule, example_args):
    """Inductor on an aten-level GraphModule. The graph is functional already; compile_fx re-traces it (no
    Dynamo: nothing Python-level is left), and the compiled callable takes the same positional tensors."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    patches = {"fallback_random": True} if _has_random(gm) else {}
    with config.patch(patches):
        fn = compile_fx(gm, list(example_args))

    def run(*args):
        out = fn(*args)
        return tuple(out) if isinstance(out, list) else out

    return run


def compile_program(gm: fx.GraphModule, args: list):
    """Real ranks: one compiled step for this rank (args: its local tensors)."""
    return _compile(gm, args)


def compile_segments(plan) -> None:
    """Emulated ranks: each segment of plan (interpret.Plan) compiled lazily, on its first call with rank 0's
    operands as the example."""
    for seg in plan.segments():
        if not any(n.op == "call_function" for n in seg.graph.nodes):
            continue
        seg.fn = _Lazy(seg.gm)


class _Lazy:
    def __init__(self, gm):
        self.gm, self.fn = gm, None

    def __call__(self, *args):
        if self.fn is None:
            self.fn = _compile(self.gm, args)
        return self.fn(*args)
