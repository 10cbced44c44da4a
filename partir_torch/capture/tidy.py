"""Small rewrites of the traced step that keep propagation from tying values that are not related by data."""
from __future__ import annotations

import torch
import torch.fx as fx
from ..contract import RANDOM_OPS

aten = torch.ops.aten

# random draws whose tensor operand is only a template (shape, dtype, device): dropout as nn.Dropout traces it,
# bernoulli_(empty_like(x), p)
_TEMPLATE_RANDOM = RANDOM_OPS & {aten.bernoulli.p, aten.rand_like.default, aten.randn_like.default}
# factories shaped like their operand -> the factory with a static shape (value argument index, else None)
LIKE = {aten.empty_like.default: (aten.empty.memory_format, None), aten.zeros_like.default: (aten.zeros.default, None),
         aten.ones_like.default: (aten.ones.default, None), aten.full_like.default: (aten.full.default, 1)}


def untie_random_templates(gm: fx.GraphModule) -> None:
    """`bernoulli(empty_like(x), p)`: the draw reads only the template's shape, but `empty_like` would tie its
    layout to x's, and random draws stay whole (rules/pointwise.py RANDOM), so a batch-tiled x would be gathered
    to make an uninitialised template whole. The template becomes a factory of x's static shape instead."""
    for n in list(gm.graph.nodes):
        if n.target not in LIKE or not n.users or any(u.target not in _TEMPLATE_RANDOM for u in n.users):
            continue
        val = n.meta["val"]
        target, value_at = LIKE[n.target]
        args = (list(val.shape),) if value_at is None else (list(val.shape), n.args[value_at])
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(target, args, {"dtype": val.dtype, "device": val.device})
        new.meta.update(n.meta)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
    gm.graph.lint()     # capture() regenerates gm's code once, after its last rewrite
