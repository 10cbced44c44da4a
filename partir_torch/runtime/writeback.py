"""The state a program holds, written into an eager module and optimizer: export_to, and the write-through after
every call that moves the state (runtime/owner.py). Every value is checked first (names, shapes, dtypes: nothing
is written on a mismatch), then written in place, each rank's block into its view of the destination."""
from __future__ import annotations

import torch

from ..errors import PartitionError
from .owner import internal

GROUP_SKIP = ("params",)


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


def check_target(held, model, optimizer) -> None:
    """export_to's target holds every state value of `held` (a HeldState) under its name, shape and dtype (else
    PartitionError, before anything is written)."""
    mine = {f"params.{k}": t for k, t in model.named_parameters()}
    mine.update({f"buffers.{k}": t for k, t in model.named_buffers()})
    bad = []
    for n in held.state:
        if not n.startswith(("params.", "buffers.")):
            continue
        t, want = mine.get(n), held.plan.captured.names[n].meta["val"]
        if t is None:
            bad.append(f"{n} is missing")
        elif tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype:
            bad.append(f"{n} is {tuple(t.shape)} {t.dtype}, the program holds {tuple(want.shape)} {want.dtype}")
    if bad:
        raise PartitionError(
            f"export_to: the {type(model).__name__} given does not match the program's state ({len(bad)} "
            f"value(s)): {'; '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}. Nothing was written. Export into "
            f"the module given to partition() or one built the same way.")
    if optimizer is not None and held.plan.captured.fopt is not None:
        optimizer_fqns(model, optimizer)           # its parameters are the module's (else PartitionError)
        if len(optimizer.param_groups) != len(held.optimizer.param_groups):
            raise PartitionError(f"export_to: the optimizer has {len(optimizer.param_groups)} param groups, "
                                 f"the program's {len(held.optimizer.param_groups)}. Nothing was written.")


def write_into(held, model, optimizer) -> None:
    """The state `held` (a HeldState) holds, into the module's tensors and the optimizer's state, in place (into the
    optimizer's tensors where it holds them at the shape, as torch.optim updates them)."""
    cap = held.plan.captured
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    with torch.no_grad(), internal():
        for n in held.state:
            if n.startswith("params."):
                held._put(n, params[n[len("params."):]])
            elif n.startswith("buffers."):
                held._put(n, buffers[n[len("buffers."):]])
    if optimizer is None or cap.fopt is None:
        return
    for gi, (group, names) in enumerate(zip(optimizer.param_groups, optimizer_fqns(model, optimizer))):
        if optimizer is not held.optimizer:
            group.update(group_hyper(held.optimizer.param_groups[gi]))
        for p, f in zip(group["params"], names):
            own = held.param_steps.get(f, held.steps)    # a parameter a branching step left behind
            if own == 0 or f not in cap.trainable:
                optimizer.state.pop(p, None)
                continue
            st = optimizer.state.setdefault(p, {})
            for s in cap.fopt.state_names:
                n = f"opt.{s}.{f}"
                if n in held.state:
                    have, want = st.get(s), held._shape(n)
                    fits = isinstance(have, torch.Tensor) and tuple(have.shape) == tuple(want) and \
                        have.dtype == held.plan.captured.names[n].meta["val"].dtype
                    st[s] = held._put(n, have if fits else p.new_empty(want, dtype=cap.names[n].meta["val"].dtype))
            if cap.fopt.kind != "sgd":
                _assign(st, "step", torch.tensor(float(own), dtype=torch.float32))


def _assign(state: dict, key: str, value: torch.Tensor) -> None:
    """state[key] = value, written into the tensor already there when it has the shape and dtype (write-through
    keeps the eager optimizer's tensors, as torch.optim updates them in place)."""
    have = state.get(key)
    if isinstance(have, torch.Tensor) and have.shape == value.shape and have.dtype == value.dtype:
        have.copy_(value)
    else:
        state[key] = value.detach().clone()
