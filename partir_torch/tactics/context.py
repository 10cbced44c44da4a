"""TacticContext: everything a tactic sees and may do while plan() applies it.

A tactic reads the mesh, the named values and what earlier tactics decided, and writes decisions only by seeding
values and propagating (seed_and_propagate). Trial copies (trial()) let the automatic search try decisions without
keeping them. What a tactic says about its work (notes on values, remarks under the summary, the automatic
search's report and the action behind each decision) goes into the plan's Planning record, not into any object's
attributes. A value is given by name ("params.layers.0.mlp.w1.weight"), FX node, or value index (PartGraph vid).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..contract import META_ROLE, Role
from ..lower.ppspec import NO_PIPELINE, NoPipeline, PipelineSpec
from ..propagate.arrays import undecided
from ..propagate.decisions import Decisions


@dataclass
class Planning:
    """What tactics report while they run (plan() freezes it into the Plan): notes per value name, remarks per
    tactic, the automatic searches' reports, the search action behind each decision, and per stage a lowering a
    tactic already made of exactly its decisions (the automatic tactic lowers its winner to simulate it)."""

    notes: dict = field(default_factory=dict)            # value name -> [text]
    remarks: dict = field(default_factory=dict)          # tactic name -> [text]
    searches: list = field(default_factory=list)         # tactics.auto.SearchReport
    actions: dict = field(default_factory=dict)          # (canonical vid, axis) -> (tactic, action label)
    stage: int = 0                                       # index of the stage being planned
    families: dict = field(default_factory=dict)         # tactic name -> declared family (collective records)
    pipeline: PipelineSpec | NoPipeline = NO_PIPELINE    # set by the pipeline tactic


class TacticContext:
    """What a tactic sees: the mesh, the named values, what earlier tactics decided, a way to seed and propagate,
    and trial copies to try decisions on. Tactics reach the propagator only through it."""

    def __init__(self, captured, graph, prop, mesh, options, planning: Planning):
        self.captured, self.graph, self.prop, self.mesh = captured, graph, prop, mesh
        self.options = options
        self.planning = planning

    def value_names(self) -> list:
        return list(self.graph.name_to_vid)

    def value_meta(self, name: str) -> dict:
        vid = self.graph.name_to_vid[name]
        node = self.graph.values[vid]
        val = node.meta["val"]
        return {"shape": tuple(val.shape), "dtype": val.dtype, "role": node.meta.get(META_ROLE, "activation")}

    def seed_and_propagate(self, axis: str, seeds: list, tactic: str, region: set | None = None,
                           closed: bool = False) -> list:
        """Seed named values, each (name, dim or pt.REPLICATED[, split factor of a strided tiling]), and propagate
        on `axis`; returns the canonical values set. closed=True: see Propagator.run (the seeded factor's region
        only, its values sealed)."""
        vids = []
        for name, state, *stride in seeds:
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

    # -- what a tactic reports -------------------------------------------------------------------------------------
    def note(self, name: str, text: str) -> None:
        """A remark shown by explain(name) (e.g. 'too small to tile on axis zero: replicated')."""
        self.planning.notes.setdefault(name, []).append(text)

    def remark(self, tactic: str, text: str) -> None:
        """A remark shown by summary() under the table (e.g. which linears Megatron left replicated)."""
        self.planning.remarks.setdefault(tactic, []).append(text)

    def record_search(self, report) -> None:
        """The automatic tactic's search report (prog.search_report()). Its candidates' lowerings are not the
        plan's: they are built without what the whole schedule decides (gathers kept from forward to backward, the
        stages' shared layouts) and would skip the memory budget and the reshard warnings; the plan lowers each stage
        once, its own way (Plan.lowered)."""
        self.planning.searches.append(report)

    def mark_action(self, canon_vid: int, axis: str, tactic: str, label: str) -> None:
        """explain() says that this decision came from the automatic search's action `label`."""
        self.planning.actions[(canon_vid, axis)] = (tactic, label)

    def optimizer_region(self) -> set:
        """Ops of the optimizer update: everything downstream of optimizer state, lr and step."""
        g = self.graph
        roots = [g.vid[n] for n in g.gm.graph.nodes if n.op == "placeholder"
                 and n.meta.get(META_ROLE) in (Role.OPT_STATE, Role.LR, Role.STEP)]   # lr: every hparams.<g>.<name>
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
        return bool(undecided(self.prop.rec.state(axis, self._vid_of(value))))

    def local_dim(self, value, dim: int) -> int:
        """The size of one dim of `value` after the tilings decided so far."""
        return self.prop.rec.local_dim(self._vid_of(value), dim)

    def dim_axes(self, value, dim: int) -> tuple:
        """The axes tiling one dim of `value`, major to minor."""
        return tuple(self.prop.rec.dim_axes.get((self.graph.canon[self._vid_of(value)], dim), ()))

    def stride(self, value, axis: str) -> int:
        """The split factor s of the part of its dim that `axis` tiles, the dim seen as (s, n / s); 1: not
        strided."""
        return self.prop.rec.strides.get((self.graph.canon[self._vid_of(value)], axis), 1)

    def axis_in_use(self, axis: str) -> bool:
        """Has any tactic seeded values on `axis` (even if it decided nothing)?"""
        return axis in self.prop.rec.axes

    def value_states(self, axis: str):
        """The state of every canonical value on `axis` in propagate/arrays.py's array form (read it with
        arrays.tiled / partial / undecided ...)."""
        return self.prop.rec.value_states(axis)

    def axis_arrays(self, axis: str) -> tuple:
        """(value_states(axis), per op its decision on `axis`), both in propagate/arrays.py's array form: what the
        simulator's fast estimate reads (sim/quick.py)."""
        return self.prop.rec.axis_arrays(axis)

    def op_decisions(self, axis: str) -> dict:
        """Op index -> its decision on `axis` (array form: a factor id, or the partial it passes through), for the
        ops decided so far (a copy)."""
        st = self.prop.rec.axes.get(axis)
        return dict(st.assign) if st is not None else {}

    def op_tactic(self, axis: str, i: int) -> str | None:
        """The tactic that decided op i on `axis`, or None."""
        st = self.prop.rec.axes.get(axis)
        return st.assign_tactic.get(i) if st is not None else None

    def conflicts_recorded(self) -> int:
        """How many conflicts propagation has recorded so far (standing or not)."""
        return self.prop.rec.conflicts_recorded()

    def decisions(self) -> Decisions:
        """An immutable snapshot of the decisions so far."""
        return Decisions(self.prop.rec)

    # -- trials --------------------------------------------------------------------------------------------------
    def trial(self, axes=None) -> "TrialContext":
        """A context over a copy of the decisions so far: tactics applied to it leave this one unchanged, their
        notes and remarks are dropped. axes: the only axes the trial decides (their states are copied, the rest
        shared and copied on write: a trial costs what it reaches); None: a full copy."""
        return TrialContext(self, self.prop.snapshot() if axes is None else self.prop.trial(axes))

    def lower(self, share=None):
        """The per-device program (lower.Lowered) of the decisions so far, with the plan's options. share: a
        lower.StageShare kept across the lowerings of one graph and mesh (the automatic search's candidates): the
        layouts of ops whose decisions equal the previous lowering's are reused."""
        from ..lower.lower import Lowerer, canonical_groups

        return Lowerer(self.graph, Decisions(self.prop.rec), self.mesh, self.captured, canonical_groups(self.mesh),
                       self.options, self.planning.families, share=share).run()


class TrialContext(TacticContext):
    """A TacticContext over a copy of the decisions (TacticContext.trial): tactics run on it unchanged; what they
    report is dropped."""

    def __init__(self, ctx: TacticContext, prop):
        super().__init__(ctx.captured, ctx.graph, prop, ctx.mesh, ctx.options,
                         Planning(families=ctx.planning.families))
