"""What a GPU reserves for a program's tensors: PyTorch's CUDA caching allocator, replayed on the liveness events.

sim/memory.py counts live tensor bytes, what `torch.cuda.max_memory_allocated` measures. Published training runs
often report `torch.cuda.max_memory_reserved` instead (torchtitan's "max reserved memory"): the bytes of the segments
the caching allocator took from the driver, which it keeps and reuses, never returning them during training. The
difference is the allocator's: each request rounded up to 512 B; requests up to 1 MiB carved from 2 MiB segments,
requests under 10 MiB from 20 MiB segments, larger ones a segment of their own rounded up to 2 MiB; a free block
reused best-fit (the smallest free block of the pool that fits), split when the rest is worth keeping (>= 512 B in the
small pool, > 1 MiB in the large), merged with its free neighbours when freed. A tensor freed while a larger one is
needed leaves a hole the larger one cannot use: the segments grow beyond the live bytes (fragmentation).

`reserved_bytes` replays the program's storages (sizes, the node that allocates each, the node after which it is
freed) through that policy for `steps` iterations of the step, the state (placeholders) allocated once before the
first, and returns the segment bytes at the end (the maximum: segments are never released). No
`expandable_segments`, no `max_split_size_mb`: PyTorch's defaults. A block belongs to the stream it was allocated
on and is reused only for requests on that stream (DeviceCachingAllocator keys its pools' blocks by stream first:
c10/cuda/CUDACachingAllocator.cpp, BlockComparatorSize): `streams` names the storages allocated on another stream
than the default one, whose freed blocks the others cannot use. What else a process reserves on a GPU (the CUDA
context, NCCL's buffers, cuBLAS workspaces outside the allocator) is not in it, as it is not in the published figure.

partir's runtime allocates every buffer on the default stream and frees each after its last use. `eager_buffers`
turns the storages into those eager PyTorch holds for the same step when its own machinery runs it (torchtitan's
runs): FSDP2 for ZeRO-3's collectives (its buffers on its streams) and torch.utils.checkpoint's selective
checkpointing for a selective remat (its cache holds every saved output until its region is recomputed).

    reserved_bytes([4096, 3 << 20, 512], born=[0, 1, 2], last=[5, 2, 3], end=6, persistent=[0])
"""
from __future__ import annotations

from bisect import bisect_left, insort
from fnmatch import fnmatchcase

from ..contract import META_NAME, META_RECOMPUTE, META_ROLE, META_SAVED, Role

_MIN_BLOCK = 512                  # kMinBlockSize: every request is rounded up to a multiple of it
_SMALL = 1 << 20                  # kSmallSize: requests up to this size use the small pool
_SMALL_BUFFER = 2 << 20           # kSmallBuffer: a small-pool segment
_LARGE_BUFFER = 20 << 20          # kLargeBuffer: a large-pool segment for requests under _MIN_LARGE_ALLOC
_MIN_LARGE_ALLOC = 10 << 20       # kMinLargeAlloc
_ROUND_LARGE = 2 << 20            # kRoundLarge: larger requests get a segment of their own, rounded up to it


def _round(n: int) -> int:
    return _MIN_BLOCK if n < _MIN_BLOCK else -(-n // _MIN_BLOCK) * _MIN_BLOCK


def _segment_size(n: int) -> int:
    if n <= _SMALL:
        return _SMALL_BUFFER
    if n < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return -(-n // _ROUND_LARGE) * _ROUND_LARGE


class CachingAllocator:
    """The policy above: blocks are [offset, size, free, prev, next] per segment; each pool (a stream's small or
    large blocks) keeps its free blocks sorted by (size, block id) for the best fit."""

    def __init__(self):
        self.reserved = 0
        self.blocks: dict = {}              # block id -> [segment, offset, size, free, prev id, next id]
        self.free: dict = {}                # (stream, small pool?) -> sorted [(size, id)]
        self.pool: dict = {}                # segment -> (stream, small pool?)
        self._ids = 0

    def _new_block(self, seg, off, size, prev, nxt) -> int:
        self._ids += 1
        self.blocks[self._ids] = [seg, off, size, False, prev, nxt]
        return self._ids

    def malloc(self, nbytes: int, stream=0) -> int | None:
        """A block for a tensor of nbytes allocated on `stream` (None for an empty tensor, which the allocator does
        not back)."""
        if nbytes <= 0:
            return None
        size = _round(nbytes)
        small = size <= _SMALL
        free = self.free.setdefault((stream, small), [])
        i = bisect_left(free, (size, 0))
        if i < len(free):
            _, b = free.pop(i)
            self.blocks[b][3] = False
        else:
            seg = len(self.pool)
            self.pool[seg] = (stream, small)
            total = _segment_size(size)
            self.reserved += total
            b = self._new_block(seg, 0, total, None, None)
        blk = self.blocks[b]
        rest = blk[2] - size
        if rest >= _MIN_BLOCK if small else rest > _SMALL:     # split: the rest stays free in the pool
            r = self._new_block(blk[0], blk[1] + size, rest, b, blk[5])
            if blk[5] is not None:
                self.blocks[blk[5]][4] = r
            blk[5], blk[2] = r, size
            self._release(r)
        return b

    def release(self, b: int | None) -> None:
        """Free block b: merged with its free neighbours, back in its pool."""
        if b is None:
            return
        blk = self.blocks[b]
        for side in (4, 5):                 # prev, next
            n = blk[side]
            if n is not None and self.blocks[n][3]:
                nb = self.blocks[n]
                self.free[self.pool[nb[0]]].remove((nb[2], n))
                if side == 4:               # absorbed into the previous block
                    nb[2] += blk[2]
                    nb[5] = blk[5]
                    if blk[5] is not None:
                        self.blocks[blk[5]][4] = n
                    del self.blocks[b]
                    b, blk = n, nb
                else:                       # the next block absorbed
                    blk[2] += nb[2]
                    blk[5] = nb[5]
                    if nb[5] is not None:
                        self.blocks[nb[5]][4] = b
                    del self.blocks[n]
        self._release(b)

    def _release(self, b: int) -> None:
        blk = self.blocks[b]
        blk[3] = True
        insort(self.free[self.pool[blk[0]]], (blk[2], b))


def reserved_bytes(sizes, born, last, end: int, persistent=(), lazy=None, steps: int = 2, streams=None) -> int:
    """Segment bytes after `steps` iterations of a program whose storage s (of sizes[s] bytes) is allocated at node
    born[s] and freed after node last[s] (last >= end: at the end of the step). `persistent` storages (the held
    state) are never freed: allocated before the first iteration, or, those in `lazy` ({storage: node}), at that
    node of the first iteration (torch.optim's state, created by the first step's update). `streams`: {storage:
    stream} for the storages allocated on another stream than the default (0)."""
    alloc = CachingAllocator()
    lazy, on = lazy or {}, (streams or {}).get
    keep = set(persistent)
    for s in sorted(keep - set(lazy), key=lambda s: born[s]):
        alloc.malloc(sizes[s], on(s, 0))
    at_birth: dict = {}
    at_free: dict = {}
    for s in range(len(sizes)):
        if s not in keep:
            at_birth.setdefault(born[s], []).append(s)
            at_free.setdefault(min(last[s], end), []).append(s)
    late: dict = {}
    for s, i in lazy.items():
        late.setdefault(i, []).append(s)
    for step in range(steps):
        held: dict = {}
        for i in range(end + 1):
            for s in late.get(i, ()) if step == 0 else ():
                alloc.malloc(sizes[s], on(s, 0))
            for s in at_birth.get(i, ()):
                held[s] = alloc.malloc(sizes[s], on(s, 0))
            for s in at_free.get(i, ()):
                alloc.release(held.pop(s, None))
    return alloc.reserved


ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM = 1, 2


def eager_buffers(events: tuple, owners: tuple, held=()) -> tuple:
    """reserved_bytes' arguments for the step as eager PyTorch runs it (module docstring). ``events``:
    MemoryResult.events; ``owners``: the node allocating each storage; ``held``: globs of the parameter names whose
    gathered copy FSDP2 keeps from the forward to the end of the backward (the modules fully_shard'ed with
    reshard_after_forward=False, and the root module's own parameters: FSDP2 never reshards the root after the
    forward). Returns (sizes, born, last, end, persistent, lazy, streams):

    - FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_all_gather / foreach_reduce): an
      all-gather's output on the all-gather copy-in stream, copied out at its wait into the unsharded parameters
      (the program's storage, on the default stream from the wait on) and then freed; a reduce-scatter's output,
      the sharded gradient, on the reduce-scatter stream; FSDP2 frees a module's unsharded parameters at the
      module's reshard, not after their last use: a held parameter's copy lives to the end of the backward (the
      first node of the update);
    - selective checkpointing (torch/utils/checkpoint.py, _CachingTorchDispatchMode): an op the policy saves
      (META_SAVED) has its outputs stored whether or not the backward reads them, until its region's recomputation
      (the first node recomputing that region) pops them."""
    sizes, born, last, end, persistent, lazy = events
    sizes, born, last = list(sizes), list(born), list(last)
    n = len(sizes)
    nodes = list(owners[0].graph.nodes) if owners else []
    _checkpoint_cache(nodes, owners[:n], last)
    streams = _fsdp2(nodes, owners[:n], sizes, born, last, held)
    return sizes, born, last, end, persistent, lazy, streams


def _checkpoint_cache(nodes, owners, last) -> None:
    """Saved outputs held until their region's first recomputed node (eager_buffers)."""
    recompute: dict = {}
    for i, node in enumerate(nodes):
        if node.meta.get(META_RECOMPUTE):
            recompute.setdefault(node.meta[META_RECOMPUTE], i)
    for s, node in enumerate(owners):
        region = node.meta.get(META_SAVED)
        if region in recompute:
            last[s] = max(last[s], recompute[region])


def _fsdp2(nodes, owners, sizes, born, last, held) -> dict:
    """FSDP2's buffers (eager_buffers): appends the copy-in buffers, moves the unsharded parameters' birth to the
    copy-out, extends the held ones; returns {storage: stream}."""
    index = {node: i for i, node in enumerate(nodes)}
    state = {x for x in nodes if x.op == "placeholder" and x.meta.get(META_ROLE) in (Role.OPT_STATE, Role.LR)}
    update = next((i for i, x in enumerate(nodes) if x.op == "call_function" and state & set(x.all_input_nodes)),
                  len(nodes))
    streams: dict = {}
    for s, node in enumerate(owners):
        target = str(getattr(node, "target", ""))
        if "reduce_scatter" in target:
            streams[s] = REDUCE_SCATTER_STREAM
        elif "all_gather" in target:
            at = min((index[u] for u in node.users if "wait_tensor" in str(u.target)), default=born[s])
            streams[len(sizes)] = ALL_GATHER_STREAM       # the copy-in stream's output buffer, issue to copy-out
            sizes.append(sizes[s])
            born.append(born[s])
            last.append(at)
            born[s] = min(at, last[s])                      # the unsharded parameters, from the copy-out on
            if held and any(fnmatchcase(p, g) for p in _param_names(node) for g in held):
                last[s] = max(last[s], update - 1)
    return streams


def _param_names(node, depth: int = 4) -> list:
    """The parameters (names without "params.") a gathered value is made of: placeholders up its inputs (casts,
    a bucket's concatenation), at most `depth` nodes up."""
    if node.op == "placeholder":
        name = str(node.meta.get(META_NAME, ""))
        return [name[len("params."):]] if name.startswith("params.") else []
    return [p for a in node.all_input_nodes for p in _param_names(a, depth - 1)] if depth else []
