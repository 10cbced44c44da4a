"""Real ranks: torch.distributed is initialised (torchrun / mp.spawn); one sub-group per mesh axis."""
from __future__ import annotations

import hashlib
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import RuntimeMismatchError
from ..mesh import Mesh
from ..sharding import Sharding
from .layout import shard_of


def real_ranks_active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"


class DistributedRuntime:
    """This process is one rank; tensors are plain local shards."""

    kind = "distributed"

    def __init__(self, mesh: Mesh, timeout_s: float = 300.0, compile: bool = False):
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != mesh.size:
            raise RuntimeMismatchError(f"partition: the mesh {mesh} has {mesh.size} devices but torch.distributed "
                                       f"has world size {dist.get_world_size()}. Launch {mesh.size} processes "
                                       f"(torchrun --nproc-per-node {mesh.size}) or change the mesh.")
        self.mesh = mesh
        self.rank = dist.get_rank()
        self.coord = mesh.coordinate(self.rank)
        self.timeout = timedelta(seconds=timeout_s)
        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.device = torch.device(dev, torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")
        self.device_mesh = init_device_mesh(dev, tuple(mesh.shape.values()), mesh_dim_names=mesh.axes)
        self.groups = {a: self.device_mesh.get_group(a).group_name for a in mesh.axes}
        self.compile = compile
        self._compiled: dict = {}
        self.measure_memory = False      # the Executor sets it from Options.measure_memory
        self.last_peak = None            # {this rank: bytes} of the last measured step (runtime/memtrack.py)

    def valid(self) -> bool:
        return dist.is_initialized()

    def check_plan(self, text: str) -> None:
        """All ranks must run the same program: compare hashes; name the first rank that differs."""
        h = hashlib.sha256(text.encode()).hexdigest()[:16]
        hashes = [None] * dist.get_world_size()
        if dist.get_backend() == "gloo":
            # a rank that died or never reached partition() is named here instead of hanging everyone
            try:
                dist.monitored_barrier(timeout=self.timeout, wait_all_ranks=True)
            except RuntimeError as e:
                raise RuntimeMismatchError(f"partition: not every rank reached the start-up check within "
                                           f"{self.timeout}: {e}. A rank may have died or not called "
                                           f"partition(); collectives later in the step use the process group's "
                                           f"timeout (init_process_group(timeout=...)).") from e
        try:
            dist.all_gather_object(hashes, h)
        except Exception as e:  # noqa: BLE001
            raise RuntimeMismatchError(f"partition: ranks could not agree on the plan within {self.timeout}: {e}. "
                                       f"A rank may have died or not called partition().") from e
        bad = [r for r, x in enumerate(hashes) if x != hashes[0]]
        if bad:
            raise RuntimeMismatchError(
                f"partition: rank {bad[0]} built a different program than rank 0 (plan hash {hashes[bad[0]]} vs "
                f"{hashes[0]}). Every rank must call partition with the same model, shapes, schedule and code, and "
                f"seed its random generator alike (torch.manual_seed) when the step draws random numbers.")

    def shard(self, full: torch.Tensor, sh: Sharding):
        return shard_of(full.detach().to(self.device), sh, self.mesh, self.coord).clone(
            memory_format=torch.contiguous_format)                  # its own storage: updated in place

    def local(self, t: torch.Tensor):
        return t.detach().to(self.device)

    def coords(self) -> list:
        return [torch.tensor(self.coord[a], dtype=torch.int64, device=self.device) for a in self.mesh.axes]

    def run(self, gm, args):
        if self.measure_memory:
            from .memtrack import measured

            out, self.last_peak = measured(self, gm, args)
            return out
        return self._run(gm, args)

    def _run(self, gm, args):
        if not self.compile:
            return gm(*args)
        fn = self._compiled.get(id(gm))
        if fn is None or fn[0] is not gm:   # the whole per-device step, collectives kept (runtime/compiled.py)
            from .compiled import compile_program

            fn = self._compiled[id(gm)] = (gm, compile_program(gm, args))
        return fn[1](*args)

    def dtensor(self, t, sh: Sharding, shape):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(t, self.device_mesh, sh.placements(self.mesh), shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride(), run_check=False)

    def full(self, t, sh: Sharding, shape) -> torch.Tensor:
        return self.dtensor(t, sh, shape).full_tensor()

    def value(self, t, sh: Sharding, shape):
        return self.dtensor(t, sh, shape)

    def program(self, plan):
        """The plan's per-device program (lowered once per plan) bound to this runtime's process groups."""
        from ..lower.lower import bind

        return bind(plan.lowered(), self.groups)

    def rank0(self, t) -> torch.Tensor:
        return t
