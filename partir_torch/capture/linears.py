"""The primitives the structure searches read a captured graph with: a value past its casts, a parameter past its
casts and transposes, and a linear (an mm of an activation and a 2-D parameter weight) with its output dim."""
from __future__ import annotations

import torch

from ..contract import META_NAME, META_ROLE
from ..rules import tags

aten = torch.ops.aten

# ops that move or cast a value without changing which elements it holds: a parameter seen through any chain of
# them is still that parameter (mixed precision casts every parameter before its use)
_CASTS = tags.ops("copy") | tags.ops("cast")
_TRANSPOSES = tags.ops("transpose")


def source(node, through=_CASTS):
    """The node `node` is a copy of, past dtype casts and copies (`through`); `node` itself if it is none."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in through \
            and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def param_source(node) -> tuple | None:
    """(parameter placeholder, transposed) if `node` is a parameter seen through casts, copies and 2-D
    transposes (every structure query reads parameters through this, so a model under mixed precision, whose
    parameters reach their ops through `_to_copy`, has the structure of the plain model); else None."""
    flips = 0
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target in _TRANSPOSES:
            perm = node.args[1] if node.target is aten.permute.default else None
            if perm is not None and list(perm) != [1, 0]:
                return None
            flips += 1
        elif node.target not in _CASTS:
            return None
        node = node.args[0]
    if isinstance(node, torch.fx.Node) and node.op == "placeholder" and node.meta.get(META_ROLE) == "param":
        return node, flips % 2 == 1
    return None


def is_param_cast(node) -> bool:
    """A dtype cast of a parameter (mixed precision's `_to_copy` of a parameter to the compute dtype)."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _CASTS \
        and param_source(node) is not None and node.meta["val"].dtype != param_source(node)[0].meta["val"].dtype


def _linear(node):
    """(W's name, W's output-feature dim) if `node` is a linear: mm(x, t(W)) (nn.Linear, W is (out, in)) or
    mm(x, W) (Hugging Face's Conv1D, W is (in, out)), W a 2-D parameter seen through casts (param_source);
    else None."""
    if node.target is not aten.mm.default:
        return None
    found = param_source(node.args[1])
    if found is None or len(found[0].meta["val"].shape) != 2:
        return None
    w, transposed = found
    return w.meta[META_NAME], 0 if transposed else 1


def linear_weight(node, graph=None):
    found = _linear(node)
    return found[0] if found else None


_RESHAPES = tags.ops("reshape")
