"""The optimizer update of a captured step: traced once per class of parameters, copied for each parameter.

Traced op by op, the update costs make_fx about 10 ms per parameter (16 ops for AdamW, each through the
functional, proxy and fake tensor modes): 5 of the 12 CPU s of a 48-layer Llama's capture. The parameters of one
param group whose parameter, gradient and state tensors have the same shapes, strides and dtypes get the same ops
with the same metadata, so capture traces the step up to the (clipped) gradients only, and `splice_update` adds
the update to that graph:

- a group's scalar math (bias corrections, step size: ``FunctionalOptimizer.scalars``) is traced once per
  (group, dtype) as a small graph over the hyperparameter and step placeholders, and copied where the inline
  trace computes it: just before the first parameter that uses it;
- one parameter's update (``FunctionalOptimizer.apply``) is traced once per class, as a graph over (parameter,
  gradient, state, scalars, hyperparameters), and copied for each parameter of the class onto its own nodes.

The copies are made in the inline trace's order and place (after the gradients, before the writes into mutated
buffers), named as it names them (FX numbers each op's name in creation order) and with its node meta ("val" and
"tensor_meta", shared with the template: the copies have the same metadata), so the graph is the one the inline
trace builds; tests/test_capture.py compares the two.

    splice_update(gm, lay, updated, anchor, trace)   # gm's output: [loss, grads..., norm?] -> the step's outputs
"""
from __future__ import annotations

import torch
import torch.fx as fx


def _signature(v: torch.Tensor) -> tuple:
    return tuple(v.shape), tuple(v.stride()), v.dtype, v.device


def _like(v: torch.Tensor) -> torch.Tensor:
    """A fresh fake tensor with the metadata of `v` (a node's meta["val"]), in v's fake mode."""
    with v.fake_mode:
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)


class _Splicer:
    """Copies the traced templates into `graph` at its current insert point."""

    def __init__(self, graph: fx.Graph, fopt, placeholders: dict, hyper_keys: list, trace):
        self.graph, self.fopt, self.trace = graph, fopt, trace
        self.step = placeholders["step"]
        # a step that branches (branches.py): each parameter's own step count, as torch.optim keeps it (a layer
        # that layerdrop skips has no gradient that step, and its count stays)
        self.steps = {k[len("step."):]: v for k, v in placeholders.items() if k.startswith("step.")}
        self.hyper = {}             # group -> ([(group, name)], [placeholder])
        for g, h in hyper_keys:
            keys, nodes = self.hyper.setdefault(g, ([], []))
            keys.append((g, h)), nodes.append(placeholders[f"hparams.{g}.{h}"])
        self.scalars: dict = {}     # (group, dtype, step) -> tuple of nodes (None where a scalar is unused)
        self.templates: dict = {}   # class -> traced apply

    def _copy(self, template: fx.GraphModule, inputs: list) -> list:
        """Copy the template's ops, its placeholders bound to `inputs`; returns the nodes of its outputs."""
        env, bound = {}, iter(inputs)
        for n in template.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(bound)
            elif n.op == "output":
                return [env[a] for a in n.args[0]]
            elif n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
                env[n] = self.graph.create_node(
                    "call_function", n.target, fx.map_arg(n.args, env.__getitem__),
                    fx.map_arg(n.kwargs, env.__getitem__),
                    name=self.graph._target_to_str(n.target.overloadpacket.__name__))   # as make_fx names it
                env[n].meta.update(n.meta)
            else:
                raise RuntimeError(f"capture: the optimizer update traced {n.format_node()}; only aten ops can be "
                                   f"copied per parameter (partir_torch/capture/replicate.py).")
        raise RuntimeError("capture: a traced optimizer template has no output")

    def _group_scalars(self, gi: int, dtype: torch.dtype, step: fx.Node) -> tuple:
        """The scalar nodes of (group gi, dtype, step count), copied in on first use."""
        if (gi, dtype, step) not in self.scalars:
            keys, nodes = self.hyper.get(gi, ([], []))
            used = []

            def scalars(*xs):
                group = self.fopt.group_values(gi, dict(zip(keys, xs[:-1])))
                out = self.fopt.scalars(group, group["lr"], xs[-1].to(torch.float64), dtype)
                used[:] = [t is not None for t in out]
                return [t for t in out if t is not None]

            inputs = nodes + [step]
            outs = iter(self._copy(self.trace(scalars, [_like(n.meta["val"]) for n in inputs]), inputs))
            self.scalars[(gi, dtype, step)] = tuple(next(outs) if u else None for u in used)
        return self.scalars[(gi, dtype, step)]

    def update(self, fqn: str, param: fx.Node, grad: fx.Node, states: list) -> list:
        """Copy one parameter's update in; returns [new param, new state...] (state in fopt.names_for order)."""
        gi = self.fopt.group_index(fqn)
        names = self.fopt.names_for(fqn)
        scalars = self._group_scalars(gi, param.meta["val"].dtype, self.steps.get(fqn, self.step))
        keys, hyper = self.hyper.get(gi, ([], []))
        sc_nodes = [s for s in scalars if s is not None]
        inputs = [param, grad] + states + sc_nodes + hyper
        cls = (gi, names, tuple(_signature(n.meta["val"]) for n in inputs))
        if cls not in self.templates:
            ns, nsc = len(names), len(sc_nodes)

            def apply(*xs):
                it = iter(xs[2 + ns:2 + ns + nsc])
                sc = tuple(next(it) if s is not None else None for s in scalars)
                group = self.fopt.group_values(gi, dict(zip(keys, xs[2 + ns + nsc:])))
                old = dict(zip(names, xs[2:2 + ns]))
                new_p, new = self.fopt.apply(group, xs[0], xs[1], old, sc)
                return [new_p] + [new.get(n, old[n]) for n in names]

            self.templates[cls] = self.trace(apply, [_like(n.meta["val"]) for n in inputs])
        return self._copy(self.templates[cls], inputs)


def splice_update(gm: fx.GraphModule, lay, updated: list, anchor: fx.Node, trace, gated=None) -> None:
    """Add the optimizer update to `gm`, traced without it: its output holds [loss, the gradient of each parameter
    of `updated` (FunctionalOptimizer.updated's order), grad_norm if clipped], and `anchor` is the last node traced
    before the update. Afterwards the output holds the step's: [loss, new parameters (lay.trainable), new optimizer
    state (lay.state_keys), grad_norm if clipped]. `trace(fn, example_inputs)` traces a template as capture traces
    the step. gated: fqn -> the predicate (a bool node) under which the parameter's layer was skipped
    (capture/gates.py): its new parameter and state are `where(skipped, old, new)`, as torch.optim leaves a
    parameter without a gradient alone."""
    graph, fopt = gm.graph, lay.fopt
    placeholders = dict(zip(lay.names, (n for n in graph.nodes if n.op == "placeholder")))
    out_node = next(iter(reversed(graph.nodes)))
    outs = list(out_node.args[0])
    grads = dict(zip(updated, outs[1:1 + len(updated)]))
    new_p = {k: placeholders[f"params.{k}"] for k in lay.trainable}
    new_s = {key: placeholders[f"opt.{key[0]}.{key[1]}"] for key in lay.state_keys}
    splicer = _Splicer(graph, fopt, placeholders, lay.hyper_keys, trace)
    with graph.inserting_before(anchor.next):
        for fqn in updated:
            names = fopt.names_for(fqn)
            old = [new_p[fqn]] + [new_s[(s, fqn)] for s in names]
            new = splicer.update(fqn, old[0], grads[fqn], old[1:])
            if gated and fqn in gated:
                new = [_masked(graph, gated[fqn], o, n) for o, n in zip(old, new)]
            new_p[fqn] = new[0]
            new_s.update({(s, fqn): n for s, n in zip(names, new[1:])})
    out_node.args = ([outs[0]] + [new_p[k] for k in lay.trainable] + [new_s[key] for key in lay.state_keys]
                     + outs[1 + len(updated):],)


def _masked(graph: fx.Graph, nograd: fx.Node, old: fx.Node, new: fx.Node) -> fx.Node:
    node = graph.call_function(torch.ops.aten.where.self, (nograd, old, new))
    node.meta.update(new.meta)
    return node
