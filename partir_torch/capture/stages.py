"""Which module and which micro-batch made each traced op: what a pipeline tactic cuts the step by
(tactics/pipeline.py). Recorded only when the schedule has a pipeline tactic (capture(..., record_modules=True)).

- forward ops: the innermost module whose forward was running (a pre-hook / hook pair per module keeps the stack);
- backward ops: autograd traces them while it executes the backward Node of some forward op
  (torch._C._current_autograd_node()); each module's forward hook claims the autograd Nodes its forward created
  (walking its outputs' grad_fn graph back to its inputs' grad_fns, innermost module first; keyword inputs too:
  HF's layers pass hidden_states by keyword, and a walk that does not stop there claims the ops that made them), so
  a backward op carries the FQN of the module whose forward it differentiates (an op of the root's own forward,
  between its children: the root's FQN, as its forward op has);
- the micro-batch index (accumulate=k unrolls k micro-batches in one step) is set by the capture loop.

    with recording_modules(model) as rec:
        ... rec.micro = j ...        # every node made now gets node.meta[META_MICRO] = j
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

from ..contract import META_MICRO, META_MODULE


class _Recorder:
    def __init__(self):
        self.stack: list = []            # FQNs of the modules whose forward is running, innermost last
        self.owner: dict = {}            # autograd Node -> FQN of the innermost module whose forward made it
        self.inputs: dict = {}           # id(module) -> [grad_fns of its inputs] (a stack: modules may recurse)
        self.micro = None

    def pre(self, mod, args, kwargs, fqn):
        self.stack.append(fqn)
        self.inputs.setdefault(id(mod), []).append({a.grad_fn for a in _tensors((args, kwargs))
                                                    if a.grad_fn is not None})

    def post(self, mod, out, fqn):
        if self.stack and self.stack[-1] == fqn:
            self.stack.pop()
        stop = self.inputs[id(mod)].pop()
        todo = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
        seen: set = set()
        while todo:
            g = todo.pop()
            if g is None or g in seen or g in stop:
                continue
            seen.add(g)
            self.owner.setdefault(g, fqn)      # inner modules' hooks ran first: they keep their nodes
            todo.extend(f for f, _ in g.next_functions if f is not None)

    def module(self):
        if self.stack:
            return self.stack[-1]
        node = torch._C._current_autograd_node()
        return None if node is None else self.owner.get(node)


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for a in x for t in _tensors(a)]
    if isinstance(x, dict):
        return [t for a in x.values() for t in _tensors(a)]
    return []


@contextlib.contextmanager
def recording_modules(model: torch.nn.Module):
    """While active, every call_function node FX creates gets META_MODULE (its module's FQN, when one is known) and
    META_MICRO (the recorder's current micro-batch, when set)."""
    rec = _Recorder()
    handles = []
    for fqn, mod in model.named_modules():
        if fqn:
            handles.append(mod.register_forward_pre_hook(lambda m, a, kw, fqn=fqn: rec.pre(m, a, kw, fqn),
                                                         with_kwargs=True))
            handles.append(mod.register_forward_hook(lambda m, a, o, fqn=fqn: rec.post(m, o, fqn)))
    base = fx.proxy.TracerBase.create_node

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = base(self, kind, target, args, kwargs, name, type_expr)
        if kind == "call_function":
            m = rec.module()
            if m is not None:
                node.meta[META_MODULE] = m
            if rec.micro is not None:
                node.meta[META_MICRO] = rec.micro
        return node

    fx.proxy.TracerBase.create_node = create_node
    try:
        yield rec
    finally:
        fx.proxy.TracerBase.create_node = base
        for h in handles:
            h.remove()
