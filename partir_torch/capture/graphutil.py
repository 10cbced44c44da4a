"""Small walks over captured graphs shared by the passes (capture rewrites, presets, lowering)."""
from __future__ import annotations

from ..contract import _reach
from ..errors import source_line  # noqa: F401  (re-exported for the capture passes)


def ancestors(roots) -> set:
    """Every node the roots depend on, the roots included."""
    return _reach(roots, lambda n: n.all_input_nodes)


def descendants(roots) -> set:
    """Every node that depends on the roots, the roots included."""
    return _reach(roots, lambda n: n.users)


def forward_nodes(gm) -> set:
    """The forward of a captured step: the ancestors of the loss (output 0); every node of a forward-only graph."""
    nodes = list(gm.graph.nodes)
    loss = nodes[-1].args[0][0]
    return ancestors([loss])
