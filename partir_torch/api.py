"""partition(): capture (plan.capture_for) -> plan (one propagation per tactic) -> Program (run | report)."""
from __future__ import annotations

import time

from .errors import PartitionError, warn
from .mesh import Mesh
from .options import Options
from .plan import capture_for, plan
from .program import Program
from .runtime.owner import take_over
from .tactics.base import CaptureRewrite
from .tactics.pipeline import Pipeline
from .tactics.recompute import recompute_to_fit
from .tactics.schedule import flatten_schedule


def partition(model, mesh: Mesh, schedule, example_inputs, loss_fn=None, optimizer=None, registry=None,
              simulate=None, timeout_s: float = Options.timeout_s, bucket_bytes: int = Options.bucket_bytes,
              clip_grad_norm=None,
              accumulate: int = 1, accumulate_dims: dict | None = None, compile: bool = False,
              prefetch: int = 1, reduce_in_flight: int = 1, tp_chunks: int = 0, async_tp: bool = False,
              measure_memory: bool = False, max_shapes: int = Options.max_shapes,
              memory_budget: float | None = None, strict: bool = False) -> Program:
    """Trace `model`'s step and partition it over `mesh` with the tactics of `schedule`, in order.

    >>> prog = partition(model, Mesh({"batch": 2}), [ManualPartition({"inputs.*": 0}, axis="batch")],
    ...                  example_inputs=(x, y), loss_fn=lambda m, x, y: F.mse_loss(m(x), y))

    simulate: a pt.sim.hardware(...) to print, after the schedule, one simulated row per tactic stage.
    timeout_s: on real ranks, how long any wait of the program lasts (the start-up check, the per-call agreement
    of the ranks, every collective of a step: its process groups are created with it) before the ranks still
    waiting raise (RankFailureError, runtime/faults.py). Default 300 s.
    bucket_bytes: parameter gathers and gradient reduce-scatters are merged into buckets of up to this many bytes
    (one collective each, as DDP/FSDP do; the bytes are unchanged), at most 1/8 (64 KiB at least) of what one kind
    of collective moves on one axis in one phase, so buckets scale down with a small model; 0 keeps one collective
    per parameter.
    clip_grad_norm: clip the gradients by their global norm before the update, as torch.nn.utils.clip_grad_norm_
    (the norm over all shards; prog.last_grad_norm holds the norm before clipping).
    accumulate: micro-batches per optimizer step. train_step takes the batch of one step (as example_inputs) and
    runs it as k micro-batches x[j::k] (see capture._micro_batches), their gradients summed, the loss their mean:
    one gradient reduction per step, one micro-batch's activations alive. accumulate_dims: input index -> batch
    dim (default 0), or None for an input shared by every micro-batch.
    compile: run the per-device program compiled by TorchInductor, its functional collectives kept (real ranks:
    the whole step; emulated ranks: each run of local ops between two collectives). See runtime/compiled.py.
    prefetch: ZeRO-3 parameter gathers on an axis are issued this many gathers ahead of their use (0: at the use).
    reduce_in_flight: at most this many gradient reductions per axis in flight; each is waited for (its unsharded
    input freed) before the next past the bound is issued (0: no bound). See lower/schedule.py.
    tp_chunks: Megatron's all_reduce after a row-parallel matmul split into this many row chunks, each reduced while
    the next chunk's matmul runs (0: off). See lower/overlap.py.
    async_tp: sequence parallelism's all_gather -> matmul and matmul -> reduce_scatter decomposed into ring steps
    (point-to-point transfers), each in flight while the matmul of the chunk at hand runs: torchtitan's async TP,
    as functional collectives on any backend. Same bytes, same values up to the order of sums. See lower/ring.py.
    memory_budget: bytes per device the program's peak must fit: fewer prefetched gathers, then one reduction in
    flight, are tried until it does (a warning when none fits). See plan.py.
    measure_memory: every step measures each rank's peak of live tensor bytes; prog.peak_memory() returns the last
    step's ({rank: bytes}; what is counted: runtime/memtrack.py). Off by default: a Python callback per op.
    max_shapes: input signatures (shapes, dtypes) that keep a program: train_step at a new shape partitions the step
    again with this schedule on the same state (runtime/shapes.py); beyond max_shapes the least recently used goes.
    strict: refuse a dim a mesh axis does not divide (the divisibility error) instead of tiling it unevenly, with
    torch.chunk sizes as DTensor's Shard does (the default; see sharding.chunk_size).

    A module whose weights a live program holds newer than the module's (real ranks with tiled state) gets them
    written back first (collective, as partition is), so the new program starts from the newest weights; when the
    new program takes them, the older program is released (runtime/owner.py).
    """
    tactics = flatten_schedule(schedule)
    _check_args(mesh, tactics, loss_fn, optimizer, clip_grad_norm, accumulate)
    _check_pipeline(tactics, loss_fn, compile, measure_memory, async_tp, reduce_in_flight)
    options = Options(bucket_bytes=bucket_bytes, timeout_s=timeout_s, compile=compile, prefetch=prefetch,
                      reduce_in_flight=reduce_in_flight, tp_chunks=tp_chunks, async_tp=async_tp, measure_memory=measure_memory,
                      max_shapes=max_shapes, memory_budget=memory_budget, strict=strict)
    take_over(model)
    costs = [0.0, 0.0]

    def replan(entries):
        t0 = time.perf_counter()
        captured = capture_for(model, entries, example_inputs, loss_fn, optimizer, clip_grad_norm=clip_grad_norm,
                               accumulate=accumulate, accumulate_dims=accumulate_dims, mesh=mesh)
        t1 = time.perf_counter()
        planned = plan(captured, mesh, entries, options, registry)
        costs[0], costs[1] = costs[0] + t1 - t0, costs[1] + time.perf_counter() - t1
        return planned

    # an automatic search that found no plan within its memory limit: the step again with recomputation
    planned = recompute_to_fit(replan(tactics), tactics, model, replan, can_rewrite=loss_fn is not None)
    prog = Program(planned, model, optimizer, loss_fn, costs=tuple(costs))
    if simulate is not None:
        print(prog.simulate(simulate).table())
    return prog


def _check_args(mesh, tactics, loss_fn, optimizer, clip_grad_norm, accumulate) -> None:
    """partition()'s arguments that do not go together, each named with the fix."""
    if not isinstance(mesh, Mesh):
        raise PartitionError(f"partition: mesh must be a pt.Mesh, got {type(mesh).__name__}.")
    if optimizer is not None and loss_fn is None:
        raise PartitionError("partition: an optimizer needs a loss_fn (the step it updates from).")
    rewrites = [t for t in tactics if isinstance(t, CaptureRewrite)]
    if rewrites and loss_fn is None:
        raise PartitionError(f"partition: {', '.join(t.name for t in rewrites)} change the training step; "
                             f"pass loss_fn= (they have nothing to act on in a forward-only program).")
    if clip_grad_norm is not None and optimizer is None:
        raise PartitionError("partition: clip_grad_norm clips the gradients before the optimizer update; pass "
                             "optimizer= (with loss_fn=).")
    if clip_grad_norm is not None and not float(clip_grad_norm) > 0:
        raise PartitionError(f"partition: clip_grad_norm must be a positive number, got {clip_grad_norm!r}.")
    if not isinstance(accumulate, int) or accumulate < 1:
        raise PartitionError(f"partition: accumulate must be a positive int (micro-batches per step), got "
                             f"{accumulate!r}.")
    if accumulate > 1 and loss_fn is None:
        raise PartitionError("partition: accumulate sums the gradients of micro-batches; pass loss_fn=.")


def _check_pipeline(tactics, loss_fn, compile: bool, measure_memory: bool, async_tp: bool = False,
                    reduce_in_flight: int = Options.reduce_in_flight) -> None:
    """What a pipeline tactic (tactics/pipeline.py) does not run with yet: each named, with the fix."""
    pipe = [t for t in tactics if isinstance(t, Pipeline)]
    if not pipe:
        return
    name = pipe[0].name
    if loss_fn is None:
        raise PartitionError(f"partition: {name} pipelines a training step (forward and backward per micro-batch); "
                             f"pass loss_fn= (and optimizer=).")
    if compile:
        raise PartitionError(f"partition: compile=True with a pipeline tactic ({name}) is not supported yet; leave "
                             f"compile=False.")
    if reduce_in_flight != Options.reduce_in_flight:
        warn(f"partition: reduce_in_flight={reduce_in_flight} does not apply to a pipelined program ({name}): a "
             f"stage's gradient reductions start inside its last backward and are waited for where its optimizer "
             f"update reads them, as Megatron's finalize_model_grads does (lower/pipeline.py).", stacklevel=3)
    if async_tp:
        raise PartitionError(f"partition: async_tp=True with a pipeline tactic ({name}) is not supported yet (its ring "
                             f"steps are not cut into stages); leave async_tp=False.")
    if measure_memory:
        raise PartitionError(f"partition: measure_memory=True with a pipeline tactic ({name}) is not supported yet; "
                             f"prog.simulate(hw).pipeline.peak_bytes predicts each stage's peak.")
