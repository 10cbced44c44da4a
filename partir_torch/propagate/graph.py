"""The captured graph as propagation sees it: values (tensor-valued nodes), ops (nodes with rules), names, ties."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..rules.factors import OpRule
from ..rules.registry import RuleRegistry, result_vals, tensor_operands
from ..capture.graphutil import no_gc  # noqa: F401 - plan() and the tactics read it from here
from ..contract import META_TAG


@dataclass
class OpInfo:
    node: fx.Node
    rule: OpRule | None
    operands: list           # per rule operand slot: value id
    results: list            # per rule result slot: value id or None (unused result)


class PartGraph:
    """Index of a captured GraphModule for propagation and lowering.

    Value ids (vid) number the tensor-valued nodes. `canon[vid]` maps tied values (a parameter and its updated
    output) to one representative, so they always share one sharding.
    """

    def __init__(self, gm: fx.GraphModule, registry: RuleRegistry, names: dict, ties: list):
        with no_gc():
            self._build(gm, registry, names, ties)

    def _build(self, gm, registry, names, ties) -> None:
        self.gm = gm
        self.values: list = []
        self.vid: dict = {}
        self.shapes: list = []
        for node in gm.graph.nodes:
            if isinstance(node.meta.get("val"), torch.Tensor):
                self.vid[node] = len(self.values)
                self.values.append(node)
                self.shapes.append(tuple(node.meta["val"].shape))
        n = len(self.values)
        self.producer = [-1] * n
        self.users: list = [[] for _ in range(n)]
        self.ops: list = []
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem:
                continue
            outs = result_vals(node)
            if not outs:
                continue
            rule = registry.build(node)
            operands = [self.vid[a] for a in tensor_operands(node)]
            if isinstance(node.meta.get("val"), torch.Tensor):
                results = [self.vid[node]]
            else:
                results = [None] * len(outs)
                for u in node.users:
                    if u.target is operator.getitem and u in self.vid:
                        results[u.args[1]] = self.vid[u]
            if rule is not None and (len(rule.operands) != len(operands) or len(rule.results) != len(results)):
                rule = None   # a rule that does not fit this call's arity is treated as absent
            i = len(self.ops)
            self.ops.append(OpInfo(node, rule, operands, results))
            for r in results:
                if r is not None:
                    self.producer[r] = i
            for v in set(operands):
                self.users[v].append(i)
        # names: "params.w" -> vid; and the reverse, for printing and errors
        self.name_to_vid = {name: self.vid[node] for name, node in names.items() if node in self.vid}
        self.vid_names: dict = {}
        for name, v in self.name_to_vid.items():
            self.vid_names.setdefault(v, name)
        self.canon = list(range(n))
        self.tied: list = [[v] for v in range(n)]
        for a, b in ties:   # (placeholder node, output node)
            va, vb = self.vid[a], self.vid[b]
            ca, cb = self.canon[va], self.canon[vb]
            if ca != cb:
                for v in self.tied[cb]:
                    self.canon[v] = ca
                self.tied[ca] += self.tied[cb]
                self.tied[cb] = []

    def name(self, vid: int) -> str:
        """The user-facing name of a value: its named value, else '<node>' with the nearest tag."""
        c = self.canon[vid]
        for v in (vid, c):
            if v in self.vid_names:
                return self.vid_names[v]
        node = self.values[vid]
        tag = node.meta.get(META_TAG)
        return f"{node.name} ({tag})" if tag else node.name
