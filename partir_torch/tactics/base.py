"""The tactic interface. A schedule holds two kinds of entries:

- Tactic: decides one mesh axis. `apply(ctx)` seeds values through the TacticContext and propagates; it may need
  extra decompositions at capture (vocabulary-parallel cross-entropy needs softmax decomposed).
- CaptureRewrite: shapes the traced step itself (mixed precision, remat), wherever it sits in the schedule:
  `install(model)` hooks the module for the trace, `transform_step(state, args)` maps the step's inputs,
  `rewrite(captured)` edits the captured graph; `in_eval` says whether eval_step's capture applies it too.

A tactic that only computes seeds derives from SeedTactic and writes `seeds(ctx)`. A tactic class declares what it
does with `@declare(family, macro=...)`: the automatic search tries the macro-actions of the classes declared
`macro=True`, and the simulator's confidence reads the families (not the tactic names). Declared classes derive
from TacticBase, which declares those members and the decompositions a tactic asks capture for, with their
defaults; a tactic of the user's own that only follows the Tactic protocol has no family and asks for none.
"""
from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass
from typing import ClassVar, Protocol, runtime_checkable

from ..contract import TACTIC_FAMILY

# Tactic classes whose `macro_actions(ctx, axis, name)` the automatic search tries, in declaration order.
MACRO_TACTICS: list = []


class TacticBase:
    """What a tactic class declares beyond the Tactic protocol, with its defaults: the base of every class
    @declare names (SeedTactic derives from it). `family` and `macro` are set by @declare."""

    family: ClassVar[str] = ""         # what the tactic does (see declare); "" for none
    macro: ClassVar[bool] = False      # the automatic search may use it as a macro-action

    def decompositions(self) -> dict:
        """The extra decompositions this tactic asks capture for (op overload -> function); none by default.
        Vocabulary-parallel cross-entropy, for instance, needs softmax decomposed."""
        return {}

    def bound(self, mesh):
        """This tactic with what it needs of the mesh at capture (an axis size: data_parallel(batchnorm="local"),
        load-balanced CP); itself by default."""
        return self

    def without_rewrite(self):
        """A tactic that is also a capture rewrite (load-balanced CP): the plain tactic a program captured without
        the rewrite runs instead (prog.forward); None for every other tactic."""
        return None

    @classmethod
    def macro_actions(cls, ctx, axis: str, name: str) -> list:
        """[(label, kind, tactics)] the automatic search may take on `axis` (kind "preset", or "zero" for a
        completion); only classes declared macro=True are asked, and they define it."""
        raise NotImplementedError(f"{cls.__name__} is not declared macro=True: it has no macro-actions")


def declare(family: str, *, macro: bool = False, names: dict | None = None):
    """Class decorator: what the automatic search and the simulator need to know of a tactic class, a frozen
    dataclass deriving from TacticBase.

    family: what the tactic does ("data_parallel", "megatron", "sequence", "embedding", "multi_query", "expert",
    "zero", "manual", "automatic"); it becomes the class attribute `family` unless the class defines one.
    macro: the automatic search may use it as a macro-action; the class then defines the classmethod
    `macro_actions(ctx, axis, name) -> [(label, kind, tactics)]` (kind "preset", or "zero" for a completion).
    names: the default names its collectives carry -> their family (default: {the default of its `name` field:
    family}).

    Example: `@declare("data_parallel", macro=True)` above `@dataclass(frozen=True) class DataParallel(SeedTactic)`.
    """
    def wrap(cls):
        if not (isinstance(cls, type) and issubclass(cls, TacticBase) and is_dataclass(cls)):
            raise TypeError(f"@declare({family!r}) applies to a dataclass deriving from tactics.base.TacticBase, "
                            f"not {cls!r}")
        if "family" not in vars(cls):
            cls.family = family
        cls.macro = macro
        if macro:
            if cls.macro_actions.__func__ is TacticBase.macro_actions.__func__:
                raise TypeError(f"{cls.__name__} is declared macro=True but defines no macro_actions(ctx, axis, name)")
            MACRO_TACTICS.append(cls)
        default = next((f.default for f in fields(cls) if f.name == "name"), MISSING)
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
    """The decompositions a schedule entry asks capture for ({} when none: a capture rewrite, a user's tactic that
    does not derive from TacticBase)."""
    return t.decompositions() if isinstance(t, TacticBase) else {}


def family_of(t) -> str:
    """The family a schedule entry's class declares (declare), "" when none: a capture rewrite, an entry that is
    not a Tactic (the automatic tactic, which decides several axes), a user's tactic not deriving from TacticBase."""
    return t.family if isinstance(t, Tactic) and isinstance(t, TacticBase) else ""


class SeedTactic(TacticBase):
    """Base of tactics that only provide seeds: (value name, dim or REPLICATED) pairs on `self.axis`."""

    def seeds(self, ctx) -> list:
        raise NotImplementedError(f"{type(self).__name__} must define seeds(ctx)")

    def apply(self, ctx) -> None:
        ctx.mesh.check_axis(self.axis, self.name)
        ctx.seed_and_propagate(self.axis, self.seeds(ctx), self.name)
