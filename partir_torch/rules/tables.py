"""All built-in rules, gathered from the per-family modules."""
from __future__ import annotations


def all_rules() -> dict:
    from . import attention, conv, group_bn, indexing, matmul, moe, nn, pointwise, reduction, stacking, views

    table: dict = {}
    for mod in (pointwise, matmul, reduction, views, stacking, nn, attention, indexing, conv, moe, group_bn):
        rows = mod.rules()
        twice = sorted(str(op) for op in rows if op in table)
        if twice:
            raise RuntimeError(f"rules.{mod.__name__.rsplit('.', 1)[-1]} registers {', '.join(twice)} again")
        table.update(rows)
    return table


def families() -> dict:
    """op -> the rule module its rule comes from ("pointwise", "matmul", ... "nn")."""
    from . import attention, conv, group_bn, indexing, matmul, moe, nn, pointwise, reduction, stacking, views

    mods = (pointwise, matmul, reduction, views, stacking, nn, attention, indexing, conv, moe, group_bn)
    return {op: mod.__name__.rsplit(".", 1)[-1] for mod in mods for op in mod.rules()}
