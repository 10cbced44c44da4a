"""partition(): capture (plan.capture_for) -> plan (one propagation per tactic) -> Program (run | report)."""
from __future__ import annotations

import time

from .errors import PartitionError
from .mesh import Mesh
from .options import Options, StepOptions
from .plan import capture_for, plan
from .program import Program
from .runtime.owner import take_over
from .tactics.base import CaptureRewrite
from .tactics.pipeline import Pipeline
from .tactics.recompute import recompute_to_fit
from .tactics.schedule import flatten_schedule


def partition(model, mesh: Mesh, schedule, example_inputs, loss_fn=None, optimizer=None, *,
              step: StepOptions | None = None, options: Options | None = None, registry=None,
              simulate=None) -> Program:
    """Trace `model`'s step and partition it over `mesh` with the tactics of `schedule`, in order.

    >>> prog = partition(model, Mesh({"batch": 2}), [ManualPartition({"inputs.*": 0}, axis="batch")],
    ...                  example_inputs=(x, y), loss_fn=lambda m, x, y: F.mse_loss(m(x), y),
    ...                  optimizer=torch.optim.AdamW(model.parameters()), options=pt.Options(bucket_bytes=0))

    loss_fn(model, *inputs) -> scalar: the step is a training step (with optimizer=: loss, backward and update;
    without: loss and gradients); without loss_fn, the forward. step: what the training step does besides
    (gradient clipping, micro-batch accumulation: pt.StepOptions). options: how the program is scheduled and run
    (buckets, prefetch, overlap, memory budget, timeouts, compile, uneven tiling: pt.Options). Both are documented
    in partir_torch/options.py. registry: the rule registry propagation uses (default: the global one, with
    pt.register_rule's rules). simulate: a pt.sim.hardware(...) to print, after the schedule, one simulated row per
    tactic stage.

    A module whose weights a live program holds newer than the module's (real ranks with tiled state) gets them
    written back first (collective, as partition is), so the new program starts from the newest weights; when the
    new program takes them, the older program is released (runtime/owner.py).
    """
    tactics = flatten_schedule(schedule)
    step = StepOptions() if step is None else step
    options = Options() if options is None else options
    _check_args(mesh, tactics, loss_fn, optimizer, step, options)
    for t in tactics:       # a pipeline's schedule says which options it runs with (lower/ppschedules.py)
        if isinstance(t, Pipeline):
            t.check_runs_with(options, training=loss_fn is not None, mesh=mesh)
    take_over(model)
    costs = [0.0, 0.0]

    def replan(entries):
        t0 = time.perf_counter()
        captured = capture_for(model, entries, example_inputs, loss_fn, optimizer, clip_grad_norm=step.clip_grad_norm,
                               accumulate=step.accumulate, accumulate_dims=step.accumulate_dims, mesh=mesh)
        t1 = time.perf_counter()
        planned = plan(captured, mesh, entries, options, registry)
        costs[0], costs[1] = costs[0] + t1 - t0, costs[1] + time.perf_counter() - t1
        return planned

    # an automatic search that found no plan within its memory limit: the step again with recomputation
    planned = recompute_to_fit(replan(tactics), tactics, model, replan, can_rewrite=loss_fn is not None)
    prog = Program(planned, model, optimizer, loss_fn, costs=tuple(costs))
    if options.dynamic is not None:     # dims declared dynamic: one program in them, built now (runtime/dims.py)
        prog.executor.declare(example_inputs)
    if simulate is not None:
        print(prog.simulate(simulate).table())
    return prog


def _check_args(mesh, tactics, loss_fn, optimizer, step, options) -> None:
    """partition()'s arguments that do not go together, each named with the fix."""
    if not isinstance(mesh, Mesh):
        raise PartitionError(f"partition: mesh must be a pt.Mesh, got {type(mesh).__name__}.")
    if not isinstance(step, StepOptions):
        raise PartitionError(f"partition: step must be a pt.StepOptions(clip_grad_norm=, accumulate=, "
                             f"accumulate_dims=), got {type(step).__name__}.")
    if not isinstance(options, Options):
        raise PartitionError(f"partition: options must be a pt.Options(...) (partir_torch/options.py), got "
                             f"{type(options).__name__}.")
    clip_grad_norm, accumulate = step.clip_grad_norm, step.accumulate
    if optimizer is not None and loss_fn is None:
        raise PartitionError("partition: an optimizer needs a loss_fn (the step it updates from).")
    rewrites = [t for t in tactics if isinstance(t, CaptureRewrite)]
    if rewrites and loss_fn is None:
        raise PartitionError(f"partition: {', '.join(t.name for t in rewrites)} change the training step; "
                             f"pass loss_fn= (they have nothing to act on in a forward-only program).")
    if clip_grad_norm is not None and optimizer is None:
        raise PartitionError("partition: clip_grad_norm clips the gradients before the optimizer update; pass "
                             "optimizer= (with loss_fn=).")
    if accumulate > 1 and loss_fn is None:
        raise PartitionError("partition: accumulate sums the gradients of micro-batches; pass loss_fn=.")
