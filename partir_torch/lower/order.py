"""Reordering a per-device graph: a topological sort that follows priorities (fusion and wait sinking use it)."""
from __future__ import annotations

import heapq

import torch.fx as fx

from ..rules.tags import draws_random


def reorder(graph: fx.Graph, prio: dict | None = None) -> None:
    """Put every node after its inputs, choosing among the ready nodes the lowest priority (default: the current
    position), so the current order is kept wherever it is already valid. Random draws keep their order (each
    waits for the one before it): they consume the generator in eager's order (a layerdrop draw whose value only
    chose the path has no users, and must still come before the next layer's dropout)."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    prio = index if prio is None else prio
    if _sorted_already(nodes, index, prio):
        return
    draws = [n for n in nodes if draws_random(n)]
    after = dict(zip(draws, draws[1:]))          # draw -> the next draw, which waits for it
    pending = {n: len(n.all_input_nodes) for n in nodes}
    for n in draws[1:]:
        pending[n] += 1
    ready = [(prio[n], index[n], n) for n in nodes if pending[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for u in list(n.users) + ([after[n]] if n in after else []):
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, (prio[u], index[u], u))
    if len(order) != len(nodes):
        raise RuntimeError("the per-device graph has a cycle")
    if order == nodes:
        return
    if order[0] is not nodes[0]:
        nodes[0].prepend(order[0])
    for prev, n in zip(order, order[1:]):
        if prev.next is not n:
            prev.append(n)


def _sorted_already(nodes, index, prio) -> bool:
    """Whether reorder would keep the order as it is: every priority is the node's position and every node comes
    after its inputs (then the ready node of least position is always the next one; random draws are in order)."""
    return all(prio[n] == i for i, n in enumerate(nodes)) and all(
        index[a] < i for i, n in enumerate(nodes) for a in n._input_nodes)
