"""Tags on module outputs: `<fqn>:out` names a module's output in the captured graph, so a tactic can name an
intermediate without touching model code.

During capture, a forward hook on every submodule looks at the graph being traced (the make_fx proxy mode's
graph) and tags the newest node whose shape and dtype match the module's output: the op that produced it.
Tuple outputs are tagged `<fqn>:out.<i>`.
"""
from __future__ import annotations

import torch
from ..contract import META_TAG, META_TAGS


def tracing_graph():
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)
    return None if mode is None else mode.tracer.graph


def _tag(graph, t: torch.Tensor, name: str) -> None:
    shape, dtype = tuple(t.shape), t.dtype
    for i, node in enumerate(reversed(graph.nodes)):
        if i > 64:
            return
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor) and tuple(v.shape) == shape and v.dtype == dtype:
            node.meta.setdefault(META_TAG, name)
            node.meta.setdefault(META_TAGS, []).append(name)
            return


def install_hooks(model: torch.nn.Module) -> list:
    """Forward hooks tagging every submodule's tensor outputs. Returns the handles (remove them after capture)."""
    handles = []
    for fqn, mod in model.named_modules():
        if not fqn:
            continue

        def hook(mod, args, out, fqn=fqn):
            graph = tracing_graph()
            if graph is None:
                return
            if isinstance(out, torch.Tensor):
                _tag(graph, out, f"{fqn}:out")
            elif isinstance(out, (tuple, list)):
                for i, t in enumerate(out):
                    if isinstance(t, torch.Tensor):
                        _tag(graph, t, f"{fqn}:out.{i}")

        handles.append(mod.register_forward_hook(hook))
    return handles


def collect_tags(gm) -> dict:
    """name -> node for every tag left on the captured graph."""
    names = {}
    for node in gm.graph.nodes:
        for name in node.meta.get(META_TAGS, ()):
            names.setdefault(name, node)
    return names
