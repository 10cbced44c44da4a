"""Tile-mapping rules: per aten op, how its operand and result dims relate (see factors.py)."""
from .factors import BLOCKED, NEED_REP, PASS, REDUCE, Factor, OpRule, RuleBuilder, einsum
from .registry import NodeCtx, RuleRegistry, default_registry, register_rule

__all__ = ["BLOCKED", "NEED_REP", "PASS", "REDUCE", "Factor", "OpRule", "RuleBuilder", "einsum", "NodeCtx",
           "RuleRegistry", "default_registry", "register_rule"]
