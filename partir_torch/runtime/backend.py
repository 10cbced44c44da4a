"""The Backend protocol: what runs a plan's per-device program and holds tensors in its layouts.

Three kinds: InterpretedRuntime (interpret.py: every rank emulated in one process, the default without
torch.distributed; emulate.EmulatedRuntime runs the same program under LocalTensorMode as a cross-check),
DistributedRuntime (distributed.py: this process is one rank of torch.distributed) and the torch-xla SPMD
backend (xla/program.py: XlaBackend runs the global step under XLA's partitioner instead of a per-device
program). The Executor (executor.py) and the state it holds (state.py) talk to all of them only through this
protocol; backend_for() is the one place that chooses between the first two, prog.to_xla() picks the third.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..mesh import Mesh
from ..sharding import Sharding


@runtime_checkable
class Backend(Protocol):
    kind: str                 # "emulated" | "distributed"
    mesh: Mesh
    groups: dict              # mesh axis -> process group name its collectives run on (lower.bind)
    compile: bool

    def valid(self) -> bool:
        """Still usable (the process group it was built on is alive)."""

    def shard(self, full: torch.Tensor, sh: Sharding):
        """This backend's handle on the local shards of `full` under `sh`, in storage of its own (never shared with
        `full` or between ranks): the program updates held state in place (lower/fuse.py's donated update)."""

    def local(self, t: torch.Tensor):
        """Every rank holds `t` as it is (a rank's own slice, or a scalar input)."""

    def coords(self) -> list:
        """The rank's coordinate on each mesh axis (the program's trailing inputs)."""

    def run(self, gm, args) -> list:
        """Run the per-device program."""

    def full(self, t, sh: Sharding, shape) -> torch.Tensor:
        """The whole value from its local shards (collective on real ranks)."""

    def local_full(self, sh: Sharding) -> bool:
        """Whether full() of a value held in layout `sh` is local: no collective, no device transfer (the held
        state is written through into the eager module only where every value's is; runtime/owner.py)."""

    def full_into(self, dest: torch.Tensor, t, sh: Sharding, shape) -> None:
        """full(), written into `dest` in place (the held state written through into an eager module)."""

    def value(self, t, sh: Sharding, shape):
        """A state value as a user sees it: a DTensor on real ranks, the full tensor in emulation."""

    def rank0(self, t) -> torch.Tensor:
        """Rank 0's local value (a replicated result: the loss)."""

    def program(self, plan):
        """What run() runs for `plan`: an object with gm, input_layouts (per captured placeholder) and local_shapes
        (the per-device backends: plan.lowered() bound to their process groups, lower.bind)."""


def backend_for(mesh: Mesh, options, emulator) -> Backend:
    """Real ranks when torch.distributed is initialised, else `emulator` (all ranks in this process)."""
    from .distributed import DistributedRuntime, real_ranks_active

    if real_ranks_active():
        return DistributedRuntime(mesh, options.timeout_s, compile=options.compile)
    return emulator(mesh, compile=options.compile)
