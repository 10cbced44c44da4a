"""Named device meshes.  Row-major: the last axis varies fastest (is innermost)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import MeshError, closest


@dataclass(frozen=True)
class Mesh:
    """A logical mesh of devices with named axes.

    >>> m = Mesh({"batch": 2, "model": 4})
    >>> m.size, m.axis_size("model"), m.coordinate(5)
    (8, 4, {'batch': 1, 'model': 1})
    """

    shape: dict
    _axes: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.shape, dict) or not self.shape:
            raise MeshError(f"Mesh needs a non-empty dict of axis name -> size, got {self.shape!r}. "
                            f"Example: Mesh({{'batch': 2, 'model': 2}}).")
        for name, size in self.shape.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise MeshError(f"Mesh axis name {name!r} must be an identifier string, e.g. 'batch'.")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise MeshError(f"Mesh axis {name!r} has size {size!r}; sizes must be positive ints.")
        object.__setattr__(self, "shape", dict(self.shape))
        object.__setattr__(self, "_axes", tuple(self.shape))

    def __eq__(self, other):
        # axis order is part of the mesh (it fixes the row-major rank layout): compare items in order
        return isinstance(other, Mesh) and tuple(self.shape.items()) == tuple(other.shape.items())

    def __hash__(self):
        return hash(tuple(self.shape.items()))

    def __repr__(self):
        return f"Mesh({self.shape!r})"

    def __str__(self):
        return "Mesh(" + " x ".join(f"{a}={s}" for a, s in self.shape.items()) + ")"

    @property
    def axes(self) -> tuple:
        return self._axes

    @property
    def size(self) -> int:
        return math.prod(self.shape.values())

    def describe(self) -> str:
        return ", ".join(f"'{a}' (size {s})" for a, s in self.shape.items())

    def check_axis(self, axis: str, what: str = "tactic") -> str:
        if axis not in self.shape:
            hint = closest(str(axis), self.shape)
            raise MeshError(f"{what}: unknown mesh axis {axis!r}; this mesh has axes {self.describe()}."
                            + (f" Did you mean {hint[0]!r}?" if hint else "")
                            + " Use one of the mesh's axis names.")
        return axis

    def axis_size(self, axis: str) -> int:
        return self.shape[self.check_axis(axis)]

    def coordinate(self, rank: int) -> dict:
        """Coordinates of a flat (row-major) rank."""
        coord = {}
        for a in reversed(self._axes):
            coord[a] = rank % self.shape[a]
            rank //= self.shape[a]
        return {a: coord[a] for a in self._axes}

    def rank_of(self, coord: dict) -> int:
        r = 0
        for a in self._axes:
            r = r * self.shape[a] + coord[a]
        return r

    def axis_groups(self, axis: str) -> list[list[int]]:
        """The flat ranks of every group that communicates along `axis`."""
        others = [a for a in self._axes if a != axis]
        groups: dict = {}
        for r in range(self.size):
            c = self.coordinate(r)
            groups.setdefault(tuple(c[a] for a in others), []).append(r)
        return list(groups.values())
