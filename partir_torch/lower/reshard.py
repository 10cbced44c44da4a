"""Resharding one value between two layouts, emitted into the per-device graph as functional collectives.

| from -> to (one axis)     | emitted                                   |
|---------------------------|-------------------------------------------|
| tiled(d) -> replicated    | all_gather on d                           |
| partial -> replicated     | all_reduce (sum / max / min)              |
| partial -> tiled(d)       | reduce_scatter on d                       |
| replicated -> tiled(d)    | local slice at the rank's coordinate      |
| tiled(d1) -> tiled(d2)    | all_to_all                                |

Order: un-tile (innermost axis of a dim first), then reduce pending partials (reduce_scatters into the target
tiling first, all_reduces on the smaller shard after, the latest tactic's axis first: a gradient that sequence
parallelism also left partial on the tensor-parallel axis is reduced there first, so its data-parallel all_reduce
ends the chain and joins its neighbours' bucket, lower/bucket.py), then tile (outermost first).

An axis that does not divide its dim (uneven, torch.chunk sizes) runs the same collectives on padded chunks:
the gather keeps the first positions, the reduce_scatter and the slice pad the whole dim first (lower/uneven.py).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from ..sharding import Sharding, chunk_size
from .uneven import chunk_of, narrow_dim, pad_dim
from .records import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, CollectiveRecord
from ..contract import META_COLLECTIVE, META_IN_SHAPE, META_LOCAL_SHAPE

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def call_function(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """graph.call_function(target, args, kwargs) without fx's check of every argument for a raw SymInt
    (Graph.create_node walks them with pytree on each call, ~10 us: a tenth of lowering a 32-layer model). The
    per-device program is static: its arguments hold ints, never SymInts. Assigning args and kwargs is the
    accounting of uses and users that create_node does; they are assigned through the properties themselves
    (object.__setattr__): Node.__setattr__ would also take the node out of fx's (op, target) lookup table and put
    it back, which neither changes. The name fx would derive from the target is derived once per target (the same
    candidate, so the same unique name)."""
    name = _NAMES.get(target)
    if name is None:
        name = _NAMES[target] = graph._target_to_str(target)
    node = graph.call_function(target, name=name)
    object.__setattr__(node, "args", args)
    if kwargs:
        object.__setattr__(node, "kwargs", kwargs)
    return node


_NAMES: dict = {}        # target -> fx's name candidate for it (Graph._target_to_str)


class Emitter:
    """Appends nodes to the per-device graph and keeps the collective records."""

    def __init__(self, graph: fx.Graph, mesh, groups: dict, coords: dict, families: dict | None = None):
        self.graph, self.mesh, self.groups, self.coords = graph, mesh, groups, coords
        self.families = families or {}       # tactic name -> its declared family (on each record)
        self.records: list = []
        self.phase = ""
        self.cause = None     # (kind, axis) -> (why, source, op) of the collective being emitted (lower/why.py)

    def call(self, target, *args, meta_shape=None, dtype=None, kwargs=None):
        node = call_function(self.graph, target, tuple(args), dict(kwargs or {}))
        node.meta[META_LOCAL_SHAPE] = meta_shape
        return node

    def collective(self, target, args, kind, axis, shape, dtype, nbytes, value, tactic, reduce_op="", dim=-1,
                   in_shape=None):
        c = self.call(target, *args, meta_shape=shape, dtype=dtype)
        c.meta[META_IN_SHAPE] = tuple(in_shape) if in_shape is not None else None
        why, source, op = self.cause(kind, axis) if self.cause is not None else ("", "", "")
        rec = CollectiveRecord(kind, axis, self.mesh.shape[axis], int(nbytes), str(dtype).replace("torch.", ""),
                               tactic, value, c.name, reduce_op, dim, self.phase, self.families.get(tactic, ""),
                               why, source, op)
        c.meta[META_COLLECTIVE] = rec
        self.records.append(rec)
        return self.call(c10d.wait_tensor.default, c, meta_shape=shape, dtype=dtype)


def _move_first(em, x, shape, d, dtype):
    """Permute dim d to the front (contiguous) so that dim-0 collectives act on it."""
    perm = [d] + [i for i in range(len(shape)) if i != d]
    t = em.call(aten.permute.default, x, perm, meta_shape=tuple(shape[i] for i in perm), dtype=dtype)
    return _contiguous(em, t, tuple(shape[i] for i in perm), dtype), perm


def _contiguous(em, x, shape, dtype):
    node = em.graph.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
    node.meta[META_LOCAL_SHAPE] = shape
    return node


def _move_back(em, x, shape_first, perm, dtype):
    inv = [perm.index(i) for i in range(len(perm))]
    out = tuple(shape_first[i] for i in inv)
    t = em.call(aten.permute.default, x, inv, meta_shape=out, dtype=dtype)
    return _contiguous(em, t, out, dtype), out


def _interleave(em, y, shape0, a, b, dtype):
    """Dim 0 of y holds a*b*m blocks ordered (a, b, m): reorder them to (b, a, m). Strided layouts use this."""
    m = shape0[0] // (a * b)
    rest = list(shape0[1:])
    v = em.call(aten.reshape.default, y, [a, b, m] + rest, meta_shape=(a, b, m, *rest), dtype=dtype)
    p = em.call(aten.permute.default, v, [1, 0] + list(range(2, 3 + len(rest))), meta_shape=(b, a, m, *rest),
                dtype=dtype)
    c = _contiguous(em, p, (b, a, m, *rest), dtype)
    return em.call(aten.reshape.default, c, list(shape0), meta_shape=tuple(shape0), dtype=dtype)


def _to_front(em, x, shape, d, dtype):
    if d == 0:
        return x, list(shape), None
    y, perm = _move_first(em, x, shape, d, dtype)
    return y, [shape[i] for i in perm], perm


def _from_front(em, y, first, perm, dtype):
    if perm is None:
        return y, tuple(first)
    return _move_back(em, y, first, perm, dtype)


def all_gather(em, x, shape, d, axis, dtype, value, tactic, stride=1, parent=None):
    """Gather dim d over `axis`. stride s > 1: the axis tiles the minor part of the dim seen as (s, n / s).
    parent: the dim's size before the axis split it, when the axis does not divide it (the padding is dropped)."""
    k = em.mesh.shape[axis]
    elt = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * k * elt
    y, first, perm = _to_front(em, x, shape, d, dtype)
    in_shape = tuple(first)
    first[0] *= k
    g = em.collective(c10d.all_gather_into_tensor.default, (y, k, em.groups[axis]), ALL_GATHER, axis,
                      tuple(first), dtype, nbytes, value, tactic, dim=d, in_shape=in_shape)
    if stride > 1:   # rank-major (k, s, m) -> (s, k, m)
        g = _interleave(em, g, first, k, stride, dtype)
    if parent is not None:
        g, first = narrow_dim(em, g, first, 0, parent, dtype)
        first = list(first)
    return _from_front(em, g, first, perm, dtype)


def all_reduce(em, x, shape, op, axis, dtype, value, tactic):
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    out = em.collective(c10d.all_reduce.default, (x, op, em.groups[axis]), ALL_REDUCE, axis, tuple(shape), dtype,
                        nbytes, value, tactic, reduce_op=op)
    return out, tuple(shape)


def reduce_scatter(em, x, shape, d, op, axis, dtype, value, tactic, stride=1, block=1):
    """Reduce-scatter dim d over `axis`; block: an uneven split goes by whole blocks of that many positions."""
    k = em.mesh.shape[axis]
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    y, first, perm = _to_front(em, x, shape, d, dtype)
    if stride > 1:   # (s, k, m) -> (k, s, m): each rank's strided chunk becomes contiguous
        y = _interleave(em, y, first, stride, k, dtype)
    if (first[0] // block) % k:    # uneven: zeros past the dim's end, so the last ranks' chunks end in padding
        y, first = pad_dim(em, y, first, 0, chunk_of(first[0], k, block) * k, dtype)
        first = list(first)
    in_shape = tuple(first)
    first[0] //= k
    r = em.collective(c10d.reduce_scatter_tensor.default, (y, op, k, em.groups[axis]), REDUCE_SCATTER, axis,
                      tuple(first), dtype, nbytes, value, tactic, reduce_op=op, dim=d, in_shape=in_shape)
    return _from_front(em, r, first, perm, dtype)


def local_slice(em, x, shape, d, axis, dtype, stride=1, block=1):
    """This rank's chunk of dim d: index_select with arange(chunk) + coord * chunk (the coordinate is a graph
    input, so the same program serves every rank). stride s > 1: chunk the minor part of (s, n / s).

    A copy (prog.audit() counts it), not a view: narrow at a tensor start reads the coordinate as a Python int
    (aten.narrow.Tensor calls item()), which fake propagation on meta tensors and Inductor's trace refuse
    (DataDependentOutputException), and a coordinate baked in per rank would make each rank's program differ."""
    k = em.mesh.shape[axis]
    inner = shape[d] // stride
    if stride == 1 and (inner // block) % k:    # uneven: pad the dim to k chunks (torch.chunk sizes, in blocks)
        x, shape = pad_dim(em, x, shape, d, chunk_of(inner, k, block) * k, dtype)
        inner = shape[d]
    chunk = inner // k
    idx = em.call(aten.arange.default, chunk, meta_shape=(chunk,), dtype=torch.int64)
    off = em.call(aten.mul.Scalar, em.coords[axis], chunk, meta_shape=(), dtype=torch.int64)
    idx = em.call(aten.add.Tensor, idx, off, meta_shape=(chunk,), dtype=torch.int64)
    out_shape = list(shape)
    out_shape[d] //= k
    if stride == 1:
        return em.call(aten.index_select.default, x, d, idx, meta_shape=tuple(out_shape), dtype=dtype), \
            tuple(out_shape)
    split = list(shape[:d]) + [stride, inner] + list(shape[d + 1:])
    v = em.call(aten.reshape.default, x, split, meta_shape=tuple(split), dtype=dtype)
    split[d + 1] = chunk
    t = em.call(aten.index_select.default, v, d + 1, idx, meta_shape=tuple(split), dtype=dtype)
    return em.call(aten.reshape.default, t, out_shape, meta_shape=tuple(out_shape), dtype=dtype), tuple(out_shape)


def all_to_all(em, x, shape, d1, d2, axis, dtype, value, tactic, s1=1, s2=1):
    """Move `axis` from tiling dim d1 to tiling dim d2 with one all_to_all (d1 becomes whole, d2 tiled).
    s1 / s2 > 1: the axis tiles the minor part of d1 / d2 seen as (s, n / s) (a strided tiling)."""
    k = em.mesh.shape[axis]
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    y, first, perm = _to_front(em, x, shape, d2, dtype)          # (n2, *rest), d1 somewhere in rest
    pos = perm.index(d1) if perm is not None else d1             # position of d1 in the moved frame
    if s2 > 1:   # (s2, k, m) -> (k, s2, m): the chunk for rank r becomes contiguous
        y = _interleave(em, y, first, s2, k, dtype)
    n = first[0] // k
    sizes = [n] * k
    z = em.collective(c10d.all_to_all_single.default, (y, sizes, sizes, em.groups[axis]), ALL_TO_ALL, axis,
                      tuple(first), dtype, nbytes, value, tactic, dim=d2)
    # z = (k, n, *rest): block r came from rank r and holds its chunk of d1, which is (s1, m1) of the whole d1
    # seen as (s1, k, m1): put k between s1 and m1
    rest = first[1:]
    m1 = rest[pos - 1] // s1
    split = [k, n] + rest[:pos - 1] + [s1, m1] + rest[pos:]
    v = em.call(aten.reshape.default, z, split, meta_shape=tuple(split), dtype=dtype)
    order = [1] + list(range(2, pos + 2)) + [0] + list(range(pos + 2, len(split)))
    moved = tuple(split[i] for i in order)
    p = em.call(aten.permute.default, v, order, meta_shape=moved, dtype=dtype)
    c = _contiguous(em, p, moved, dtype)
    out_first = [n] + rest
    out_first[pos] = rest[pos - 1] * k
    r = em.call(aten.reshape.default, c, out_first, meta_shape=tuple(out_first), dtype=dtype)
    return _from_front(em, r, out_first, perm, dtype)


def _stride_before(sh_dims, strides: dict, axis, mesh) -> int:
    """Local split factor of `axis` given the axes that tile its dim before it."""
    s = strides.get(axis, 1)
    if s == 1:
        return 1
    for a in sh_dims:
        if a == axis:
            break
        s //= mesh.shape[a]
    return max(s, 1)


def reshard(em, x, shape, dtype, src: Sharding, dst: Sharding, value: str, tactic_of, gshape=None) -> fx.Node:
    """Emit the collectives turning layout src into dst. shape: x's local shape under src; gshape: the value's
    global shape (None: every tiling divides its dim). tactic_of(axis) names the tactic to blame for a collective
    on that axis."""
    shape = tuple(shape)
    gshape = tuple(gshape) if gshape is not None else None

    def parent(d, axes):     # dim d's size on a rank once `axes` (all but the innermost, exact) split it
        return None if gshape is None else chunk_size(gshape[d], [em.mesh.shape[a] for a in axes])
    cur_dims = [list(a) for a in src.dims]
    src_sf, dst_sf = dict(src.strides), dict(dst.strides)
    pending = dict(src.partial)
    # 0. an axis that moves from one dim to another (innermost in both): one all_to_all
    for d1 in range(len(cur_dims)):
        if not cur_dims[d1]:
            continue
        axis = cur_dims[d1][-1]
        d2 = dst.tiled_axes().get(axis)
        if (d2 is None or d2 == d1 or axis in pending
                or dst.dims[d2][:len(cur_dims[d2])] != tuple(cur_dims[d2])
                or dst.dims[d2][len(cur_dims[d2])] != axis):
            continue
        if list(dst.dims[d1][:len(cur_dims[d1]) - 1]) != cur_dims[d1][:-1]:
            continue
        s1 = _stride_before(cur_dims[d1], src_sf, axis, em.mesh)
        s2 = _stride_before(dst.dims[d2], dst_sf, axis, em.mesh)
        if shape[d1] % s1 or shape[d2] % (s2 * em.mesh.shape[axis]) or src.block(axis) > 1 or \
                dst.block(axis) > 1 or (gshape is not None and parent(d1, cur_dims[d1][:-1]) % em.mesh.shape[axis]):
            continue     # uneven on either dim: gathered and sliced below
        x, shape = all_to_all(em, x, shape, d1, d2, axis, dtype, value, tactic_of(axis), s1, s2)
        src_sf[axis] = dst_sf.get(axis, 1)
        cur_dims[d1].pop()
        cur_dims[d2].append(axis)
    # 1. un-tile: drop axes not in dst's prefix (same axis, same split factor), innermost first
    for d in range(len(cur_dims)):
        keep = 0
        while (keep < len(cur_dims[d]) and keep < len(dst.dims[d]) and cur_dims[d][keep] == dst.dims[d][keep]
               and src_sf.get(cur_dims[d][keep], 1) == dst_sf.get(cur_dims[d][keep], 1)):
            keep += 1
        for axis in reversed(cur_dims[d][keep:]):
            stride = _stride_before(cur_dims[d], src_sf, axis, em.mesh)
            p = parent(d, cur_dims[d][:-1])
            uneven = p is not None and (p // src.block(axis)) % em.mesh.shape[axis]
            x, shape = all_gather(em, x, shape, d, axis, dtype, value, tactic_of(axis), stride,
                                  p if uneven else None)
            cur_dims[d].remove(axis)
    # 2. pending reductions: reduce_scatter straight into the target tiling where it is the next split of its dim,
    # first; then all_reduce the others on the smaller shard (HSDP: the gradient is reduce-scattered on the shard
    # axis and only its shard is all-reduced across replicas)
    dst_tiled = dst.tiled_axes()
    progress = True
    while progress:
        progress = False
        for axis, op in list(pending.items()):
            d = dst_tiled.get(axis)
            if (dst.partial_op(axis) != op and d is not None and len(dst.dims[d]) > len(cur_dims[d])
                    and dst.dims[d][len(cur_dims[d])] == axis
                    and (shape[d] % em.mesh.shape[axis] == 0 or not dst_sf.get(axis))):
                stride = _stride_before(dst.dims[d], dst_sf, axis, em.mesh)
                x, shape = reduce_scatter(em, x, shape, d, op, axis, dtype, value, tactic_of(axis), stride,
                                          dst.block(axis))
                cur_dims[d].append(axis)
                del pending[axis]
                progress = True
    # latest tactic's axis first, data parallelism's last: its all_reduce ends the chain and can join a bucket
    for axis, op in reversed(list(pending.items())):
        if dst.partial_op(axis) == op:
            continue
        x, shape = all_reduce(em, x, shape, op, axis, dtype, value, tactic_of(axis))
        del pending[axis]
    for axis, op in dst.partial:
        if pending.get(axis) != op:
            raise AssertionError(f"internal: cannot make {value} partial({op}) on '{axis}' from a whole value")
    # 3. tile: slice locally, outermost first
    for d in range(len(cur_dims)):
        for axis in dst.dims[d][len(cur_dims[d]):]:
            stride = _stride_before(dst.dims[d], dst_sf, axis, em.mesh)
            x, shape = local_slice(em, x, shape, d, axis, dtype, stride, dst.block(axis))
            cur_dims[d].append(axis)
    return x
