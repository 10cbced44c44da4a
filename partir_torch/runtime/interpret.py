"""Emulated ranks without a tensor subclass: the per-device program runs once per rank on plain tensors, and its
collectives are computed exactly over the ranks' values.

The lowered program is cut at its collectives into segments (runs of local ops). Each segment becomes its own small
GraphModule, called once per rank with that rank's operands (plain eager aten calls, the cost of the local math
and nothing more); each collective then combines the ranks' values of its group (the ranks that differ only in
their coordinate on the collective's axis), in rank order:

    rt = InterpretedRuntime(mesh)
    outs = rt.run(lowered.gm, args)          # args, outs: PerRank values (one tensor per rank)

Random draws agree on every rank (the rules keep them whole): each rank's segment starts from the same generator
state, as torch.distributed._local_tensor.LocalTensorMode does (tests/test_fast.py checks both give the same step).
With compile=True each segment is compiled once with TorchInductor and called for every rank (runtime/compiled.py).
"""
from __future__ import annotations

import traceback

import torch
import torch.fx as fx

from ..contract import EXC_NODE, RANDOM_OPS
from ..mesh import Mesh
from ..sharding import Sharding
from .layout import assemble, shard_of

c10d = torch.ops._c10d_functional
WAIT = c10d.wait_tensor.default
COLLECTIVES = {c10d.all_reduce.default, c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
               c10d.all_to_all_single.default}


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
        g.output(tuple(env[n] for n in self.outputs))
        self.gm = fx.GraphModule(torch.nn.Module(), g)
        self.fn = self.gm
        self.random = any(n.target in RANDOM_OPS or str(n.target).startswith(("aten.rand", "aten.bernoulli",
                                                                                 "aten.normal"))
                          for n in nodes)


class Plan:
    """The lowered program as a list of steps: ("segment", _Segment) or ("collective", node). Values read by
    later steps or the output are the only ones kept between steps."""

    def __init__(self, gm: fx.GraphModule):
        nodes = list(gm.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output = next(n for n in nodes if n.op == "output")
        self.alias: dict = {}            # wait_tensor node -> the collective it waits for (the value itself)
        steps, run = [], []
        for n in nodes:
            if n.op in ("placeholder", "output"):
                continue
            if n.target is WAIT:
                self.alias[n] = self._resolve(n.args[0])
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
                self.steps.append(("segment", seg))
            else:
                self.steps.append(("collective", s))

    def _resolve(self, n):
        while n in getattr(self, "alias", {}):
            n = self.alias[n]
        return n

    def segments(self) -> list:
        return [s for kind, s in self.steps if kind == "segment"]


class InterpretedRuntime:
    """All ranks in one process, values as PerRank lists of plain tensors. Same interface as the other runtimes
    (shard, local, coords, run, full, rank0)."""

    kind = "emulated"

    def __init__(self, mesh: Mesh, compile: bool = False):
        self.mesh = mesh
        self.compile = compile
        self.n = mesh.size
        self.groups = {a: f"partir_{a}" for a in mesh.axes}   # lower.canonical_groups: no binding
        self._axis_of = {g: a for a, g in self.groups.items()}
        self._rank_groups = {a: self._groups_of(a) for a in mesh.axes}
        self._plans: dict = {}

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
            plan = Plan(gm)
            if self.compile:
                from .compiled import compile_segments

                compile_segments(plan)
            p = self._plans[id(gm)] = (gm, plan)
        return p[1]

    def run(self, gm, args) -> list:
        plan = self.plan(gm)
        env: dict = {}
        for ph, a in zip(plan.placeholders, args):
            env[ph] = a if isinstance(a, PerRank) else PerRank([a] * self.n)
        ranks = range(self.n)
        for kind, s in plan.steps:
            if kind == "collective":
                env[s] = self._collective(s, env[plan._resolve(s.args[0])].ts)
                continue
            ins = [env[n].ts for n in s.inputs]
            rng = torch.get_rng_state() if s.random else None
            outs = []
            for r in ranks:
                if rng is not None:
                    torch.set_rng_state(rng)
                try:
                    outs.append(s.fn(*[x[r] for x in ins]))
                except Exception as e:   # name the node that failed (executor.internal_error reads it)
                    setattr(e, EXC_NODE, _failing_name(s.gm, e))
                    raise
            for j, n in enumerate(s.outputs):
                env[n] = PerRank([o[j] for o in outs])
        res = []
        for o in plan.output.args[0]:
            if isinstance(o, fx.Node):
                res.append(env[plan._resolve(o)])
            else:
                res.append(PerRank([o] * self.n))
        return res

    def _collective(self, node, x: list) -> PerRank:
        """The collective over each group of its axis, from every rank's operand x (exact, in rank order)."""
        t = node.target
        out = [None] * self.n
        axis = self._axis_of[node.args[-1]]
        for grp in self._rank_groups[axis]:
            vals = [x[r] for r in grp]
            if t is c10d.all_reduce.default:
                red = _reduce(vals, node.args[1])
                for r in grp:
                    out[r] = red
            elif t is c10d.all_gather_into_tensor.default:
                cat = torch.cat(vals, 0)
                for r in grp:
                    out[r] = cat
            elif t is c10d.reduce_scatter_tensor.default:
                parts = _reduce(vals, node.args[1]).chunk(len(grp), 0)
                for i, r in enumerate(grp):
                    out[r] = parts[i].contiguous()
            else:   # all_to_all_single(x, output_split_sizes, input_split_sizes, group)
                in_sizes = node.args[2]
                splits = [v.split(list(in_sizes) if in_sizes else v.shape[0] // len(grp), 0) for v in vals]
                for i, r in enumerate(grp):
                    out[r] = torch.cat([s[i] for s in splits], 0)
        return PerRank(out)


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

