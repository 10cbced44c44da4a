"""Evaluation and inference on the live sharded state: prog.eval_step(*batch) and prog.forward(*inputs).

For each input signature (shapes, dtypes) the loss-only or forward-only step is captured once in eval mode
(dropout off, batch norm normalising with its running statistics) and partitioned by one seeding pass, "live":
every parameter and buffer is seeded on every axis with the sharding the training program keeps it in (tiled on
its dim or replicated), and every input with the training inputs' tiling where its size allows. Propagation does
the rest. The local shards the training program holds are then fed as they are: no gather, no copy, and the
training step is never partitioned again.
"""
from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..capture import capture
from ..errors import PartitionError
from ..propagate.state import REPLICATED
from ..tactics.base import CaptureRewrite

LIVE = "live"


class _Live:
    """The seeding pass, shaped like a tactic so that Program/TacticContext treat it as one."""

    name, axis = LIVE, ""


class Evaluator:
    def __init__(self, executor):
        self.ex = executor
        self.cache: dict = {}     # (kind, signature) -> (Program, Lowered)

    def eval_step(self, batch):
        if getattr(self.ex.prog, "loss_fn", None) is None:
            raise PartitionError("eval_step needs partition(..., loss_fn=...); use prog.forward(*inputs) for the "
                                 "model's outputs.")
        outs, _, _ = self._run("loss", batch)
        return outs[0]

    def forward(self, inputs):
        outs, cap, _ = self._run("forward", inputs)
        return tree_unflatten(outs[:cap.out_spec.num_leaves], cap.out_spec)

    # -------------------------------------------------------------------------------------------------------------
    def _run(self, kind, batch):
        ex = self.ex
        ex.ensure()
        flat, _ = tree_flatten(tuple(batch))
        for i, x in enumerate(flat):
            if not isinstance(x, torch.Tensor):
                raise PartitionError(f"{'eval_step' if kind == 'loss' else 'forward'}: input {i} is a "
                                     f"{type(x).__name__}; pass tensors.")
        key = (kind, tuple((tuple(x.shape), x.dtype) for x in flat), id(ex.rt))
        if key not in self.cache:
            self.cache[key] = self._build(kind, tuple(batch))
        prog, low = self.cache[key]
        cap = prog.captured
        args, k = [], 0
        for name, role, sh in zip(cap.input_names, cap.input_roles, low.input_layouts):
            if role in ("param", "buffer"):
                args.append(self._live(name, sh))
            elif role == "const":
                args.append(ex.rt.shard(cap.consts[name], sh))
            else:
                args.append(ex.rt.shard(flat[k], sh))
                k += 1
        outs = list(ex.rt.run(low.gm, args + ex.rt.coords()))
        return [ex.rt.rank0(t) for t, n in zip(outs, cap.output_names) if not n.startswith("buffers.")], cap, low

    def _live(self, name, sh):
        """The training program's local shard of a state value, in the eval program's layout `sh`."""
        ex = self.ex
        have = ex._layout(name)
        if _same(sh, have):
            return ex.state[name]
        # the eval program settled on another layout (a conflict): reshard through the full value (correct, slow)
        g = ex.prog.graph
        full = ex.rt.full(ex.state[name], have, g.shapes[g.vid[ex._placeholder(name)]])
        return ex.rt.shard(full, sh)

    def _build(self, kind, batch):
        from ..program import Program, TacticContext
        from ..lower.lower import lower
        from ..propagate.engine import Propagator
        from ..propagate.graph import PartGraph, no_gc
        from ..rules.registry import default_registry

        train = self.ex.prog
        model = train.model
        was = model.training
        model.eval()
        try:
            # the loss runs in the training step's compute dtype (mixed_precision's casts); remat has no backward here
            options = [t for t in train.tactics if isinstance(t, CaptureRewrite) and hasattr(t, "param_dtype")]
            cap = capture(model, batch, train.loss_fn if kind == "loss" else None, None,
                          options if kind == "loss" else (),
                          getattr(train, "decompositions", None), eval_loss=kind == "loss")
        finally:
            model.train(was)
        with no_gc():
            graph = PartGraph(cap.gm, getattr(train, "registry", None) or default_registry(), cap.names, cap.ties)
            prog = Program(cap, graph, Propagator(graph, train.mesh), train.mesh, [_Live()], model, None,
                           train.options)
            ctx = TacticContext(prog)
            # one pass per training stage, seeding what that tactic decided: axes that share a dim compose in the
            # same order as in training (megatron's "model" before ZeRO's "batch" on a weight's dim 0)
            stages = [(s.tactic, s.axis) for s in train.stages if s.axis in train.mesh.axes]
            for k, (tactic, axis) in enumerate(stages):
                last = all(a != axis for _, a in stages[k + 1:])
                seeds = self._seeds(train, cap, axis, tactic, last)
                if seeds:
                    ctx.seed_and_propagate(axis, seeds, LIVE)
            prog.stages.append(prog._snapshot(_Live()))
        low = lower(prog, self.ex.rt.groups)
        moved = [n for n, sh in zip(cap.input_names, low.input_layouts)
                 if n in self.ex.state and not _same(sh, self.ex._layout(n))]
        if moved:
            warnings.warn(f"{kind}: {len(moved)} state value(s) settle in another layout in the eval program than in "
                          f"training ({', '.join(moved[:3])}); they are resharded at every call.", stacklevel=3)
        return prog, low

    @staticmethod
    def _seeds(train, cap, axis, tactic, last) -> list:
        """(name, dim[, split factor]) or (name, REPLICATED) on `axis` for the values training's `tactic` decided
        there (last: also those no tactic decided): state as training keeps it; inputs tiled like training's
        inputs where the size divides."""
        mesh = train.mesh
        seeds = []
        decisions = train.decisions
        for name, role in zip(cap.input_names, cap.input_roles):
            vid = train.graph.name_to_vid.get(name)
            by = decisions.tactic_of(vid, axis) if vid is not None else "-"     # "-": no tactic decided it
            if not (by == tactic if by != "-" else last):
                continue
            if role in ("param", "buffer"):
                sh = train.sharding(name)
                d = sh.tiled_axes().get(axis)
                if d is None:
                    seeds.append((name, REPLICATED))
                else:
                    stride = dict(sh.strides).get(axis)
                    seeds.append((name, d) + ((stride,) if stride and stride > 1 else ()))
            elif role == "input" and name in train.graph.name_to_vid:
                sh = train.sharding(name)
                d = sh.tiled_axes().get(axis)
                shape = cap.names[name].meta["val"].shape
                if d is not None and d < len(shape):
                    k = 1
                    for a in sh.dims[d][:sh.dims[d].index(axis) + 1]:
                        k *= mesh.shape[a]
                    if shape[d] % k == 0:
                        seeds.append((name, d))
        return seeds


def _same(a, b) -> bool:
    """The same data layout (explicitly-replicated markers aside)."""
    return tuple(map(tuple, a.dims)) == tuple(map(tuple, b.dims)) and tuple(a.partial) == tuple(b.partial) and \
        tuple(a.strides) == tuple(b.strides)
