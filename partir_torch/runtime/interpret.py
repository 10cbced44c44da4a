"""Emulated ranks without a tensor subclass: the per-device program runs once per rank on plain tensors, and its
collectives are computed exactly over the ranks' values.

The lowered program is cut at its collectives into segments (runs of local ops). Each segment becomes its own small
GraphModule, called once per rank with that rank's operands (plain eager aten calls, the cost of the local math
and nothing more); each collective then combines the ranks' values of its group (the ranks that differ only in
their coordinate on the collective's axis), in rank order:

    rt = InterpretedRuntime(mesh)
    outs = rt.run(lowered.gm, args)          # args, outs: PerRank values (one tensor per rank)

A pipelined program (lower/pipeline.py) is MPMD on its pipeline axis: each node carries the coordinate that runs
it (META_STAGE); a segment (cut where that coordinate changes) runs on those ranks only, a collective combines only
their groups, and a pp_transfer hands each sending rank's value to the rank at the destination coordinate with the
same coordinates on the other axes. A value lives on the ranks of its stage (None elsewhere); the step's outputs
are then completed from them (the emulated ranks share the stage's tensors: one state, read by every rank).

Random draws agree on every rank (the rules keep them whole): each rank's segment starts from the same generator
state, as torch.distributed._local_tensor.LocalTensorMode does (tests/test_fast.py checks both give the same step).
With compile=True each segment is compiled once with TorchInductor and called for every rank (runtime/compiled.py).
"""
from __future__ import annotations

import traceback

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from ..contract import EXC_NODE, META_STAGE
from ..rules.tags import draws_random
from ..lower.pipeline import PIPELINE_AXIS, pp_transfer
from ..lower.bucketops import ALL_GATHER_BUCKET, ALL_REDUCE_BUCKET
from ..lower.ring import RING_SHIFT
from ..mesh import Mesh
from ..sharding import Sharding
from .backend import InProcess
from .layout import assemble, assemble_into, shard_of

c10d = torch.ops._c10d_functional
WAIT = c10d.wait_tensor.default
COLLECTIVES = {c10d.all_reduce.default, c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
               c10d.all_to_all_single.default, RING_SHIFT, ALL_GATHER_BUCKET, ALL_REDUCE_BUCKET}


class PerRank:
    """One value per rank (index = rank): what the emulated program's values are."""

    __slots__ = ("ts",)

    def __init__(self, ts: list):
        self.ts = ts

    def __repr__(self) -> str:
        t = self.ts[0]
        return f"PerRank({len(self.ts)} x {tuple(t.shape) if isinstance(t, torch.Tensor) else t!r})"


class _Segment:
    """Local ops between two collectives, as a GraphModule over the values it reads from earlier steps."""

    def __init__(self, nodes: list, later: set):
        g = fx.Graph()
        env: dict = {}
        self.inputs: list = []

        def arg(n):
            if n not in env:
                env[n] = g.placeholder(n.name)
                self.inputs.append(n)
            return env[n]

        for n in nodes:
            env[n] = g.node_copy(n, arg)
        self.outputs = [n for n in nodes if n in later]
        self.stage = None                # pipelined programs: the coordinate on the pipeline axis that runs it
        g.output(tuple(env[n] for n in self.outputs))
        self.graph = g                   # run eagerly as `boxed`, compiled as `gm` (runtime/compiled.py)
        self.fn = None                   # compile_segments sets it: the compiled segment (positional arguments)
        self._boxed = self._gm = None
        self.random = any(draws_random(n) for n in nodes)

    @property
    def gm(self) -> fx.GraphModule:
        """The segment over positional arguments (compiled segments; built once, on a copy of its graph, its code
        generated when first called)."""
        if self._gm is None:
            g = fx.Graph()
            g.output(g.graph_copy(self.graph, {}))
            self._gm = _LazyGraphModule(torch.nn.Module(), g)
        return self._gm

    @property
    def boxed(self) -> fx.GraphModule:
        """The eager form: takes one list and clears it, so that inputs die at their last use (built once, on the
        segment's graph itself: a program's first run generates each segment's code once)."""
        if self._boxed is None:
            self._boxed = _boxed(self.graph)
        return self._boxed


class Plan:
    """The lowered program as a list of steps: ("segment", _Segment) or ("collective", node). Values read by
    later steps or the output are the only ones kept between steps, each dropped after its last use (`dying`).
    split_waits (memory measured): a run of local ops also ends at each wait, so that a collective's operand,
    which the communication holds until its wait, is dropped exactly there."""

    def __init__(self, gm: fx.GraphModule, split_waits: bool = False):
        nodes = list(gm.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output = next(n for n in nodes if n.op == "output")
        self.alias: dict = {}            # wait_tensor node -> the collective it waits for (the value itself)
        steps, run, wait_at = [], [], {}
        stage = lambda n: n.meta.get(META_STAGE)   # noqa: E731 - pipelined programs: the coordinate running n
        self.pipeline_axis = gm.meta.get(PIPELINE_AXIS)
        for n in nodes:
            if n.op in ("placeholder", "output"):
                continue
            if run and stage(n) != stage(run[-1]):
                steps.append(run)
                run = []
            if n.target is pp_transfer:
                if run:
                    steps.append(run)
                    run = []
                steps.append(n)
            elif n.target is WAIT:
                self.alias[n] = self._resolve(n.args[0])
                if split_waits and run:          # the run before the wait ends there: its operand dies after it
                    steps.append(run)
                    run = []
                # the step after which the operand dies: the run being built or the next step (or, split, the last)
                wait_at[n] = max(len(steps) - 1, 0) if split_waits else len(steps)
            elif n.target in COLLECTIVES:
                if run:
                    steps.append(run)
                    run = []
                steps.append(n)
            else:
                run.append(n)
        if run:
            steps.append(run)
        # read-after: a value crosses a step boundary when some node of another step (or the output) reads it
        owner = {}
        for i, s in enumerate(steps):
            for n in (s if isinstance(s, list) else [s]):
                owner[n] = i
        later: set = set()
        for n in nodes:
            if n.op == "placeholder":
                continue
            for a in n.all_input_nodes:
                a = self._resolve(a)
                if a in owner and (n.op == "output" or n.target is WAIT or owner.get(n) != owner[a]):
                    later.add(a)
        self.steps = []
        for s in steps:
            if isinstance(s, list):
                seg = _Segment([n for n in s], later)
                # the segment reads waits through their collectives
                for i, n in enumerate(seg.inputs):
                    seg.inputs[i] = self._resolve(n)
                seg.stage = stage(s[0])
                self.steps.append(("segment", seg))
            else:
                self.steps.append(("transfer" if s.target is pp_transfer else "collective", s))

        self.dying = self._dying(steps, owner, wait_at, later)

    def _resolve(self, n):
        while n in self.alias:
            n = self.alias[n]
        return n

    def _dying(self, steps, owner, wait_at, later) -> list:
        """Per step, the set of values kept between steps (env keys) whose last use it is: dropped after it. A
        collective's operand lives until its wait (the communication reads it); what the output returns and the
        placeholders (held by the caller) are never dropped here."""
        last: dict = {}
        end = len(steps) - 1
        for n, i in owner.items():
            for a in n.all_input_nodes:
                a = self._resolve(a)
                if a in owner:
                    last[a] = max(last.get(a, -1), i)
        for w, i in wait_at.items():
            for a in self.alias[w].all_input_nodes:
                a = self._resolve(a)
                if a in owner:
                    last[a] = max(last.get(a, -1), min(i, end))
        for a in self.output.all_input_nodes:
            last.pop(self._resolve(a), None)
        dying = [set() for _ in steps]
        for a, i in last.items():
            if a in later or a.target in COLLECTIVES:
                dying[i].add(a)
        return dying

    def segments(self) -> list:
        return [s for kind, s in self.steps if kind == "segment"]


class InterpretedRuntime(InProcess):
    """All ranks in one process, values as PerRank lists of plain tensors. Same interface as the other runtimes
    (shard, local, coords, run, full, rank0); it measures each rank's peak memory (memtrack.py)."""

    measures_memory = True

    def __init__(self, mesh: Mesh, compile: bool = False):
        self.mesh = mesh
        self.compile = compile
        self.n = mesh.size
        self.groups = {a: f"partir_{a}" for a in mesh.axes}   # lower.canonical_groups: no binding
        self._axis_of = {g: a for a, g in self.groups.items()}
        self._rank_groups = {a: self._groups_of(a) for a in mesh.axes}
        self._plans: dict = {}
        self.measure_memory = False      # the Executor sets it from Options.measure_memory
        self.last_peak = None            # {rank: bytes} of the last measured step
        self._pp = None                  # the pipeline axis of the program being run (None: SPMD)

    def _groups_of(self, axis) -> list:
        """The ranks of each group of `axis` (same coordinates on the other axes), ordered by coordinate."""
        out: dict = {}
        for r in range(self.n):
            c = self.mesh.coordinate(r)
            key = tuple(c[a] for a in self.mesh.axes if a != axis)
            out.setdefault(key, []).append((c[axis], r))
        return [[r for _, r in sorted(v)] for v in out.values()]

    def valid(self) -> bool:
        return True

    # -- values ----------------------------------------------------------------------------------------------------
    def per_rank(self, fn) -> PerRank:
        return PerRank([fn(r, self.mesh.coordinate(r)) for r in range(self.n)])

    def shard(self, full: torch.Tensor, sh: Sharding) -> PerRank:
        full = full.detach()
        if not sh.tiled_axes():           # replicated: every rank holds its own copy
            return PerRank([full.contiguous().clone() for _ in range(self.n)])
        own = torch.contiguous_format           # each rank's shard in storage of its own: updated in place
        return self.per_rank(lambda r, c: shard_of(full, sh, self.mesh, c).clone(memory_format=own))

    def local(self, full: torch.Tensor) -> PerRank:
        full = full.detach()
        return PerRank([full.clone() for _ in range(self.n)])

    def coords(self) -> list:
        return [self.per_rank(lambda r, c, a=a: torch.tensor(c[a], dtype=torch.int64)) for a in self.mesh.axes]

    def full(self, t: PerRank, sh: Sharding, shape) -> torch.Tensor:
        return assemble(dict(enumerate(t.ts)), sh, self.mesh, shape)

    def local_full(self, sh: Sharding) -> bool:
        return True                           # every rank's shard is in this process

    def full_into(self, dest: torch.Tensor, t: PerRank, sh: Sharding, shape) -> None:
        assemble_into(dest, dict(enumerate(t.ts)), sh, self.mesh)

    def value(self, t, sh: Sharding, shape) -> torch.Tensor:
        return self.full(t, sh, shape)

    def program(self, plan):
        """The plan's per-device program (lowered once per plan) bound to this runtime's process groups."""
        from ..lower.lower import bind

        return bind(plan.lowered(), self.groups)

    def rank0(self, t: PerRank) -> torch.Tensor:
        return t.ts[0].clone()

    # -- running ---------------------------------------------------------------------------------------------------
    def plan(self, gm) -> Plan:
        p = self._plans.get(id(gm))
        if p is None or p[0] is not gm:
            plan = Plan(gm, split_waits=self.measure_memory)
            if self.compile:
                from .compiled import compile_segments

                compile_segments(plan)
            p = self._plans[id(gm)] = (gm, plan)
        return p[1]

    def forget(self, gm) -> None:
        self._plans.pop(id(gm), None)

    def run(self, gm, args) -> list:
        """Each step in order; a value is dropped after its last use (Plan.dying), so every rank holds what its
        own device would. With measure_memory, a MemoryTracker (runtime/memtrack.py) counts each rank's live bytes
        and last_peak holds their peaks ({rank: bytes})."""
        plan = self.plan(gm)
        env: dict = {}
        for ph, a in zip(plan.placeholders, args):
            env[ph] = a if isinstance(a, PerRank) else PerRank([a] * self.n)
        if not self.measure_memory:
            return self._run(plan, env, None)
        from .memtrack import MemoryTracker, refuse_compiled

        refuse_compiled(self)
        tr = MemoryTracker(range(self.n))
        with tr.step({r: [env[ph].ts[r] for ph in plan.placeholders] for r in range(self.n)}):
            out = self._run(plan, env, tr)
        self.last_peak = dict(tr.peaks)
        return out

    def _run(self, plan, env, tr) -> list:
        ranks = range(self.n)
        self._pp = plan.pipeline_axis
        for (kind, s), dying in zip(plan.steps, plan.dying):
            if kind == "collective":
                env[s] = self._collective(s, _operand(env, plan, s.args[0], self.n), tr)
            elif kind == "transfer":
                env[s] = self._transfer(s, env[plan._resolve(s.args[0])].ts)
            else:
                self._segment(s, env, [n for n in s.inputs if n in dying], tr)
            for n in dying:
                del env[n]
        res = []
        for o in plan.output.args[0]:
            if isinstance(o, fx.Node):
                res.append(self._complete(env[plan._resolve(o)]) if self._pp else env[plan._resolve(o)])
            else:
                res.append(PerRank([o] * len(ranks)))
        return res

    # -- pipelined programs ----------------------------------------------------------------------------------------
    def _ranks_at(self, c) -> list:
        """The ranks that run a node at coordinate c of the pipeline axis (all ranks when c is None)."""
        if c is None or self._pp is None:
            return list(range(self.n))
        return [r for r in range(self.n) if self.mesh.coordinate(r)[self._pp] == c]

    def _peer(self, r: int, c: int) -> int:
        """The rank at coordinate c of the pipeline axis with rank r's coordinates on the other axes."""
        coord = dict(self.mesh.coordinate(r))
        coord[self._pp] = c
        return self.mesh.rank_of(coord)

    def _transfer(self, node, x: list) -> PerRank:
        """pp_transfer(x, src, dst, group): each rank at src hands its value to its peer at dst."""
        _, src, dst, _ = node.args
        out = [None] * self.n
        for r in self._ranks_at(src):
            out[self._peer(r, dst)] = x[r]
        return PerRank(out)

    def _complete(self, t: PerRank) -> PerRank:
        """An output of a pipelined step, held by the ranks of one stage: every other rank reads its peer's."""
        if all(x is not None for x in t.ts):
            return t
        out = list(t.ts)
        for r in range(self.n):
            if out[r] is None:
                out[r] = next((t.ts[self._peer(r, c)] for c in range(self.mesh.shape[self._pp])
                               if t.ts[self._peer(r, c)] is not None), None)
        return PerRank(out)

    def _segment(self, s, env, dying: list, tr) -> None:
        """Run segment `s` for every rank. Eager segments take their inputs boxed (a list they clear), and the
        inputs whose last use this is are dropped from env first, so they die inside the segment at their last
        use, as in one device's program."""
        ins = [env[n].ts for n in s.inputs]
        drop = [env[n].ts for n in dying if not n.op == "placeholder"]
        rng = torch.get_rng_state() if s.random else None
        eager = s.fn is None
        outs = []
        ranks = self._ranks_at(s.stage)
        for r in ranks:
            if rng is not None:
                torch.set_rng_state(rng)
            xs = [x[r] for x in ins]
            for ts in drop:
                ts[r] = None
            if tr is not None:
                tr.rank = r
            try:
                outs.append(s.boxed(xs) if eager else s.fn(*xs))
            except Exception as e:   # name the node that failed (executor.internal_error reads it)
                setattr(e, EXC_NODE, _failing_name(s.boxed if eager else s.gm, e))
                raise
            finally:
                if tr is not None:
                    tr.rank = None
            del xs
        if len(ranks) == self.n:
            for j, n in enumerate(s.outputs):
                env[n] = PerRank([o[j] for o in outs])
            return
        for j, n in enumerate(s.outputs):
            ts = [None] * self.n
            for r, o in zip(ranks, outs):
                ts[r] = o[j]
            env[n] = PerRank(ts)

    def _collective(self, node, x: list, tr=None) -> PerRank:
        """The collective over each group of its axis, from every rank's operand x (exact, in rank order). Ranks of
        a group share one result, except when memory is measured (tr): then each rank holds its own copy, adopted
        for it as its device's output buffer."""
        out = self._combine(node, x)
        if tr is not None:
            seen: set = set()
            for r in range(self.n):
                if id(out[r]) in seen:
                    out[r] = out[r].clone()
                seen.add(id(out[r]))
                tr.adopt(r, out[r])
        return PerRank(out)

    def _combine(self, node, x: list) -> list:
        t = node.target
        out = [None] * self.n
        axis = self._axis_of[node.args[-1]]
        here = set(self._ranks_at(node.meta.get(META_STAGE)))
        for grp in self._rank_groups[axis]:
            if grp[0] not in here:
                continue
            vals = [x[r] for r in grp]
            if t is c10d.all_reduce.default:
                red = _reduce(vals, node.args[1])
                for r in grp:
                    out[r] = red
            elif t is ALL_GATHER_BUCKET:       # each member gathered, member after member (lower/bucketops.py)
                flat = torch.cat([torch.cat([v[i] for v in vals], 0).reshape(-1) for i in range(len(vals[0]))])
                for r in grp:
                    out[r] = flat
            elif t is ALL_REDUCE_BUCKET:
                red = _reduce([torch.cat([m.reshape(-1) for m in v]) for v in vals], node.args[1])
                for r in grp:
                    out[r] = red
            elif t is c10d.all_gather_into_tensor.default:
                cat = torch.cat(vals, 0)
                for r in grp:
                    out[r] = cat
            elif t is RING_SHIFT:              # ring_shift(x, shift, group): each rank receives from `shift` before
                for i, r in enumerate(grp):
                    out[r] = vals[(i - node.args[1]) % len(grp)].clone()
            elif t is c10d.reduce_scatter_tensor.default:
                parts = _reduce(vals, node.args[1]).chunk(len(grp), 0)
                for i, r in enumerate(grp):
                    out[r] = parts[i].clone()      # its own buffer, not a view of the whole sum
            else:   # all_to_all_single(x, output_split_sizes, input_split_sizes, group)
                in_sizes = node.args[2]
                splits = [v.split(list(in_sizes) if in_sizes else v.shape[0] // len(grp), 0) for v in vals]
                for i, r in enumerate(grp):
                    out[r] = torch.cat([s[i] for s in splits], 0)
        return out


def _operand(env, plan, arg, n: int) -> list:
    """Per rank, a collective's operand: a tensor, or a list of tensors (a bucket's members, lower/bucketops.py)."""
    if isinstance(arg, (list, tuple)):
        per = [env[plan._resolve(a)].ts for a in arg]
        return [[p[r] for p in per] for r in range(n)]
    return env[plan._resolve(arg)].ts


def _reduce(vals: list, op: str) -> torch.Tensor:
    acc = vals[0].clone()
    for v in vals[1:]:
        if op in ("sum", "avg"):
            acc.add_(v)
        elif op == "max":
            torch.maximum(acc, v, out=acc)
        elif op == "min":
            torch.minimum(acc, v, out=acc)
        elif op == "product":
            acc.mul_(v)
        else:
            raise NotImplementedError(f"emulated reduce op {op!r}")
    if op == "avg":
        acc.div_(len(vals))
    return acc


def _failing_name(gm, exc) -> str | None:
    """The node of `gm` whose line raised `exc` (from the generated code's traceback)."""
    lines = gm.code.splitlines()
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        if fr.filename.startswith("<eval_with_key>") and 0 < fr.lineno <= len(lines):
            return lines[fr.lineno - 1].strip().split(" = ")[0]
    return None


def _boxed(g: fx.Graph) -> fx.GraphModule:
    """Segment graph `g` compiled with FX's boxed calling convention (one list argument, cleared once read), so
    that no caller frame keeps an input alive past its last use in the segment. Sets g's codegen."""
    from torch.fx.graph import _BoxedCodeGen

    g.set_codegen(_BoxedCodeGen())
    return fx.GraphModule(torch.nn.Module(), g)
