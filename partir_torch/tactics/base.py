"""The tactic interface. A schedule holds two kinds of entries:

- Tactic: decides one mesh axis. `apply(ctx)` seeds values through the TacticContext and propagates; it may need
  extra decompositions at capture (vocabulary-parallel cross-entropy needs softmax decomposed).
- CaptureRewrite: shapes the traced step itself (mixed precision, remat), wherever it sits in the schedule:
  `install(model)` hooks the module for the trace, `transform_step(state, args)` maps the step's inputs,
  `rewrite(captured)` edits the captured graph; `in_eval` says whether eval_step's capture applies it too.

A tactic that only computes seeds derives from SeedTactic and writes `seeds(ctx)`.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Tactic(Protocol):
    name: str
    axis: str

    def apply(self, ctx) -> None: ...


@runtime_checkable
class CaptureRewrite(Protocol):
    name: str
    in_eval: bool

    def install(self, model) -> list: ...

    def transform_step(self, state: dict, args: tuple): ...

    def rewrite(self, captured) -> None: ...


def decompositions_of(t) -> dict:
    """The decompositions a schedule entry asks capture for ({} when none)."""
    fn = getattr(type(t), "decompositions", None)
    return fn(t) if fn is not None else {}


class SeedTactic:
    """Base of tactics that only provide seeds: (value name, dim or REPLICATED) pairs on `self.axis`."""

    def seeds(self, ctx) -> list:
        raise NotImplementedError(f"{type(self).__name__} must define seeds(ctx)")

    def apply(self, ctx) -> None:
        ctx.mesh.check_axis(self.axis, self.name)
        ctx.seed_and_propagate(self.axis, self.seeds(ctx), self.name)
