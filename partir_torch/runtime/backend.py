"""The Backend protocol: what runs a plan's per-device program and holds tensors in its layouts.

Three backends: InterpretedRuntime (interpret.py: every rank emulated in one process, the default without
torch.distributed; emulate.EmulatedRuntime runs the same program under LocalTensorMode as a cross-check),
DistributedRuntime (distributed.py: this process is one rank of torch.distributed) and the torch-xla SPMD
backend (xla/program.py: XlaBackend runs the global step under XLA's partitioner instead of a per-device
program). The Executor (executor.py, its one call path in call.py) and the state it holds (state.py) talk to all
of them only through this protocol, and tell them apart only by the capabilities it declares (never by class or
name): `ranks` (real ranks: the calls agreed, the plan checked, a failure releasing the groups), `stages` (real
ranks of a pipelined program: each stage's ranks hold its state), `new_programs` (programs of other input
signatures, symbolic instances, eval programs), `measures_memory` and `reports` (what the backend compiled:
the HLO). backend_for() is the one place that chooses between the first two, prog.to_xla() picks the third.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..mesh import Mesh
from ..sharding import Sharding


class RankControl(Protocol):
    """Real ranks (this process is one of them): the checks every rank makes with its peers (faults.py)."""

    rank: int
    coord: dict               # this rank's coordinate on each mesh axis
    timeout_s: float          # how long any wait lasts before the ranks still waiting raise

    def check_plan(self, text: str) -> None:
        """Every rank runs the same program (its text hashed and compared; the first rank that differs named)."""

    def agree(self, fields: dict, what: str) -> None:
        """The ranks agree on a call (faults.describe_call) before any collective of it; a difference raises."""

    def release(self, exc: BaseException | None = None, roll_call: bool = False) -> dict | None:
        """After a failed step: the process groups destroyed, so that peers fail at once; with roll_call, the
        other ranks' answers (liveness.py)."""


class StageHolding(Protocol):
    """Real ranks of a pipelined program: each stage's ranks hold its state values (runtime/p2p.py)."""

    def holds(self, name: str) -> bool:
        """Whether this rank holds state value `name`."""

    def full_owned(self, t, sh: Sharding, shape, name: str, dtype) -> torch.Tensor:
        """A state value whole on every rank: gathered in its stage, broadcast on the pipeline axis."""

    def value_owned(self, t, sh: Sharding, shape, name: str):
        """A state value as its stage's ranks hold it (a DTensor on their sub-mesh), None on the others."""


class BackendReports(Protocol):
    """A backend that compiles the global step itself (torch-xla): what it compiled."""

    host_ops: list            # aten ops it ran on the host (a step split in several programs)

    def hlo(self, mode: str | None = None) -> str:
        """The post-partitioning HLO of the step (the captured mode's, by default)."""

    def collectives(self) -> list:
        """The collectives of that HLO (the fields of prog.collectives())."""

    def compare(self, tolerance: float = 0.05):
        """partir's per-device collectives against the backend's, per kind and axis."""


@runtime_checkable
class Backend(Protocol):
    mesh: Mesh
    groups: dict              # mesh axis -> process group name its collectives run on (lower.bind)
    compile: bool
    device: torch.device      # where this process's shards live
    device_mesh: object       # the torch DeviceMesh its shards are laid out on (a loaded DTensor on it is taken as
    #                           it is: state.to_global); None: none (the interpreted emulator, torch-xla)
    # -- capabilities ------------------------------------------------------------------------------------------
    ranks: RankControl | None         # real ranks; None: every rank (or device) driven from this process
    new_programs: bool                # runs programs other than the plan's: other input signatures (shapes.py),
    #                                   instances of a symbolic dim (dims.py), eval_step / forward (evaluate.py)
    measures_memory: bool             # measure_memory=True counts each rank's peak (memtrack.py)
    measure_memory: bool              # ... set by the Executor from Options.measure_memory
    last_peak: dict | None            # ... {rank: bytes} of the last measured step
    reports: BackendReports | None    # what the backend compiled (torch-xla's HLO); None: partir's program runs

    @property
    def stages(self) -> StageHolding | None:
        """Real ranks of a pipelined program: who holds each state value; None: every rank holds every value."""

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

    def forget(self, gm) -> None:
        """Drop what run() keeps for gm (its segments, its compiled code): a program the cache of programs per
        input shape dropped (runtime/shapes.py), whose memory would otherwise stay held."""

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


class InProcess:
    """The capabilities of a backend that drives every rank (or device) from this process: no peers to agree
    with, every rank holds every state value, nothing compiled of its own to report. The emulators and the
    torch-xla backend start from it and set what they do otherwise."""

    ranks = None
    stages = None
    new_programs = True
    measures_memory = False
    measure_memory = False
    last_peak = None
    reports = None
    device = torch.device("cpu")
    device_mesh = None

    def forget(self, gm) -> None:
        """Nothing kept per program."""


def backend_for(mesh: Mesh, options, emulator) -> Backend:
    """Real ranks when torch.distributed is initialised, else `emulator` (all ranks in this process)."""
    from .distributed import DistributedRuntime, real_ranks_active

    if real_ranks_active():
        return DistributedRuntime(mesh, options.timeout_s, compile=options.compile)
    return emulator(mesh, compile=options.compile)
