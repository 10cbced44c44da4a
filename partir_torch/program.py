"""The result of partition(): shardings after every tactic, explanations, conflicts, and the runnable program."""
from __future__ import annotations

import math
from dataclasses import dataclass

from tabulate import tabulate

from .errors import PartitionError, closest
from .propagate.state import PARTIAL_OP, REPLICATED, UNKNOWN, state_str
from .sharding import Sharding
from .contract import META_COLLECTIVE, META_RECOMPUTE, META_ROLE, META_SRC, META_TAG
from .options import Options
from .propagate.decisions import Decisions, value_sharding


@dataclass(frozen=True)
class Stage:
    """Snapshot after one tactic: the sharding of every named value, and the conflicts standing then."""

    tactic: str
    axis: str
    shardings: dict
    conflicts: tuple
    decided: int          # (value, axis) decisions made by this tactic
    prop: object = None   # the propagator's decisions at this point (for lowering / simulating the stage)


class TacticContext:
    """What a tactic sees: the mesh, the named values, and a way to seed and propagate."""

    def __init__(self, program: "Program"):
        self.program = program
        self.mesh = program.mesh
        self.graph = program.graph
        self.prop = program.prop
        self.captured = program.captured

    def value_names(self) -> list:
        return list(self.graph.name_to_vid)

    def value_meta(self, name: str) -> dict:
        vid = self.graph.name_to_vid[name]
        node = self.graph.values[vid]
        val = node.meta["val"]
        return {"shape": tuple(val.shape), "dtype": val.dtype, "role": node.meta.get(META_ROLE, "activation")}

    def seed_and_propagate(self, axis: str, seeds: list, tactic: str, region: set | None = None,
                           closed: bool = False) -> list:
        """Seed named values and propagate on `axis`; returns the canonical values set. closed=True: see
        Propagator.run (the seeded factor's region only, its values sealed)."""
        vids = []
        for name, state, *stride in seeds:      # (name, dim or state[, split factor of a strided tiling])
            vid = self.graph.name_to_vid[name]
            self.prop.seed(axis, vid, state, tactic, *stride)
            vids.append(vid)
        return self.prop.run(axis, tactic, vids, region, closed)

    def seed_nodes_and_propagate(self, axis: str, seeds: list, tactic: str, region: set | None = None) -> None:
        """Like seed_and_propagate, for graph nodes that have no name (a linear's input activation)."""
        vids = []
        for node, state in seeds:
            vid = self.graph.vid[node]
            self.prop.seed(axis, vid, state, tactic)
            vids.append(vid)
        self.prop.run(axis, tactic, vids, region)

    def note(self, name: str, text: str) -> None:
        """A remark shown by explain(name) (e.g. 'too small to tile on axis zero: replicated')."""
        self.program.notes.setdefault(name, []).append(text)

    def remark(self, tactic: str, text: str) -> None:
        """A remark shown by summary() under the table (e.g. which linears Megatron left replicated)."""
        self.program.remarks.setdefault(tactic, []).append(text)

    def optimizer_region(self) -> set:
        """Ops of the optimizer update: everything downstream of optimizer state, lr and step."""
        g = self.graph
        roots = [g.vid[n] for n in g.gm.graph.nodes if n.op == "placeholder"
                 and n.meta.get(META_ROLE) in ("opt_state", "lr", "step")]   # lr: every hparams.<g>.<name>
        region, stack = set(), list(roots)
        seen = set(roots)
        while stack:
            v = stack.pop()
            for i in g.users[v]:
                if i in region:
                    continue
                region.add(i)
                for r in g.ops[i].results:
                    if r is not None and r not in seen:
                        seen.add(r)
                        stack.append(r)
        return region


class Program:
    """A partitioned step. `print(prog)` shows the graph with shardings; see DESIGN §2 for the API."""

    def __init__(self, captured, graph, prop, mesh, tactics, model=None, optimizer=None, options: Options = None):
        self.captured, self.graph, self.prop, self.mesh = captured, graph, prop, mesh
        self.tactics = tactics
        self.options = options or Options()
        self.stages: list = []
        self.model, self.optimizer = model, optimizer
        self.notes: dict = {}
        self.remarks: dict = {}   # tactic name -> lines summary() prints under its table
        self._exec = None
        self._stage_lowered: dict = {}     # stage index -> Lowered (see stage_lowered)

    @property
    def bucket_bytes(self) -> int:
        return self.options.bucket_bytes

    @property
    def timeout_s(self) -> float:
        return self.options.timeout_s

    @property
    def decisions(self) -> Decisions:
        """What the whole schedule decided (an immutable snapshot; stages[k].decisions after tactic k)."""
        return Decisions(self.prop)

    # -- running (see runtime/) ----------------------------------------------------------------------------------
    @property
    def executor(self):
        if self._exec is None:
            from .runtime import Executor

            self._exec = Executor(self, self.model, self.optimizer)
        return self._exec

    @property
    def lowered(self):
        """The per-device program (lower.Lowered): GraphModule, collective records, layouts."""
        return self.executor.ensure()

    def collectives(self) -> list:
        """CollectiveRecords of the per-device program: kind, axis, bytes, dtype, tactic, value, FX node."""
        return list(self.lowered.records)

    def train_step(self, *batch):
        """One step (forward, backward, optimizer update) on the global batch; each rank keeps its slice."""
        return self.executor.train_step(batch)

    def train_step_local(self, *local_batch):
        """One step where each rank passes its own shard of the batch (from a real data loader)."""
        return self.executor.train_step(local_batch, local=True)

    def loss_and_grads(self, *batch):
        return self.executor.loss_and_grads(batch)

    def __call__(self, *inputs):
        return self.executor.forward(inputs)

    def gather_parameters(self) -> dict:
        """Full parameter tensors, keyed by FQN."""
        return self.executor.gather_parameters()

    def state_dict(self) -> dict:
        """{"model": {fqn: T}, "optimizer": {"state": {fqn: {"step", "exp_avg", ...}}, "param_groups": [...]}}, the
        layout of torch.distributed.checkpoint's get_state_dict: T are DTensors on real ranks (placements = the
        program's shardings; torch.distributed.checkpoint.save/load work on it) and full tensors in emulation."""
        return self.executor.state_dict()

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Load state_dict()'s layout, resharding DTensors of any placement (or full tensors) to this program's;
        the optimizer's param groups take the saved hyperparameters and the step count resumes."""
        self.executor.load_state_dict(state_dict, strict)

    def full_state_dict(self) -> dict:
        """The consolidated module state (model.state_dict() keys, full tensors): model.load_state_dict(it)."""
        return self.executor.full_state_dict()

    def export_to(self, model=None, optimizer=None) -> None:
        """Write parameters, buffers and optimizer state into an eager module and optimizer (default: the ones
        given to partition)."""
        self.executor.export_to(model, optimizer)

    def import_from(self, model=None, optimizer=None) -> None:
        """Take parameters, buffers and optimizer state from an eager module and optimizer (after editing them)."""
        self.executor.import_from(model, optimizer)

    @property
    def steps(self) -> int:
        """Optimizer steps taken (restored by load_state_dict)."""
        return self.executor.steps

    @property
    def last_grad_norm(self):
        """With partition(..., clip_grad_norm=...): the global gradient norm of the last train_step (before
        clipping), as torch.nn.utils.clip_grad_norm_ returns it."""
        return self.executor.last_grad_norm

    def eval_step(self, *batch):
        """The loss on the live (sharded) state in eval mode (dropout off, batch norm running statistics), at any
        batch size; no update. The loss-only step is captured once per input shape and cached."""
        return self.executor.evaluator.eval_step(batch)

    def forward(self, *inputs):
        """The model's outputs on the live state in eval mode, at any batch size (captured once per shape)."""
        return self.executor.evaluator.forward(inputs)

    def to_xla(self):
        """The same plan as a torch-xla SPMD program (xla.XlaProgram: train_step, forward, state_dict, hlo,
        collectives, compare); needs torch-xla (the .venv-xla environment)."""
        from .xla import XlaProgram

        return XlaProgram(self)

    # -- shardings -----------------------------------------------------------------------------------------------
    def _vid(self, name: str) -> int:
        vid = self.graph.name_to_vid.get(name)
        if vid is None:   # an FX node's name, as conflicts and collective records give it
            vid = next((v for n, v in self.graph.vid.items() if n.name == name), None)
        if vid is None:
            near = closest(name, self.graph.name_to_vid, n=5)
            raise PartitionError(f"no value named {name!r}." + (f" Closest: {', '.join(near)}." if near else ""))
        return vid

    def sharding_of_vid(self, vid: int) -> Sharding:
        return value_sharding(self.prop, vid)

    def sharding(self, name: str) -> Sharding:
        """The sharding of a named value after the last tactic (e.g. "params.layers.0.attn.wq.weight")."""
        return self.sharding_of_vid(self._vid(name))

    @property
    def conflicts(self) -> list:
        return self.prop.conflicts

    def explain(self, name: str) -> str:
        """Which tactic decided each axis of a value, and through which path."""
        vid = self._vid(name)
        g, c = self.graph, self.graph.canon[vid]
        lines = [f"{name}: {self.sharding_of_vid(vid)}  shape {tuple(g.shapes[vid])}"]
        for axis in self.mesh.axes:
            st = self.prop.axes.get(axis)
            s = UNKNOWN if st is None else st.value[c]
            if s == UNKNOWN:
                lines.append(f"  axis '{axis}': replicated (no tactic decided it)")
                continue
            lines.append(f"  axis '{axis}': {self._why(st, c, s)}")
        for text in self.notes.get(name, ()):
            lines.append(f"  note: {text}")
        for conflict, via in self._conflicts_of(vid):
            lines.append(f"  conflict: {conflict}" + (f" (reached from this value's seed through {via})"
                                                      if via else ""))
        return "\n".join(lines)

    def _conflicts_of(self, vid: int) -> list:
        """(conflict, value it reached) for the conflicts that involve this value: it is one of the competing
        values, or a competing value's decision comes (by provenance) from this value's seed."""
        g = self.graph
        out = []
        for conflict in self.prop.conflicts:
            st = self.prop.axes.get(conflict.axis)
            for value, _, _ in conflict.states:
                v = g.name_to_vid.get(value, next((x for n, x in g.vid.items() if n.name == value), None))
                if v is None or st is None:
                    continue
                if g.canon[v] == g.canon[vid]:
                    out.append((conflict, ""))
                    break
                if self._seed_of(st, g.canon[v]) == g.canon[vid]:
                    out.append((conflict, value))
                    break
        return out

    def _seed_of(self, st, c: int) -> int | None:
        """The canonical value whose seed decided `c` on this axis (following provenance), or None."""
        seen = set()
        while c not in seen:
            seen.add(c)
            prov = st.prov.get(c)
            if prov is None:
                return None
            if prov.op is None:
                return c
            c = self.graph.canon[prov.source]
        return None

    def search_report(self) -> str:
        """The automatic tactics' searches (tactics.automatic): the candidates lowered and simulated (actions, step
        time, peak memory, exposed communication, next to the fast estimate) and the search statistics."""
        reports = self.__dict__.get("search_reports", [])
        if not reports:
            raise PartitionError("search_report: no automatic tactic in this schedule (pt.tactics.automatic).")
        return "\n\n".join(r.table() for r in reports)

    def _why(self, st, c: int, s: int) -> str:
        auto = self.__dict__.get("auto_actions", {}).get((c, st.axis))
        why = self._why_path(st, c, s)
        return why + (f"; decided by {auto[0]} (automatic), action '{auto[1]}'" if auto else "")

    def _why_path(self, st, c: int, s: int) -> str:
        g = self.graph
        prov = st.prov[c]
        what = state_str(s)
        if prov.op is None:
            return f"{what} by tactic {prov.tactic}: seeded"
        path, cur, seen = [], prov, set()
        while cur is not None and cur.op is not None and len(path) < 6:
            node = g.ops[cur.op].node
            path.append(f"{node.target} ({node.name}) from {g.name(cur.source)}")
            src = g.canon[cur.source]
            if src in seen:
                break
            seen.add(src)
            cur = st.prov.get(src)
        more = " ..." if cur is not None and cur.op is not None else ""
        origin = f" (seeded by {cur.tactic})" if cur is not None and cur.op is None else ""   # the last `from` value
        return f"{what} by {prov.tactic} via " + " <- ".join(path) + more + origin

    # -- printing ------------------------------------------------------------------------------------------------
    def annotated(self, max_nodes: int | None = None) -> str:
        """The captured graph, one line per value, with its sharding."""
        g = self.graph
        lines = [f"# mesh {self.mesh}; schedule: " + ", ".join(f"{t.name}[{getattr(t, 'axis', '?')}]" for t in self.tactics)]
        for i, node in enumerate(g.gm.graph.nodes):
            if max_nodes is not None and i >= max_nodes:
                lines.append("...")
                break
            if node.op == "output":
                lines.append(f"return {node.args[0]}")
                continue
            vid = g.vid.get(node)
            val = node.meta.get("val")
            shape = list(val.shape) if vid is not None else ""
            lhs = f"%{node.name}: {shape}" if vid is not None else f"%{node.name}"
            if node.op == "placeholder":
                rhs = f"input {node.meta.get('partir_name', '')}"
            else:
                args = ", ".join(f"%{a.name}" if hasattr(a, "name") else repr(a) for a in node.args)
                rhs = f"{node.target}({args})"
            sh = f"  # {self.sharding_of_vid(vid)}" if vid is not None else ""
            tag = f"  ({node.meta['partir_tag']})" if node.meta.get(META_TAG) else ""
            lines.append(f"{lhs} = {rhs}{sh}{tag}")
        return "\n".join(lines)

    def device_program(self) -> str:
        """The per-device program: local shapes, each op's value sharding, and every collective with its kind,
        axis, bytes and the tactic that made it necessary."""
        low = self.stage_lowered(len(self.stages) - 1)
        g = self.graph
        src = {n.name: n for n in g.gm.graph.nodes}
        lines = [f"# per-device program on mesh {self.mesh}; schedule: "
                 + ", ".join(f"{t.name}[{getattr(t, 'axis', '?')}]" for t in self.tactics)]
        for node in low.gm.graph.nodes:
            if node.op == "output":
                lines.append(f"return {node.args[0]}")
                continue
            val = node.meta.get("val")
            shape = f": {_dt(val)}{list(val.shape)}" if hasattr(val, "shape") else ""
            if node.op == "placeholder":
                lines.append(f"%{node.name}{shape} = input {node.meta.get('partir_name', '')}")
                continue
            args = ", ".join(f"%{a.name}" if hasattr(a, "name") else repr(a) for a in node.args)
            line = f"%{node.name}{shape} = {_short(node.target)}({args})"
            rec = node.meta.get(META_COLLECTIVE)
            origin = src.get(node.meta.get(META_SRC, ""))
            if rec is not None:
                op = f"({rec.reduce_op})" if rec.reduce_op else ""
                line += f"  # {rec.kind}{op} on '{rec.axis}' (x{rec.group_size}) {_fmt_bytes(rec.nbytes)} " \
                        f"<- {rec.tactic}, for {rec.value}"
            elif origin is not None and origin in g.vid:
                line += f"  # {self.sharding_of_vid(g.vid[origin])}"
            lines.append(line)
        return "\n".join(lines)

    def __str__(self):
        return self.device_program()

    # -- stages: lowering and simulating the program as it stood after each tactic ---------------------------------
    def _view(self, prop) -> "Program":
        import copy

        v = copy.copy(self)
        v.prop, v._exec = prop, None
        return v

    def stage_lowered(self, k: int):
        """The per-device program after tactic k (k = -1: before any tactic, everything replicated)."""
        cache = self._stage_lowered
        if k not in cache:
            from .lower.fakeprop import annotate_local_vals
            from .lower.lower import Lowerer
            from .propagate.engine import Propagator

            prop = Propagator(self.graph, self.mesh) if k < 0 else self.stages[k].prop
            low = Lowerer(self.graph, Decisions(prop), self.mesh, self.captured,
                          {a: f"partir_{a}" for a in self.mesh.axes}, self.options).run()
            annotate_local_vals(low, self.captured)
            cache[k] = low
        return cache[k]

    def simulate(self, hw, axis_map=None, issue: str = "ready"):
        """SimReport for the final program on hardware `hw` (pt.sim.hardware(...)); `.stages` holds one report per
        tactic stage (the first: nothing partitioned), so the table shows what each tactic changed."""
        from .sim import simulate_graph

        reports = []
        for k, name in [(-1, "replicated")] + [(k, s.tactic) for k, s in enumerate(self.stages)]:
            low = self.stage_lowered(k)
            recompute = {n.name for n in low.gm.graph.nodes if n.meta.get(META_RECOMPUTE)}
            reports.append(simulate_graph(low.gm, self.mesh, hw, axis_map=axis_map, stage_name=name, issue=issue,
                                          exclude_flops=recompute))
        final = reports[-1]
        final.stages = reports
        return final

    def summary(self) -> str:
        """One row per tactic stage: decisions, conflicts, collectives added (by kind and axis), bytes per step,
        parameter and optimizer-state memory per device."""
        rows = []
        prev = self._stage_stats(-1)
        for k, s in enumerate(self.stages):
            cur = self._stage_stats(k)
            added = {key: n - prev["by"].get(key, 0) for key, n in cur["by"].items() if n != prev["by"].get(key, 0)}
            added_s = ", ".join(f"{kind}[{axis}] {'+' if n > 0 else ''}{n}" for (kind, axis), n in sorted(added.items()))
            rows.append([s.tactic, s.axis, s.decided, len(s.conflicts), added_s or "-", _fmt_bytes(cur["bytes"]),
                         _fmt_bytes(cur["param"]), _fmt_bytes(cur["opt"])])
            prev = cur
        table = tabulate(rows, headers=["tactic", "axis", "decisions", "conflicts", "collectives added",
                                        "comm bytes/step", "params/device", "opt state/device"], tablefmt="simple")
        notes = [text for s in self.stages for text in self.remarks.get(s.tactic, ())]
        if self.conflicts:
            shown = "\n".join(f"  {c}" for c in self.conflicts[:3])
            more = f"\n  ... and {len(self.conflicts) - 3} more (prog.conflicts)" if len(self.conflicts) > 3 else ""
            notes.append(f"{len(self.conflicts)} conflict{'s' if len(self.conflicts) > 1 else ''} (propagation "
                         f"stopped there; lowering reshards the values around them; prog.explain(<value or FX node "
                         f"name>) names the cause):\n{shown}{more}")
        return "\n".join([table] + notes)

    def _stage_stats(self, k: int) -> dict:
        low = self.stage_lowered(k)
        by: dict = {}
        for r in low.records:
            by[(r.kind, r.axis)] = by.get((r.kind, r.axis), 0) + 1
        sent = sum(r.nbytes for r in low.records)
        param = opt = 0
        for role, shape, n in zip(self.captured.input_roles, low.local_shapes,
                                  [n for n in self.captured.gm.graph.nodes if n.op == "placeholder"]):
            if role in ("param", "opt_state") and shape is not None:
                b = math.prod(shape) * n.meta["val"].element_size()
                if role == "param":
                    param += b
                else:
                    opt += b
        return {"by": by, "bytes": sent, "param": param, "opt": opt}

    def _snapshot(self, tactic) -> Stage:
        names = self.graph.name_to_vid
        shardings = {n: self.sharding_of_vid(v) for n, v in names.items()}
        decided = sum(1 for st in self.prop.axes.values() for p in st.prov.values() if p.tactic == tactic.name)
        return Stage(tactic.name, getattr(tactic, "axis", ""), shardings, tuple(self.prop.conflicts), decided,
                     self.prop.snapshot())


def _dt(val) -> str:
    return {"torch.float32": "f32", "torch.bfloat16": "bf16", "torch.float16": "f16", "torch.int64": "i64",
            "torch.bool": "b8"}.get(str(getattr(val, "dtype", "")), str(getattr(val, "dtype", "")))


def _short(target) -> str:
    name = str(target)
    for prefix in ("aten.", "_c10d_functional."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.rsplit(".default", 1)[0]


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if b < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1024
