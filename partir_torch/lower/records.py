"""What lowering records on the per-device program, for users (`prog.collectives()`) and the simulator."""
from __future__ import annotations

from dataclasses import dataclass

# Kinds of collectives lowering can emit.
ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_TO_ALL = "all_to_all"
KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL)


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective in the per-device program.

    nbytes is the size of the *full* (unsharded along this axis) array the collective produces or consumes, the
    nccl-tests convention: all_reduce of S bytes, all_gather whose output is S bytes, reduce_scatter whose input is
    S bytes, all_to_all of S bytes per rank.
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

    def __str__(self):
        op = f"({self.reduce_op})" if self.reduce_op else ""
        return f"{self.kind}{op}[{self.axis}x{self.group_size}] {self.nbytes}B {self.dtype} {self.value} <- {self.tactic}"
