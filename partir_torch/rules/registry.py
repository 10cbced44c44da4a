"""The rule registry: aten op overload -> rule (an einsum spec string, or a builder function of the node)."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from ..errors import PartitionError
from .factors import OpRule, einsum

aten = torch.ops.aten


@dataclass
class NodeCtx:
    """What a rule builder sees of one node: its args (fx.Nodes kept) and tensor slot shapes."""

    node: fx.Node
    operands: list          # tensor operand fx.Nodes, in flattened-arg order (one slot each)
    in_shapes: list         # their global shapes
    out_shapes: list        # per result slot: shape, or None when that result is not a tensor
    out_dtypes: list

    @property
    def args(self):
        return self.node.args

    @property
    def kwargs(self):
        return self.node.kwargs

    def arg(self, i: int, name: str, default=None):
        if len(self.node.args) > i:
            return self.node.args[i]
        return self.node.kwargs.get(name, default)


_ZEROS = {torch.ops.aten.new_zeros.default, torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default}
_FULLS = {torch.ops.aten.full.default: 1, torch.ops.aten.new_full.default: 2, torch.ops.aten.full_like.default: 1}


def structural_zero(a) -> bool:
    """Is `a` a graph node that is all zeros by construction (new_zeros, zeros_like, full(..., 0))? Rules may rely
    on it (accumulating into zeros is a sum over ranks); the verifier then feeds zeros there."""
    if not isinstance(a, fx.Node) or a.op != "call_function":
        return False
    if a.target in _ZEROS:
        return True
    i = _FULLS.get(a.target)
    return i is not None and len(a.args) > i and a.args[i] == 0


def tensor_operands(node: fx.Node) -> list:
    """Tensor-valued fx.Node operands in flattened (args, kwargs) order (pytree's order, without its generic walk:
    this runs for every node of the graph, several times)."""
    out: list = []

    def walk(a):
        if isinstance(a, fx.Node):
            if isinstance(a.meta.get("val"), torch.Tensor):
                out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                walk(x)
        elif isinstance(a, dict):
            for x in a.values():
                walk(x)

    walk(node.args)
    walk(node.kwargs)
    return out


def result_vals(node: fx.Node) -> list:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def make_ctx(node: fx.Node) -> NodeCtx:
    ops = tensor_operands(node)
    outs = result_vals(node)
    return NodeCtx(node, ops, [tuple(o.meta["val"].shape) for o in ops],
                   [None if v is None else tuple(v.shape) for v in outs],
                   [None if v is None else v.dtype for v in outs])


def _op_key(op):
    """Rules are keyed by OpOverload; an OpOverloadPacket registers all its overloads."""
    return op


class RuleRegistry:
    """Maps aten ops to rules. Build your own for tests (`RuleRegistry(table)`), or use `default_registry()`.

    A rule is an einsum spec string (see factors.einsum) or a callable `(NodeCtx) -> OpRule | None` (None: no
    rule applies to these arguments; the node is a barrier).
    """

    def __init__(self, table: dict | None = None):
        self._rules: dict = {}
        self._warned: set = set()
        for op, rule in (table or {}).items():
            self.register(op, rule)

    def register(self, op, rule, override: bool = False) -> None:
        """Add a rule for `op` (an OpOverload, or a packet: every overload). A second rule for an op is refused
        unless override=True; an einsum spec must name one operand per tensor argument of the op's schema."""
        if isinstance(op, torch._ops.OpOverloadPacket):
            for name in op.overloads():
                self.register(getattr(op, name), rule, override)
            return
        if not isinstance(rule, (str, Callable)):
            raise PartitionError(f"register_rule: the rule for {op} must be an einsum spec string ('mk,kn->mn') or "
                                 f"a callable (NodeCtx) -> OpRule | None, got {rule!r}.")
        if op in self._rules and not override:
            raise PartitionError(f"register_rule: {op} already has a rule; pass override=True to replace it.")
        if isinstance(rule, str):
            _check_spec(op, rule)
        self._rules[op] = rule

    def __contains__(self, op) -> bool:
        return op in self._rules

    def ops(self):
        return list(self._rules)

    def copy(self) -> "RuleRegistry":
        r = RuleRegistry()
        r._rules = dict(self._rules)
        return r

    def build(self, node: fx.Node) -> OpRule | None:
        """The rule instantiated for this node, or None (a barrier: values stay whole on every axis)."""
        rule = self._rules.get(node.target)
        if rule is None:
            if node.target not in self._warned:
                self._warned.add(node.target)
                warnings.warn(f"partir_torch: no sharding rule for {node.target}; its operands and results stay "
                              f"replicated (a barrier). Register one with partir_torch.register_rule.", stacklevel=2)
            return None
        ctx = make_ctx(node)
        if isinstance(rule, str):
            return einsum(rule, ctx.in_shapes, ctx.out_shapes)
        return rule(ctx)


_DEFAULT: RuleRegistry | None = None


def default_registry() -> RuleRegistry:
    global _DEFAULT
    if _DEFAULT is None:
        from . import tables

        _DEFAULT = RuleRegistry(tables.all_rules())
    return _DEFAULT


def register_rule(op, rule, override: bool = False) -> None:
    """Register a rule for a (user) op in the default registry: `register_rule(torch.ops.mylib.op.default, "mk,kn->mn")`.
    Replacing a built-in (or earlier) rule needs override=True."""
    default_registry().register(op, rule, override)


def _check_spec(op, spec: str) -> None:
    """An einsum spec's operands against the op's tensor arguments: 'mk,kn->mn' needs two (a list argument, as
    cat's, cannot be checked)."""
    if "->" not in spec:
        raise PartitionError(f"register_rule: spec {spec!r} for {op} has no '->' (write it as 'mk,kn->mn').")
    schema = getattr(op, "_schema", None)
    if schema is None:
        return
    kinds = [str(a.type) for a in schema.arguments]
    if any("[]" in k and "Tensor" in k for k in kinds):
        return
    tensors = [a for a, k in zip(schema.arguments, kinds) if k.startswith("Tensor") or k == "Optional[Tensor]"]
    required = [a for a, k in zip(schema.arguments, kinds) if k.startswith("Tensor")]
    n = len(spec.split("->")[0].split(","))
    if not len(required) <= n <= len(tensors):
        raise PartitionError(f"register_rule: spec {spec!r} names {n} operand(s), but {op} takes "
                             f"{len(required)}" + (f" to {len(tensors)}" if len(tensors) > len(required) else "")
                             + f" tensor argument(s) ({', '.join(a.name for a in tensors)}).")
