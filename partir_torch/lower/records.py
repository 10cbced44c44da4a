"""What lowering records on the per-device program, for users (`prog.collectives()`) and the simulator."""
from __future__ import annotations

from dataclasses import dataclass

# Kinds of collectives lowering can emit.
ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_TO_ALL = "all_to_all"
COLLECTIVE_PERMUTE = "collective_permute"     # one ring step of Options.async_tp (lower/ring.py): send and receive
KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, COLLECTIVE_PERMUTE)

# Why a collective is in the program (CollectiveRecord.why), decided by lowering (lower/why.py) from the value it
# moves and the op it serves, in this order:
#
#   "gradient"  a collective on a parameter's gradient: a value the optimizer update reads (or a grads.* output),
#               or one summed into it through views, casts, adds, scalings and the padding of a sliced parameter
#               (micro-batch accumulation, tied weights, clipping, wpe[:T]): its reduction (all_reduce,
#               reduce_scatter, bucketed or not), or its gather into the layout of its parameter (a replicated
#               position embedding's gradient, tiled by sequence parallelism).
#   "state"     any collective on a parameter, buffer or optimizer state: the placeholder, a view or cast of it
#               (ZeRO-3's gathers, mixed precision's gathered bf16 copy) or the updated value tied to it (ZeRO-1/2's
#               gather of the updated shards).
#   "tactic"    any other reduction: a partial value propagation made partial (Megatron's activation all_reduces,
#               sequence parallel's reduce_scatters, batch-norm statistics, the loss); a collective bringing an
#               output of the step whole (the API returns outputs whole); and an all_gather / all_to_all at an op
#               that uses the axis itself, on another factor, at no conflict (sequence parallel's gathers in front
#               of the column-parallel linears, expert parallel's all_to_alls).
#   "reshard"   everything else: an all_gather / all_to_all at an op that does not use the axis (an op without a
#               rule is a barrier; a rule that needs the dim whole: the op then runs on the whole tensor on every
#               rank of the axis), or at an op where propagation recorded a conflict on that axis.
#
# A bucket of several collectives takes the first of reshard, tactic, gradient, state that one of its members has;
# its `members` keep each one's why, bytes and source.
#
# A pipelined program (lower/pipeline.py) adds two on its pipeline axis, listed only where present:
#
#   "grad norm"    clip_grad_norm's all_reduce of each rank's partial sum of squared gradients (its stages').
#   "tied weight"  the all_reduce of a parameter's gradient over the stages that hold it (tied weights).
GRADIENT, STATE, TACTIC, RESHARD = "gradient", "state", "tactic", "reshard"
GRAD_NORM, TIED = "grad norm", "tied weight"
WHYS = (GRADIENT, STATE, TACTIC, RESHARD, GRAD_NORM, TIED)


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective in the per-device program.

    nbytes is the size of the *full* (unsharded along this axis) array the collective produces or consumes, the
    nccl-tests convention: all_reduce of S bytes, all_gather whose output is S bytes, reduce_scatter whose input is
    S bytes, all_to_all of S bytes per rank; a collective_permute (one ring step) sends S bytes from every rank.
    """

    kind: str          # one of KINDS
    axis: str          # mesh axis name
    group_size: int    # ranks in the group (= mesh axis size)
    nbytes: int        # full array bytes (see above)
    dtype: str         # e.g. "float32"
    tactic: str        # name of the tactic whose decision made this collective necessary
    value: str         # the value it serves, e.g. "params.layers.0.attn.wq.weight" or an FX node name
    node: str          # FX node name of the collective in the lowered graph
    reduce_op: str = ""   # "sum" | "max" | "min" for all_reduce / reduce_scatter
    dim: int = -1         # gathered / scattered dim; all_to_all: split dim
    phase: str = ""       # "forward" | "backward" | "optimizer" | "" when unknown
    family: str = ""      # the family the tactic's class declares (tactics.base.declare), "" when none
    why: str = ""         # one of WHYS (see above); "" for records not made by lowering (sim/synthetic.py)
    source: str = ""      # the user's file:line of the op it serves ("" when the trace has none: the backward)
    op: str = ""          # the captured op it serves ("aten.flip.default"); "output" for the step's outputs
    members: tuple = ()   # a bucket (lower/bucket.py): the records it merged, in program order

    def parts(self) -> tuple:
        """The collectives this record stands for: a bucket's members, else the record itself."""
        return self.members or (self,)

    def __str__(self):
        op = f"({self.reduce_op})" if self.reduce_op else ""
        return f"{self.kind}{op}[{self.axis}x{self.group_size}] {self.nbytes}B {self.dtype} {self.value} <- {self.tactic}"
