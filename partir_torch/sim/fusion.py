"""What a compiled per-device program runs as fused kernels (Options(compile=True): TorchInductor, runtime/compiled.py).

Inductor fuses elementwise ops, and reductions with the elementwise ops around them, into one kernel each; matmuls,
convolutions, attention kernels and collectives stay extern kernels between them. The simulator approximates its
vertical fusion: the program is cut into segments at every op that is not fusible (a FLOP-carrying op, a
collective or its wait, an op without the pointwise tag that is not a fusible reduction: rules/tags.py
`fuses_when_compiled`), and within a segment the fusible ops connected by their operands (views between them
included) are one kernel. A kernel reads each tensor it takes from outside once and writes each result read
outside it once: its intermediates never reach memory. It costs one memory-bound kernel of those bytes
(sim/compute.memory_time: one launch overhead), charged where its first op runs.

Not modelled: horizontal fusion of independent kernels, Inductor's recomputation of cheap producers into several
consumers, and its memory planning (the simulated peak stays the eager program's liveness; the report says so).
"""
from __future__ import annotations

from ..rules import tags
from .compute import COMPUTE, FREE


def fused_kernels(nodes, facts) -> dict:
    """{first op of each fused kernel of two or more ops: bytes it reads and writes} and {every other member: 0},
    over the program's nodes in order (facts: simulate._Facts). Ops alone in their kernel are absent (they are
    costed as they are)."""
    parent: dict = {}

    def find(x):
        while parent[x] is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    segment, seg_of = 0, {}
    for n in nodes:
        if n.op != "call_function":
            continue
        cls, info = facts.classes[n]
        fusible = cls == COMPUTE and info is None and tags.fuses_when_compiled(n.target)
        view = cls == FREE and info == "view"
        if not (fusible or view):
            segment += 1                     # an extern kernel (or a collective, a wait): a fusion boundary
            continue
        seg_of[n] = segment
        parent[n] = n
        for a in facts.inputs[n]:
            if seg_of.get(a) == segment:
                ra, rn = find(a), find(n)
                if ra is not rn:
                    parent[rn] = ra
    members: dict = {}
    for n in seg_of:
        members.setdefault(find(n), []).append(n)
    out: dict = {}
    for group in members.values():
        ops = [n for n in group if facts.classes[n][0] == COMPUTE]
        if len(ops) < 2:
            continue
        inside = set(group)
        reads = {a for n in group for a in facts.inputs[n] if a not in inside}
        writes = {n for n in group if any(u not in inside for u in n.users)}
        out[ops[0]] = sum(facts.nbytes.get(a, 0) for a in reads) + sum(facts.nbytes.get(n, 0) for n in writes)
        out.update((n, 0) for n in ops[1:])
    return out
