"""The one call path: every call that runs a program (train_step, train_step_local, loss_and_grads, prog(...),
eval_step, forward), on any backend, pipelined or not, goes through call():

    backend (ensure) -> the state guarded (owner.py) -> the ranks agree (real ranks: faults.py) -> the inputs
    checked -> signature (shapes.py) -> path (a step that branches: paths.py) -> its program: cached, or an
    instance of a symbolic dim (dims.py), or built (captured, planned, lowered) -> bound to the backend's groups ->
    first-call draws (capture/settle.py) -> arguments by role -> execute (a failure named: faults.py) -> the
    model's asserts (paths.verify)

What differs between a kind of call is data and a few methods of its Calls (TrainCalls in executor.py: the
partitioned step, on the state it updates; EvalCalls in evaluate.py: eval-mode programs on the live state, one
family per input structure); what the backend can do is asked of its declared capabilities (backend.py: ranks,
new_programs), never of its class.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from ..capture.inputs import conform
from ..contract import META_ZIGZAG, STATE_ROLES, Role
from ..errors import PartitionError
from . import paths
from .layout import same_layout
from .shapes import show


class Calls:
    """What one kind of call keeps (its ShapeCache, its StepPaths) and how it makes a program; call() runs it."""

    feeds_first_call = True     # the first call's draws depend on the program run (lifted draws fed as inputs)

    def __init__(self, cache, step_paths):
        self.cache, self.paths = cache, step_paths

    def describe(self, what: str, steps: int) -> str:
        """The call as faults.py and errors name it."""
        return what

    def inputs(self, ex, batch, what: str) -> tuple:
        """(the batch's tensors, flat; the step placeholder name of each), the inputs checked."""
        raise NotImplementedError

    def signature(self, ex, batch, flat, local: bool):
        """The key of this call's programs before its path (shapes.signature and what else tells them apart)."""
        raise NotImplementedError

    def symbolic(self, ex, sig, local: bool) -> bool:
        """Whether this signature's program may be an instance of a symbolic dim (dims.py)."""
        raise NotImplementedError

    def instance(self, ex, sig):
        """The program of `sig` instantiated from a symbolic dim, or None."""
        raise NotImplementedError

    def build(self, ex, batch, sig, real, what: str):
        """The program of a new signature, partitioned in full (a ShapeProgram)."""
        raise NotImplementedError

    def keep(self, ex, entry, batch, symbolic: bool, what: str) -> None:
        """A program just built and bound: into the cache (and, symbolic, the dim's family)."""
        raise NotImplementedError

    def before_run(self, ex, entry) -> None:
        """Just before the program runs (the state held in its layouts)."""


def call(ex, calls: Calls, batch, what: str, local: bool = False) -> tuple:
    """Run one call of `calls` on the executor `ex`: (the program's outputs, the ShapeProgram that ran)."""
    ex.ensure()
    held = ex.held()
    held.guard(what)
    desc = calls.describe(what, held.steps)
    # real ranks agree on the call (program, step, inputs' shapes) before anything that could differ between them:
    # a new shape's capture, its plan check, the step's collectives
    ex.agree(desc, tree_flatten(conform(tuple(batch), None))[0])
    if not calls.feeds_first_call:
        ex.first_call()
    entry, flat = program(ex, calls, batch, what, local)
    if calls.feeds_first_call:
        ex.first_call(entry)
    calls.before_run(ex, entry)
    args = arguments(ex, entry, flat, calls.paths.draws, local, what)
    outs = ex.execute(entry.lowered.gm, args, desc, entry.plan)
    cap = entry.plan.captured
    if cap.checks:     # the model's asserts on tensor values (paths.py)
        paths.verify(cap.checks, cap.output_names, outs, ex.rt.rank0, desc)
    return outs, entry


def program(ex, calls: Calls, batch, what: str, local: bool = False) -> tuple:
    """(the program of this call's inputs: cached, instantiated or built now, bound; the inputs, flat)."""
    flat, names = calls.inputs(ex, batch, what)
    sig = calls.signature(ex, batch, flat, local)
    real = paths.real_values(names, flat, ex.held())
    values, key = (), (sig, ())
    device = ex.plan.captured.device
    if calls.paths:
        if local:
            raise PartitionError(f"{what}: this step branches on tensor values "
                                 f"({paths.describe(ex.plan.captured.guards, ex.first.path)}); the branch "
                                 f"is decided once per step on the global batch, which per-rank shards do not "
                                 f"give. Call train_step with the global batch.")
        values, key = calls.paths.select(sig, real, device)
    entry = calls.cache.get(key) if key is not None else None
    # a size may become a symbol (dims.py); a backend that runs only its plan's program (torch-xla) has none, and
    # train_step_local runs the programs train_step made
    symbolic = ex.rt.new_programs and not ex.plan.pipeline.staged and not local and calls.symbolic(ex, sig, local)
    if entry is None and symbolic:
        entry = calls.instance(ex, sig)
        if entry is not None:
            calls.cache.add(entry)
    if entry is None:
        _refuse_new(ex, what, local, names, flat, sig)
        calls.paths.before_capture(values, device)
        entry = calls.build(ex, batch, sig, real, what)
        calls.paths.captured(sig, entry, values, real)
        ex.bind(entry)
        calls.keep(ex, entry, batch, symbolic, what)
    ex.bind(entry)
    calls.paths.gate(entry)      # a gated step's draws (capture/gates.py)
    entry.calls += 1
    return entry, flat


def arguments(ex, entry, flat, draws: dict, local: bool, what: str) -> list:
    """The program's arguments by role: the state held (in the program's layout), hyperparameters and step counts
    read now, constants and draws placed, the inputs sharded (or, local, each rank's own), the rank's coordinates."""
    cap, low, rt, held = entry.plan.captured, entry.lowered, ex.rt, ex.held()
    args, k, hyper = [], 0, None
    for name, role, sh, shp in zip(cap.input_names, cap.input_roles, low.input_layouts, low.local_shapes):
        if role in STATE_ROLES:
            args.append(_held_as(held, name, sh))
        elif role == Role.LR:   # hparams.<group>.<name>: read from the optimizer's param groups at every step
            if hyper is None:
                hyper = cap.fopt.hyper_values(ex.optimizer)   # this program's optimizer
            _, g, h = name.split(".")
            args.append(rt.local(torch.tensor(hyper[(int(g), h)], dtype=torch.float64)))
        elif role == Role.CONST:
            args.append(rt.shard(cap.consts[name], sh))
        elif role == Role.DRAW:   # drawn by the guards before the step (paths.py)
            args.append(rt.shard(draws[name[len("draws."):]], sh))
        elif role == Role.STEP:   # "step", or "step.<fqn>": a parameter's own count (paths.py)
            n = ex.paths.step_of(name, held.steps)
            args.append(rt.local(torch.tensor(float(n + 1), dtype=torch.float64)))
        else:
            x = flat[k]
            k += 1
            if local:
                if tuple(x.shape) != tuple(shp):
                    full = tuple(cap.names[name].meta["val"].shape)
                    raise PartitionError(f"{what}: {name} has shape {tuple(x.shape)}, but each rank's shard must "
                                         f"have shape {tuple(shp)} (global {full}, {sh}).")
                args.append(rt.local(x))
            else:
                args.append(rt.shard(_laid_out(x, cap.names[name]), sh))
    return args + rt.coords()


def _laid_out(x, node):
    """x in the program's order of positions: a sequence input of context_parallel(load_balance=True) in zigzag
    order (tactics/cpbalance.py), so that its contiguous tiles are each rank's two chunks."""
    zz = node.meta.get(META_ZIGZAG)
    if zz is None:
        return x
    from ..lower.zigzag import zigzag_order

    dim, n = zz
    return x.index_select(dim, zigzag_order(x.shape[dim], n).to(x.device))


def _held_as(held, name: str, sh):
    """The local shard of state value `name` in layout `sh`: as held, or (an eval program that settled on another
    layout, a conflict) resharded through the full value (correct, slow)."""
    have = held.layouts[name]
    if sh is have or same_layout(sh, have):
        return held.state[name]
    return held.rt.shard(held.rt.full(held.state[name], have, held._shape(name)), sh)


def _refuse_new(ex, what, local, names, flat, sig) -> None:
    """A call that would need a new program where none can be made."""
    first, cap = ex.first, ex.plan.captured
    if local:
        # per-rank shards of a shape no program has: every rank would have to agree on it before capturing,
        # and a global batch passed by mistake would pass for one; new shapes come through train_step
        want = [tuple(s) for n, s in zip(cap.input_names, first.lowered.local_shapes) if n in names]
        raise PartitionError(f"{what}: inputs of shapes {[tuple(x.shape) for x in flat]}; each rank's shard "
                             f"must have shapes {want} (global [{show(first.signature)}]), or those of "
                             f"another shape train_step has run. A new shape is partitioned by train_step, "
                             f"which takes the global batch; or pad every rank's shard to these shapes.")
    if not ex.rt.new_programs:
        # the XLA backend's shardings and constraints are those of the plan it was built for
        raise PartitionError(f"{what}: inputs [{show(sig)}]; this torch-xla program runs the shapes it was "
                             f"built for, [{show(first.signature)}] (its shardings are that plan's). "
                             f"Pad batches to these shapes, or build the XLA program from a partition with "
                             f"example inputs of the new shape.")
