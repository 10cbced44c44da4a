"""The one error family users see.  Every message names the value, the op, the axes with their sizes and the fix."""
from __future__ import annotations

import difflib


class PartitionError(ValueError):
    """A mistake the user can fix: bad axis, non-divisible dim, unknown selector, untraceable model, ..."""


class MeshError(PartitionError):
    """Bad mesh or axis name."""


class TraceError(PartitionError):
    """The model, loss or optimizer could not be captured as one graph."""


class SelectorError(PartitionError):
    """A tactic's selector matched no named value."""


class ShardingConflictError(PartitionError):
    """Two tactics (or a tactic and the shape of a value) demand incompatible shardings."""


class RuntimeMismatchError(PartitionError):
    """Ranks disagree about the program, or a rank died."""


def closest(name: str, candidates, n: int = 3) -> list[str]:
    """The few candidates nearest to `name`, for 'did you mean' hints."""
    return difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.3)
