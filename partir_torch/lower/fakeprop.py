"""Local shapes on the per-device program: fake-tensor propagation fills node.meta["val"] (the simulator reads it)."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..contract import META_NAME


def annotate_local_vals(lowered, captured) -> None:
    """Give every node of lowered.gm a FakeTensor meta["val"] with its local shape (no memory is allocated)."""
    gm = lowered.gm
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    cap_vals = [n.meta["val"] for n in captured.gm.graph.nodes if n.op == "placeholder"]
    args = []
    with mode:
        for val, shape in zip(cap_vals, lowered.local_shapes):
            args.append(torch.empty(tuple(shape) if shape is not None else tuple(val.shape), dtype=val.dtype,
                                    device=val.device))
        args += [torch.zeros((), dtype=torch.int64) for _ in lowered.coord_axes]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    out.meta[META_NAME] = list(captured.output_names)
    lowered.annotated = True
