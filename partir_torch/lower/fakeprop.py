"""Local shapes on the per-device program: every node's meta["val"] gets a tensor with its local shape and dtype
(the simulator, the memory sweep and the reports read it).

The program is run once on `meta` tensors (shapes, dtypes and strides, no data, no memory): about 4x faster than
fake-tensor propagation (FakeTensorProp's dispatch cache and device bookkeeping), which matters because
`prog.simulate` lowers and annotates one program per tactic stage. Ops that create tensors on a device are run on
`meta` instead, constants are read as meta tensors; kernels of our own (lower/fuse.py's adam_update) take the shapes-only path on meta operands.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..contract import META_NAME

META = torch.device("meta")


def _makes_tensors(target) -> bool:
    """An aten factory (arange, zeros, full, ...): it takes a device, and would default to the CPU."""
    made = _FACTORIES.get(target)
    if made is None:
        schema = getattr(target, "_schema", None)
        made = _FACTORIES[target] = schema is not None and any(a.name == "device" and a.kwarg_only
                                                               for a in schema.arguments)
    return made


_FACTORIES: dict = {}


class _MetaProp(fx.Interpreter):
    def call_function(self, target, args, kwargs):
        if "device" in kwargs or _makes_tensors(target):
            kwargs = {**kwargs, "device": META}
        return target(*args, **kwargs)

    def get_attr(self, target, args, kwargs):
        t = super().get_attr(target, args, kwargs)            # a constant the capture kept (cpu): its meta twin
        return t.to(META) if isinstance(t, torch.Tensor) else t

    def run_node(self, n):
        out = super().run_node(n)
        n.meta["val"] = out
        return out


def annotate_graph(graph: fx.Graph, args: list) -> None:
    """meta["val"] on every node of a per-device graph being built (lower/ring.py reads the shapes), from meta
    tensors for its placeholders."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    with torch.no_grad():
        _MetaProp(_LazyGraphModule(torch.nn.Module(), graph)).run(*args)


def annotate_local_vals(lowered, captured) -> None:
    """Give every node of lowered.gm a meta-device tensor in meta["val"] with its local shape (no memory)."""
    gm = lowered.gm
    cap_vals = [n.meta["val"] for n in captured.gm.graph.nodes if n.op == "placeholder"]
    args = [torch.empty(tuple(shape) if shape is not None else tuple(val.shape), dtype=val.dtype, device=META)
            for val, shape in zip(cap_vals, lowered.local_shapes)]
    args += [torch.zeros((), dtype=torch.int64, device=META) for _ in lowered.coord_axes]
    with torch.no_grad():
        _MetaProp(gm).run(*args)
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    out.meta[META_NAME] = list(captured.output_names)
    lowered.annotated = True
