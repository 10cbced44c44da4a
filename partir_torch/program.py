"""Program: what partition() returns, a thin facade over a Plan (plan.py: what the schedule decided), its Reports
(reporting.py: what it prints) and an Executor (runtime/: the backend that runs it and the state it holds). One
facade for every backend: prog.to_xla() is a Program too, on the torch-xla backend."""
from __future__ import annotations

from .capture import FORWARD
from .capture.counts import describe as describe_counts
from .errors import PartitionError, warn
from .propagate.decisions import Decisions
from .reporting import Reports
from .sharding import Sharding


class Program:
    """A partitioned step. `print(prog)` shows the per-device program; see DESIGN §2 for the API.

    plan: the frozen decisions (prog.plan.stages, prog.decisions); model, optimizer, loss_fn: what partition was
    given (the state starts from them, eval_step captures with them); the runtime and the state are created on the
    first call that runs something (collectives(), summary() and simulate() never touch parameter memory).
    costs: (capture seconds, plan seconds) of `plan`, as partition() measured them (prog.shapes()).
    backend: a fixed backend (runtime/backend.py; prog.to_xla() gives the torch-xla one); None: real ranks when
    torch.distributed is initialised, else every rank emulated in this process."""

    def __init__(self, plan, model=None, optimizer=None, loss_fn=None, costs=(None, None), backend=None):
        self.plan = plan
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.reports = Reports(plan)
        self._executor = None
        self._costs = costs
        self._backend = backend

    # -- the plan ------------------------------------------------------------------------------------------------
    @property
    def captured(self):
        return self.plan.captured

    @property
    def graph(self):
        return self.plan.graph

    @property
    def mesh(self):
        return self.plan.mesh

    @property
    def tactics(self) -> list:
        return list(self.plan.tactics)

    @property
    def stages(self) -> tuple:
        """One Stage per schedule entry: its Decisions, shardings, conflicts and decision count."""
        return self.plan.stages

    @property
    def options(self):
        return self.plan.options

    @property
    def decisions(self) -> Decisions:
        """What the whole schedule decided (an immutable snapshot; stages[k].decisions after tactic k)."""
        return self.plan.decisions

    @property
    def conflicts(self) -> list:
        return self.plan.conflicts

    def sharding_of_vid(self, vid: int) -> Sharding:
        return self.plan.sharding(vid)

    def sharding(self, name: str) -> Sharding:
        """The sharding of a named value after the last tactic (e.g. "params.layers.0.attn.wq.weight")."""
        return self.plan.sharding(self.reports.vid(name))

    @property
    def lowered(self):
        """The per-device program (lower.Lowered): GraphModule, collective records, layouts."""
        return self.plan.lowered()

    def collectives(self) -> list:
        """CollectiveRecords of the per-device program: kind, axis, bytes, dtype, tactic, value, FX node. On a
        backend that compiles the step itself (to_xla()): the collectives of its program (XLA's partitioned HLO:
        XlaCollectives, the same fields), after a step has run."""
        if self._backend is not None and self._backend.reports is not None:
            return self._backend.reports.collectives()
        return list(self.plan.lowered().records)

    # -- reports (reporting.py) ----------------------------------------------------------------------------------
    def explain(self, name: str) -> str:
        """Which tactic decided each axis of a value, and through which path."""
        return self.reports.explain(name)

    def summary(self) -> str:
        """One row per tactic stage: decisions, conflicts, collectives added, bytes per step, memory per device;
        for a step that branches on tensor values, the paths captured so far (the table is the example inputs'
        path's program)."""
        text = self.reports.summary()
        cap = self.plan.captured
        lines = describe_counts(cap)
        if cap.gates is not None:
            g = cap.gates
            lines.append(f"Layerdrop in {', '.join(g.lists)}: {len(g.gates)} layers gated in one program (each "
                         f"layer's draw decides, at every step, whether its output and update are kept); every "
                         f"layer is computed at every step, so skipped layers save no time, unlike eager.")
        ex = self._executor
        if ex is not None and (len(ex.shapes) > 1 or ex.shapes.evicted):   # other input shapes (runtime/shapes.py)
            lines.append(ex.shapes.line())
        if not cap.guards and not cap.checks:
            return "\n".join([text] + lines)
        if cap.guards:
            seen = list(dict.fromkeys(g.where or g.node for g in cap.guards))
            lines.append(f"The step branches on tensor values ({len(cap.guards)} read(s) on this path, at "
                         f"{'; '.join(seen[:4])}{' ...' if len(seen) > 4 else ''}): one program per path taken.")
            ex = self._executor
            entries = list(ex.shapes.entries.values()) if ex is not None else []
            for e in entries:
                lines.append(f"  path {e.info('').path or '(example inputs)'}: {e.calls} call(s)")
            if ex is None:
                lines.append("  paths captured: the example inputs' only (no step has run)")
        if cap.checks:
            lines.append(f"{len(cap.checks)} assert(s) on tensor values, checked after each step: "
                         + "; ".join(c.where for c in cap.checks[:3]))
        return "\n".join([text] + lines)

    def audit(self) -> str:
        """The "reshard" collectives (layout changes no tactic asked for: an op without a rule, a conflict), grouped
        by op and source line with their bytes per step; "no reshard collectives" when there are none."""
        return self.reports.audit()

    def simulate(self, hw, axis_map=None, issue: str = "program", stages: bool = True):
        """SimReport for the final program on hardware `hw` (pt.sim.hardware(...)); `.stages` holds one report per
        tactic stage (the first: nothing partitioned). stages=False: the final program only (one lowering instead
        of one per stage: the interactive answer when comparing schedules)."""
        return self.reports.simulate(hw, axis_map, issue, stages)

    def annotated(self, max_nodes: int | None = None) -> str:
        """The captured graph, one line per value, with its sharding."""
        return self.reports.annotated(max_nodes)

    def device_program(self) -> str:
        """The per-device program: local shapes, shardings, and every collective with its cause."""
        return self.reports.device_program()

    def search_report(self) -> str:
        """The automatic tactics' candidates and search statistics."""
        return self.reports.search_report()

    @property
    def search_reports(self) -> list:
        """The automatic tactics' SearchReports, in schedule order."""
        return list(self.plan.searches)

    def __str__(self):
        return self.reports.device_program()

    # -- running (runtime/) --------------------------------------------------------------------------------------
    @property
    def executor(self):
        """The backend running this plan and the state it holds (created on first use)."""
        if self._executor is None:
            from .runtime import Executor

            self._executor = Executor(self.plan, self.model, self.optimizer, self.loss_fn, backend=self._backend,
                                      costs=self._costs)
        return self._executor

    @property
    def backend(self):
        """The backend running this program (runtime/backend.py; started on first use)."""
        self.executor.ensure()
        return self.executor.rt

    @property
    def state(self) -> dict:
        """Placeholder name -> the local shard the backend holds ("params.<fqn>", "opt.<state>.<fqn>", ...)."""
        return self.executor.held().state

    def hlo(self) -> str:
        """The post-partitioning HLO of the step, as the backend compiled it at the first call (to_xla() programs:
        XLA's SPMD partitioner's); runs nothing itself."""
        return self._backend_reports("hlo()").hlo()

    def compare(self, tolerance: float = 0.05):
        """partir's per-device collectives against those of the program the backend compiled (to_xla()), per kind
        and axis (count and bytes): xla/compare.py."""
        return self._backend_reports("compare()").compare(tolerance)

    def _backend_reports(self, what: str):
        if self._backend is None or self._backend.reports is None:
            raise PartitionError(f"prog.{what} reads the program a backend compiles itself (torch-xla's HLO), and "
                                 f"this program runs partir's own per-device program: print(prog) shows it, "
                                 f"prog.collectives() lists its collectives. For XLA's, use prog.to_xla().{what}.")
        return self._backend.reports

    def shapes(self) -> list:
        """The programs kept, one per input signature (runtime/shapes.py): train_step (or loss_and_grads, prog(...))
        captures and partitions the step again for inputs of a new shape or dtype, with the same schedule, on the
        same state; eval_step and forward keep their own. From the second size of a dim (or from partition, for
        dims declared in Options.dynamic), that dim and the batch dim are symbols: the programs at a grid of their
        sizes, built then, are fitted as one program, and a new size is an instance of it (runtime/dims.py:
        instance_of is its size, or its sizes per symbol; no capture or plan). Each a ShapeInfo: kind, signature
        ((shape, dtype) per input), capture_s, plan_s, lower_s, calls, instance_of, symbolic_s; least recently used
        first. The reports (print(prog), collectives(), simulate()) describe the example inputs' program."""
        ex = self.executor
        kind = {"train": "train", "loss_and_grads": "loss_and_grads"}.get(self.plan.captured.mode, "forward")
        rows = [e.info(kind) for e in ex.shapes.entries.values()]
        return rows + (ex.evaluator.shapes() if ex._evaluator is not None else [])

    def train_step(self, *batch, **named):
        """One step (forward, backward, optimizer update) on the global batch; each rank keeps its slice.
        train_step(**batch) is train_step(batch) for a program captured from one dict. A batch of a new shape
        (another sequence length) is partitioned on first use with the same schedule, on the same state
        (prog.shapes()). From its first step the program owns the weights: see README "One owner of the weights"."""
        return self.executor.train_step(_batch(batch, named, "train_step"))

    def train_step_local(self, *local_batch, **named):
        """One step where each rank passes its own shard of the batch (from a real data loader)."""
        return self.executor.train_step(_batch(local_batch, named, "train_step_local"), local=True)

    def loss_and_grads(self, *batch, **named):
        return self.executor.loss_and_grads(_batch(batch, named, "loss_and_grads"))

    def __call__(self, *inputs, **named):
        return self.executor.forward(_batch(inputs, named, "prog(...)"))

    def eval_step(self, *batch, **named):
        """The loss on the live (sharded) state in eval mode (dropout off, batch norm running statistics), at any
        batch size; no update. The loss-only step is captured once per input shape and cached."""
        return self.executor.evaluator.eval_step(_batch(batch, named, "eval_step"))

    def forward(self, *inputs, **named):
        """The model's outputs on the live state in eval mode, at any batch size (captured once per shape). On a
        backend that runs only the program it was built for (to_xla()), a forward-only program runs itself."""
        batch = _batch(inputs, named, "forward")
        if self._backend is not None and not self._backend.new_programs and self.plan.captured.mode == FORWARD:
            return self.executor.forward(batch)
        return self.executor.evaluator.forward(batch)

    def peak_memory(self) -> dict:
        """{rank: bytes}: each rank's peak of live tensor bytes during the last step, measured by the runtime
        (partition(..., measure_memory=True); what is counted: runtime/memtrack.py). On real ranks, this rank's
        only. Compare prog.simulate(hw).peak_memory_bytes, the simulator's prediction for the same program."""
        return self.executor.peak_memory()

    def gather_parameters(self) -> dict:
        """Full parameter tensors, keyed by FQN."""
        return self.executor.held().gather_parameters()

    def state_dict(self) -> dict:
        """{"model": {fqn: T}, "optimizer": {"state": {fqn: {"step", "exp_avg", ...}}, "param_groups": [...]}}, the
        layout of torch.distributed.checkpoint's get_state_dict: T are DTensors on real ranks (placements = the
        program's shardings; torch.distributed.checkpoint.save/load work on it) and full tensors in emulation."""
        return self.executor.held().state_dict()

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Load state_dict()'s layout, resharding DTensors of any placement (or full tensors) to this program's;
        the optimizer's param groups take the saved hyperparameters and the step count resumes."""
        self.executor.held().load_state_dict(state_dict, strict)

    def full_state_dict(self) -> dict:
        """The consolidated module state (model.state_dict() keys, full tensors): model.load_state_dict(it)."""
        return self.executor.held().full_state_dict()

    def export_to(self, model=None, optimizer=None) -> None:
        """Write parameters, buffers and optimizer state into an eager module and optimizer (default: the ones
        given to partition)."""
        self.executor.held().export_to(model, optimizer)

    def import_from(self, model=None, optimizer=None) -> None:
        """Take parameters, buffers and optimizer state from an eager module and optimizer (after editing them)."""
        self.executor.held().import_from(model, optimizer)

    @property
    def steps(self) -> int:
        """Optimizer steps taken (restored by load_state_dict)."""
        return self.executor.held().steps

    @property
    def last_grad_norm(self):
        """With partition(..., clip_grad_norm=...): the global gradient norm of the last train_step (before
        clipping), as torch.nn.utils.clip_grad_norm_ returns it."""
        return self.executor.last_grad_norm

    def to_xla(self):
        """The same plan as a torch-xla SPMD program: a Program on xla.XlaBackend (train_step, prog(...), state_dict,
        hlo, collectives: XLA's, compare), with state of its own taken from the model; needs torch-xla (the .venv-xla
        environment)."""
        from .xla import XlaBackend

        if self.model is None:
            raise PartitionError("to_xla: this program was built without a model to take the state from.")
        opts = self.plan.options
        moved = [f"{k}={v!r}" for k, v in (("async_tp", opts.async_tp), ("tp_chunks", opts.tp_chunks)) if v]
        if moved:      # the per-device program's overlap passes: XLA's partitioner makes its own program
            warn(f"to_xla: {', '.join(moved)} shape partir's per-device program (lower/ring.py, lower/overlap.py); "
                 f"the torch-xla program is XLA's SPMD partitioner's from the same plan, so they do not apply to it "
                 f"(XLA's own collective-matmul options do: its windowed einsum flags).", stacklevel=2)
        return Program(self.plan, self.model, self.optimizer, self.loss_fn, backend=XlaBackend(self.plan))


def _batch(args: tuple, named: dict, what: str) -> tuple:
    """The call's batch: positional inputs as given, or keyword arguments as one dict (an HF batch: f(**batch))."""
    if named and args:
        raise PartitionError(f"{what}: pass the batch positionally or as keywords, not both (got {len(args)} "
                             f"positional and {sorted(named)}). A dict batch is f(batch) or f(**batch).")
    return (named,) if named else args
