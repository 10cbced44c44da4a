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
import warnings

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from ..capture.inputs import conform
from ..contract import META_NAME
from ..errors import PartitionError, user_stacklevel, warn
from ..lower.lower import bind
from ..tactics.base import TacticBase
from .call import Calls, call
from .layout import same_layout
from . import paths
from .live import LiveLayout
from .dims import SymbolicDims
from .symbols import resized_batch
from .shapes import ShapeCache, ShapeInfo, ShapeProgram, signature

class Evaluator:
    """eval_step and forward: each goes the one call path (call.py) with its EvalCalls; both kinds share one cache
    of programs (at most Options.max_shapes, least recently used first out: shapes.py), their paths (paths.py) and
    their symbolic dims (dims.py, one family per kind, input structure and backend)."""

    def __init__(self, executor):
        self.ex = executor
        # (kind, structure, signature, backend) -> ShapeProgram (plan, lowering bound to the backend)
        cache = ShapeCache(executor.plan.options.max_shapes, "eval_step / forward", lambda key: key[0][2],
                           executor.plan.options.shape_cache_bytes)
        self.cache = cache
        self.paths = paths.StepPaths(None, {})   # per key, for a step that branches on tensor values (paths.py)
        self.dims: dict = {}           # (kind, structure, backend) -> SymbolicDims (dims.py)
        self.calls = {kind: EvalCalls(self, kind, cache, self.paths) for kind in ("loss", "forward")}

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
        what = "eval_step" if kind == "loss" else "forward"
        ex = self.ex
        ex.ensure()
        if not ex.rt.new_programs:
            raise PartitionError(f"{what}: this program's backend ({type(ex.rt).__name__}) runs only the program "
                                 f"it was built for, and {what} captures an eval-mode program of its own. Call "
                                 f"the program itself (a forward-only partition: prog(*inputs)), or run {what} on "
                                 f"the partition this one was made from.")
        outs, entry = call(ex, self.calls[kind], batch, what)
        cap = entry.plan.captured
        return [ex.rt.rank0(t) for t, n in zip(outs, cap.output_names) if not n.startswith("buffers.")], cap, \
            entry.lowered

    def _built(self, family, kind, entry, batch, what) -> None:
        """A program partitioned in full: the first of its family, or a point of it (dims.py: from the second size
        of a dim, the dim and the batch dim are symbols, fitted on programs built here at the grid's sizes)."""
        if family not in self.dims:
            self.dims[family] = SymbolicDims(entry, what, sig_of=lambda e: e.signature[2],
                                             step=self.ex.plan.mesh.size, batch=True)
            return

        def trace(symbols):
            from ..plan import capture_for

            model, was = self.ex.model, self.ex.model.training
            model.eval()
            try:
                rewrites, tactics = self._schedule(kind)
                return capture_for(model, rewrites + tactics, batch, self.ex.loss_fn if kind == "loss" else None,
                                   eval_loss=kind == "loss", dynamic=symbols.positions)
            finally:
                model.train(was)

        def make_at(sig):
            key = entry.signature[:2] + (sig,) + entry.signature[3:]
            with warnings.catch_warnings():     # a moved layout is said for the programs called, not the fit's
                warnings.simplefilter("ignore")
                made = self._build(kind, resized_batch(batch, sig), key)
            self.cache.add(made)
            return made
        self.dims[family].built(entry, trace, make_at)

    def _schedule(self, kind):
        """(capture rewrites, tactics) an eval program is captured with: the loss runs in the training step's
        compute dtype (mixed_precision's casts); remat has no backward here."""
        train = self.ex.plan
        tactics = [t for t in train.tactics if t not in train.capture_rewrites]
        if kind != "loss":      # a tactic that is also a capture rewrite (load-balanced CP) runs as its plain form
            plain = [t.without_rewrite() for t in train.capture_rewrites if isinstance(t, TacticBase)]
            tactics += [t for t in plain if t is not None]
        return ([t for t in train.capture_rewrites if t.in_eval] if kind == "loss" else []), tactics

    def _build(self, kind, batch, key, real=None):
        from ..plan import capture_for, plan

        train = self.ex.plan
        staged = train.pipeline.staged and self.ex.rt.ranks is not None    # real ranks hold their stages' state
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


class EvalCalls(Calls):
    """eval_step's ("loss") or forward's calls: eval-mode programs on the live state, one per input structure,
    signature and path, bound to the backend they were built on; the first call's draws are made before the program
    is chosen (an eval program is never the steady step they were lifted from)."""

    feeds_first_call = False

    def __init__(self, evaluator, kind: str, cache, step_paths):
        super().__init__(cache, step_paths)
        self.ev, self.kind = evaluator, kind

    def inputs(self, ex, batch, what: str) -> tuple:
        batch = conform(tuple(batch), None)           # mappings as dicts (an HF BatchEncoding)
        _refuse_non_tensors(what, batch)
        flat, _ = tree_flatten(batch)
        return flat, [f"inputs.{i}" for i in range(len(flat))]

    def signature(self, ex, batch, flat, local: bool):
        # the structure too: a dict with its keys in another order is another program's inputs (capture flattens a
        # dict in its key order)
        spec = tree_flatten(conform(tuple(batch), None))[1]
        return (self.kind, str(spec), signature(flat), id(ex.rt))

    def symbolic(self, ex, key, local: bool) -> bool:
        return key not in self.paths.tries

    def instance(self, ex, key):
        dims = self.ev.dims.get(_family(key))
        if dims is None:
            return None
        return dims.instance(key[2], lambda sig, plan, low, t, s: ShapeProgram(
            key, plan, None, None, t, lowered=bind(low, ex.rt.groups), rt=ex.rt, canonical=low, dim=s))

    def build(self, ex, batch, key, real, what: str):
        return self.ev._build(self.kind, conform(tuple(batch), None), key, real)

    def keep(self, ex, entry, batch, symbolic: bool, what: str) -> None:
        if symbolic and not entry.path:     # a path's program is no point of a symbolic dim
            self.ev._built(_family(entry.signature), self.kind, entry, conform(tuple(batch), None), what)
        self.cache.add(entry)


def _family(key) -> tuple:
    """The programs whose sizes may become one symbol (dims.py): one kind, input structure and backend."""
    return key[:2] + key[3:]


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
