"""plan(): the one place where tactics are applied. A Plan is a frozen value: the captured step, its rule graph,
one Stage per schedule entry (each with its Decisions), what the tactics reported, and the options.

    cap = capture_for(model, schedule, example_inputs, loss_fn, optimizer)   # trace once
    p = plan(cap, pt.Mesh({"batch": 2, "model": 2}), schedule)            # decide (no lowering, no state)
    p2 = plan(cap, pt.Mesh({"batch": 4}), other_schedule)                 # the same capture, planned again
    p.decisions.sharding(vid); p.stages[0].decisions; p.lowered().records # lowered once, on first use

Everything downstream takes a Plan: lowering (Plan.lowered, one per stage, memoised), the backends that run it
(runtime/, xla/), the reports (reporting.Reports) and the Program facade (program.py). A Captured can be planned
many times with different meshes and schedules: the automatic search and the tests do that instead of capturing
again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

from .capture import capture
from .capture.capture import dim_guards
from .errors import PartitionError, user_stacklevel, warn
from .lower.ppspec import NO_PIPELINE, NoPipeline, PipelineSpec
from .mesh import Mesh
from .options import Options
from .propagate.decisions import Decisions
from .propagate.engine import Propagator
from .propagate.record import DecisionRecord
from .propagate.graph import PartGraph, no_gc
from .rules.registry import default_registry
from .tactics.base import CaptureRewrite, Tactic, TacticBase, decompositions_of, family_of
from .tactics.context import Planning, TacticContext
from .tactics.cp import ContextParallel
from .tactics.pipeline import Pipeline
from .tactics.presets import DataParallel, Zero
from .tactics.schedule import flatten_schedule


@dataclass(frozen=True, eq=False)
class Stage:
    """The decisions after one schedule entry, and what it added: the conflicts standing then and the number of
    (value, axis) decisions this tactic made."""

    tactic: str
    axis: str
    decisions: Decisions
    conflicts: tuple
    decided: int

    @cached_property
    def shardings(self) -> dict:
        """Named value -> its Sharding at this stage."""
        d = self.decisions
        return {n: d.sharding(v) for n, v in d.graph.name_to_vid.items()}


@dataclass(frozen=True, eq=False)
class Plan:
    """A captured step and what the schedule decided for it on a mesh (see the module docstring). Immutable but for
    the memo of its lowerings (Plan.lowered) and what they share (Plan.share), functions of the plan."""

    captured: object                     # capture.Captured
    graph: PartGraph
    mesh: Mesh
    tactics: tuple                       # the flattened schedule (tactics and capture rewrites), in order
    stages: tuple                        # one Stage per entry of `tactics`
    options: Options
    registry: object                     # the rule registry propagation used
    notes: MappingProxyType              # value name -> (text, ...) for explain()
    remarks: MappingProxyType            # tactic name -> (text, ...) for summary()
    searches: tuple = ()                 # the automatic tactics' SearchReports
    actions: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))   # (canon vid, axis) -> label
    pipeline: PipelineSpec | NoPipeline = NO_PIPELINE    # what the pipeline tactic decided (lower/ppspec.py)
    pipeline_at: int = -1                # the index of the pipeline tactic in `tactics`
    _lowered: dict = field(default_factory=dict, repr=False)   # stage index -> lower.Lowered (memo)

    @property
    def decisions(self) -> Decisions:
        """What the whole schedule decided (stages[k].decisions after entry k)."""
        return self.stages[-1].decisions if self.stages else self.replicated

    @cached_property
    def replicated(self) -> Decisions:
        """The decisions before any tactic: every value whole on every axis."""
        return Decisions(DecisionRecord(self.graph, self.mesh))

    def stage_decisions(self, k: int) -> Decisions:
        """Decisions after entry k (k = -1: before any)."""
        return self.replicated if k < 0 else self.stages[k].decisions

    @property
    def conflicts(self) -> list:
        return list(self.decisions.conflicts)

    def sharding(self, vid: int):
        return self.decisions.sharding(vid)

    def lowered(self, k: int | None = None):
        """The per-device program (lower.Lowered) after entry k (None: the whole schedule; -1: before any tactic),
        with collectives on lower.canonical_groups; lowered once per stage, on first use. The first lowering of
        the whole schedule (the program's first step or report) warns once per op type that forces "reshard"
        collectives (reporting.reshard_warnings), at the user's line that asked for it."""
        k = len(self.stages) - 1 if k is None else k
        if k not in self._lowered:
            with no_gc():     # a bulk pass building a graph as large as the captured one (capture/graphutil.py)
                low = self._lower(k, self.options)
                if self.options.memory_budget is not None:
                    low = self._within_budget(k, low)
            self._lowered[k] = low
            if k == len(self.stages) - 1:
                _warn_reshards(self._lowered[k])
        return self._lowered[k]

    def _lower(self, k: int, options: Options):
        from .lower.lower import Lowerer, canonical_groups

        staged = self.pipeline.staged and self.pipeline_at <= k      # the stages exist from the pipeline tactic on
        low = Lowerer(self.graph, self.stage_decisions(k), self.mesh, self.captured, canonical_groups(self.mesh),
                      options, self.families, self.kept_gathered,
                      pipelined=self.pipeline if staged else None, share=self.share, ring=self.ring_axes).run()
        if staged:
            from .lower.pipeline import pipeline_program

            low = pipeline_program(low, self.pipeline, self.captured)
        return low

    def _within_budget(self, k: int, low):
        """Options.memory_budget: the first schedule whose peak (sim/memory.py's liveness of the lowered program, the
        figure prog.peak_memory() measures) fits, trying fewer gathers in flight first, then one reduction in
        flight; none fits: the one with the least peak, said once."""
        import dataclasses

        from .lower.fakeprop import annotate_local_vals
        from .sim.memory import analyze_memory

        budget, o = self.options.memory_budget, self.options
        tries = [(p, o.reduce_in_flight) for p in range(o.prefetch, -1, -1)]
        if o.reduce_in_flight != 1:
            tries += [(p, 1) for p in range(o.prefetch, -1, -1)]
        best = None
        for i, (pf, rif) in enumerate(tries):
            cand = low if i == 0 else self._lower(k, dataclasses.replace(o, prefetch=pf, reduce_in_flight=rif))
            annotate_local_vals(cand, self.captured, self.share.meta_memo)
            peak = analyze_memory(list(cand.gm.graph.nodes)).peak_bytes
            if peak <= budget:
                return cand
            if best is None or peak < best[0]:
                best = (peak, cand, pf, rif)
        if k == len(self.stages) - 1:
            warn(f"memory_budget: no schedule of this plan fits {budget / 2**30:.2f} GiB per device; the smallest "
                 f"peaks at {best[0] / 2**30:.2f} GiB (prefetch={best[2]}, reduce_in_flight={best[3]}). Add a "
                 f"tactic that shards more (zero(3), remat) or raise the budget.", stacklevel=user_stacklevel())
        return best[1]

    def annotated_lowered(self, k: int | None = None):
        """lowered(k) with every node's local FakeTensor in meta["val"] (what the simulator and reports read)."""
        from .lower.fakeprop import annotate_local_vals

        low = self.lowered(k)
        if not low.annotated:
            with no_gc():
                annotate_local_vals(low, self.captured, self.share.meta_memo)
        return low

    @cached_property
    def share(self):
        """What the lowerings of this plan's stages share (lower.StageShare): the layouts of ops a stage left
        unchanged, the meta run's memo."""
        from .lower.lower import StageShare

        return StageShare()

    @cached_property
    def families(self) -> dict:
        """Tactic name -> the family its class declares (tactics.base.declare); lowering puts it on every
        collective record, so the simulator's confidence classifies a renamed tactic by what it does."""
        return tactic_families(self.tactics)

    @property
    def kept_gathered(self) -> frozenset:
        """Names of the tactics whose gathered state lives from the forward to the backward (zero(3,
        reshard_after_forward=False)): lowering gathers such a value once per step instead of once per phase."""
        return frozenset(t.name for t in self.tactics if isinstance(t, Zero) and t.reshard_after_forward is False)

    @property
    def ring_axes(self) -> frozenset:
        """Axes whose attention lowering runs as a ring (context_parallel(attention="ring"), lower/cp.py)."""
        return frozenset(t.axis for t in self.tactics if isinstance(t, ContextParallel) and t.attention == "ring")

    @property
    def capture_rewrites(self) -> tuple:
        """The schedule's capture-time entries (mixed_precision, remat): they shaped the captured step."""
        return tuple(t for t in self.tactics if isinstance(t, CaptureRewrite))


def capture_for(model, schedule, example_inputs, loss_fn=None, optimizer=None, clip_grad_norm=None,
                accumulate: int = 1, accumulate_dims=None, eval_loss: bool = False, values=None,
                record_modules: bool = False, dynamic=(), mesh: Mesh | None = None):
    """Capture `model`'s step as `schedule` needs it: its capture rewrites (mixed precision, remat) applied and the
    decompositions its tactics ask for. The result can be planned with any schedule of the same capture rewrites.
    A pipeline tactic in the schedule (training) captures its micro-batches unrolled (accumulate) and each op's
    module and micro-batch (capture/stages.py). dynamic: (input index, dim) pairs of one size traced as one symbol;
    then the guards on it (capture/dims.py DimGuards) instead of a Captured. mesh: the mesh the step will be
    planned on, for tactics whose capture depends on an axis size (data_parallel(batchnorm="local"))."""
    entries = bound_to(flatten_schedule(schedule), mesh)
    rewrites = [t for t in entries if isinstance(t, CaptureRewrite)]
    pipe = next((t for t in entries if isinstance(t, Pipeline)), None)
    if pipe is not None and loss_fn is not None and not eval_loss:
        record_modules = True
        if accumulate not in (1, pipe.n_microbatches):
            raise PartitionError(f"partition: accumulate={accumulate} and the pipeline tactic's microbatches="
                                 f"{pipe.n_microbatches} disagree; the pipeline runs its micro-batches as the "
                                 f"accumulation. Leave accumulate at 1.")
        accumulate = pipe.n_microbatches
    if dynamic:
        return dim_guards(model, example_inputs, loss_fn, optimizer, rewrites, _decompositions(entries),
                          clip_grad_norm=clip_grad_norm, accumulate=accumulate, accumulate_dims=accumulate_dims,
                          eval_loss=eval_loss, record_modules=record_modules, positions=dynamic)
    cap = capture(model, example_inputs, loss_fn, optimizer, rewrites, _decompositions(entries),
                  clip_grad_norm=clip_grad_norm,
                  accumulate=accumulate, accumulate_dims=accumulate_dims, eval_loss=eval_loss, values=values,
                  record_modules=record_modules, bn_groups=_bn_groups(entries))
    if cap.bn_groups:
        from .capture.bn_local import sink_running_statistics

        sink_running_statistics(cap)
    return cap


def plan(captured, mesh: Mesh, schedule, options: Options | None = None, registry=None) -> Plan:
    """Apply `schedule`'s tactics, in order, to a captured step on `mesh`: one propagation per tactic, a Stage
    after each entry. Capture rewrites in the schedule are recorded (they acted at capture: capture_for)."""
    if not isinstance(mesh, Mesh):
        raise PartitionError(f"partition: mesh must be a pt.Mesh, got {type(mesh).__name__}.")
    entries = tuple(bound_to(flatten_schedule(schedule), mesh))
    _check_captured_for(captured, entries)
    options = options or Options()
    registry = registry or default_registry()
    planning = Planning(families=tactic_families(entries))
    stages = []
    with no_gc():   # linear time: no full collections over the traced graph's heap while partitioning
        graph = PartGraph(captured.gm, registry, captured.names, captured.ties)
        prop = Propagator(graph, mesh, uneven=not options.strict)
        ctx = TacticContext(captured, graph, prop, mesh, options, planning)
        for k, t in enumerate(entries):
            planning.stage = k
            if isinstance(t, Tactic):
                t.apply(ctx)
            decided = sum(1 for st in prop.rec.axes.values() for p in st.prov.values() if p.tactic == t.name)
            axis = t.axis if isinstance(t, Tactic) else ""      # a capture rewrite decides no axis
            stages.append(Stage(t.name, axis, Decisions(prop.rec), tuple(prop.rec.conflicts), decided))
        spec = planning.pipeline
        if spec.staged and ctx.axis_in_use(spec.axis):
            raise PartitionError(f"plan: a tactic after the pipeline decided values on its axis '{spec.axis}'; the "
                                 f"pipeline axis runs stages, every value stays whole on it. Give the other tactics "
                                 f"the other axes.")
    frozen = lambda d: MappingProxyType({k: tuple(v) for k, v in d.items()})   # noqa: E731
    at = next((k for k, t in enumerate(entries) if isinstance(t, Pipeline)), -1)
    return Plan(captured, graph, mesh, entries, tuple(stages), options, registry, frozen(planning.notes),
                frozen(planning.remarks), tuple(planning.searches), MappingProxyType(dict(planning.actions)),
                spec, at)



def _check_captured_for(captured, entries) -> None:
    """A schedule plans a captured step only if the step was captured as that schedule needs it: the same capture
    rewrites (they changed the traced step) and every decomposition its tactics ask for."""
    rewrites = tuple(t.name for t in entries if isinstance(t, CaptureRewrite))
    if rewrites != tuple(captured.rewrites):
        raise PartitionError(f"plan: the schedule's capture rewrites {list(rewrites)} differ from those the step was "
                             f"captured with {list(captured.rewrites)}; they shape the traced step itself. Capture "
                             f"it for this schedule: plan.capture_for(model, schedule, example_inputs, ...).")
    missing = set(_decompositions(entries)) - captured.decompositions
    if missing:
        names = sorted(str(op) for op in missing)
        raise PartitionError(f"plan: the schedule's tactics need {', '.join(names[:3])} decomposed at capture, and "
                             f"the step was captured without. Capture it for this schedule: "
                             f"plan.capture_for(model, schedule, example_inputs, ...).")
    want, have = _bn_groups(entries), captured.bn_groups
    global_dp = any(isinstance(t, DataParallel) and t.batchnorm == "global" for t in entries)
    if (want and want != have) or (have and not want and global_dp):
        say = lambda g: f"{g} per-rank batches" if g else "the whole batch"   # noqa: E731
        raise PartitionError(f"plan: the schedule takes batch norm statistics over {say(want)}, and the step was "
                             f"captured with them over {say(have)} (data_parallel(batchnorm='local') on a mesh axis "
                             f"of that size). Capture it for this schedule and mesh: "
                             f"plan.capture_for(model, schedule, example_inputs, ..., mesh=mesh).")


def bound_to(entries, mesh) -> list:
    """The schedule's entries with what they need of the mesh at capture (TacticBase.bound); as given when mesh is
    None."""
    return list(entries) if mesh is None else [t.bound(mesh) if isinstance(t, TacticBase) else t for t in entries]


def _bn_groups(entries) -> int:
    """The per-rank batches batch norm takes its statistics over (data_parallel(batchnorm="local")), 0 for the
    whole batch. One axis at most."""
    local = [t for t in entries if isinstance(t, DataParallel) and t.batchnorm == "local"]
    if len(local) > 1:
        raise PartitionError(f"partition: batchnorm='local' on axes {[t.axis for t in local]}: per-rank statistics on "
                             f"more than one axis are not supported yet. Keep batchnorm='local' on one "
                             f"data_parallel tactic.")
    return local[0].bn_groups if local else 0


def tactic_families(entries) -> dict:
    """Tactic name -> declared family, for the tactics of a schedule that declare one (a user's own tactic class
    may not: its collectives then carry no family and the simulator falls back to the name)."""
    return {t.name: f for t in entries if (f := family_of(t))}


def _warn_reshards(lowered) -> None:
    from .errors import user_stacklevel, warn
    from .reporting import reshard_warnings

    for text in reshard_warnings(lowered.records):
        warn(text, stacklevel=user_stacklevel())


def _decompositions(entries) -> dict:
    """The extra decompositions a schedule's entries ask capture for (op overload -> function)."""
    out = {}
    for t in entries:
        out.update(decompositions_of(t))
    return out
