"""Per-axis states of values, node decisions, provenance and conflicts: the data propagation records."""
from __future__ import annotations

from dataclasses import dataclass, field

UNKNOWN = -1
WHOLE = -2           # explicitly replicated (the public pt.REPLICATED seed)
PARTIAL = {"sum": -3, "max": -4, "min": -5}
PARTIAL_OP = {v: k for k, v in PARTIAL.items()}


def state_str(s: int) -> str:
    if s >= 0:
        return f"tiled(dim {s})"
    if s == UNKNOWN:
        return "unknown"
    if s == WHOLE:
        return "replicated"
    return f"partial({PARTIAL_OP[s]})"


@dataclass(frozen=True)
class Provenance:
    """Why a value has its state on an axis: the tactic, and the op + neighbour it came through (None: seeded)."""

    tactic: str
    op: int | None = None        # index into PartGraph.ops
    source: int | None = None    # vid of the neighbour whose state implied this one


@dataclass(frozen=True)
class Conflict:
    """Propagation stopped at an op: its neighbours demand states it cannot satisfy at once."""

    node: str                    # FX node name
    op: str                      # aten op
    axis: str
    tactic: str
    states: tuple                # ((value name, state string, tactic that decided it), ...)
    reason: str

    def __str__(self):
        parts = "; ".join(f"{v} is {s} (by {t})" for v, s, t in self.states)
        return f"[{self.tactic} on '{self.axis}'] {self.op} at {self.node}: {self.reason}: {parts}"


@dataclass
class AxisState:
    """Everything decided on one mesh axis."""

    axis: str
    value: list                          # per canonical vid: UNKNOWN / REPLICATED / PARTIAL[...] / dim >= 0
    prov: dict = field(default_factory=dict)     # canonical vid -> Provenance
    assign: dict = field(default_factory=dict)   # op index -> factor id (>= 0) or PARTIAL[...] (partial pass-through)
    assign_tactic: dict = field(default_factory=dict)  # op index -> tactic name
