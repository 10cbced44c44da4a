"""Runs a plan's per-device program step after step on a backend (backend.py), with the state it holds as local
shards (state.py's HeldState)."""
from __future__ import annotations

import hashlib
import time
import warnings

import torch
from torch.utils._pytree import tree_flatten

from ..capture import FORWARD, LOSS_AND_GRADS, TRAIN
from ..capture.inputs import as_batch, conform
from ..contract import EXC_NODE, META_SRC, Role
from ..rules.tags import draws_random
from ..errors import PartitionError, internal_error
from ..lower.lower import bind
from . import faults
from .backend import backend_for
from .call import Calls, call
from .interpret import InterpretedRuntime
from . import paths
from .dims import SymbolicDims
from .symbols import declared, resized_batch
from .shapes import (ShapeCache, ShapeProgram, build, check_divisible, global_signature, plan_signature, say_new,
                     signature, trace_guards)
from .state import HeldState

_KIND = {TRAIN: "train_step", LOSS_AND_GRADS: "loss_and_grads", FORWARD: "prog(...)"}


class Executor:
    """Runs the plan's lowered program (Plan.lowered, bound to the backend's process groups) on the state it holds:
    set-up (backend, binding, state) and the steps, each through the one call path (call.py) with TrainCalls;
    eval_step and forward go the same path with the Evaluator's EvalCalls (evaluate.py). Moving the state in and
    out (state_dict, load_state_dict, export_to, ...) is the HeldState's (state.py)."""

    # emulated ranks: plain tensors per rank, collectives computed over them (interpret.py); tests swap in
    # emulate.EmulatedRuntime (LocalTensorMode) as a cross-check
    emulator = InterpretedRuntime

    def __init__(self, plan, model, optimizer, loss_fn=None, backend=None, costs=(None, None)):
        self.plan, self.model, self.optimizer, self.loss_fn = plan, model, optimizer, loss_fn
        self._backend = backend              # a fixed backend (prog.to_xla()); None: backend_for() decides
        self.rt = None
        self.lowered = None                  # the example inputs' program: plan.lowered() bound to self.rt's groups
        self._held = HeldState(plan, model, optimizer)
        self.last_grad_norm = None
        self._evaluator = None
        self.failure = None                  # real ranks: the error of a step that failed (its groups released)
        self._digest = ""                    # real ranks: the plan's digest, part of every call's agreement
        # one program per input signature (shapes.py), sharing the state held; costs: (capture_s, plan_s) of plan
        self.shapes = ShapeCache(plan.options.max_shapes, _KIND.get(plan.captured.mode, "run"),
                                 limit_bytes=plan.options.shape_cache_bytes)
        first = ShapeProgram(plan_signature(plan), plan, *costs)
        self.paths, self._last = paths.StepPaths(first, self._held.param_steps), None   # branches; last program run
        self._first = self.shapes.add(first, pinned=True)
        self._first_call = plan.captured.first_call is not None     # capture/settle.py: drawn before the first call
        # sizes that become symbols (dims.py); a fit builds programs at sizes a multiple of `step` apart
        step = plan.mesh.size * plan.captured.settings.get("accumulate", 1)
        self.dims = SymbolicDims(first, self.shapes.what, step=step, batch=True)
        self.calls = TrainCalls(self.shapes, self.paths)

    @property
    def first(self):
        """The example inputs' program (a ShapeProgram, pinned in the cache)."""
        return self._first

    @property
    def steps(self) -> int:
        return self._held.steps

    @property
    def state(self) -> dict:
        """Placeholder name -> local shard held (after ensure())."""
        return self._held.state

    def held(self) -> HeldState:
        """The state, on a live backend."""
        self.ensure()
        return self._held

    @property
    def evaluator(self):
        """eval_step / forward on the live state (evaluate.py), one captured program per input signature."""
        if self._evaluator is None:
            from .evaluate import Evaluator

            self._evaluator = Evaluator(self)
        return self._evaluator

    # -- set-up ----------------------------------------------------------------------------------------------------
    def ensure(self):
        if self.failure is not None:
            raise type(self.failure)(f"partir_torch: this program cannot run on: an earlier call failed on this rank "
                                     f"and released its process groups. That error:\n{self.failure}")
        if self.rt is None or not self.rt.valid():
            rt = self._backend or backend_for(self.plan.mesh, self.plan.options, self.emulator)
            self.bind(self._first, rt)
            if self.plan.options.measure_memory:
                rt.measure_memory = True         # the backend measures each step (runtime/memtrack.py)
            self.rt = rt
            self._held.attach(rt)
        self.lowered = self._first.lowered
        return self.lowered

    def declare(self, batch) -> None:
        """Options.dynamic: the declared symbols checked against the example inputs (symbols.py) and fitted as one
        program now (dims.py), so that a new size of them is an instance from the first call."""
        where = "partition: dynamic="
        if self.plan.pipeline.staged:
            raise PartitionError(f"{where} is not supported for a pipelined program: it keeps a program per shape "
                                 f"(runtime/dims.py). Drop dynamic=, or pad batches to one shape.")
        if self.paths:
            raise PartitionError(f"{where}: this step branches on tensor values (one program per path, "
                                 f"runtime/paths.py), and its paths keep a program per shape. Drop dynamic=.")
        symbols = declared(self.plan.options.dynamic, self._first.signature)
        self.dims.declare(symbols, *self.calls.fitting(self, as_batch(batch)))

    def bind(self, entry, rt=None) -> None:
        """entry's program bound to the process groups of rt (default: the live backend), once per backend; on real
        ranks, every rank checks that all run the same one."""
        rt = rt or self.rt
        if entry.rt is rt:
            return
        t0 = time.perf_counter()
        # an instance of a symbolic dim (dims.py) has its own program; the others are their plan's
        entry.lowered = rt.program(entry.plan) if entry.canonical is None else bind(entry.canonical, rt.groups)
        if rt.ranks is not None:
            text = _plan_text(entry.canonical or entry.plan.lowered())
            rt.ranks.check_plan(text)
            if entry is self._first:
                self._digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        if entry.lower_s is None:
            entry.lower_s = time.perf_counter() - t0
        entry.rt = rt

    def run(self, batch, local=False, what="train_step"):
        """Random ops (dropout) are drawn whole on every rank from the caller's generator and sliced (their rule
        keeps them whole), so a step equals the single-device step given the same generator state; on real ranks
        every process must be seeded alike (checked with the plan at start-up). The step goes the one call path
        (call.py)."""
        outs, self._last = call(self, self.calls, batch, what, local)
        return outs

    def first_call(self, entry=None) -> None:
        """The random draws a model that changed itself on its first call makes before a call (capture/settle.py)."""
        fc, first, self._first_call = self.plan.captured.first_call, self._first_call, False
        if fc is not None:
            self.paths.draws.update(fc.before(first, entry is not None and entry.plan.captured.first_call is fc))

    def agree(self, what: str, flat) -> None:
        """Real ranks: the ranks agree on the program, the step and the inputs' shapes and dtypes before any
        collective of `what` (faults.py); a difference raises on every rank."""
        if self.rt.ranks is not None:
            self.rt.ranks.agree(faults.describe_call(what, self._digest, self.steps, flat), what)

    def execute(self, gm, args, what: str, plan=None) -> list:
        """Run gm (a program of `plan`, default the first); a failure is named: RankFailureError when a peer died or
        hung (real ranks), else InternalError (a failing per-device op is a bug of ours). On real ranks a failed step
        releases the process groups, so the peers fail at once too, and the program refuses further calls."""
        plan = plan or self.plan
        try:
            return list(self.rt.run(gm, args))
        except Exception as e:  # noqa: BLE001 - named below
            ranks = self.rt.ranks
            if ranks is not None:
                peer = faults.peer_failure_kind(e) is not None
                rec = faults.collective_of(faults.node_at(gm, e))  # read before release clears the frames
                answers = ranks.release(e, roll_call=peer)    # first: the peers waiting on this rank fail now
                if peer:
                    err = faults.step_failure(what, ranks.rank, self.plan.mesh, rec, e, ranks.timeout_s,
                                              answers=answers)
                else:
                    err = e if isinstance(e, PartitionError) else internal_error(_failing_node(gm, e, plan),
                                                                                 "running", e)
                self.failure = err
                if err is e:
                    raise
                raise err from e
            if isinstance(e, PartitionError):
                raise
            raise internal_error(_failing_node(gm, e, plan), "running", e) from e

    def peak_memory(self) -> dict:
        """{rank: peak live tensor bytes} of the last program run (runtime/memtrack.py says what counts)."""
        if not self.plan.options.measure_memory:
            raise PartitionError("prog.peak_memory() returns the peaks measured during the last step, and this "
                                 "program does not measure them. Partition with measure_memory=True (off by "
                                 "default: it costs a Python callback per op).")
        if self.rt is not None and not self.rt.measures_memory:
            raise PartitionError(f"prog.peak_memory(): the {type(self.rt).__name__} backend does not measure memory; "
                                 f"the interpreted emulator (the default without torch.distributed) and real ranks "
                                 f"do.")
        peak = self.rt.last_peak if self.rt is not None else None
        if peak is None:
            raise PartitionError("prog.peak_memory(): no step has run yet; run prog.train_step(...) first.")
        return dict(peak)

    def train_step(self, batch, local=False):
        cap = self.plan.captured
        if cap.mode != TRAIN:
            raise PartitionError("train_step needs partition(..., loss_fn=..., optimizer=...).")
        outs = self.run(batch, local, "train_step_local" if local else "train_step")
        self.paths.count(self._last.plan.captured, self.steps)
        self._keep_state(outs, step=True)
        if self.optimizer is not None:   # the update ran: lr schedulers stepped after it do not warn
            self.optimizer._opt_called = True
        if "grad_norm" in cap.output_names:
            self.last_grad_norm = self.rt.rank0(outs[cap.output_names.index("grad_norm")])
        return self.rt.rank0(outs[0])

    def loss_and_grads(self, batch):
        cap = self.plan.captured
        if cap.mode != LOSS_AND_GRADS:
            raise PartitionError("loss_and_grads needs partition(..., loss_fn=...) without an optimizer.")
        outs = self.run(batch, what="loss_and_grads")
        self._keep_state(outs)
        return self.rt.rank0(outs[0]), {n[len("grads."):]: self.rt.rank0(t)
                                        for n, t in zip(cap.output_names[1:], outs[1:]) if n.startswith("grads.")}

    def _keep_state(self, outs, step=False):
        """Updated state outputs (running statistics) replace the state held, (step) an update ran (owner.py)."""
        kept = {name: t for name, t in zip(self.plan.captured.output_names, outs) if name in self.state}
        self.state.update(kept)
        self._held.steps += step
        if kept or step:
            self._held.moved()

    def forward(self, inputs):
        cap = self.plan.captured
        if cap.mode != FORWARD:
            raise PartitionError("calling the program runs the forward; this program was captured with a loss_fn "
                                 "(use train_step or loss_and_grads).")
        outs = self.run(inputs, what="prog(...)")
        self._keep_state(outs)
        n = cap.out_spec.num_leaves
        return cap.out_spec.unflatten([self.rt.rank0(t) for t in outs[:n]])


class TrainCalls(Calls):
    """The partitioned step's calls (train_step, train_step_local, loss_and_grads, prog(...)): one program per input
    signature and path (shapes.py, paths.py), all on the state they update, held in the layouts of the program
    that runs."""

    def describe(self, what: str, steps: int) -> str:
        return f"{what} (step {steps + 1})" if what.startswith("train_step") else what

    def inputs(self, ex, batch, what: str) -> tuple:
        cap = ex.plan.captured
        flat, _ = tree_flatten(conform(tuple(batch), cap.in_spec))
        names = [n for n, r in zip(cap.input_names, cap.input_roles) if r == Role.INPUT]
        if len(flat) != len(names):
            raise PartitionError(f"the program was captured with {len(names)} input tensors; got {len(flat)}.")
        for name, x in zip(names, flat):
            _check_input(cap, name, x)
        return flat, names

    def signature(self, ex, batch, flat, local: bool):
        sig = signature(flat)
        return global_signature(ex.plan, sig) if local else sig

    def symbolic(self, ex, sig, local: bool) -> bool:
        return not self.paths

    def instance(self, ex, sig):
        return ex.dims.instance(sig, _instance)

    def build(self, ex, batch, sig, real, what: str):
        check_divisible(ex.plan, sig, what)
        # a step that branches reads its values from this call's batch and the state held (not the module's)
        return build(ex.plan, ex.model, ex.optimizer, ex.loss_fn, tuple(batch), sig, values=real, what=what)

    def keep(self, ex, entry, batch, symbolic: bool, what: str) -> None:
        self.cache.add(entry)
        if symbolic:
            ex.dims.built(entry, *self.fitting(ex, batch))
        if entry.path and entry.signature == ex.first.signature:
            paths.say_new(what, entry, len(self.cache.entries), self.cache.limit)
        else:
            say_new(what, entry, ex.first, len(self.cache.entries), self.cache.limit)

    def before_run(self, ex, entry) -> None:
        ex.held().relayout(entry.layouts)

    def fitting(self, ex, batch) -> tuple:
        """(trace_guards, make_at) for dims.py: the step traced with symbols, and the step partitioned at another
        signature, on `batch` resized (its values repeated along each resized dim: real, valid values)."""
        cap = ex.plan.captured

        def trace(symbols):
            return trace_guards(ex.plan, ex.model, ex.optimizer, ex.loss_fn, tuple(batch), symbols.positions)

        def make_at(sig):
            with warnings.catch_warnings():     # the schedule's remarks, said at partition; the fit says its own
                warnings.simplefilter("ignore")
                entry = build(ex.plan, ex.model, ex.optimizer, ex.loss_fn,
                              resized_batch(conform(tuple(batch), cap.in_spec), sig), sig)
            self.cache.add(entry)
            return entry
        return trace, make_at


def _check_input(cap, name, x) -> None:
    """The call's input against the captured one: a tensor on the program's device (its shape and dtype select
    the program: shapes.py)."""
    val = cap.names[name].meta["val"]
    if not isinstance(x, torch.Tensor):
        raise PartitionError(f"{name} is a {type(x).__name__}; the program was captured with a tensor "
                             f"{tuple(val.shape)} {val.dtype} there.")
    dev = cap.device
    if x.device.type == "meta" or (x.device.type != dev.type and dev.type != "meta"):
        raise PartitionError(f"{name} is on {x.device}; the program runs on {dev.type}. Move the batch there "
                             f"(x.to('{dev.type}')).")


def _instance(sig, plan, canonical, seconds: float, s) -> ShapeProgram:
    """A program instantiated from a symbolic dim (dims.py): the fitted programs' plan, its own lowering."""
    return ShapeProgram(sig, plan, None, None, seconds, canonical=canonical, dim=s)


def _plan_text(canonical) -> str:
    """What every rank must agree on: the program's code on canonical group names (each rank numbers its own
    process groups) and, when the step draws random numbers, the generator state."""
    code = canonical.gm.code
    if any(draws_random(n) for n in canonical.gm.graph.nodes):
        # random draws must agree on every rank (hashlib: Python's hash() of bytes is salted per process)
        code += f"\n# rng {hashlib.sha256(bytes(torch.get_rng_state().numpy())).hexdigest()}"
    return code


def _failing_node(gm, exc, plan):
    """The captured node whose per-device op raised `exc` (from the generated code's line), else None."""
    name = getattr(exc, EXC_NODE, None)   # emulated: the interpreter names the node of its segment
    node = next((n for n in gm.graph.nodes if n.name == name), None) if name is not None else \
        faults.node_at(gm, exc)
    if node is None:
        return None
    src = node.meta.get(META_SRC)
    return next((n for n in plan.captured.gm.graph.nodes if n.name == src), None) or node
