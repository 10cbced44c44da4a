"""What the step's Python decides from one input dim: the guards of a symbolic trace (issue 22).

A program fitted as a function of the sequence length (lower/template.py) reads only the integers of the per-device
programs it was fitted on. The model's Python may also decide from the length: a position table sliced to
`wpe[:T]` holds only up to its size (T <= 64), a special case for T == 1, a mask built differently past a window.
Those decisions are not integers in the program; a trace in which the dim is a symbol records each of them as a
guard on that symbol (torch's ShapeEnv: `s0 <= 64`, `Ne(s0, 4)`). `capture(..., dynamic=positions)` traces the
step once so, with the positions' sizes one shared symbol s and every other size static, and keeps the guards as
`DimGuards`; `check(s)` says which guard a new length breaks (then that length is partitioned as any new shape
is). The graph of that trace is not used. Several symbols (the batch and the sequence length, issue 40): positions
maps each (input, dim) to its symbol's name, every position gets a symbol of its own in the trace (no duck sizing:
a batch of 8 and a length of 8 stay apart), and each is read back as its name's symbol; a trace that unifies two
names, or fixes one to a value, records that as a guard that fails elsewhere.

Sizes 0 and 1 are special to a symbolic trace (they are never symbols), so s >= 2 is a guard too.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext


def fake_mode_for(dynamic) -> "torch._subclasses.fake_tensor.FakeTensorMode":
    """The capture's FakeTensorMode: static sizes everywhere, with a ShapeEnv when some input dims are symbolic."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not dynamic:
        return FakeTensorMode(allow_non_fake_inputs=True)
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(duck_shape=False), static_shapes=True)


def symbolic_input(mode, x: torch.Tensor, dims) -> torch.Tensor:
    """x faked with `dims` (its dims that are the symbol) symbolic, the others static."""
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC
                                                  for d in range(x.dim())])
    return mode.from_tensor(x, static_shapes=False, symbolic_context=ctx)


def symbolic_decompositions() -> dict:
    """Decompositions a symbolic trace needs beyond the capture's: constant_pad_nd's C++ kernel reads concrete
    sizes (Hugging Face's causal-LM loss pads its labels), so the length would be specialised there."""
    from torch._decomp import decomposition_table

    aten = torch.ops.aten
    return {aten.constant_pad_nd.default: decomposition_table[aten.constant_pad_nd.default]}


@dataclass(frozen=True)
class DimGuards:
    """The conditions on the symbols under which the trace holds, as sympy expressions in symbols named by
    `names` (one symbol: "s")."""

    exprs: tuple
    traced_at: tuple
    names: tuple = ("s",)

    @staticmethod
    def collect(mode, inputs: dict, names: dict | None = None) -> "DimGuards":
        """inputs: {(input index, dim): the faked input's size there (a SymInt)}, after the trace; names: {(input
        index, dim): the name of its symbol} (default: all one symbol s)."""
        env: ShapeEnv = mode.shape_env
        names = names or {pos: "s" for pos in inputs}
        order = tuple(dict.fromkeys(names[p] for p in inputs))
        sym = {n: sympy.Symbol(n, integer=True, positive=True) for n in order}
        # each position's own symbol (SymNode._expr: as created, before the trace's replacements) -> its name's
        ours = {x.node._expr: sym[names[p]] for p, x in inputs.items()}
        exprs = [sympy.Ge(v, 2) for v in sym.values()]
        for g in env.guards:
            exprs.append(g.expr.xreplace(ours))
        for sy, val in env.replacements.items():     # a symbol specialised to a value, or unified with another
            if sy in ours:
                exprs.append(sympy.Eq(ours[sy], val.xreplace(ours)))
        hints = {names[p]: int(x.node.hint) for p, x in inputs.items()}
        return DimGuards(tuple(e for e in exprs if e is not sympy.true), tuple(hints[n] for n in order), order)

    def check(self, value) -> str | None:
        """None where every guard holds at s = value (a tuple, one size per name; an int for one symbol), else the
        first that does not (as the trace wrote it)."""
        values = (value,) if isinstance(value, int) else tuple(value)
        sub = {sympy.Symbol(n, integer=True, positive=True): v for n, v in zip(self.names, values)}
        for e in self.exprs:
            got = e.xreplace(sub)
            if got is not sympy.true and got != True:  # noqa: E712 - sympy booleans
                return str(e)
        return None

    def __str__(self):
        return ", ".join(map(str, self.exprs))
