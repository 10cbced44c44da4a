"""The array form of one axis's decisions, for code that scores many candidates at once (the automatic search,
the simulator's fast estimate): per canonical value and per op one int64 entry. The encoding is propagation's own
(state.py); everything outside propagate/ reads and builds these arrays through the names below, never through
the numbers.

    vals, assign = ctx.axis_arrays("model")      # per canonical value, per op
    tiled(vals)                                  # bool: the value is tiled on the axis (its entry is the dim)
    undecided(assign)                            # bool: no tactic decided the op on the axis
"""
from __future__ import annotations

import numpy as np

from .state import PARTIAL, UNKNOWN, WHOLE


def undecided(a):
    """No decision (lowered as replicated)."""
    return a == UNKNOWN


def tiled(a):
    """A value tiled on the axis (the entry is its dim), or an op that tiles one of its factors (the factor id)."""
    return a >= 0


def partial(a):
    """A pending reduction: a partial value, or an op that passes a partial operand through."""
    return a <= PARTIAL["sum"]


def whole(a):
    """Neither tiled nor partial: undecided or explicitly replicated (the data is whole on every rank)."""
    return (a == UNKNOWN) | (a == WHOLE)


def replicated(a):
    """Explicitly replicated (a REPLICATED seed or a want that needs the value whole)."""
    return a == WHOLE


def replicated_code() -> int:
    """The entry of an explicitly replicated value (np.where(mask, dims, replicated_code()))."""
    return WHOLE


def partial_code(op: str) -> int:
    """The entry of a value partial over `op` ("sum" / "max" / "min")."""
    return PARTIAL[op]


def undecided_array(shape) -> np.ndarray:
    """An int64 array with no decision anywhere."""
    return np.full(shape, UNKNOWN, dtype=np.int64)
