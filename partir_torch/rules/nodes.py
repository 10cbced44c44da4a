"""What a rule reads of an FX node's results: their example values (rules, localize and propagation share it)."""
from __future__ import annotations

import torch
import torch.fx as fx


def result_vals(node: fx.Node) -> list:
    """Per result of `node`: its example tensor (meta["val"]), None for a non-tensor result; [] for none."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []
