"""The tactic interface. A schedule holds two kinds of entries:

- Tactic: decides one mesh axis. `apply(ctx)` seeds values through the TacticContext and propagates; it may need
  extra decompositions at capture (vocabulary-parallel cross-entropy needs softmax decomposed).
- CaptureRewrite: shapes the traced step itself (mixed precision, remat), wherever it sits in the schedule:
  `install(model)` hooks the module for the trace, `transform_step(state, args)` maps the step's inputs,
  `rewrite(captured)` edits the captured graph; `in_eval` says whether eval_step's capture applies it too.

A tactic that only computes seeds derives from SeedTactic and writes `seeds(ctx)`. A tactic class declares what it
does with `@declare(family, macro=...)`: the automatic search tries the macro-actions of the classes declared
`macro=True`, and the simulator's confidence reads the families (not the tactic names).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..contract import TACTIC_FAMILY

# Tactic classes whose `macro_actions(ctx, axis, name)` the automatic search tries, in declaration order.
MACRO_TACTICS: list = []


def declare(family: str, *, macro: bool = False, names: dict | None = None):
    """Class decorator: what the automatic search and the simulator need to know of a tactic class.

    family: what the tactic does ("data_parallel", "megatron", "sequence", "embedding", "multi_query", "expert",
    "zero", "manual", "automatic"); it becomes the class attribute `family` unless the class defines one.
    macro: the automatic search may use it as a macro-action; the class then defines the classmethod
    `macro_actions(ctx, axis, name) -> [(label, kind, tactics)]` (kind "preset", or "zero" for a completion).
    names: the default names its collectives carry -> their family (default: {cls.name: family}).

    Example: `@declare("data_parallel", macro=True)` above `@dataclass(frozen=True) class DataParallel(SeedTactic)`.
    """
    def wrap(cls):
        if "family" not in vars(cls):
            cls.family = family
        cls.macro = macro
        if macro:
            if not callable(getattr(cls, "macro_actions", None)):
                raise TypeError(f"{cls.__name__} is declared macro=True but defines no macro_actions(ctx, axis, name)")
            MACRO_TACTICS.append(cls)
        default = getattr(cls, "name", None)
        TACTIC_FAMILY.update(names if names is not None else {default: family} if isinstance(default, str) else {})
        return cls
    return wrap


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
