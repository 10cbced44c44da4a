"""The propagator's record: what propagation has decided so far, as working tables, and the ways to copy it.

Propagator (engine.py) is the loop that writes these tables; this module owns their layout: the queries on them,
the one place a decision is written (`set_state`) and undone (`undo_op`), the stage snapshot and the copy-on-write
trial copy the automatic tactic and expert parallelism try decisions on. Everything downstream reads an immutable
Decisions (decisions.py) built from a snapshot, never these tables.
"""
from __future__ import annotations

import numpy as np

from ..mesh import Mesh
from ..sharding import chunk_size
from .graph import PartGraph
from .state import UNKNOWN, AxisState


class DecisionRecord:
    """Per-axis states for one PartGraph, and the per-op / per-dim tables lowering needs."""

    def __init__(self, graph: PartGraph, mesh: Mesh):
        self.g = graph
        self.mesh = mesh
        self.axes: dict = {}                     # axis -> AxisState
        self.axis_order: list = []               # axes in the order tactics first used them
        self._conflicts: dict = {}                # (op index, axis) -> Conflict (the latest)
        # per op: factor id -> axes tiling it (in order); per canonical value: dim -> axes tiling it (in order)
        self.op_axes: dict = {}
        self.dim_axes: dict = {}
        # (canonical vid, axis) -> split factor s > 1 when the axis tiles a minor factor of its dim: the dim is seen
        # as (s, n / s) and the axis tiles the second part (DTensor's _StridedShard). E.g. (B*T, C) after a
        # reshape, with T tiled on "seq".
        self.strides: dict = {}
        # (op index, axis) -> inner split factor when the op tiles a factor strided (the factor seen as
        # (inner, size / inner), the axis on the second part): a (B*H) batch dim of bmm tiled on H
        self.op_inner: dict = {}
        # uneven tilings (an axis that does not divide what it splits; sharding.chunk_size): (op index, axis) ->
        # the block, in positions of the tiled factor, that op i splits its factor by (1: single positions), and
        # (canonical vid, axis) -> the block in positions of the value's dim, where it is over 1 (a ragged batch
        # in a (B*T) dim splits by blocks of T)
        self.op_uneven: dict = {}
        self.blocks: dict = {}
        # (canonical vid, axis) pairs fixed by a closed run (expert parallelism's token buffers): an op outside
        # that run computes in whatever layout its other neighbours imply and lowering reshards the value at the
        # boundary (tiled(groups) <-> tiled(experts) on one axis is an all_to_all)
        self.sealed: set = set()

    # -- copies --------------------------------------------------------------------------------------------------
    def snapshot(self):
        """A copy of every decision so far (the state after one tactic stage), sharing the graph."""
        p = type(self).__new__(type(self))
        p.g, p.mesh = self.g, self.mesh
        p.axes = {a: _copy_axis(st) for a, st in self.axes.items()}
        p.axis_order = list(self.axis_order)
        p._conflicts = dict(self._conflicts)
        p.op_axes = {i: {f: list(axes) for f, axes in d.items()} for i, d in self.op_axes.items()}
        p.dim_axes = {k: list(v) for k, v in self.dim_axes.items()}
        p.strides = dict(self.strides)
        p.op_inner = dict(self.op_inner)
        p.op_uneven, p.blocks = dict(self.op_uneven), dict(self.blocks)
        p.sealed = set(self.sealed)
        return p

    def trial(self, axes):
        """A copy that starts from these decisions and may run on `axes` without changing them (only those axes'
        states are copied; the per-op / per-dim axis lists are copied on write): a trial propagation costs what
        it reaches, not the size of the graph."""
        p = type(self).__new__(type(self))
        p.__dict__.update(self.__dict__)
        p.axes = dict(self.axes)
        for a in axes:
            st = self.axes.get(a)
            if st is not None:
                p.axes[a] = _copy_axis(st)
        p.axis_order = list(self.axis_order)
        p._conflicts = dict(self._conflicts)
        p.op_axes = _COW(self.op_axes, lambda d: {f: list(x) for f, x in d.items()})
        p.dim_axes = _COW(self.dim_axes, list)
        p.strides = dict(self.strides)
        p.op_inner = dict(self.op_inner)
        p.op_uneven, p.blocks = dict(self.op_uneven), dict(self.blocks)
        p.sealed = set(self.sealed)
        return p

    # -- queries -------------------------------------------------------------------------------------------------
    @property
    def conflicts(self) -> list:
        """Conflicts still standing (an op decided later on that axis is no longer in conflict)."""
        return [c for (i, a), c in self._conflicts.items() if i not in self.axes[a].assign]

    def axis_state(self, axis: str) -> AxisState:
        if axis not in self.axes:
            self.axes[axis] = AxisState(axis, [UNKNOWN] * len(self.g.values))
            self.axis_order.append(axis)
        return self.axes[axis]

    def state(self, axis: str, vid: int) -> int:
        st = self.axes.get(axis)
        return UNKNOWN if st is None else st.value[self.g.canon[vid]]

    def local_dim(self, vid: int, dim: int) -> int:
        c, n = self.g.canon[vid], self.g.shapes[vid][dim]
        for a in self.dim_axes.get((c, dim), ()):
            m = self.blocks.get((c, a), 1)
            n = chunk_size(n // m, [self.mesh.shape[a]]) * m
        return n

    def conflicts_recorded(self) -> int:
        """Conflicts recorded so far, standing or not (a trial counts the ones it adds)."""
        return len(self._conflicts)

    def value_states(self, axis: str) -> np.ndarray:
        """The state of every canonical value on `axis`, as an int64 array (all UNKNOWN if the axis is unused)."""
        st = self.axes.get(axis)
        if st is None:
            return np.full(len(self.g.values), UNKNOWN, dtype=np.int64)
        return np.asarray(st.value, dtype=np.int64)

    def axis_arrays(self, axis: str) -> tuple:
        """(value states per canonical vid, op assignments) of `axis` as int64 arrays (all unknown if unused)."""
        st = self.axes.get(axis)
        vals, no = self.value_states(axis), len(self.g.ops)
        if st is None:
            return vals, np.full(no, UNKNOWN, dtype=np.int64)
        assign = np.full(no, UNKNOWN, dtype=np.int64)
        if st.assign:
            keys = np.fromiter(st.assign.keys(), dtype=np.int64, count=len(st.assign))
            assign[keys] = np.fromiter(st.assign.values(), dtype=np.int64, count=len(st.assign))
        return vals, assign

    # -- writing and undoing one decision ------------------------------------------------------------------------
    def set_state(self, st: AxisState, c: int, state: int, prov) -> None:
        st.value[c] = state
        st.prov[c] = prov
        if state >= 0:
            # a dim's axes are kept major to minor: a later axis goes before an earlier one only where it tiles a
            # more major part in whole blocks of that one's part; otherwise it splits the shard left by the
            # earlier axes, i.e. it is the most minor (place_axis; lowering orders an op's layouts alike)
            axes = self.dim_axes.setdefault((c, state), [])
            if axes:
                place_axis(axes, st.axis, lambda a: self.strides.get((c, a), 1), self.mesh)
            else:
                axes.append(st.axis)

    def undo_op(self, st: AxisState, i: int, c: int) -> None:
        """Undo op i's decision on st.axis and the state it gave its result's canonical value c."""
        f = st.assign.pop(i)
        st.assign_tactic.pop(i)
        axes = self.op_axes[i][f]
        axes.remove(st.axis)
        if not axes:
            del self.op_axes[i][f]
        self.op_inner.pop((i, st.axis), None)
        self.op_uneven.pop((i, st.axis), None)
        d = st.value[c]
        if d >= 0:
            self.dim_axes[(c, d)].remove(st.axis)
        st.value[c] = UNKNOWN
        st.prov.pop(c, None)
        self.strides.pop((c, st.axis), None)
        self.blocks.pop((c, st.axis), None)


def place_axis(axes: list, axis: str, stride_of, mesh) -> None:
    """Insert `axis` into `axes` (one dim's axes, major to minor): before the first earlier axis whose part it tiles
    in whole blocks from a more major part (the batch of a (B*H) dim whose heads were tiled first); otherwise
    last, splitting what the earlier axes left. stride_of(axis): the split factor of the part it tiles."""
    mine, k = stride_of(axis), mesh.shape[axis]
    at = next((j for j, a in enumerate(axes) if stride_of(a) > mine and stride_of(a) % (mine * k) == 0), len(axes))
    axes.insert(at, axis)


def _copy_axis(st: AxisState) -> AxisState:
    return AxisState(st.axis, list(st.value), dict(st.prov), dict(st.assign), dict(st.assign_tactic))


class _COW(dict):
    """A dict whose values (lists, dicts of lists) are copied the first time they are written through it, so a trial
    copy shares the real record's per-op and per-dim axis lists until it changes one."""

    def __init__(self, base, copy):
        super().__init__(base)
        self._copy, self._own = copy, set()

    def _mine(self, key):
        if key not in self._own:
            if dict.__contains__(self, key):
                dict.__setitem__(self, key, self._copy(dict.__getitem__(self, key)))
            self._own.add(key)

    def setdefault(self, key, default=None):
        self._mine(key)
        return dict.setdefault(self, key, default)

    def __getitem__(self, key):
        self._mine(key)
        return dict.__getitem__(self, key)
