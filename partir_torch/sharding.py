"""How one value is laid out on the mesh: per dim, the axes that tile it (major to minor); pending reductions."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import PartitionError
from .mesh import Mesh

REDUCE_OPS = ("sum", "max", "min")


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

    def __post_init__(self):
        object.__setattr__(self, "dims", tuple(tuple(a) for a in self.dims))
        object.__setattr__(self, "partial", tuple(tuple(p) for p in self.partial))
        object.__setattr__(self, "replicated", frozenset(self.replicated))
        object.__setattr__(self, "strides", tuple(sorted((a, int(s)) for a, s in dict(self.strides).items()
                                                         if int(s) > 1)))
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
    def interned(dims, partial=(), replicated=(), strides=()) -> "Sharding":
        """Sharding(dims, partial, replicated, strides), one object per distinct value: propagation and lowering
        build the same few layouts for thousands of values, and construction validates (a large program's
        lowering spent a tenth of its time here)."""
        key = (tuple(map(tuple, dims)), tuple(map(tuple, partial)), tuple(replicated), tuple(strides))
        hit = _INTERNED.get(key)
        if hit is None:
            if len(_INTERNED) > 65536:
                _INTERNED.clear()
            hit = _INTERNED[key] = Sharding(dims, partial, replicated, strides)
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
        out = []
        for d, size in enumerate(shape):
            k = 1
            for a in self.dims[d]:
                k *= mesh.shape[a]
            out.append(size // k)
        return tuple(out)

    def is_replicated(self) -> bool:
        return not self.partial and all(not axes for axes in self.dims)

    def __str__(self):
        sf = dict(self.strides)
        body = "[" + ", ".join("{" + ", ".join(f"{a}:s{sf[a]}" if a in sf else a for a in axes) + "}"
                               for axes in self.dims) + "]"
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
