"""Emulated ranks through a tensor subclass: every rank of the mesh in one process (LocalTensorMode over a `fake`
process group). Same per-device program, same numerics as real ranks. The default emulator is interpret.py (plain
tensors per rank, far less overhead per op); this one stays as a cross-check in the tests. It runs eager only:
Dynamo/Inductor do not trace LocalTensor subclasses (compile=True is refused here)."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ..mesh import Mesh
from ..sharding import Sharding
from .backend import InProcess
from .layout import assemble, assemble_into, shard_of


def _ensure_world(n: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() == "fake" and dist.get_world_size() == n:
            return
        if dist.get_backend() != "fake":
            raise RuntimeError("a real process group is initialised; use the distributed runtime")
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)


class EmulatedRuntime(InProcess):
    """All ranks in one process. Tensors the program sees are LocalTensors (one value per rank); it does not
    measure memory (measures_memory: the interpreted emulator does)."""

    def __init__(self, mesh: Mesh, compile: bool = False):
        from torch.distributed._local_tensor import LocalTensorMode

        if compile:
            raise NotImplementedError("EmulatedRuntime (LocalTensorMode) runs eager only; the interpreted "
                                      "emulator (runtime/interpret.py) compiles each segment.")
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh, self.compile = mesh, False
        _ensure_world(mesh.size)
        self.mode = LocalTensorMode(mesh.size)
        with self.mode:
            self.device_mesh = init_device_mesh("cpu", tuple(mesh.shape.values()), mesh_dim_names=mesh.axes)
        self.groups = {a: self.device_mesh.get_group(a).group_name for a in mesh.axes}
        self._world = id(dist.group.WORLD)

    def valid(self) -> bool:
        return dist.is_initialized() and id(dist.group.WORLD) == self._world

    def per_rank(self, fn):
        """A LocalTensor whose rank-r value is fn(r, coord)."""
        with self.mode:
            return self.mode.rank_map(lambda r: fn(r, self.mesh.coordinate(r)))

    def shard(self, full: torch.Tensor, sh: Sharding):
        full = full.detach()
        own = torch.contiguous_format           # each rank's shard in storage of its own: updated in place
        return self.per_rank(lambda r, c: shard_of(full, sh, self.mesh, c).clone(memory_format=own))

    def local(self, full: torch.Tensor):
        """A rank's own slice is given by the caller (train_step_local): every rank receives the same tensor."""
        return self.per_rank(lambda r, c: full.detach().clone())

    def coords(self) -> list:
        return [self.per_rank(lambda r, c, a=a: torch.tensor(c[a], dtype=torch.int64)) for a in self.mesh.axes]

    def run(self, gm, args):
        with self.mode:
            return _functional(gm)(*args)

    def full(self, t, sh: Sharding, shape) -> torch.Tensor:
        return assemble(dict(t._local_tensors), sh, self.mesh, shape)

    def local_full(self, sh: Sharding) -> bool:
        return True                           # every rank's shard is in this process

    def full_into(self, dest: torch.Tensor, t, sh: Sharding, shape) -> None:
        assemble_into(dest, dict(t._local_tensors), sh, self.mesh)

    def value(self, t, sh: Sharding, shape) -> torch.Tensor:
        return self.full(t, sh, shape)

    def program(self, plan):
        """The plan's per-device program (lowered once per plan) bound to this runtime's process groups."""
        from ..lower.lower import bind

        return bind(plan.lowered(), self.groups)

    def rank0(self, t) -> torch.Tensor:
        return t._local_tensors[0].clone()


def _functional(gm):
    """gm with lower/bucketops.py's bucket collectives replaced by the functional collectives they equal (once per
    program): LocalTensorMode knows those, and would run an op of ours on each rank alone."""
    from ..lower.bucketops import FUNCTIONAL

    if not any(n.target in FUNCTIONAL for n in gm.graph.nodes):
        return gm
    done = gm.meta.get("partir_functional")
    if done is None:
        done = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        for n in done.graph.nodes:
            if n.target in FUNCTIONAL:
                n.target = FUNCTIONAL[n.target]
        done.recompile()
        gm.meta["partir_functional"] = done
    return done
