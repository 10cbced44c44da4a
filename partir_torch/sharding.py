"""How one value is laid out on the mesh: per dim, the axes that tile it (major to minor); pending reductions."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import PartitionError
from .mesh import Mesh

REDUCE_OPS = ("sum", "max", "min")


def chunk_size(n: int, ks) -> int:
    """Positions of a dim of size n each rank holds when axes of sizes ks (major to minor) tile it, as DTensor's
    Shard does (torch.chunk: the first chunks have ceil(n / k) positions, the last fewer, possibly none). Lowering
    keeps every rank's shard at this size (the largest), the last ranks' ending in padding that no value sees:
    collectives pad and unpad, reductions mask (lower/uneven.py).

    >>> chunk_size(1001, [2]), chunk_size(8, [2, 2]), chunk_size(5, [4])
    (501, 2, 2)
    """
    for k in ks:
        n = -(-n // k)
    return n


def chunk_extent(n: int, k: int, coord: int) -> int:
    """How many of its chunk_size(n, [k]) positions the rank at `coord` holds (the rest is padding)."""
    c = -(-n // k)
    return max(0, min(c, n - coord * c))


class _Replicated:
    """Seed value meaning 'explicitly replicated on this axis' (never tiled later)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self):
        return "REPLICATED"


REPLICATED = _Replicated()


@dataclass(frozen=True)
class Sharding:
    """Sharding of a value over a mesh.

    dims[d] is the tuple of axes tiling dim d, major to minor (the order in which tactics tiled it, except that
    an axis tiling a more major factor of a folded dim in whole blocks of an earlier axis's factor goes before it);
    partial is a tuple of (axis, reduce op) on which the value is a pending reduction; replicated are the axes
    explicitly seeded replicated. Every other axis is (implicitly) replicated.

    >>> s = Sharding(dims=(("batch",), (), ("model",)))
    >>> str(s)
    '[{batch}, {}, {model}]'
    >>> s.placements(Mesh({"batch": 2, "model": 2}))
    (Shard(dim=0), Shard(dim=2))
    """

    dims: tuple = ()
    partial: tuple = ()
    replicated: frozenset = frozenset()
    strides: tuple = ()     # (axis, split factor s > 1): the axis tiles a minor part of its dim, seen as (s, n/s)
    # (axis, m > 1): the axis tiles its dim unevenly in whole blocks of m positions (the dim is (u, m) with u the
    # major factor it splits: a ragged batch flattened with the sequence, (B*T); see chunk_size)
    blocks: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "dims", tuple(tuple(a) for a in self.dims))
        object.__setattr__(self, "partial", tuple(tuple(p) for p in self.partial))
        object.__setattr__(self, "replicated", frozenset(self.replicated))
        object.__setattr__(self, "strides", tuple(sorted((a, int(s)) for a, s in dict(self.strides).items()
                                                         if int(s) > 1)))
        object.__setattr__(self, "blocks", tuple(sorted((a, int(m)) for a, m in dict(self.blocks).items()
                                                        if int(m) > 1)))
        seen = {}
        for d, axes in enumerate(self.dims):
            for a in axes:
                if a in seen:
                    where = f"appears twice in dim {d}" if seen[a] == d else f"tiles both dim {seen[a]} and dim {d}"
                    raise PartitionError(f"Sharding: mesh axis {a!r} {where}; an axis can tile at most one dim of a "
                                         f"value, once. Remove one of the two tilings.")
                seen[a] = d
        for a, op in self.partial:
            if op not in REDUCE_OPS:
                raise PartitionError(f"Sharding: partial reduce op {op!r} on axis {a!r} must be one of {REDUCE_OPS}.")
            if a in seen:
                raise PartitionError(f"Sharding: axis {a!r} both tiles dim {seen[a]} and is partial; pick one.")
        for a in self.replicated:
            if a in seen or any(a == p for p, _ in self.partial):
                raise PartitionError(f"Sharding: axis {a!r} is explicitly replicated, so it cannot also "
                                     f"{'tile dim %d' % seen[a] if a in seen else 'be partial'}; pick one.")

    @staticmethod
    def interned(dims, partial=(), replicated=(), strides=(), blocks=()) -> "Sharding":
        """Sharding(dims, partial, replicated, strides, blocks), one object per distinct value: propagation and
        lowering build the same few layouts for thousands of values, and construction validates (a large program's
        lowering spent a tenth of its time here)."""
        key = (tuple(map(tuple, dims)), tuple(map(tuple, partial)), tuple(replicated), tuple(strides), tuple(blocks))
        hit = _INTERNED.get(key)
        if hit is None:
            if len(_INTERNED) > 65536:
                _INTERNED.clear()
            hit = _INTERNED[key] = Sharding(dims, partial, replicated, strides, blocks)
        return hit

    @staticmethod
    def replicate(ndim: int) -> "Sharding":
        return Sharding(dims=((),) * ndim)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def tiled_axes(self) -> dict:
        """axis -> dim it tiles."""
        return {a: d for d, axes in enumerate(self.dims) for a in axes}

    def stride(self, axis: str) -> int:
        """The split factor of a tiling (1: contiguous chunks)."""
        for a, s in self.strides:
            if a == axis:
                return s
        return 1

    def local_stride(self, axis: str, mesh: Mesh) -> int:
        """The split factor as seen by this axis: s divided by the axes tiling its dim before it."""
        s = self.stride(axis)
        if s == 1:
            return 1
        d = self.tiled_axes()[axis]
        for a in self.dims[d]:
            if a == axis:
                break
            s //= mesh.shape[a]
        return s

    def partial_op(self, axis: str):
        for a, op in self.partial:
            if a == axis:
                return op
        return None

    def local_shape(self, shape, mesh: Mesh) -> tuple:
        """Each rank's local shape: a dim of size n tiled on axes of sizes k1, k2, ... holds chunk_size(n, ks)
        positions on every rank (uneven: the largest chunk; the last ranks' chunks end in padding)."""
        out = []
        for d, n in enumerate(shape):
            for a in self.dims[d]:
                m = self.block(a)
                n = chunk_size(n // m, [mesh.shape[a]]) * m
            out.append(n)
        return tuple(out)

    def block(self, axis: str) -> int:
        """The positions an unevenly tiling axis splits its dim by (1: single positions)."""
        for a, m in self.blocks:
            if a == axis:
                return m
        return 1

    def uneven_dims(self, shape, mesh: Mesh) -> dict:
        """dim -> (parent size P, its innermost axis, block m) for every dim its innermost axis tiles unevenly:
        the axes before it split the dim exactly into P positions per rank, and that axis does not divide the P / m
        blocks of m positions it splits (each rank holds chunk_size(P / m, k) blocks, padding at the end)."""
        out = {}
        for d, axes in enumerate(self.dims):
            if axes:
                parent = chunk_size(shape[d], [mesh.shape[a] for a in axes[:-1]])
                m = self.block(axes[-1])
                if (parent // m) % mesh.shape[axes[-1]]:
                    out[d] = (parent, axes[-1], m)
        return out

    def is_replicated(self) -> bool:
        return not self.partial and all(not axes for axes in self.dims)

    def __str__(self):
        sf, bf = dict(self.strides), dict(self.blocks)
        body = "[" + ", ".join("{" + ", ".join(f"{a}:s{sf[a]}" if a in sf else f"{a}:b{bf[a]}" if a in bf else a
                                               for a in axes) + "}" for axes in self.dims) + "]"
        by_op: dict = {}
        for a, op in self.partial:
            by_op.setdefault(op, []).append(a)
        for op, axes in by_op.items():
            body += f" partial({op})={{{', '.join(axes)}}}"
        if self.replicated:
            body += " replicated={" + ", ".join(sorted(self.replicated)) + "}"
        return body

    def __repr__(self):
        args = [f"dims={self.dims!r}"]
        if self.partial:
            args.append(f"partial={self.partial!r}")
        if self.replicated:
            args.append(f"replicated=frozenset({sorted(self.replicated)!r})")
        if self.strides:
            args.append(f"strides={self.strides!r}")
        if self.blocks:
            args.append(f"blocks={self.blocks!r}")
        return f"Sharding({', '.join(args)})"

    def placements(self, mesh: Mesh) -> tuple:
        """One DTensor placement per mesh axis (Shard(d), Partial(op) or Replicate())."""
        from torch.distributed.tensor import Partial, Replicate, Shard

        tiled = self.tiled_axes()
        for a in list(tiled) + [a for a, _ in self.partial] + sorted(self.replicated):
            mesh.check_axis(a, f"Sharding {self}")
        order = {a: i for i, a in enumerate(mesh.axes)}
        out = []
        for a in mesh.axes:
            if a in tiled:
                # DTensor splits a dim by its mesh axes in mesh order; an axis that this sharding applies after a
                # later mesh axis (or to a minor factor) is a strided shard whose split factor counts those chunks
                d = tiled[a]
                sf = self.local_stride(a, mesh)
                for b in self.dims[d][:self.dims[d].index(a)]:
                    if order[b] > order[a]:
                        sf *= mesh.shape[b]
                if sf > 1:
                    from torch.distributed.tensor.placement_types import _StridedShard

                    out.append(_StridedShard(d, split_factor=sf))
                else:
                    out.append(Shard(d))
            elif self.partial_op(a):
                out.append(Partial(self.partial_op(a)))
            else:
                out.append(Replicate())
        return tuple(out)


_INTERNED: dict = {}
