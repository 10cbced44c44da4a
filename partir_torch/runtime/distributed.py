"""Real ranks: torch.distributed is initialised (torchrun / mp.spawn); one sub-group per mesh axis, all with the
program's timeout, and a CPU group for the checks of faults.py (start-up plan check, per-call agreement)."""
from __future__ import annotations

import hashlib
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import RankFailureError, RuntimeMismatchError
from ..errors import PartitionError
from ..mesh import Mesh
from ..sharding import Sharding
from . import faults, restart
from .layout import shard_of, unpadded
from .liveness import Liveness, tcp_store


def real_ranks_active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"


class DistributedRuntime:
    """This process is one rank; tensors are plain local shards. Its capabilities (backend.py): it is its own
    RankControl (`ranks`), and its StageHolding (`stages`) once it runs a pipelined program."""

    new_programs = True
    measures_memory = True
    reports = None

    def __init__(self, mesh: Mesh, timeout_s: float = 300.0, compile: bool = False):
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != mesh.size:
            raise RuntimeMismatchError(f"partition: the mesh {mesh} has {mesh.size} devices but torch.distributed "
                                       f"has world size {dist.get_world_size()}. Launch {mesh.size} processes "
                                       f"(torchrun --nproc-per-node {mesh.size}) or change the mesh.")
        self.mesh = mesh
        self.rank = dist.get_rank()
        self.coord = mesh.coordinate(self.rank)
        self.timeout_s = timeout_s
        self.timeout = timedelta(seconds=timeout_s)
        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.device = torch.device(dev, torch.cuda.current_device()) if dev == "cuda" else torch.device("cpu")
        # every group with the program's timeout (DeviceMesh would give its groups torch's 30-minute default,
        # whatever init_process_group was given): a peer that does not answer fails the collective (faults.py)
        opts = self._group_options(dev)
        store = tcp_store()
        port = store.port if store is not None else None
        before = faults.socket_fds(port)
        with restart.program_groups_store():    # a torchrun restart: keys of this attempt (restart.py)
            self.device_mesh = init_device_mesh(dev, tuple(mesh.shape.values()), mesh_dim_names=mesh.axes,
                                                backend_override={a: opts for a in mesh.axes})
            # the checks' group: CPU tensors on every backend (no device sync), the same timeout
            self.check_group = dist.new_group(timeout=self.timeout, backend="gloo", group_desc="partir_check")
        self.groups = {a: self.device_mesh.get_group(a).group_name for a in mesh.axes}
        self.sockets = faults.socket_fds(port) - before     # the groups' gloo connections (release shuts them)
        self.failed = False
        # who is alive after a failure: answered by a thread of every rank (liveness.py); group names agree
        self.liveness = Liveness(f"partir_live/{restart.attempt()}/{self.check_group.group_name}", self.rank,
                                 mesh.size, lambda me=weakref.ref(self): me() is None or me().failed)
        self.compile = compile
        self._compiled: dict = {}
        self.measure_memory = False      # the Executor sets it from Options.measure_memory
        self.last_peak = None            # {this rank: bytes} of the last measured step (runtime/memtrack.py)
        self.state_owner = None          # pipelined programs: (axis, {state name: coordinate that holds it})
        self.state_held = {}             # ... and the tied weights: {state name: every coordinate that holds it}

    @property
    def ranks(self):
        """backend.RankControl: this runtime (agree, check_plan, release); a property, not a reference to itself, so
        that dropping the runtime frees it at once (its liveness thread watches a weak reference)."""
        return self

    @property
    def stages(self):
        """backend.StageHolding: this runtime, while it runs a pipelined program (state_owner set)."""
        return self if self.state_owner is not None else None

    def _group_options(self, dev: str):
        from torch._C._distributed_c10d import Backend as C10dBackend

        if dev == "cuda":       # NCCL's own Options: its watchdog aborts a collective after _timeout
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            return opts
        return C10dBackend.Options("gloo", self.timeout)

    def valid(self) -> bool:
        return dist.is_initialized()

    def check_plan(self, text: str) -> None:
        """All ranks must run the same program: compare hashes; name the first rank that differs."""
        h = hashlib.sha256(text.encode()).hexdigest()[:16]
        hashes = [None] * dist.get_world_size()
        # a rank that died or never reached its first step is named here instead of hanging everyone
        try:
            dist.monitored_barrier(group=self.check_group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as e:
            raise RankFailureError(f"partition: not every rank reached the start-up check within "
                                   f"timeout_s={self.timeout_s:g} s: {e}. A rank may have died or not called "
                                   f"partition() and its first step.") from e
        try:
            dist.all_gather_object(hashes, h, group=self.check_group)
        except Exception as e:  # noqa: BLE001
            raise RankFailureError(f"partition: ranks could not agree on the plan within timeout_s="
                                   f"{self.timeout_s:g} s: {e}. A rank may have died or not called "
                                   f"partition().") from e
        bad = [r for r, x in enumerate(hashes) if x != hashes[0]]
        if bad:
            raise RuntimeMismatchError(
                f"partition: rank {bad[0]} built a different program than rank 0 (plan hash {hashes[bad[0]]} vs "
                f"{hashes[0]}). Every rank must call partition with the same model, shapes, schedule and code, and "
                f"seed its random generator alike (torch.manual_seed) when the step draws random numbers.")

    def agree(self, fields: dict, what: str) -> None:
        """Before `what` runs: every rank describes it (faults.describe_call) and the ranks compare one 8-byte
        digest; a difference raises RuntimeMismatchError on every rank, naming the ranks and the fields that differ,
        before any collective of the step. A peer that died or does not answer raises RankFailureError."""
        world = dist.get_world_size()
        mine = torch.tensor([faults.digest(fields)], dtype=torch.int64)
        got = [torch.empty_like(mine) for _ in range(world)]
        try:
            dist.all_gather(got, mine, group=self.check_group)
            if all(bool(g == mine) for g in got):
                return
            everyone = [None] * world
            dist.all_gather_object(everyone, fields, group=self.check_group)
        except Exception as e:  # noqa: BLE001 - classified below
            if faults.peer_failure_kind(e) is None:
                raise
            answers = self.release(e, roll_call=True)
            raise faults.step_failure(what, self.rank, self.mesh, None, e, self.timeout_s,
                                      coll=f"the ranks' agreement check before it (an all_gather of 8 bytes on all "
                                           f"{world} ranks)", answers=answers) from e
        raise faults.divergence(everyone, what)

    def release(self, exc: BaseException | None = None, roll_call: bool = False) -> dict | None:
        """Destroy this runtime's process groups after a failed step (faults.py): a peer blocked in a collective
        with this rank fails at once instead of at its timeout. gloo has no abort that wakes a peer, and only the
        last reference to a group closes its connections (a pending collective's work object, held by torch's
        functional-collective registry, keeps them open): the groups' sockets are shut down first (shutdown(2):
        the peer reads end-of-file; gloo still owns and closes the descriptors), then the finished frames of
        `exc`'s traceback are cleared (its lines stay) and the groups destroyed. The default group is the user's and
        is left alone. With roll_call, returns the other ranks' answers to the roll call (Liveness.roll_call)."""
        import gc
        import traceback

        if self.check_group is None:
            return None
        self.failed = True
        if self.check_group in dist.distributed_c10d._world.pg_map:    # not destroyed already: the fds are its own
            faults.shut_sockets(self.sockets)   # the peers see "connection closed" now, whoever holds the groups
        if exc is not None:
            traceback.clear_frames(exc.__traceback__)
        pgs = []
        for name in set(self.groups.values()):
            try:
                pgs.append(dist.distributed_c10d._resolve_process_group(name))
            except Exception:  # noqa: BLE001 - already gone
                pass
        pgs.append(self.check_group)
        for pg in pgs:
            if pg is None or pg == dist.GroupMember.WORLD or pg is dist.distributed_c10d._get_default_group():
                continue
            try:
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001 - a group already destroyed or broken: nothing left to release
                pass
        self.device_mesh = self.check_group = None
        self._compiled.clear()
        del pgs
        gc.collect()
        return self.liveness.roll_call() if roll_call else None

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

    def forget(self, gm) -> None:
        self._compiled.pop(id(gm), None)

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

        if sh.blocks:
            from ..errors import PartitionError

            raise PartitionError(f"a value of shape {tuple(shape)} is laid out {sh}: tiled unevenly in blocks of "
                                 f"several positions, which a DTensor Shard placement cannot hold (it splits single "
                                 f"positions). Use sizes the axes divide for the values you read as DTensors.")
        t = unpadded(t, sh, self.mesh, self.coord, shape)       # an uneven shard as DTensor holds it
        return DTensor.from_local(t, self.device_mesh, sh.placements(self.mesh), shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride(), run_check=False)

    def full(self, t, sh: Sharding, shape) -> torch.Tensor:
        return self.dtensor(t, sh, shape).full_tensor()

    def local_full(self, sh: Sharding) -> bool:
        return self.state_owner is None and sh.is_replicated()    # else a gather (a broadcast when pipelined)

    def full_into(self, dest: torch.Tensor, t, sh: Sharding, shape) -> None:
        """A replicated value is its local tensor (no collective); others are gathered (collective)."""
        dest.copy_(t if sh.is_replicated() else self.full(t, sh, shape))

    def value(self, t, sh: Sharding, shape):
        if self.state_owner is not None:
            raise PartitionError("partir_torch: a state value of a pipelined program is read with value_owned (its "
                                 "stage's ranks hold it).")
        return self.dtensor(t, sh, shape)

    def value_owned(self, t, sh: Sharding, shape, name: str):
        """A state value of a pipelined program as the ranks of its stage hold it: a DTensor over their sub-mesh
        (the other axes; a plain tensor when there are none), None on the other ranks. torch.distributed.checkpoint
        saves each stage's values from its ranks: one FQN space over the stages (a tied weight is held, saved and
        loaded by each stage reading it, as a replicated value: DCP writes it once)."""
        from torch.distributed.tensor import DTensor

        axis, coords = self.state_owner
        if not self.holds(name):
            return None
        rest = tuple(a for a in self.mesh.axes if a != axis)
        if not rest:
            return t
        placements = [p for a, p in zip(self.mesh.axes, sh.placements(self.mesh)) if a != axis]
        return DTensor.from_local(t, self.device_mesh[rest], placements, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride(), run_check=False)

    def holds(self, name: str) -> bool:
        """Whether this rank holds state value `name` of the pipelined program (its stage's; a tied weight: every
        stage reading it)."""
        axis, coords = self.state_owner
        me = self.coord[axis]
        return coords.get(name, me) == me or me in self.state_held.get(name, ())

    def program(self, plan):
        """The plan's per-device program (lowered once per plan) bound to this runtime's process groups."""
        from ..lower.lower import bind

        if plan.pipeline.staged:    # this rank's stage, its transfers as send/recv (p2p.py)
            from .p2p import rank_program, state_coords

            if self.compile or self.measure_memory:
                raise PartitionError("partition: a pipeline on real ranks runs eager and unmeasured for now; leave "
                                     "compile and measure_memory off.")
            self.state_owner = (plan.pipeline.axis, state_coords(plan))
            self.state_held = {n: plan.pipeline.holders(n) for n in plan.pipeline.tied}
            return rank_program(bind(plan.annotated_lowered(), self.groups), plan, self)
        return bind(plan.lowered(), self.groups)

    def full_owned(self, t, sh: Sharding, shape, name: str, dtype) -> torch.Tensor:
        """A state value of a pipelined program: gathered by the ranks of the stage that holds it (on their own
        groups of the other axes), then broadcast on the pipeline axis from each rank's peer in that stage."""
        axis, coords = self.state_owner
        c = coords.get(name)
        if c is None:
            return self.full(t, sh, shape)
        if self.coord[axis] == c:
            out = self.full(t, sh, shape).contiguous()
        else:
            out = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        src = self.mesh.rank_of({**self.coord, axis: c})
        dist.broadcast(out, src=src, group=self.device_mesh.get_group(axis))
        return out

    def rank0(self, t) -> torch.Tensor:
        return t
