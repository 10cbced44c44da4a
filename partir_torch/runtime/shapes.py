"""A program per input shape, one state: train_step (and loss_and_grads, prog(...)) at any input shape.

partition() plans the step for its example inputs' shapes. A call whose inputs have another signature (each input's
shape and dtype: a sequence length padded per batch, another batch size) captures the step again for it with what
the first capture used (the schedule, its capture rewrites, clip_grad_norm, accumulate, each module's training
flag: plan.capture_for), plans it with the same schedule, options and rule registry (plan.plan), lowers it, and runs
it on the state the program already holds: the state's names and shapes do not depend on the inputs, and the
tactics seed it alike. Where the new plan keeps a state value in another layout (an automatic tactic that decided
otherwise for this shape), the held value is resharded when the program switches shapes (exact; warned once).

    prog.train_step(tokens_8x32, targets_8x32)     # the program of partition()'s example inputs
    prog.train_step(tokens_8x48, targets_8x48)     # warns once: partitioned for (8, 48) in 0.4 s; state carried
    prog.shapes()                                  # [ShapeInfo(train (8, 32) ...), ShapeInfo(train (8, 48) ...)]

Programs are kept by signature within Options.shape_cache_bytes of programs (their graphs' nodes times the bytes
measured per node: see program_bytes) and, if set, Options.max_shapes; beyond it the least recently used one is
dropped with the backend's copy of it (the example inputs' program stays; counted in summary()) and built again if
its shape comes back (said once). From the second size of a
dim (or at partition, for dims declared dynamic), a new size is not partitioned but instantiated from the programs
fitted as one program in that dim (dims.py). A dim the mesh axes that tile it do not divide (a ragged last batch) is
tiled unevenly, as torch.chunk splits it; under Options.strict it is refused with the fix (drop_last=True).
"""
from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..contract import STATE_ROLES, Role
from ..errors import PartitionError, user_stacklevel, warn
from .layout import same_layout
from .paths import describe


def signature(flat) -> tuple:
    """The input signature of a call: (shape, dtype) of each input tensor, in flattening order."""
    return tuple((tuple(x.shape), x.dtype) for x in flat)


def plan_signature(plan) -> tuple:
    """The input signature a plan was captured with."""
    cap = plan.captured
    vals = [cap.names[n].meta["val"] for n, r in zip(cap.input_names, cap.input_roles) if r == Role.INPUT]
    return signature(vals)


def show(sig) -> str:
    """(8, 32) int64, (8, 32) int64"""
    return ", ".join(f"{tuple(s)} {str(d).replace('torch.', '')}" for s, d in sig)


@dataclass
class ShapeProgram:
    """The program of one input signature: its plan, what building it cost, and its lowering bound to the backend
    (rt) it last ran on."""

    signature: tuple
    plan: object
    capture_s: float | None        # None: not measured (a Program built from a plan directly)
    plan_s: float | None
    lower_s: float | None = None
    calls: int = 0
    lowered: object = None
    rt: object = None
    path: tuple = ()               # a step that branches on tensor values: the guard values of this program's path
    canonical: object = None       # an instance of a symbolic dim (dims.py): its Lowered on canonical groups
    dim: int | None = None         # ... and its s
    symbolic_s: float | None = None   # the program that made a dim symbolic: the fit and the symbolic trace

    @property
    def key(self) -> tuple:
        return (self.signature, self.path)

    @property
    def layouts(self) -> dict:
        """State value name -> the Sharding this plan keeps it in between steps."""
        cap, g = self.plan.captured, self.plan.graph
        return {n: self.plan.sharding(g.vid[cap.names[n]]) for n, r in zip(cap.input_names, cap.input_roles)
                if r in STATE_ROLES}

    def info(self, kind: str) -> "ShapeInfo":
        return ShapeInfo(kind, self.signature, self.capture_s, self.plan_s, self.lower_s, self.calls,
                         describe(self.plan.captured.guards, self.path) if self.path else "", self.dim,
                         self.symbolic_s)


@dataclass(frozen=True)
class ShapeInfo:
    """A row of prog.shapes(): the kind of program ("train", "loss_and_grads", "forward" for the partitioned step;
    "eval", "eval forward" for eval_step / forward), its input signature, its capture, plan and lowering times in
    seconds (None where not measured: lowering before the first call), and how many calls ran it. instance_of: the
    s of a program instantiated from a symbolic dim (runtime/dims.py; lower_s is then the instantiation, and
    capture_s and plan_s are None: there were none); symbolic_s: the fit and symbolic trace that made the dim
    symbolic, on the program partitioned when it happened."""

    kind: str
    signature: tuple
    capture_s: float | None
    plan_s: float | None
    lower_s: float | None
    calls: int
    path: str = ""
    instance_of: int | None = None
    symbolic_s: float | None = None

    @property
    def seconds(self) -> float:
        """capture + plan + lowering (+ the symbolic dim's fit and trace), the parts measured."""
        return sum(t for t in (self.capture_s, self.plan_s, self.lower_s, self.symbolic_s) if t is not None)

    def __str__(self):
        part = lambda k, t: f"{k} {t:.2f} s" if t is not None else f"{k} -"   # noqa: E731
        return (f"{self.kind} [{show(self.signature)}]: {part('capture', self.capture_s)}, "
                f"{part('plan', self.plan_s)}, {part('lower', self.lower_s)}; {self.calls} call(s)"
                + (f"; path: {self.path}" if self.path else "")
                + (f"; instance of the symbolic dim at s = {self.instance_of}" if self.instance_of is not None else "")
                + (f"; made the dim symbolic in {self.symbolic_s:.2f} s" if self.symbolic_s is not None else ""))


# The Python memory a kept program holds per node of its graphs (graphs, fake values, shardings, the plan, the
# runtime's generated segments), measured with tracemalloc by benchmarks/program_bytes.py (notes there): a program
# partitioned in full 4.9-9.2 KB per node of its captured step and lowered program, an instance of symbolic dims
# 3.1-3.4 KB per node of its lowered program (the zoo's GPT and HF GPT-2 under DP x MP); the larger figures, rounded
# up, so that the bound holds. Tensor storage (the captured constants) is not counted.
FULL_NODE_BYTES = 10 * 1024
INSTANCE_NODE_BYTES = 4 * 1024


def program_bytes(entry: "ShapeProgram") -> int:
    """The memory a kept program holds: its own graphs' nodes times the bytes measured per node. A program
    partitioned in full owns its captured step and its lowered program; an instance of symbolic dims shares its plan
    with the fitted programs and owns only its lowered program."""
    if entry.canonical is not None:
        return len(entry.canonical.gm.graph.nodes) * INSTANCE_NODE_BYTES
    low = entry.plan.lowered()
    return (len(entry.plan.captured.gm.graph.nodes) + len(low.gm.graph.nodes)) * FULL_NODE_BYTES


class ShapeCache:
    """ShapePrograms by key (signature, path), least recently used first out beyond `limit_bytes` of programs
    (program_bytes) or `limit` programs (None: no count bound); `pinned` (the example inputs' program) is never
    dropped and not counted. `evicted` counts the programs dropped."""

    def __init__(self, limit: int | None, what: str, signature_of=lambda key: key[0], limit_bytes: int = 2 ** 31):
        self.limit, self.what, self.signature_of = limit, what, signature_of    # signature_of: an entry key's
        self.limit_bytes = limit_bytes
        self.entries: OrderedDict = OrderedDict()
        self.bytes: dict = {}                  # key -> program_bytes of its entry
        self.pinned = None
        self.evicted = 0
        self._said_evict = False

    def __len__(self):
        return len(self.entries)

    @property
    def held_bytes(self) -> int:
        return sum(n for k, n in self.bytes.items() if k != self.pinned)

    def get(self, key):
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def add(self, entry: ShapeProgram, pinned: bool = False) -> ShapeProgram:
        self.entries[entry.key] = entry
        self.entries.move_to_end(entry.key)
        if pinned:
            self.pinned = entry.key
        else:
            self.bytes[entry.key] = program_bytes(entry)
        while (self.limit is not None and len(self.entries) > self.limit) or self.held_bytes > self.limit_bytes:
            old_key = next((s for s in self.entries if s != self.pinned and s != entry.key), None)
            if old_key is None:
                break
            old = self.signature_of(old_key)
            self._forget(self.entries.pop(old_key))
            self.bytes.pop(old_key, None)
            self.evicted += 1
            if not self._said_evict:
                self._said_evict = True
                bound = (f"{self.limit} programs or " if self.limit is not None else "") + \
                    f"{self.limit_bytes / 2 ** 20:.0f} MiB of programs"
                warn(f"{self.what}: the programs kept for other input shapes pass {bound}: the program for "
                     f"[{show(old)}], the least recently used, is dropped and built again if that shape comes back "
                     f"(an instance of a symbolic dim in milliseconds, any other shape partitioned in full; said once; "
                     f"prog.summary() counts the evictions). Raise the bound: partition(..., options=pt.Options("
                     f"shape_cache_bytes=...)).", stacklevel=user_stacklevel())
        return entry

    def _forget(self, gone: ShapeProgram) -> None:
        """The backend's own copy of a dropped program (its segments, its compiled code) dropped too, unless a kept
        program runs the same graph."""
        gm = gone.lowered.gm if gone.lowered is not None else None
        if gone.rt is not None and gm is not None and \
                all(e.lowered is None or e.lowered.gm is not gm for e in self.entries.values()):
            gone.rt.forget(gm)

    def line(self) -> str:
        """What summary() says of the programs kept."""
        bound = f"bound {self.limit_bytes / 2 ** 20:.0f} MiB" + (f" and {self.limit} programs" if self.limit else "")
        return (f"{self.what}: {len(self.entries)} program(s) kept for input shapes, {self.held_bytes / 2 ** 20:.1f} "
                f"MiB besides the example inputs' ({bound}); {self.evicted} evicted")


def build(train, model, optimizer, loss_fn, batch, sig, values=None, what="train_step") -> ShapeProgram:
    """The step captured and planned again for `batch` (signature `sig`) as `train` (a Plan) was. values: a step
    that branches on tensor values (capture/branches.py): name -> the full real value of each placeholder."""
    from ..plan import capture_for, plan

    t0 = time.perf_counter()
    with _modes_of(model, train.captured):
        new = capture_for(model, train.tactics, batch, loss_fn, optimizer, values=values, **train.captured.settings)
    t1 = time.perf_counter()
    try:
        p = plan(new, train.mesh, train.tactics, train.options, train.registry)
    except PartitionError as e:
        if not new.guards:
            raise
        p = _plan_like(train, new, e)
    entry = ShapeProgram(sig, p, t1 - t0, time.perf_counter() - t1)
    _check_same_state(train, p, sig)
    first = {n: train.sharding(train.graph.vid[train.captured.names[n]]) for n in entry.layouts}
    moved = [n for n, sh in entry.layouts.items() if not same_layout(sh, first[n])]
    if moved:
        warn(f"{what}: the program for inputs [{show(sig)}] keeps {len(moved)} state value(s) in another "
             f"layout than the first program ({', '.join(moved[:3])}); they are resharded whenever the program "
             f"switches between the two shapes.", stacklevel=user_stacklevel())
    return entry


def trace_guards(train, model, optimizer, loss_fn, batch, where):
    """The step traced as `train` was, with the input sizes at `where` one symbol: its guards (capture/dims.py)."""
    from ..plan import capture_for

    with _modes_of(model, train.captured):
        return capture_for(model, train.tactics, batch, loss_fn, optimizer, dynamic=where, **train.captured.settings)


@contextlib.contextmanager
def _modes_of(model, cap):
    """Each module's training flag as at the first capture (restored after)."""
    modules = list(model.modules())
    was = [m.training for m in modules]
    try:
        if len(cap.modes) == len(modules):
            for m, mode in zip(modules, cap.modes):
                m.training = mode
        yield
    finally:
        for m, mode in zip(modules, was):
            m.training = mode


def _plan_like(train, new, refused):
    """A path of a step that branches that the schedule refuses (Megatron finds no linear pair on a path where
    layerdrop skipped every layer): planned to keep the state and the inputs as the first program does (the eval
    programs' LiveLayout tactic), said once per path."""
    from ..plan import plan
    from .live import LiveLayout

    p = plan(new, train.mesh, list(train.capture_rewrites) + [LiveLayout(train)], train.options, train.registry)
    warn(f"train_step: the schedule refused the path ({describe(new.guards, tuple(g.value for g in new.guards))}): "
         f"{str(refused).splitlines()[0]} This path's program keeps the state and the inputs in the first "
         f"program's layout instead.", stacklevel=user_stacklevel())
    return p


def _check_same_state(train, p, sig) -> None:
    """The held state must fit the new program: the same state values with the same shapes and dtypes."""
    def state(pl):
        cap = pl.captured
        return {n: (tuple(cap.names[n].meta["val"].shape), cap.names[n].meta["val"].dtype)
                for n, r in zip(cap.input_names, cap.input_roles) if r in STATE_ROLES}

    have, new = state(train), state(p)
    if have != new:
        diff = sorted(set(have.items()) ^ set(new.items()), key=str)[:3]
        raise PartitionError(f"the step captured for inputs [{show(sig)}] holds other state than the program's "
                             f"(differing: {diff}): the model's parameters or buffers depend on the input shape. "
                             f"Partition such a model once per shape (each its own program and state).")


def check_divisible(train, sig, what: str) -> None:
    """Under Options.strict, a dim the program tiles over mesh axes must stay divisible by their size. Otherwise
    a dim they do not divide is tiled unevenly (a ragged last batch): the new shape's plan either splits it as
    torch.chunk does, or its propagation refuses it with the fix (drop_last=True) where padding cannot stay out of
    the values (a view merging the batch with the sequence, propagate/engine.py)."""
    if not train.options.strict:
        return
    cap, mesh = train.captured, train.mesh
    names = [n for n, r in zip(cap.input_names, cap.input_roles) if r == Role.INPUT]
    old = plan_signature(train)
    for name, (shape, _), (was, _) in zip(names, sig, old):
        if len(shape) != len(was):
            continue                      # another rank: capture names what the model makes of it
        sh = train.sharding(train.graph.vid[cap.names[name]])
        for d, axes in enumerate(sh.dims):
            k = 1
            for a in axes:
                k *= mesh.shape[a]
            if k > 1 and shape[d] % k:
                on = ", ".join(f"'{a}' (size {mesh.shape[a]})" for a in axes)
                fix = (f"A last batch smaller than the others: pass drop_last=True to the DataLoader, or use a "
                       f"batch size divisible by {k}" if d == 0 else
                       f"Pad dim {d} to a multiple of {k} (pad_to_multiple_of={k} in Hugging Face's data "
                       f"collators)")
                raise PartitionError(f"{what}: {name} has shape {tuple(shape)}; the program tiles its dim {d} on "
                                     f"{on}, and {k} does not divide {shape[d]} (strict=True: shards are even; the "
                                     f"program was partitioned for {tuple(was)}). {fix}, or drop strict=True to "
                                     f"tile it unevenly.")


def global_signature(train, local_sig) -> tuple:
    """train_step_local: the global signature of per-rank inputs, each tiled dim times its axes' size (as the
    program of the example inputs tiles them); train_step_local runs the programs train_step made, never a new one."""
    cap, mesh = train.captured, train.mesh
    names = [n for n, r in zip(cap.input_names, cap.input_roles) if r == Role.INPUT]
    out = []
    for name, (shape, dtype) in zip(names, local_sig):
        sh = train.sharding(train.graph.vid[cap.names[name]])
        shape = list(shape)
        for d, axes in enumerate(sh.dims[:len(shape)]):
            for a in axes:
                shape[d] *= mesh.shape[a]
        out.append((tuple(shape), dtype))
    return tuple(out)


def say_new(what: str, entry: ShapeProgram, first: ShapeProgram, count: int, limit: int) -> None:
    """The one line a new shape costs."""
    t = entry.info("").seconds - (entry.symbolic_s or 0)     # the symbolic dim's fit and trace: said apart
    was = first.info("").seconds if first.capture_s is not None else None
    rel = f" ({t / was:.0%} of the first partition's {was:.2f} s)" if was else ""
    warn(f"{what}: new input shape [{show(entry.signature)}] (partitioned for [{show(first.signature)}]): captured, "
         f"planned with the same schedule and lowered in {t:.2f} s{rel}; the state carries over. "
         f"{count} program(s) kept; prog.shapes() lists them.", stacklevel=user_stacklevel())
