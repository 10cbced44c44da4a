"""Pipeline parallelism as a tactic (MPMD on one mesh axis, Shardy-MPMD style).

    schedule = [pt.tactics.pipeline("pp", [["tok", "blocks.[0-3]"], ["blocks.[4-7]", "norm", "head"]],
                                    schedule="1F1B", microbatches=8),
                pt.tactics.data_parallel("dp"), pt.tactics.megatron("tp")]

The step is captured with its m micro-batches unrolled in one graph (partition's accumulate machinery: one
gradient sum, one optimizer update). This tactic decides nothing on the other axes: it assigns every op of the
captured step to a stage, and the pipeline axis stays whole (no value is tiled or partial on it):

- a forward op to the stage whose module globs match its module (capture/stages.py records the innermost module
  whose forward made the op; a glob matches a module or any of its ancestors, fnmatch syntax, as torchtitan's
  module_fqns_per_model_part); a backward op to the stage of the module whose forward it differentiates;
- an op outside every stage's modules (the loss, the gradient sums, the optimizer update of a parameter) to the
  latest stage among its operands (a backward op: the earliest stage sending it a gradient); an op of none (slicing the batch into micro-batches) to every stage that
  reads it (lowering copies it);
- parameters, buffers and optimizer state to the stage of their module;
- with clip_grad_norm, a gradient's scaling to the gradient's stage (lowering computes the norm on every rank from
  the stages' partial sums of squares, all-reduced on the axis).

Lowering (lower/pipeline.py) then runs each stage's ops on the ranks of its coordinate on the axis, in the
schedule's order per micro-batch, and turns every value crossing a stage boundary into a point-to-point transfer
on the axis. The tactics on the other axes partition every stage's ops as they would the whole step.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from types import MappingProxyType

from ..contract import META_CLIP, META_MODULE, META_NAME, META_ROLE, Phase, Role, phase_of
from ..errors import PartitionError, warn
from ..lower.ppschedules import DEFAULT_SCHEDULE, Schedule, schedule_of
from ..lower.ppspec import PipelineSpec
from ..options import Options
from ..rules.tags import draws_random
from .base import TacticBase, declare
from .cut import balanced_cut
from .structure import param_source

@declare("pipeline")
@dataclass(frozen=True)
class Pipeline(TacticBase):
    """PP: the stages of the step on the ranks of `axis` (see the module docstring). stages: an int (that many
    stages, cut between the model's repeated blocks so that their forward FLOPs are balanced) or one list of module
    FQN globs per stage. schedule: a name of lower/ppschedules.SCHEDULES (GPipe, 1F1B, Interleaved1F1B: several
    stages per rank, ZBVZeroBubble: 2 stages per rank in a V, each backward split into its input gradient and its
    weight gradients) or a Schedule. microbatches: per step (default 2 x stages); partition captures the step with
    that many (accumulate)."""

    axis: str
    stages: object = 2
    schedule: str | Schedule = DEFAULT_SCHEDULE
    microbatches: int | None = None
    name: str = "PP"
    placed: tuple = ()           # ((state value name, stage), ...): where a training plan put its state (the eval
    #                              step of a pipelined program, runtime/evaluate.py, runs on the training stages)

    def __post_init__(self):
        schedule_of(self.schedule)            # a name the table does not know is refused here
        st = self.stages
        if isinstance(st, bool) or not (isinstance(st, int) and st >= 1 or isinstance(st, (list, tuple)) and st
                                        and all(isinstance(g, (list, tuple)) and g for g in st)):
            raise PartitionError(f"pipeline: stages must be an int >= 1 or a non-empty list with one non-empty list of "
                                 f"module FQN globs per stage, got {st!r}.")
        if isinstance(st, list):
            object.__setattr__(self, "stages", tuple(tuple(g) for g in st))
        m = self.microbatches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise PartitionError(f"pipeline: microbatches must be a positive int, got {m!r}.")

    @property
    def n_stages(self) -> int:
        return self.stages if isinstance(self.stages, int) else len(self.stages)

    @property
    def n_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else 2 * self.n_stages

    @property
    def kind(self) -> Schedule:
        """The schedule (lower/ppschedules.py) this tactic runs."""
        return schedule_of(self.schedule)

    def check_runs_with(self, options: Options, training: bool, mesh=None) -> None:
        """Refuse, before anything is captured, what this tactic cannot run: partition's options its schedule does
        not run with (Schedule.check_options) and, given the mesh, an axis the mesh lacks or a stage count the
        schedule cannot place on it (Schedule.check_stages). A 70B model's capture takes a minute: a wrong stage
        count is said before it."""
        self.kind.check_options(options, training, self.name)
        if mesh is not None:
            self._check_mesh(mesh)

    def _check_mesh(self, mesh) -> None:
        if self.axis not in mesh.axes:
            raise PartitionError(f"{self.name}: axis '{self.axis}' is not an axis of the mesh {dict(mesh.shape)}.")
        self.kind.check_stages(self.n_stages, mesh.shape[self.axis], self.n_microbatches, self.axis, self.name)

    def apply(self, ctx) -> None:
        cap, mesh = ctx.captured, ctx.mesh
        self._check_mesh(mesh)
        if ctx.planning.pipeline.staged:
            raise PartitionError(f"{self.name}: the schedule has two pipeline tactics; one pipeline axis per program.")
        if ctx.axis_in_use(self.axis):
            raise PartitionError(f"{self.name}: axis '{self.axis}' already holds decisions of an earlier tactic; the "
                                 f"pipeline axis runs stages, not shards. Put the pipeline tactic first on its own "
                                 f"axis.")
        ranks = mesh.shape[self.axis]
        n = self.n_stages
        s = cap.settings
        if cap.mode not in ("train", "loss_and_grads", "eval"):      # eval: a pipelined eval_step (evaluate.py)
            raise PartitionError(f"{self.name}: a pipeline runs a training step; pass loss_fn= (and optimizer=).")
        if not s.get("record_modules"):
            raise PartitionError(f"{self.name}: the step was captured without the module of each op; capture it for "
                                 f"this schedule (plan.capture_for(model, schedule, ...) or pt.partition).")
        if s.get("accumulate", 1) != self.n_microbatches:
            raise PartitionError(f"{self.name}: the step was captured with {s.get('accumulate', 1)} micro-batches and "
                                 f"the pipeline runs {self.n_microbatches}; pt.partition(..., accumulate=) must be "
                                 f"{self.n_microbatches} or left at 1 (the pipeline sets it).")
        globs = self.stages if not isinstance(self.stages, int) else balanced_cut(cap, self.stages, self.name)
        spec = assign_stages(cap, globs, self, ranks)
        ctx.planning.pipeline = spec
        self._warn_draws(cap)
        for name, st in spec.tied.items():
            ranks_ = spec.holders(name)
            how = (f"its gradient is summed over them (all_reduce on '{self.axis}', why 'tied weight') and each "
                   f"applies the same update" if len(ranks_) > 1 else f"all on rank {ranks_[0]}: no exchange")
            ctx.note(name, f"{self.name}: tied weight, read by stages {', '.join(map(str, st))}: held by each of "
                           f"them (ranks {', '.join(map(str, ranks_))} of '{self.axis}'); {how}.")
        sizes = ", ".join(f"{len(p)}" for p in spec.params)
        ctx.remark(self.name, f"{n} stages on axis '{self.axis}' ({self.schedule}, {spec.microbatches} micro-batches); "
                              f"parameters per stage: {sizes}")


    def _warn_draws(self, cap) -> None:
        """Say where the step's random draws differ from one device's. Dropout masks drawn from shape templates
        are one device's whole-batch draws (capture/microdraws.py), made on the stage that reads them in forward
        order: one process (emulated ranks) draws them as one device does. Other draws are per micro-batch."""
        import torch.distributed as dist

        from ..capture.microdraws import WHOLE_DRAW

        draws = [n for n in cap.gm.graph.nodes if draws_random(n)]
        own = sorted({str(n.target) for n in draws if not n.meta.get(WHOLE_DRAW)})
        if own:
            warn(f"{self.name}: the step draws random numbers per micro-batch ({', '.join(own[:3])}): the draws "
                 f"differ from one device's (same distribution, other numbers; dropout masks of a batch-major "
                 f"activation are one device's). Train with that randomness off to compare with one device.")
        elif draws and dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake":
            warn(f"{self.name}: on real ranks each stage's processes draw only their own stage's dropout masks, "
                 f"from the generator state they start the step with, so the masks differ from one device's (same "
                 f"distribution); emulated ranks draw them as one device does.")


def pipeline(axis: str, stages=2, schedule: str | Schedule = DEFAULT_SCHEDULE, microbatches: int | None = None,
             name: str = "PP") -> Pipeline:
    """The pipeline tactic (see Pipeline)."""
    return Pipeline(axis, stages, schedule, microbatches, name)


# -- the cut -------------------------------------------------------------------------------------------------------
def _matcher(globs) -> callable:
    """module FQN -> the first stage with a glob matching it or one of its ancestors, else None."""
    memo: dict = {}

    def stage(fqn: str | None):
        if not fqn:
            return None
        if fqn not in memo:
            parts = fqn.split(".")
            prefixes = [".".join(parts[:k]) for k in range(len(parts), 0, -1)]
            memo[fqn] = next((i for p in prefixes for i, gs in enumerate(globs)
                              if any(fnmatch.fnmatchcase(p, g) for g in gs)), None)
        return memo[fqn]
    return stage


def _state_fqn(name: str) -> str | None:
    """The module owning a state value: params.<m>.<p> / buffers.<m>.<b> / opt.<state>.<m>.<p> -> <m>."""
    if name.startswith(("params.", "buffers.")):
        fqn = name.split(".", 1)[1]
    elif name.startswith("opt."):
        fqn = name.split(".", 2)[2]
    else:
        return None
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def assign_stages(cap, globs, tactic: Pipeline, ranks: int) -> PipelineSpec:
    """Every op of the captured step -> its stage (see the module docstring); refuses what a pipeline cannot run:
    a parameter no stage holds, a buffer or optimizer state read by two stages, a forward op reading a later stage's
    value. A parameter read by several stages (tied weights) is held by each of them (PipelineSpec.tied)."""
    stage_of_module = _matcher(globs)
    stateful = {_state_fqn(n.meta.get(META_NAME, "")) for n in cap.gm.graph.nodes if n.op == "placeholder"} - {None}
    shared: set = set()         # modules without state whose calls run on several stages
    updated = {ph for ph, _ in cap.ties}
    readers: dict = {}          # tied parameter placeholder -> the stages that read it
    placed = dict(tactic.placed)
    stage: dict = {}
    by_param: dict = {}
    params = [[] for _ in globs]
    for n in cap.gm.graph.nodes:
        if n.op == "placeholder":
            s = _state_stage(n, tactic, globs, stage_of_module, placed, by_param, n not in updated)
            if s is not None:
                stage[n] = s
                if n.meta.get(META_ROLE) == Role.PARAM:
                    fqn = n.meta[META_NAME][len("params."):]
                    params[s].append(fqn)
                    by_param[fqn] = s
            continue
        if n.op != "call_function":
            continue
        ins = [stage[a] for a in n.all_input_nodes if stage.get(a) is not None]
        mod = n.meta.get(META_MODULE)
        s = stage_of_module(mod) if mod not in shared else None
        if (n.meta.get("custom") or {}).get(META_CLIP) == "scale" and stage.get(n.args[0]) is not None:
            s = stage[n.args[0]]      # clip_grad_norm scales a gradient on its own stage (by the factor every rank has)
        elif s is None:
            s = _stage_outside_modules(n, ins, stage)
        elif phase_of(n) == Phase.FORWARD and max(ins, default=-1) > s \
                and max((late := _non_param_stages(n, stage)), default=(-1,))[0] > s \
                and not _owns_state(mod, stateful) and not _draws(mod, cap):
            # a module without state called on several stages (one activation or dropout module shared by every
            # layer, HF openai-gpt and xlnet; a weightless norm, nanochat): each call runs where its inputs are
            shared.add(mod)
            s = _stage_outside_modules(n, ins, stage)
        elif phase_of(n) == Phase.FORWARD and max(ins, default=-1) > s and late and max(late)[0] > s:
            at, _, a = max(late)
            why = (f"module '{mod}' has no state but draws random numbers (one dropout module called by the layers of "
                   f"several stages): its draws on the stages would not be one device's. Give each layer its own "
                   f"dropout module, or set its probability to 0" if not _owns_state(mod, stateful) else
                   f"stages must follow the forward's order. {_fix(tactic, globs)}")
            raise PartitionError(f"{tactic.name}: {n.format_node()} of module '{mod}' (stage {s}) reads {a.name}, "
                                 f"computed on the later stage {at}; {why}")
        if s is not None:
            stage[n] = s
        for a in n.all_input_nodes:
            src = a if a.op == "placeholder" else (param_source(a) or (None,))[0]
            if src is None or stage.get(src) is None or s is None or stage.get(a) == s:
                continue
            if src.meta.get(META_ROLE) == Role.PARAM and phase_of(n) != Phase.OPTIMIZER:
                readers.setdefault(src, {stage[src]}).add(s)       # a tied weight: held by every stage reading it
                continue
            if phase_of(n) == Phase.OPTIMIZER and _param_fqn(src) in {_param_fqn(r) for r in readers}:
                continue         # a tied weight's update: lowering runs it on every stage that holds the weight
            raise PartitionError(f"{tactic.name}: {src.meta.get(META_NAME)} (stage {stage[src]}) is read by "
                                 f"{n.format_node()} on stage {s}; a value of the step's state other than a "
                                 f"parameter must live on one stage. {_fix(tactic, globs, 'Put both uses in one stage.')}")
    auto = isinstance(tactic.stages, int)
    for i, p in enumerate(params):
        if not p and not any(s == i for s in stage.values()):
            raise PartitionError(f"{tactic.name}: stage {i}{'' if auto else f' ({list(globs[i])})'} holds no op of the "
                                 f"step; every stage needs some of the model. {_fix(tactic, globs)}")
    tied, views = _tied(cap, readers, stage)
    return PipelineSpec(tactic.axis, tactic.kind, len(globs), ranks, tactic.n_microbatches,
                        MappingProxyType({n.name: s for n, s in stage.items() if n.name not in views}),
                        tuple(tuple(g) for g in globs), tuple(tuple(p) for p in params), tactic.name,
                        MappingProxyType(tied), frozenset(views))


def _state_stage(n, tactic, globs, stage_of_module, placed: dict, by_param: dict, constant: bool) -> int | None:
    """The stage of placeholder `n` when it is state (a parameter, an updated buffer, optimizer state), else None
    (the batch, a constant buffer: every stage reads its own copy). Refuses state no stage's globs match."""
    name = n.meta.get(META_NAME, "")
    fqn = _state_fqn(name)
    if n.meta.get(META_ROLE) == Role.BUFFER and constant:
        fqn = None      # a constant buffer (rope tables): every stage reads its own copy, as the batch
    s = None
    if name in placed:
        s = placed[name]
    elif name.startswith("opt.") and name.split(".", 2)[2] in by_param:
        s = by_param[name.split(".", 2)[2]]        # a parameter's optimizer state lives with it
    elif fqn is not None:
        s = stage_of_module(fqn) if fqn else None
        if s is None and n.users and (fqn == "" or isinstance(tactic.stages, int)):
            # the root module's own state, or (a balanced cut) a module read only through its attributes
            # (wpe.weight[:T]): the first stage whose modules read it, else the last
            s = _first_reader(n, stage_of_module, len(globs) - 1)
        elif s is None and not n.users:
            s = len(globs) - 1     # state the step never reads (a tower a text-only call skips): no op
    if fqn is None:
        return None
    if s is None:
        raise PartitionError(f"{tactic.name}: {name} belongs to module '{fqn or '<root>'}', which no stage's globs "
                             f"match ({[list(g) for g in globs]}). Add it to a stage.")
    return s


def _draws(mod: str, cap) -> bool:
    """Whether an op of module `mod` draws random numbers (a dropout module): its calls on several stages would draw
    in another order than one device's (not supported: refused as any order violation)."""
    return any(n.meta.get(META_MODULE) == mod and draws_random(n) for n in cap.gm.graph.nodes
               if n.op == "call_function")


def _owns_state(mod: str | None, stateful: set) -> bool:
    """Whether module `mod` (an FQN) or a module inside it holds a parameter or buffer (`stateful`: their FQNs)."""
    return mod is not None and any(f == mod or f.startswith(mod + ".") for f in stateful)


def _non_param_stages(n, stage: dict) -> list:
    """(stage, position, value) of the values `n` reads, leaving out parameters (and their views): a parameter read by several
    stages is a tied weight, held by each of them, whichever stage its name puts it on (HF's Camembert names its
    tied embedding after the LM head, which its module order lists first)."""
    out = []
    for i, a in enumerate(n.all_input_nodes):
        src = a if a.op == "placeholder" else (param_source(a) or (None,))[0]
        if stage.get(a) is not None and not (src is not None and src.meta.get(META_ROLE) == Role.PARAM):
            out.append((stage[a], i, a))
    return out


def _stage_outside_modules(n, ins: list, stage: dict) -> int | None:
    """The stage of an op no stage's modules made: a forward op (the loss, a slice between blocks) or an update runs
    on the latest stage among its operands; a backward op (a gradient sum over layers, the backward of a slice the
    root took between blocks) on the earliest stage that sends it a gradient: gradients flow to earlier stages, so
    that stage has received every other one before it runs, where the latest would wait for a gradient that the
    earlier stage computes only after it (HF Gemma-4's per-layer inputs, summed over the layers of both stages)."""
    if not ins:
        return None
    if phase_of(n) == Phase.BACKWARD:
        grads = [stage[a] for a in n.all_input_nodes if stage.get(a) is not None and phase_of(a) == Phase.BACKWARD
                 and param_source(a) is None]             # a weight's transpose made for the backward: no gradient
        if grads:
            return min(grads)
    return max(ins)


def _fix(tactic: Pipeline, globs, own: str = "Reorder the stages' module globs.") -> str:
    """The fix a message proposes: `own` where the user gave the globs; where the cut was automatic (the user wrote
    no glob), the stages to give explicitly, starting from the cut it chose."""
    if not isinstance(tactic.stages, int):
        return own
    return (f"stages={tactic.stages} cut the model automatically at its repeated blocks; give the stages yourself, "
            f"one list of module FQN globs per stage, starting from the cut it chose: "
            f"stages={[list(g) for g in globs]}.")


def _param_fqn(node) -> str | None:
    """The parameter FQN of a params.<fqn> or opt.<state>.<fqn> placeholder."""
    name = node.meta.get(META_NAME, "")
    return name[len("params."):] if name.startswith("params.") else name.split(".", 2)[2] \
        if name.startswith("opt.") else None


def _tied(cap, readers: dict, stage: dict) -> tuple:
    """Tied weights ({state value name: holder stages, the owner first}, the names of the ops that only view a tied
    parameter: casts and transposes, made on each stage that reads them). A parameter's optimizer state is held
    with it."""
    if not readers:
        return {}, set()
    by_fqn = {_param_fqn(ph): (stage[ph],) + tuple(sorted(st - {stage[ph]})) for ph, st in readers.items()}
    tied = {n.meta[META_NAME]: by_fqn[_param_fqn(n)] for n in cap.gm.graph.nodes
            if n.op == "placeholder" and _param_fqn(n) in by_fqn}
    views = {n.name for n in cap.gm.graph.nodes if n.op == "call_function"
             and (param_source(n) or (None,))[0] in readers}
    return tied, views


def _first_reader(node, stage_of_module, last: int) -> int:
    """The lowest stage among the first ops of some stage's modules that read `node`'s value (through ops of no
    module: a slice, the residual add around the blocks); `last` when none does (the loss reads it)."""
    found, seen, todo = [], set(), list(node.users)
    while todo:
        u = todo.pop()
        if u in seen or u.op != "call_function" or phase_of(u) != Phase.FORWARD:
            continue
        seen.add(u)
        s = stage_of_module(u.meta.get(META_MODULE))
        if s is not None:
            found.append(s)
        else:
            todo.extend(u.users)
    return min(found) if found else last
