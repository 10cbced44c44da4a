"""All built-in rules, gathered from the per-family modules."""
from __future__ import annotations


def all_rules() -> dict:
    from . import conv, indexing, matmul, nn, pointwise, reduction, stacking, views

    table: dict = {}
    for mod in (pointwise, matmul, reduction, views, stacking, nn, indexing, conv):
        table.update(mod.rules())
    return table
