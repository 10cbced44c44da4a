"""Layout copies of the per-device program (issue 39): the ops that write elements into new storage and compute
nothing (rules/tags.py's "layout_copy": clone, contiguous, cat, index_select, ...) and the reshapes whose operand
is not laid out for a view. A copy is *extra* when the one-device step does not make it: lowering inserted it (no
captured node: a dim moved to the front for a collective and back, a bucket's copy-in or copy-out, a chunked
all_reduce's concatenation, a local slice at the rank's coordinate), or a captured view that became a copy on the
local shards.

    copies = layout_copies(low, captured)        # low: an annotated Lowered (plan.annotated_lowered())
    extra = [c for c in copies if c.extra]
    one = one_device_copies(captured)            # the captured step's own, for comparison

prog.audit() prints them by op and source line (reporting.copies_text).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract import META_COLLECTIVE, META_SRC
from ..errors import source_location
from ..rules import tags

_COPIES = tags.ops("layout_copy")
_RESHAPES = tags.ops("reshape")


@dataclass(frozen=True)
class CopyRecord:
    """One layout copy in a program: its op ("clone", "cat", "reshape"), the bytes it writes per step, the node,
    the value it serves (a captured node or a collective's value), the user's file:line ("" when unknown) and
    whether the one-device step makes it too."""

    op: str
    nbytes: int
    node: str
    value: str
    source: str
    extra: bool


def copies_of(node) -> bool:
    """Whether lowered or captured node `node` (meta["val"] holds its result) writes a layout copy."""
    if node.op != "call_function":
        return False
    if node.target in _COPIES:
        return isinstance(node.meta.get("val"), torch.Tensor)
    if node.target in _RESHAPES:
        return not _viewable(node.args[0], node.meta.get("val"))
    return False


def _viewable(arg, out) -> bool:
    """Whether `out`'s shape is a view of `arg`'s layout (its shape and strides): what reshape decides."""
    x = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
        return True
    try:
        torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta").view(out.shape)
    except RuntimeError:
        return False
    return True


def _nbytes(node) -> int:
    v = node.meta["val"]
    return v.numel() * v.element_size()


def layout_copies(low, captured) -> list:
    """[CopyRecord] of lowered program `low` (annotated: every node's local meta["val"]), in program order."""
    cap = {n.name: n for n in captured.gm.graph.nodes}
    out = []
    for n in low.gm.graph.nodes:
        if not copies_of(n):
            continue
        src = cap.get(n.meta.get(META_SRC))
        if src is not None:
            out.append(CopyRecord(_short(n.target), _nbytes(n), n.name, src.name, source_location(src),
                                  not copies_of(src)))
            continue
        value, source = _served(n, cap)
        out.append(CopyRecord(_short(n.target), _nbytes(n), n.name, value, source, True))
    return out


def one_device_copies(captured) -> list:
    """[CopyRecord] of the captured one-device step (none extra)."""
    return [CopyRecord(_short(n.target), _nbytes(n), n.name, n.name, source_location(n), False)
            for n in captured.gm.graph.nodes if copies_of(n)]


def _served(node, cap) -> tuple:
    """(value, source) of the nearest collective around an inserted node, up or down the graph (a copy-out reads
    its result, a copy-in feeds it); else of the nearest captured op."""
    frontier, seen, near = [node], {node}, None
    for _ in range(6):
        nxt = []
        for n in frontier:
            for m in n.all_input_nodes + list(n.users):
                if m in seen:
                    continue
                seen.add(m)
                rec = m.meta.get(META_COLLECTIVE)
                if rec is not None:
                    return rec.value, rec.source
                if near is None and m.meta.get(META_SRC) in cap:
                    near = cap[m.meta[META_SRC]]
                nxt.append(m)
        frontier = nxt
    return (near.name, source_location(near)) if near is not None else (node.name, "")


def _short(target) -> str:
    return str(target).split(".")[1]          # "aten.clone.default" -> "clone" (copies are aten ops)
