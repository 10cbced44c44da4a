"""Why each collective is in the per-device program: the classification records.py documents, from what lowering
knows when it emits one (the value moved, the op it serves, the axis) and what capture and propagation recorded
(roles, ties, phases, the ops' decisions, conflicts).

    causes = Causes(graph, decisions, captured)
    why, source, op = causes.of(kind, axis, value_node, op_node)     # op_node None: an output of the step
"""
from __future__ import annotations

import torch

from ..contract import META_ROLE, STATE_ROLES, Phase, phase_of
from ..errors import source_location
from ..rules import tags
from .records import ALL_REDUCE, GRADIENT, REDUCE_SCATTER, RESHARD, STATE, TACTIC

aten = torch.ops.aten

# ops through which a value is still the same tensor, for state and gradients alike: views, copies, dtype casts
SAME_VALUE = tags.ops("same_value")
# a gradient is still the gradient when padded back into its parameter's shape (wpe[:T]: the first operand), summed
# (micro-batches, tied weights: every operand of its shape) or scaled (clipping, loss scaling: the first operand)
_PADDED, _SUMMED, _SCALED = tags.ops("pads_back"), tags.ops("adds"), tags.ops("scales")
_REDUCTIONS = (ALL_REDUCE, REDUCE_SCATTER)


class Causes:
    """The why, source and op of each collective lowering emits (records.py states the rule)."""

    def __init__(self, graph, decisions, captured, roles: tuple | None = None):
        """roles: (state nodes, gradient nodes) of this graph from another Causes (Causes.roles), else read here:
        they depend on the captured graph alone, not on the decisions."""
        self.d = decisions
        self.op_index = {op.node: i for i, op in enumerate(graph.ops)}
        self.conflicts = {(c.node, c.axis) for c in decisions.conflicts}
        self.state, self.grads = roles or (_state_nodes(graph.gm, captured), _gradient_nodes(graph.gm, captured))

    @property
    def roles(self) -> tuple:
        return self.state, self.grads

    def of(self, kind: str, axis: str, value, op) -> tuple:
        """(why, source, op name) of a `kind` collective on `axis` moving captured node `value` for captured op
        node `op` (its consumer, or its producer when the value settles into its recorded layout; None for the
        step's outputs)."""
        source = (source_location(op) if op is not None else "") or source_location(value)
        name = "output" if op is None else str(op.target)
        return self._why(kind, axis, value, op), source, name

    def _why(self, kind, axis, value, op) -> str:
        if value in self.grads:
            return GRADIENT
        if value in self.state:
            return STATE
        if kind in _REDUCTIONS or op is None:
            return TACTIC
        i = self.op_index.get(op)
        if i is None or (op.name, axis) in self.conflicts or self.d.op_tactic(i, axis) is None:
            return RESHARD
        return TACTIC


def _state_nodes(gm, captured) -> set:
    """Parameters, buffers and optimizer state: the placeholders, their views and casts, and their updated values
    (tied outputs)."""
    out = {n for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get(META_ROLE) in STATE_ROLES}
    out |= {b for _, b in captured.ties}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in SAME_VALUE and n.args and n.args[0] in out:
            out.add(n)
    return out


def _gradient_nodes(gm, captured) -> set:
    """Parameter gradients: what the optimizer update reads from the backward (or the grads.* outputs), and the
    values summed or scaled into them."""
    nodes = list(gm.graph.nodes)
    if captured.mode == "loss_and_grads":
        outs = nodes[-1].args[0]
        sinks = [n for name, n in zip(captured.output_names, outs) if name.startswith("grads.")]
    else:
        sinks = [n for n in nodes if n.op == "call_function" and phase_of(n) != Phase.OPTIMIZER
                 and any(u.op == "call_function" and phase_of(u) == Phase.OPTIMIZER for u in n.users)]
    seen, stack = set(), [n for n in sinks if hasattr(n, "op")]
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if n.target in SAME_VALUE or n.target in _SCALED or n.target in _PADDED:
            nxt = n.args[:1]
        elif n.target in _SUMMED:
            nxt = [a for a in n.args if hasattr(a, "meta") and _same_shape(a, n)]
        else:
            nxt = ()
        stack.extend(a for a in nxt if hasattr(a, "op"))
    return seen


def _same_shape(a, b) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
