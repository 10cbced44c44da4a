"""Evaluation and inference on the live sharded state: prog.eval_step(*batch) and prog.forward(*inputs).

For each input signature (shapes, dtypes) the loss-only or forward-only step is captured once in eval mode
(dropout off, batch norm normalising with its running statistics) and partitioned by one seeding pass, "live":
every parameter and buffer is seeded on every axis with the sharding the training program keeps it in (tiled on
its dim or replicated), and every input with the training inputs' tiling where its size allows. Propagation does
the rest. The local shards the training program holds are then fed as they are: no gather, no copy, and the
training step is never partitioned again.
"""
from __future__ import annotations

import time

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from ..capture.inputs import conform
from ..contract import META_NAME, Role
from ..errors import PartitionError, user_stacklevel, warn
from ..lower.lower import bind
from .layout import same_layout
from . import paths
from .live import LiveLayout
from .dims import SymbolicDims
from .shapes import ShapeCache, ShapeInfo, ShapeProgram, signature

class Evaluator:
    def __init__(self, executor):
        self.ex = executor
        # (kind, structure, signature, backend) -> ShapeProgram (plan, lowering bound to the backend), at most
        # Options.max_shapes of them, least recently used first out (shapes.py)
        self.cache = ShapeCache(executor.plan.options.max_shapes, "eval_step / forward", lambda key: key[0][2])
        self.paths: dict = {}          # key -> PathTrie, for a step that branches on tensor values (paths.py)
        self.dims: dict = {}           # (kind, structure, backend) -> SymbolicDims (dims.py)

    def eval_step(self, batch):
        if self.ex.loss_fn is None:
            raise PartitionError("eval_step needs partition(..., loss_fn=...); use prog.forward(*inputs) for the "
                                 "model's outputs.")
        outs, _, _ = self._run("loss", batch)
        return outs[0]

    def forward(self, inputs):
        outs, cap, _ = self._run("forward", inputs)
        return cap.out_spec.unflatten(outs[:cap.out_spec.num_leaves])

    # -------------------------------------------------------------------------------------------------------------
    def _run(self, kind, batch):
        ex = self.ex
        ex.ensure()
        batch = conform(tuple(batch), None)           # mappings as dicts (an HF BatchEncoding)
        flat, spec = tree_flatten(batch)
        what = "eval_step" if kind == "loss" else "forward"
        ex.agree(what, flat)                          # real ranks: the same call everywhere (faults.py)
        ex.first_call()
        _refuse_non_tensors(what, batch)
        # the structure too: a dict with its keys in another order is another program's inputs (capture flattens
        # a dict in its key order)
        ex.held().guard(what)
        key = (kind, str(spec), signature(flat), id(ex.rt))
        # a step that branches on tensor values: its guards select the path's program (paths.py)
        real = paths.real_values([f"inputs.{i}" for i in range(len(flat))], flat, ex.held())
        values, ckey, draws = (), (key, ()), {}
        rng = paths.generator_state(ex.plan.captured.device)
        if key in self.paths:
            values, ckey, draws = paths.guard_values(self.paths[key], real)
        entry = self.cache.get(ckey) if ckey is not None else None
        family = (kind, str(spec), id(ex.rt))        # the programs whose sizes may become a symbol (dims.py)
        symbolic = key not in self.paths and not ex.plan.pipeline.staged and ex.rt.kind != "xla"
        if entry is None and symbolic and family in self.dims:
            entry = self.dims[family].instance(key[2], lambda sig, plan, low, t, s: ShapeProgram(
                key, plan, None, None, t, lowered=bind(low, ex.rt.groups), rt=ex.rt, canonical=low, dim=s))
            if entry is not None:
                self.cache.add(entry)
        if entry is None:
            paths.rewind(rng, ex.plan.captured.device)
            entry = self._build(kind, tuple(batch), key, real)
            paths.join(self.paths, key, entry, values)
            if entry.path:      # capture left the generator where it found it
                values, ckey, draws = paths.guard_values(self.paths[key], real)
            elif symbolic:
                self._built(family, kind, entry, tuple(batch), what)
            self.cache.add(entry)
        entry.calls += 1
        plan, low = entry.plan, entry.lowered
        cap = plan.captured
        args, k = [], 0
        for name, role, sh in zip(cap.input_names, cap.input_roles, low.input_layouts):
            if role in (Role.PARAM, Role.BUFFER):
                args.append(self._live(name, sh))
            elif role == Role.CONST:
                args.append(ex.rt.shard(cap.consts[name], sh))
            elif role == Role.DRAW:
                args.append(ex.rt.shard(draws[name[len("draws."):]], sh))
            else:
                args.append(ex.rt.shard(flat[k], sh))
                k += 1
        outs = ex.execute(low.gm, args + ex.rt.coords(), what, plan)
        if cap.checks:
            paths.verify(cap.checks, cap.output_names, outs, ex.rt.rank0, what)
        return [ex.rt.rank0(t) for t, n in zip(outs, cap.output_names) if not n.startswith("buffers.")], cap, low

    def _built(self, family, kind, entry, batch, what) -> None:
        """A program partitioned in full: the first of its family, or a point of it (dims.py)."""
        if family not in self.dims:
            self.dims[family] = SymbolicDims(entry, what, sig_of=lambda e: e.signature[2])
            return

        def trace(where):
            from ..plan import capture_for

            model, was = self.ex.model, self.ex.model.training
            model.eval()
            try:
                rewrites, tactics = self._schedule(kind)
                return capture_for(model, rewrites + tactics, batch, self.ex.loss_fn if kind == "loss" else None,
                                   eval_loss=kind == "loss", dynamic=where)
            finally:
                model.train(was)
        self.dims[family].built(entry, trace)

    def _schedule(self, kind):
        """(capture rewrites, tactics) an eval program is captured with: the loss runs in the training step's
        compute dtype (mixed_precision's casts); remat has no backward here."""
        train = self.ex.plan
        tactics = [t for t in train.tactics if t not in train.capture_rewrites]
        return ([t for t in train.capture_rewrites if t.in_eval] if kind == "loss" else []), tactics

    def _live(self, name, sh):
        """The training program's local shard of a state value, in the eval program's layout `sh`."""
        held = self.ex.held()
        have = held.layouts[name]
        if same_layout(sh, have):
            return held.state[name]
        # the eval program settled on another layout (a conflict): reshard through the full value (correct, slow)
        full = held.rt.full(held.state[name], have, held._shape(name))
        return held.rt.shard(full, sh)

    def _build(self, kind, batch, key, real=None):
        from ..plan import capture_for, plan

        train = self.ex.plan
        staged = train.pipeline.staged and self.ex.rt.kind == "distributed"
        if staged and kind != "loss":
            raise PartitionError("forward of a pipelined program on real ranks is not supported yet (each rank holds "
                                 "its stages' state only; eval_step runs through the stages); run it with ranks "
                                 "emulated, or gather the parameters (prog.gather_parameters()).")
        pipe = _eval_pipeline(train, batch) if staged else None
        model = self.ex.model
        was = model.training
        model.eval()
        t0 = time.perf_counter()
        try:
            rewrites, tactics = self._schedule(kind)
            more = {} if pipe is None else dict(accumulate=pipe.n_microbatches, record_modules=True,
                                                 accumulate_dims=train.captured.settings.get("accumulate_dims"))
            cap = capture_for(model, rewrites + tactics, batch, self.ex.loss_fn if kind == "loss" else None,
                              eval_loss=kind == "loss", values=real, **more)
        finally:
            model.train(was)
        t1 = time.perf_counter()
        p = plan(cap, train.mesh, rewrites + ([pipe] if pipe else []) + [LiveLayout(train)], train.options,
                 train.registry)
        t2 = time.perf_counter()
        if pipe is not None:      # each rank runs its stages' forwards (runtime/p2p.py), the loss broadcast on pp
            from .p2p import rank_program

            low = rank_program(bind(p.annotated_lowered(), self.ex.rt.groups), p, self.ex.rt)
        else:
            low = bind(p.lowered(), self.ex.rt.groups)
        held = self.ex.held()
        moved = [n for n, sh in zip(cap.input_names, low.input_layouts)
                 if n in held.state and not same_layout(sh, held.layouts[n])]
        if moved:
            warn(f"{kind}: {len(moved)} state value(s) settle in another layout in the eval program than in "
                 f"training ({', '.join(moved[:3])}); they are resharded at every call.", stacklevel=user_stacklevel())
        return ShapeProgram(key, p, t1 - t0, t2 - t1, time.perf_counter() - t2, lowered=low, rt=self.ex.rt)

    def shapes(self) -> list:
        """ShapeInfo rows of the eval and forward programs kept."""
        kinds = {"loss": "eval", "forward": "eval forward"}
        return [ShapeInfo(kinds[e.signature[0]], e.signature[2], e.capture_s, e.plan_s, e.lower_s, e.calls,
                          paths.describe(e.plan.captured.guards, e.path) if e.path else "", e.dim, e.symbolic_s)
                for e in self.cache.entries.values()]


def _eval_pipeline(train, batch):
    """The pipeline of a pipelined program's eval step on real ranks: the training stages (their module globs), the
    forwards only, over the most micro-batches up to training's that divide the batch and are a multiple of the
    schedule's eval_group, in its eval_schedule's order (lower/ppschedules.py)."""
    from ..tactics.pipeline import Pipeline

    spec = train.pipeline
    dims = train.captured.settings.get("accumulate_dims")
    flat, _ = tree_flatten(tuple(batch))
    sizes = [x.shape[(dims or {}).get(i, 0)] for i, x in enumerate(flat)
             if isinstance(x, torch.Tensor) and (dims or {}).get(i, 0) is not None and x.dim() > 0]
    step = spec.schedule.eval_group(spec.ranks)
    m = next((k for k in range(spec.microbatches, 0, -1) if k % step == 0 and all(b % k == 0 for b in sizes)), None)
    if m is None:
        raise PartitionError(f"eval_step: the pipeline on axis '{spec.axis}' (size {spec.ranks}) runs "
                             f"{spec.schedule} in groups of {step} micro-batches, and no such count divides the "
                             f"batch sizes {sorted(set(sizes))}. Use an eval batch size divisible by {step}.")
    placed = tuple((n.meta[META_NAME], spec.stage_of[n.name]) for n in train.captured.gm.graph.nodes
                   if n.op == "placeholder" and n.name in spec.stage_of)
    return Pipeline(spec.axis, [list(g) for g in spec.modules], spec.schedule.eval_schedule, m, spec.name, placed)


def _refuse_non_tensors(what, batch) -> None:
    """The inputs of a step are tensors: a flag (use_cache=False) or a cache passed in is refused by its path."""
    for path, x in tree_flatten_with_path(tuple(batch))[0]:
        if isinstance(x, torch.Tensor):
            continue
        fix = ("A KV cache comes back in forward's outputs but cannot be passed in: continue decoding eagerly from "
               "it (model(next_ids, cache=out.cache))." if not isinstance(x, (bool, int, float, str, type(None)))
               else "Flags are not inputs: set them on the model before partition (model.config.use_cache = "
                    "False), or close over them in loss_fn; the default use_cache=True works (the cache is "
                    "returned with the outputs).")
        raise PartitionError(f"{what}: input{keystr(path)} is a {type(x).__name__} ({str(x)[:40]}); the inputs of "
                             f"a step are tensors. {fix}")
