"""What partition() takes besides the model, mesh, schedule, inputs, loss and optimizer, in two groups, each
documented once here: StepOptions (what the captured training step does besides loss, backward and update: the
capture reads them) and Options (how the program is scheduled and run: lowering, the runtime and the backends read
them). partition(..., step=StepOptions(...), options=Options(...)); both frozen, checked when built."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import PartitionError


@dataclass(frozen=True)
class Options:
    """bucket_bytes: parameter gathers and gradient reduce-scatters / all-reduces are merged into buckets of up to
    this many bytes (one collective each, as DDP/FSDP do; the bytes are unchanged), and never more than 1/8 of what
    one kind of collective moves on one axis in one phase, 64 KiB at least (lower/bucket.py): buckets scale with
    the model, so on a model smaller than the 64 MiB default ZeRO still gathers and frees a part at a time; 0 keeps
    one collective per value.
    timeout_s: on real ranks, how long any wait lasts (start-up check, the per-call agreement of the ranks,
    every collective of a step: the program's process groups are created with it) before the waiting ranks raise
    RankFailureError (runtime/faults.py). compile: the per-device program runs compiled by TorchInductor
    (runtime/compiled.py; eager otherwise, with the optimizer update as fused kernels, lower/fuse.py). measure_memory:
    every step measures each rank's peak of live tensor bytes (runtime/memtrack.py; prog.peak_memory() reads the last
    step's); it costs a Python callback per op, so it is off by default.

    Shapes (runtime/shapes.py, dims.py, symbols.py): dynamic: input dims that are symbols from the start, as
    torch.compile's mark_dynamic: {"inputs.0": {1: "seq"}, "inputs.1": {1: "seq"}} (input, as in example_inputs
    flattened -> {dim: name}; one name is one size in every batch); the batch dim (dim 0 of the inputs of inputs.0's
    batch size) is the symbol "batch" too unless declared {0: None}. partition() then builds one program in those
    symbols (a few programs at other sizes, fitted as one, and a symbolic trace for the model's guards) and every
    new size of them is an instance of it: no capture, no plan, no lowering. None (the default): a dim becomes a
    symbol at its second distinct size (with the batch dim). shape_cache_bytes: the memory the programs kept for
    other input shapes may hold (each program's Python memory, counted as its graphs' nodes times the bytes per node
    measured with tracemalloc, shapes.program_bytes; tensor storage not counted); beyond it the least recently used
    ones are dropped with the backend's copy of them (counted: prog.summary()), and built again (an instance in
    milliseconds) if their shape comes back. A family of symbolic dims keeps its base program's plan besides. max_shapes: a count bound as well (None: none).

    Scheduling (lower/schedule.py): prefetch: state gathers (ZeRO-3's parameters) on one axis are issued this many
    gathers ahead of their use (FSDP2's default is 1; 0 gathers each where it is used); reduce_in_flight: at most
    this many gradient reductions per axis are in flight, each waited for before the next one past the bound is
    issued, which frees its unsharded input (0: no bound, each waited for where the update reads it; a pipelined
    program has no bound: its accumulated gradients live through the step anyway, and a wait inside the last
    backward would hold back the gradient the previous stage waits for, lower/pipeline.bucket_parts); tp_chunks: a
    tensor-parallel all_reduce of a matmul's result (Megatron's row-parallel linears) is split into this many row
    chunks, each reduced while the next chunk's matmul runs (lower/overlap.py; 0 or 1: off); async_tp: sequence
    parallelism's all_gather -> matmul and matmul -> reduce_scatter run as rings of point-to-point steps, each in
    flight while the matmul of the chunk at hand runs (lower/ring.py); memory_budget: bytes
    per device the program's peak (its liveness, what prog.peak_memory() measures) must fit: fewer gathers in flight,
    then one reduction in flight, are tried until it does (plan.py; None: the options as given).

    strict: a dim a mesh axis does not divide is refused (the divisibility error) instead of tiled unevenly as
    DTensor's Shard tiles it (torch.chunk sizes: the first ranks hold ceil(n / k), the last fewer or none; see
    sharding.chunk_size and lower/uneven.py)."""

    bucket_bytes: int = 64 * 2 ** 20
    timeout_s: float = 300.0
    compile: bool = False
    prefetch: int = 1
    reduce_in_flight: int = 1
    tp_chunks: int = 0
    async_tp: bool = False
    measure_memory: bool = False
    max_shapes: int | None = None
    shape_cache_bytes: int = 2 * 2 ** 30
    dynamic: dict | None = None
    memory_budget: float | None = None
    strict: bool = False

    def __post_init__(self):
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 0:
            raise PartitionError(f"partition: bucket_bytes must be an int >= 0 (0: no buckets), got "
                                 f"{self.bucket_bytes!r}.")
        if not isinstance(self.compile, bool):
            raise PartitionError(f"partition: compile must be True or False, got {self.compile!r}.")
        for name in ("prefetch", "reduce_in_flight", "tp_chunks"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise PartitionError(f"partition: {name} must be an int >= 0, got {v!r}.")
        if not isinstance(self.async_tp, bool):
            raise PartitionError(f"partition: async_tp must be True or False, got {self.async_tp!r}.")
        if not isinstance(self.strict, bool):
            raise PartitionError(f"partition: strict must be True or False, got {self.strict!r}.")
        if not isinstance(self.measure_memory, bool):
            raise PartitionError(f"partition: measure_memory must be True or False, got {self.measure_memory!r}.")
        if self.max_shapes is not None and (not isinstance(self.max_shapes, int) or self.max_shapes < 1):
            raise PartitionError(f"partition: max_shapes must be an int >= 1 (input shapes that keep a program) or "
                                 f"None, got {self.max_shapes!r}.")
        if not isinstance(self.shape_cache_bytes, int) or self.shape_cache_bytes < 1:
            raise PartitionError(f"partition: shape_cache_bytes must be an int >= 1 (bytes the programs of other "
                                 f"input shapes may hold), got {self.shape_cache_bytes!r}.")
        _check_dynamic(self.dynamic)
        if self.memory_budget is not None and (isinstance(self.memory_budget, bool) or
                                               not isinstance(self.memory_budget, (int, float)) or
                                               not self.memory_budget > 0):
            raise PartitionError(f"partition: memory_budget must be a positive number of bytes per device or None, "
                                 f"got {self.memory_budget!r}.")
        if not self.timeout_s > 0:
            raise PartitionError(f"partition: timeout_s must be a positive number of seconds, got {self.timeout_s!r}.")


def _check_dynamic(dynamic) -> None:
    """Options.dynamic's spelling (what it names is checked against the example inputs: runtime/symbols.py)."""
    if dynamic is None:
        return
    ok = isinstance(dynamic, dict) and all(
        isinstance(k, str) and isinstance(v, dict) and all(
            isinstance(d, int) and not isinstance(d, bool) and (n is None or isinstance(n, str) and n.isidentifier())
            for d, n in v.items()) for k, v in dynamic.items())
    if not ok:
        raise PartitionError(f"partition: dynamic must map inputs to {{dim: symbol name}}, e.g. "
                             f"{{'inputs.0': {{1: 'seq'}}, 'inputs.1': {{1: 'seq'}}}} (a name is an identifier; "
                             f"None marks a dim static), got {dynamic!r}.")


@dataclass(frozen=True)
class StepOptions:
    """What the captured training step does besides loss_fn, backward and the optimizer's update.

    clip_grad_norm: clip the gradients by their global norm before the update, as torch.nn.utils.clip_grad_norm_
    (the norm over all shards; prog.last_grad_norm holds the norm before clipping). Needs an optimizer.
    accumulate: micro-batches per optimizer step. train_step takes the batch of one step (as example_inputs) and
    runs it as k micro-batches x[j::k] (capture/capture.py's _micro_batches), their gradients summed, the loss
    their mean: one gradient reduction per step, one micro-batch's activations alive. accumulate_dims: input index
    -> batch dim (default 0), or None for an input shared by every micro-batch."""

    clip_grad_norm: float | None = None
    accumulate: int = 1
    accumulate_dims: dict | None = None

    def __post_init__(self):
        if self.clip_grad_norm is not None and not float(self.clip_grad_norm) > 0:
            raise PartitionError(f"partition: clip_grad_norm must be a positive number, got {self.clip_grad_norm!r}.")
        if not isinstance(self.accumulate, int) or isinstance(self.accumulate, bool) or self.accumulate < 1:
            raise PartitionError(f"partition: accumulate must be a positive int (micro-batches per step), got "
                                 f"{self.accumulate!r}.")
