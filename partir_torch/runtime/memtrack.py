"""Measured peak memory of a step, per rank: the runtime's side of `prog.peak_memory()` (the simulator predicts the
same figure from the program, sim/memory.py).

What is counted (CPU ranks and emulation): the bytes of every tensor *storage* a rank holds, each storage once
(views share their base's storage), from the start of the step to its end:

- held at the start: every tensor the step is called with (parameters, buffers and optimizer state held by the
  program, the batch shards, the learning rate and the coordinates), counted from the start to the end of the step
  (the program holds its state across steps);
- created during the step: every storage an op of the per-device program returns, counted from that op until the
  storage is freed (its last reference dropped: FX frees a value after its last use; a collective's output from its
  issue); the temporaries inside the fused optimizer update (lower/fuse.py, a Python function of torch._foreach_*
  ops) are counted op by op, as torch.optim's would be; the old state the update writes in place is not new;
- not counted: a kernel's internal workspace that is not a tensor (a matmul's packing buffers), allocator
  rounding and caching, the communication library's staging buffers, and anything outside the step (the caller's
  model, the data loader).

A storage's size is read when it is first seen and again whenever it is resized (UntypedStorage.resize_: FSDP2
frees and re-allocates its gathered parameters that way, out of the dispatcher's sight). Peak = the maximum over
the step of a rank's live bytes, sampled after every op, adoption and resize.

In emulation (interpret.py) all ranks run in one process: the interpreter tells the tracker which rank runs
(`tracker.rank`), and adopts each rank's collective outputs for it (`adopt`). On real CPU ranks the same tracker
runs in every process with `rank` fixed. On CUDA ranks the runtime reads `torch.cuda.max_memory_allocated`
instead (reset at the start of the step): the caching allocator's figure, which also counts everything else the
process holds on the device.

Cost: a Python callback per aten op (TorchDispatchMode), so it runs only when asked:
`partition(..., measure_memory=True)`.

    tr = MemoryTracker(ranks=4)
    with tr.step(held={0: [...], 1: [...]}):      # rank -> tensors held at the start
        tr.rank = 0; ...                           # ops run for rank 0
    tr.peaks                                       # {0: bytes, 1: bytes, ...}
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class MemoryTracker(TorchDispatchMode):
    """Live storage bytes per rank, and their peak over the step (see the module docstring for what counts)."""

    def __init__(self, ranks):
        super().__init__()
        self.ranks = list(ranks)
        self.rank = None                 # the rank whose ops run now (None: allocations are not attributed)
        self.live = dict.fromkeys(self.ranks, 0)
        self.peaks = dict.fromkeys(self.ranks, 0)
        self._held: dict = {}            # id(storage) -> [nbytes, set of ranks, finalizer]

    # -- accounting ------------------------------------------------------------------------------------------------
    def adopt(self, rank, t) -> None:
        """`rank` holds the tensors of `t` (a tensor or a nest of them) from now until their storage is freed."""
        for x in tree_leaves(t):
            if not isinstance(x, torch.Tensor) or x.device.type == "meta":
                continue
            self._take(rank, x.untyped_storage())

    def _take(self, rank, st) -> None:
        key = id(st)
        rec = self._held.get(key)
        if rec is None:
            rec = self._held[key] = [st.nbytes(), set(), weakref.finalize(st, self._freed, key)]
        if rank not in rec[1]:
            rec[1].add(rank)
            self.live[rank] += rec[0]
            if self.live[rank] > self.peaks[rank]:
                self.peaks[rank] = self.live[rank]

    def _freed(self, key) -> None:
        rec = self._held.pop(key, None)
        if rec is not None:
            for r in rec[1]:
                self.live[r] -= rec[0]

    @contextmanager
    def step(self, held: dict):
        """Track one step: `held` (rank -> tensors) is live from the start; peaks restart from it."""
        for r in self.ranks:
            self.live[r] = 0
        for r, ts in held.items():
            self.adopt(r, ts)
        self.peaks = dict(self.live)
        resize = torch.UntypedStorage.resize_
        torch.UntypedStorage.resize_ = lambda st, n: self._resized(resize, st, n)
        try:
            with self:
                yield self
        finally:
            torch.UntypedStorage.resize_ = resize
            self.rank = None
            for rec in self._held.values():         # forget what outlives the step (the new state, the loss)
                rec[2].detach()
            self._held.clear()

    def _resized(self, resize, st, n):
        """UntypedStorage.resize_ (FSDP2 frees and re-allocates its gathered parameters so, out of the dispatcher's
        sight): the storage's bytes change for every rank that holds it; one nobody holds yet is adopted by the
        running rank."""
        out = resize(st, n)
        rec = self._held.get(id(st))
        if rec is None:
            if self.rank is not None and st.nbytes():
                self._take(self.rank, st)
            return out
        grow, rec[0] = st.nbytes() - rec[0], st.nbytes()
        for r in rec[1]:
            self.live[r] += grow
            self.peaks[r] = max(self.peaks[r], self.live[r])
        return out

    # -- the dispatch hook -----------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.rank is not None:
            self.adopt(self.rank, out)
        return out


class CudaPeak:
    """CUDA ranks: the caching allocator's peak over the step (torch.cuda.max_memory_allocated, reset at its
    start)."""

    def __init__(self, device):
        self.device = device
        self.peak = None

    @contextmanager
    def step(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        yield self
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device)


def measured(rt, gm, args):
    """A real rank's step run by `rt` (DistributedRuntime) under the tracker: (outputs, {rank: peak bytes}). CUDA:
    the caching allocator's peak; CPU: the storage tracker (eager only: a compiled program allocates inside
    Inductor's kernels, out of the tracker's sight)."""
    if rt.device.type == "cuda":
        cp = CudaPeak(rt.device)
        with cp.step():
            out = rt._run(gm, args)
        return out, {rt.rank: cp.peak}
    refuse_compiled(rt)
    tr = MemoryTracker([rt.rank])
    with tr.step({rt.rank: list(args)}):
        tr.rank = rt.rank
        out = rt._run(gm, args)
    return out, dict(tr.peaks)


def refuse_compiled(rt) -> None:
    if rt.compile:
        from ..errors import PartitionError

        raise PartitionError("measure_memory on CPU counts the tensors each op of the per-device program creates; "
                             "a compiled program (compile=True) allocates inside Inductor's kernels, out of its "
                             "sight. Measure with compile=False (same program, same liveness), or on CUDA ranks "
                             "(torch.cuda.max_memory_allocated).")
