"""The pipeline schedules, one class each, chosen by name from one table (SCHEDULES). The only module that knows
the schedules' names: everything else asks the schedule object (PipelineSpec.schedule, Pipeline.kind).

A schedule says
- how many stages it runs per rank of the pipeline axis and which rank runs a stage (`check_stages`, `rank_of`);
- each rank's forward / backward actions in the order it runs them (`order`; lower/pipeline.rank_orders adds the
  optimizer update and the actions every rank meets at);
- whether a backward is split into its input gradient "B" and its weight gradients "W" (`split_backward`);
- its textbook bubble (`bubble`, `bubble_text`; sim/pipeline.py compares the simulated one with it);
- how the eval step of a pipelined program runs (`eval_schedule`, `eval_group`; runtime/evaluate.py);
- which of partition's options it runs with (`check_options`).

    schedule_of("1F1B").order(r=0, p=2, m=4, v=1)   # [(0, 'F', 0), (0, 'F', 1), (0, 'B', 0), (0, 'F', 2), ...]
"""
from __future__ import annotations

from typing import ClassVar

from ..errors import InternalError, PartitionError, user_stacklevel, warn
from ..options import Options


class Schedule:
    """One pipeline schedule (see the module docstring). The defaults: one stage per rank (stage s on rank s), the
    micro-batches one at a time, bubble (p - 1) / (v m + p - 1) (Narayanan et al. 2021, section 2.2)."""

    name: ClassVar[str] = ""
    split_backward: ClassVar[bool] = False        # each backward as "B" (input gradient) and "W" (weight gradients)
    bubble_text: ClassVar[str] = "(p-1)/(v m+p-1)"
    # partition's options a pipelined step runs with; the others are refused (check_options)
    supports: ClassVar[frozenset] = frozenset()

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"schedule_of({self.name!r})"

    def check_stages(self, n: int, ranks: int, microbatches: int, axis: str, who: str) -> None:
        """Refuse n stages with `microbatches` micro-batches on `axis` of size `ranks`, naming the fix."""
        if n != ranks:
            raise PartitionError(f"{who}: {self.name} runs one stage per rank: {n} stages on axis '{axis}' of size "
                                 f"{ranks}. Use stages={ranks}, or {INTERLEAVED.name} for several stages per rank.")

    def rank_of(self, stage: int, ranks: int) -> int:
        """The coordinate on the pipeline axis that runs `stage`."""
        return stage % ranks

    def order(self, r: int, p: int, m: int, v: int) -> list:
        """Rank r's actions (stage, "F" | "B" | "W", micro-batch) in the order it runs them: p ranks, m
        micro-batches, v stages per rank."""
        raise NotImplementedError(f"{type(self).__name__} must define order(r, p, m, v)")

    def bubble(self, p: int, m: int, v: int) -> float:
        """The textbook fraction of the forward/backward span the ranks sit idle (equal stages, free transfers)."""
        return (p - 1) / (v * m + p - 1)

    def eval_group(self, ranks: int) -> int:
        """The eval step's micro-batch count is a multiple of this."""
        return 1

    @property
    def eval_schedule(self) -> Schedule:
        """The schedule the eval step (forwards only) runs: GPipe's order, the stages where training put them."""
        return GPIPE

    def check_options(self, options: Options, training: bool, who: str) -> None:
        """What a pipelined step does not run with (yet): each refused (or, where it only does not apply, said
        once) with the fix."""
        if not training:
            raise PartitionError(f"partition: {who} pipelines a training step (forward and backward per micro-batch); "
                                 f"pass loss_fn= (and optimizer=).")
        if options.compile and "compile" not in self.supports:
            raise PartitionError(f"partition: compile=True with a pipeline tactic ({who}) is not supported yet; leave "
                                 f"compile=False.")
        if options.reduce_in_flight != Options.reduce_in_flight and "reduce_in_flight" not in self.supports:
            warn(f"partition: reduce_in_flight={options.reduce_in_flight} does not apply to a pipelined program "
                 f"({who}): a stage's gradient reductions start inside its last backward and are waited for where its "
                 f"optimizer update reads them, as Megatron's finalize_model_grads does (lower/pipeline.py).",
                 stacklevel=user_stacklevel())
        if options.async_tp and "async_tp" not in self.supports:
            raise PartitionError(f"partition: async_tp=True with a pipeline tactic ({who}) is not supported yet (its "
                                 f"ring steps are not cut into stages); leave async_tp=False.")
        if options.measure_memory and "measure_memory" not in self.supports:
            raise PartitionError(f"partition: measure_memory=True with a pipeline tactic ({who}) is not supported "
                                 f"yet; prog.simulate(hw).pipeline.peak_bytes predicts each stage's peak.")


class GPipe(Schedule):
    """Every forward, then every backward (Huang et al. 2019)."""

    name = "GPipe"

    def order(self, r, p, m, v):
        return [(r, "F", j) for j in range(m)] + [(r, "B", j) for j in range(m)]


class OneFOneB(Schedule):
    """PipeDream-flush (Narayanan et al. 2021): p - 1 - r forwards to warm up, then one forward and one backward
    in turn, then the remaining backwards."""

    name = "1F1B"

    def order(self, r, p, m, v):
        warm = min(p - 1 - r, m)
        fs = [(r, "F", j) for j in range(m)]
        bs = [(r, "B", j) for j in range(m)]
        acts = fs[:warm]
        for i in range(m - warm):
            acts += [fs[warm + i], bs[i]]
        return acts + bs[m - warm:]


class Interleaved1F1B(Schedule):
    """Megatron-LM's virtual stages: rank r holds stages r, r + p, ... (v >= 2 per rank); 1F1B with the
    micro-batches in groups of p, each group through every chunk in turn, warm-up (p - r - 1) * 2 + (v - 1) * p."""

    name = "Interleaved1F1B"

    def check_stages(self, n, ranks, microbatches, axis, who):
        if n % ranks or n < 2 * ranks:
            raise PartitionError(f"{who}: {self.name} runs v >= 2 stages per rank: {n} stages on axis '{axis}' "
                                 f"(size {ranks}) is not a multiple >= 2 of it. Use stages={2 * ranks}.")
        if microbatches % ranks:
            raise PartitionError(f"{who}: {self.name} runs the micro-batches in groups of the axis size {ranks}; "
                                 f"{microbatches} micro-batches is not a multiple of it.")

    def order(self, r, p, m, v):
        n = v * m

        def fwd(k):
            return ((k // p) % v * p + r, "F", (k // (p * v)) * p + k % p)

        def bwd(k):
            return ((v - 1 - (k // p) % v) * p + r, "B", (k // (p * v)) * p + k % p)

        warm = min((p - r - 1) * 2 + (v - 1) * p, n)
        acts = [fwd(k) for k in range(warm)]
        for i in range(n - warm):
            acts += [fwd(warm + i), bwd(i)]
        return acts + [bwd(k) for k in range(n - warm, n)]

    def eval_group(self, ranks):
        return ranks

    @property
    def eval_schedule(self):
        return self          # several stages per rank: its order keeps their placement


class ZBVZeroBubble(Schedule):
    """ZB-V (Qi et al. 2024, section 6): the 2 p stages in a V, rank r running stages r and 2 p - 1 - r (the first
    and the last on rank 0), each backward split into B and W; close to no bubble when F = B = W."""

    name = "ZBVZeroBubble"
    split_backward = True
    bubble_text = "ZB-V with F = B = W"

    def check_stages(self, n, ranks, microbatches, axis, who):
        if n != 2 * ranks:
            raise PartitionError(f"{who}: {self.name} runs exactly 2 stages per rank, placed in a V (rank r runs "
                                 f"stages r and {2 * ranks - 1} - r): {n} stages on axis '{axis}' (size {ranks}). "
                                 f"Use stages={2 * ranks}.")

    def rank_of(self, stage, ranks):
        return stage if stage < ranks else 2 * ranks - 1 - stage

    def order(self, r, p, m, v):
        return zbv_order(r, p, m)

    def bubble(self, p, m, v):
        return 0.0

    @property
    def eval_schedule(self):
        return self          # the stages in their V


def zbv_order(r: int, p: int, m: int) -> list:
    """Rank r's actions under ZB-V (Qi et al. 2024, section 6): its stages c0 = r and c1 = 2 p - 1 - r (the V), each
    backward split into B (the input gradient the previous stage waits for) and W (the weight gradients, which wait
    for nothing). Warm-up: 2 (p - r) - 1 forwards of c0, r of c1 and c0 in turn, then p - r of c1 each followed by
    its backward; steady state: one forward and one backward of c0, then of c1; cool-down: the remaining B's of c0
    and c1, the W's filling the bubble last. Laid out for max(m, 2 p - 1) micro-batches (the V needs 2 p - 1 in
    flight to fill), the actions of micro-batches >= m dropped."""
    n, c0, c1 = max(m, 2 * p - 1), r, 2 * p - 1 - r
    done = {(c, k): 0 for c in (c0, c1) for k in "FBW"}
    out = []

    def run(c, *kinds):
        for k in kinds:
            out.append((c, k, done[(c, k)]))
            done[(c, k)] += 1
    for _ in range(2 * (p - r) - 1):
        run(c0, "F")
    for _ in range(r):
        run(c1, "F")
        run(c0, "F")
    for _ in range(p - r):
        run(c1, "F", "B", "W")
    while done[(c1, "F")] < done[(c0, "F")] or done[(c0, "F")] < n:
        if done[(c0, "F")] < n:
            run(c0, "F")
        run(c0, "B", "W")
        run(c1, "F", "B", "W")
    for _ in range(r):
        run(c0, "B")
        run(c1, "B")
    for _ in range(p - r):
        run(c0, "B", "W")
    while done[(c1, "W")] < n:
        run(c1, "W")
    while done[(c0, "W")] < n:
        run(c0, "W")
    if any(v != n for v in done.values()):
        raise InternalError(f"pipeline: ZB-V laid out {done} actions on rank {r} of {p}, not {n} of each.")
    return [a for a in out if a[2] < m]


GPIPE, INTERLEAVED = GPipe(), Interleaved1F1B()
# the table: a schedule's name (as pt.tactics.pipeline takes it) -> its class's one instance
SCHEDULES = {s.name: s for s in (GPIPE, OneFOneB(), INTERLEAVED, ZBVZeroBubble())}
DEFAULT_SCHEDULE = OneFOneB.name     # pt.tactics.pipeline's default


def schedule_of(schedule) -> Schedule:
    """The Schedule named `schedule` (a name of SCHEDULES, or a Schedule, returned as it is)."""
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, str) and schedule in SCHEDULES:
        return SCHEDULES[schedule]
    raise PartitionError(f"pipeline: schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}.")
