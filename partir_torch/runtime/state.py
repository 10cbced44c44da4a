"""The program's state in torch.distributed.checkpoint's layout, and moving it in and out of eager modules.

`Program.state_dict()` is what `torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)` gives,
under two keys (torchtitan's checkpoint layout):

    {"model":     {"fc1.weight": T, "bn.running_mean": T, ...},           # model.state_dict() keys (persistent)
     "optimizer": {"state": {"fc1.weight": {"step": T, "exp_avg": T, "exp_avg_sq": T}, ...},
                   "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), ..., "params": ["fc1.weight", ...]}]}}

T is a DTensor on real ranks (the local shard held by the program, placements = its sharding; the step count a
plain tensor) and a full tensor in emulation. torch.distributed.checkpoint.save/load read and write it, and
load reshards into whatever layout the loading program has. `load_state_dict` accepts DTensors of any placement
and mesh, or full tensors.
"""
from __future__ import annotations

import torch

from ..errors import PartitionError

GROUP_SKIP = ("params",)


def model_keys(model: torch.nn.Module, state_names) -> dict:
    """model.state_dict() key -> program state name ("params.<fqn>" / "buffers.<fqn>"). Tied parameters appear
    under every key the module's own state_dict uses, all mapped to the one state value."""
    canon = {id(p): f"params.{k}" for k, p in model.named_parameters()}
    canon.update({id(b): f"buffers.{k}" for k, b in model.named_buffers()})
    out = {}
    for k, t in model.state_dict(keep_vars=True).items():
        name = canon.get(id(t))
        if name is not None and name in state_names:
            out[k] = name
    return out


def optimizer_fqns(model: torch.nn.Module, optimizer) -> list:
    """Per param group, the FQNs of its parameters (the optimizer's own order)."""
    names = {id(p): k for k, p in model.named_parameters()}
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise PartitionError(f"param group {gi} of the optimizer holds parameters of shapes {missing} that are "
                                 f"not parameters of the model given. Pass the model the optimizer was built on.")
        out.append([names[id(p)] for p in group["params"]])
    return out


def group_hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in GROUP_SKIP}


def to_global(value, name: str, shape, rt, sh):
    """A loaded value (DTensor of any placement/mesh, or full tensor) as this rank's shard under `sh`."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        same = getattr(rt, "device_mesh", None) is value.device_mesh and \
            tuple(value.placements) == tuple(sh.placements(rt.mesh))
        if same and tuple(value.shape) == tuple(shape):
            return value.to_local().detach().clone()
        value = value.full_tensor()
    if not isinstance(value, torch.Tensor):
        raise PartitionError(f"load_state_dict: {name} is a {type(value).__name__}, not a tensor.")
    if tuple(value.shape) != tuple(shape):
        raise PartitionError(f"load_state_dict: {name} has shape {tuple(value.shape)}; the program holds "
                             f"{tuple(shape)}. Load a checkpoint of the same model.")
    return rt.shard(value, sh)
