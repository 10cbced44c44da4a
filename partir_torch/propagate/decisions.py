"""Decisions: what a schedule (or one stage of it) decided, as an immutable, typed snapshot.

This is the contract between propagation and everything downstream (lowering, the simulator's estimates,
explain(), the torch-xla backend, checkpoint resharding): they read decisions through these queries, never the
propagator's working tables.

Per value and mesh axis, one AxisDecision:

| kind       | meaning                                                   | fields             |
|------------|-----------------------------------------------------------|--------------------|
| UNKNOWN    | nothing decided (lowered as replicated)                   |                    |
| REPLICATED | explicitly whole (a REPLICATED seed); never tiled later   |                    |
| TILED      | the axis tiles dim `dim` (minor part of (stride, n/stride)) | dim, stride      |
| PARTIAL    | a pending reduction over the axis                         | op: sum / max / min |

Per op: which axes tile each of its rule's factors (`op_factor_axes`), the inner split of a strided factor
(`op_inner`), and the reduction an op passes a partial value through (`op_partial`).

    d = prog.decisions                       # after the last tactic; prog.stages[k].decisions after tactic k
    d.state("model", vid)                    # AxisDecision(kind=TILED, dim=0, stride=1, tactic='MP')
    d.sharding(vid)                          # the public Sharding
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..sharding import Sharding, chunk_extent
from .state import PARTIAL_OP, UNKNOWN, WHOLE, Provenance, state_str


def value_sharding(rec, vid: int) -> Sharding:
    """The Sharding of a value from a DecisionRecord's tables (Decisions.sharding)."""
    g = rec.g
    c = g.canon[vid]
    dims = [list(rec.dim_axes.get((c, d), ())) for d in range(len(g.shapes[vid]))]
    partial, rep, strides, blocks = [], [], [], []
    for axis, st in rec.axes.items():
        s = st.value[c]
        if s in PARTIAL_OP:
            partial.append((axis, PARTIAL_OP[s]))
        elif s == WHOLE:
            rep.append(axis)
        elif s >= 0 and (c, axis) in rec.strides:
            strides.append((axis, rec.strides[(c, axis)]))
        if s >= 0 and (c, axis) in rec.blocks:
            blocks.append((axis, rec.blocks[(c, axis)]))
    return Sharding.interned(dims, partial, rep, strides, tuple(sorted(blocks)))


class Kind(Enum):
    UNKNOWN = "unknown"
    REPLICATED = "replicated"
    TILED = "tiled"
    PARTIAL = "partial"


@dataclass(frozen=True)
class AxisDecision:
    """One value's state on one mesh axis."""

    kind: Kind
    dim: int | None = None       # TILED: the tensor dim
    stride: int = 1              # TILED: the axis tiles the minor part of the dim seen as (stride, n / stride)
    op: str | None = None        # PARTIAL: "sum" | "max" | "min"
    tactic: str = "-"            # the tactic that decided it ("-" for UNKNOWN)

    @property
    def is_tiled(self) -> bool:
        return self.kind is Kind.TILED

    @property
    def is_partial(self) -> bool:
        return self.kind is Kind.PARTIAL

    def __str__(self):
        if self.kind is Kind.TILED:
            return f"tiled(dim {self.dim}" + (f", stride {self.stride})" if self.stride > 1 else ")")
        return f"partial({self.op})" if self.kind is Kind.PARTIAL else self.kind.value


class Decisions:
    """An immutable snapshot of a DecisionRecord (record.py): Decisions(prop.rec)."""

    def __init__(self, record):
        # a private copy: later tactics keep propagating on the original
        self._p = record.snapshot()
        self.graph, self.mesh = record.g, record.mesh

    # -- values ------------------------------------------------------------------------------------------------
    @property
    def axes(self) -> tuple:
        """Mesh axes in the order tactics first decided on them."""
        return tuple(self._p.axis_order)

    def state(self, axis: str, vid: int) -> AxisDecision:
        p = self._p
        c = self.graph.canon[vid]
        st = p.axes.get(axis)
        s = UNKNOWN if st is None else st.value[c]
        prov = st.prov.get(c) if st is not None else None
        tactic = prov.tactic if prov is not None else "-"
        if s >= 0:
            return AxisDecision(Kind.TILED, dim=s, stride=p.strides.get((c, axis), 1), tactic=tactic)
        if s == WHOLE:
            return AxisDecision(Kind.REPLICATED, tactic=tactic)
        if s in PARTIAL_OP:
            return AxisDecision(Kind.PARTIAL, op=PARTIAL_OP[s], tactic=tactic)
        return AxisDecision(Kind.UNKNOWN)

    def state_text(self, axis: str, vid: int) -> str:
        """The state as explain() prints it: "tiled(dim 0)", "partial(sum)", "replicated", "unknown"; an uneven
        tiling with its torch.chunk sizes: "tiled(dim 0), uneven: 501 | 500 rows"."""
        st = self._p.axes.get(axis)
        s = UNKNOWN if st is None else st.value[self.graph.canon[vid]]
        text = state_str(s)
        uneven = self.sharding(vid).uneven_dims(self.graph.shapes[vid], self.mesh) if s >= 0 else {}
        if s in uneven and uneven[s][1] == axis:
            parent, _, m = uneven[s]
            k = self.mesh.shape[axis]
            sizes = [chunk_extent(parent // m, k, r) * m for r in range(k)]
            shown = " | ".join(map(str, sizes[:8])) + (" | ..." if k > 8 else "")
            text += f", uneven: {shown} positions" + (f" (whole blocks of {m})" if m > 1 else "")
        return text

    def provenance(self, axis: str, vid: int) -> Provenance | None:
        """Why the value has its state on `axis`: the tactic, and the op and neighbour the decision came through
        (op None: seeded); None when nothing decided it."""
        st = self._p.axes.get(axis)
        return None if st is None else st.prov.get(self.graph.canon[vid])

    def is_sealed(self, vid: int, axis: str) -> bool:
        """Fixed by a closed run (expert parallelism's token buffers; see propagate/engine.py)."""
        return (self.graph.canon[vid], axis) in self._p.sealed

    def tactic_of(self, vid: int, axis: str) -> str:
        """The tactic whose decision on `axis` this value carries ("-" when none)."""
        return self.state(axis, vid).tactic

    def dim_axes(self, vid: int, dim: int) -> tuple:
        """Axes tiling one dim of a value, major to minor."""
        return tuple(self._p.dim_axes.get((self.graph.canon[vid], dim), ()))

    def local_dim(self, vid: int, dim: int) -> int:
        return self._p.local_dim(vid, dim)

    def sharding(self, vid: int) -> Sharding:
        """The public Sharding of a value: tiled dims (axes major to minor), partial axes, explicitly replicated
        axes and strided splits."""
        return value_sharding(self._p, vid)

    def axis_arrays(self, axis: str) -> tuple:
        """(per canonical value, per op) decisions on `axis` in propagate/arrays.py's array form."""
        return self._p.axis_arrays(axis)

    # -- ops ---------------------------------------------------------------------------------------------------
    def op_factor_axes(self, i: int) -> dict:
        """Rule factor id -> the axes tiling it (in order) for op i."""
        return {f: tuple(axes) for f, axes in self._p.op_axes.get(i, {}).items()}

    def op_inner(self, i: int, axis: str) -> int:
        """Inner split factor when op i tiles a factor strided on `axis` (1 when not)."""
        return self._p.op_inner.get((i, axis), 1)

    def op_uneven(self, i: int, axis: str) -> int | None:
        """The block (in positions of the factor) op i splits its tiled factor by on `axis` when that axis does
        not divide it (uneven, sharding.chunk_size); None when it does."""
        return self._p.op_uneven.get((i, axis))

    def op_tactic(self, i: int, axis: str) -> str | None:
        """The tactic that decided op i on `axis`, or None."""
        st = self._p.axes.get(axis)
        return st.assign_tactic.get(i) if st is not None else None

    def op_partial(self, i: int, axis: str) -> str | None:
        """The reduction op i passes a partial operand through on `axis` ("sum" / "max" / "min"), else None."""
        st = self._p.axes.get(axis)
        a = st.assign.get(i) if st is not None else None
        return PARTIAL_OP[a] if a is not None and a < 0 else None

    def ops_differing(self, other: "Decisions") -> set | None:
        """Indices of the ops whose per-op decisions differ from `other`'s (another stage of the same graph and
        mesh): the tables lower.op_layouts reads (factor axes, inner splits, uneven blocks, assignments), and every
        op passing a partial value through in either (its layouts also read its operands' states). An axis one of
        them has not used yet counts as nothing assigned. None: not comparable (another graph or mesh, or axes
        first used in another order: lowering orders an op's partial axes so)."""
        a, b = self._p, other._p
        n = min(len(a.axis_order), len(b.axis_order))
        if a.g is not b.g or a.mesh != b.mesh or a.axis_order[:n] != b.axis_order[:n]:
            return None
        changed = _keys_differing(a.op_axes, b.op_axes)
        changed |= {i for i, _ in _keys_differing(a.op_inner, b.op_inner) | _keys_differing(a.op_uneven, b.op_uneven)}
        for axis in set(a.axis_order) | set(b.axis_order):
            sa = a.axes[axis].assign if axis in a.axes else {}
            sb = b.axes[axis].assign if axis in b.axes else {}
            changed |= _keys_differing(sa, sb)
            changed |= {i for i, f in sa.items() if f < 0} | {i for i, f in sb.items() if f < 0}
        return changed

    def values_differing(self, other: "Decisions") -> set | None:
        """Canonical ids of the values whose Sharding may differ from `other`'s (another stage of the same graph and
        mesh): a state on some axis (an axis one has not used counts as unknown), the axes of a dim, a strided
        split or an uneven block. None: not comparable (another graph or mesh, or axes used in another order)."""
        a, b = self._p, other._p
        n = min(len(a.axis_order), len(b.axis_order))
        if a.g is not b.g or a.mesh != b.mesh or a.axis_order[:n] != b.axis_order[:n]:
            return None
        changed = {c for c, _ in _keys_differing(a.dim_axes, b.dim_axes)}
        changed |= {c for c, _ in _keys_differing(a.strides, b.strides) | _keys_differing(a.blocks, b.blocks)}
        unknown = [UNKNOWN] * len(a.g.values)
        for axis in set(a.axis_order) | set(b.axis_order):
            va = a.axes[axis].value if axis in a.axes else unknown
            vb = b.axes[axis].value if axis in b.axes else unknown
            changed.update(c for c, (x, y) in enumerate(zip(va, vb)) if x != y)
        return changed

    @property
    def conflicts(self) -> list:
        return self._p.conflicts


def _keys_differing(a: dict, b: dict) -> set:
    """Keys whose entries differ between two dicts (present in one only, or unequal)."""
    missing = object()
    return {k for k in a.keys() | b.keys() if a.get(k, missing) != b.get(k, missing)}
