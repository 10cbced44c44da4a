"""Reordering a per-device graph: a topological sort that follows priorities (fusion and wait sinking use it)."""
from __future__ import annotations

import heapq

import torch.fx as fx


def reorder(graph: fx.Graph, prio: dict | None = None) -> None:
    """Put every node after its inputs, choosing among the ready nodes the lowest priority (default: the current
    position), so the current order is kept wherever it is already valid."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    prio = index if prio is None else prio
    pending = {n: len(n.all_input_nodes) for n in nodes}
    ready = [(prio[n], index[n], n) for n in nodes if pending[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for u in n.users:
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
