"""The result of partition(): shardings after every tactic, explanations, conflicts, and the runnable program."""
from __future__ import annotations

from dataclasses import dataclass

from .contract import META_ROLE
from .errors import PartitionError, closest
from .options import Options
from .propagate.decisions import Decisions, value_sharding
from .propagate.state import UNKNOWN
from .reporting import ProgramReports
from .sharding import Sharding


@dataclass(frozen=True)
class Stage:
    """Snapshot after one tactic: the sharding of every named value, and the conflicts standing then."""

    tactic: str
    axis: str
    shardings: dict
    conflicts: tuple
    decided: int          # (value, axis) decisions made by this tactic
    prop: object = None   # the propagator's decisions at this point (for lowering / simulating the stage)

    @property
    def decisions(self) -> Decisions:
        """What the schedule had decided after this tactic (an immutable snapshot)."""
        return Decisions(self.prop)


class TacticContext:
    """What a tactic sees: the mesh, the named values, what earlier tactics decided, a way to seed and propagate,
    and trial copies to try decisions on. Tactics reach the propagator only through it.

    A value is given by name ("params.layers.0.mlp.w1.weight"), FX node, or value index (PartGraph vid)."""

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

    # -- what earlier tactics decided ----------------------------------------------------------------------------
    def _vid_of(self, value) -> int:
        if isinstance(value, str):
            return self.graph.name_to_vid[value]
        return value if isinstance(value, int) else self.graph.vid[value]

    def is_unknown(self, axis: str, value) -> bool:
        """Has no tactic decided `value` on `axis` yet?"""
        return self.prop.state(axis, self._vid_of(value)) == UNKNOWN

    def local_dim(self, value, dim: int) -> int:
        """The size of one dim of `value` after the tilings decided so far."""
        return self.prop.local_dim(self._vid_of(value), dim)

    def dim_axes(self, value, dim: int) -> tuple:
        """The axes tiling one dim of `value`, major to minor."""
        return tuple(self.prop.dim_axes.get((self.graph.canon[self._vid_of(value)], dim), ()))

    def stride(self, value, axis: str) -> int:
        """The split factor s of the part of its dim that `axis` tiles, the dim seen as (s, n / s); 1: not
        strided."""
        return self.prop.strides.get((self.graph.canon[self._vid_of(value)], axis), 1)

    def axis_in_use(self, axis: str) -> bool:
        """Has any tactic seeded values on `axis` (even if it decided nothing)?"""
        return axis in self.prop.axes

    def value_states(self, axis: str):
        """The state of every canonical value on `axis`, an int64 array (propagate/state.py's codes: UNKNOWN,
        REPLICATED, PARTIAL[op], dim >= 0)."""
        return self.prop.value_states(axis)

    def axis_arrays(self, axis: str) -> tuple:
        """(value_states(axis), per op its decision on `axis`: factor id or partial code, UNKNOWN if none), as
        int64 arrays: the form the simulator's fast estimate reads (sim/estimate.py)."""
        return self.prop.axis_arrays(axis)

    def op_decisions(self, axis: str) -> dict:
        """Op index -> its decision on `axis` (factor id, or the partial code it passes through), for the ops
        decided so far (a copy)."""
        st = self.prop.axes.get(axis)
        return dict(st.assign) if st is not None else {}

    def op_tactic(self, axis: str, i: int) -> str | None:
        """The tactic that decided op i on `axis`, or None."""
        st = self.prop.axes.get(axis)
        return st.assign_tactic.get(i) if st is not None else None

    def conflicts_recorded(self) -> int:
        """How many conflicts propagation has recorded so far (standing or not)."""
        return self.prop.conflicts_recorded()

    # -- trials --------------------------------------------------------------------------------------------------
    def trial(self, axes=None) -> "TrialContext":
        """A context over a copy of the decisions so far: tactics applied to it leave this one unchanged, their
        notes and remarks are dropped. axes: the only axes the trial decides (their states are copied, the rest
        shared and copied on write: a trial costs what it reaches); None: a full copy."""
        return TrialContext(self, self.prop.snapshot() if axes is None else self.prop.trial(axes))

    def lower(self):
        """The per-device program (lower.Lowered) of the decisions so far, with the program's options."""
        from .lower.lower import Lowerer

        return Lowerer(self.graph, Decisions(self.prop), self.mesh, self.captured,
                       {a: f"partir_{a}" for a in self.mesh.axes}, self.program.options).run()


class TrialContext(TacticContext):
    """A TacticContext over a copy of the decisions (TacticContext.trial): tactics run on it unchanged; their notes
    and remarks are dropped."""

    def __init__(self, ctx: TacticContext, prop):   # noqa: super().__init__ would take program.prop
        self.program, self.mesh, self.graph, self.captured = ctx.program, ctx.mesh, ctx.graph, ctx.captured
        self.prop = prop

    def note(self, name, text):
        pass

    def remark(self, tactic, text):
        pass


class Program(ProgramReports):
    """A partitioned step. `print(prog)` shows the graph with shardings; see DESIGN §2 for the API. What it prints
    and reports (explain, summary, simulate, ...) is in reporting.py."""

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

    # -- stages: lowering and simulating the program as it stood after each tactic ---------------------------------
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

    def _snapshot(self, tactic) -> Stage:
        names = self.graph.name_to_vid
        shardings = {n: self.sharding_of_vid(v) for n, v in names.items()}
        decided = sum(1 for st in self.prop.axes.values() for p in st.prov.values() if p.tactic == tactic.name)
        return Stage(tactic.name, getattr(tactic, "axis", ""), shardings, tuple(self.prop.conflicts), decided,
                     self.prop.snapshot())
