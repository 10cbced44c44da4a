"""Small walks over captured graphs shared by the passes (capture rewrites, presets, lowering)."""
from __future__ import annotations

import os

import torch


def ancestors(roots) -> set:
    """Every node the roots depend on, the roots included."""
    return _reach(roots, lambda n: n.all_input_nodes)


def descendants(roots) -> set:
    """Every node that depends on the roots, the roots included."""
    return _reach(roots, lambda n: n.users)


def _reach(roots, step) -> set:
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(step(n))
    return seen


def forward_nodes(gm) -> set:
    """The forward of a captured step: the ancestors of the loss (output 0); every node of a forward-only graph."""
    nodes = list(gm.graph.nodes)
    loss = nodes[-1].args[0][0]
    return ancestors([loss])


def source_line(node: fx.Node) -> str:
    """The user's source line that made `node`: the innermost frame of its stack trace outside torch and
    partir_torch ('' when the node has none)."""
    torch_dir = os.path.dirname(torch.__file__)
    our_dir = os.path.dirname(os.path.dirname(__file__))
    lines = node.meta.get("stack_trace", "").strip().splitlines()
    found = ""
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith("File \"") and torch_dir not in line and our_dir not in line:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            found = line[len("File "):] + (f": {code}" if code and not code.startswith("File ") else "")
    return found
