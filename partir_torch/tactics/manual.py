"""ManualPartition: seed named values on one axis, then propagate."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Callable

from ..errors import PartitionError, SelectorError, closest
from ..sharding import REPLICATED
from .base import SeedTactic, declare


def _matcher(sel):
    if isinstance(sel, re.Pattern):
        return lambda name, meta: sel.fullmatch(name) is not None
    if isinstance(sel, str):
        return lambda name, meta: fnmatch.fnmatchcase(name, sel)
    if callable(sel):
        return sel
    raise PartitionError(f"ManualPartition: selector {sel!r} must be a glob string, a compiled regex or a callable "
                         f"(name, meta) -> bool.")


@declare("manual")
@dataclass(frozen=True)
class ManualPartition(SeedTactic):
    """Tile (or replicate) the named values matching each selector on `axis`, then propagate.

    >>> ManualPartition({"inputs.*": 0}, axis="batch", name="BP")                # batch dim of every input
    >>> ManualPartition({"params.layers.*.mlp.w1.weight": 0,                   # column-parallel
    ...                  "params.layers.*.mlp.w2.weight": 1}, axis="model")    # row-parallel

    Selectors: glob strings over value names ("params.*", "inputs.0", "layers.0.attn:out"), compiled regexes
    (full match), or callables `(name, meta) -> bool` where meta has `shape`, `dtype`, `role`. Targets: a dim
    (negative counts from the end), `pt.REPLICATED`, or a callable `(name, shape) -> dim | REPLICATED | None`
    (None: leave that value alone).
    """

    inputs: dict
    axis: str
    name: str | None = None
    allow_unmatched: bool = field(default=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.inputs, dict) or not self.inputs:
            raise PartitionError(f"ManualPartition needs a non-empty dict selector -> dim, got {self.inputs!r}.")
        for sel in self.inputs:
            _matcher(sel)
        if self.name is None:
            object.__setattr__(self, "name", f"Manual[{self.axis}]")

    def __repr__(self):
        return f"ManualPartition({self.inputs!r}, axis={self.axis!r}, name={self.name!r})"

    def seeds(self, ctx) -> list:
        """(value name, state) pairs for this tactic on ctx's graph."""
        out = []
        for sel, target in self.inputs.items():
            match = _matcher(sel)
            hits = [n for n in ctx.value_names() if match(n, ctx.value_meta(n))]
            if not hits and not self.allow_unmatched:
                shown = sel if isinstance(sel, str) else getattr(sel, "pattern", repr(sel))
                near = closest(str(shown), ctx.value_names(), n=5)
                raise SelectorError(f"{self.name}: selector {shown!r} matches no value. "
                                    + (f"Closest names: {', '.join(near)}. " if near else "")
                                    + "Value names look like inputs.0, params.<fqn>, buffers.<fqn>, "
                                      "opt.<state>.<fqn>, <module fqn>:out.")
            for name in hits:
                shape = ctx.value_meta(name)["shape"]
                t = target(name, shape) if callable(target) and target is not REPLICATED else target
                if t is None:
                    continue
                if t is REPLICATED:
                    out.append((name, REPLICATED))
                    continue
                if not isinstance(t, int) or not -len(shape) <= t < max(len(shape), 1):
                    raise PartitionError(f"{self.name}: {name} has shape {tuple(shape)}; dim {t!r} is out of range "
                                         f"for axis '{self.axis}'. Use a dim in 0..{len(shape) - 1} or REPLICATED.")
                out.append((name, t % len(shape)))
        return out
