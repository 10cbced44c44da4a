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

from ..contract import STATE_ROLES  # noqa: F401  (runtime.executor reads it from here)
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


class StateIO:
    """The Executor's state in and out: gathered, as a state dict in the layout above (and back, resharded), and
    to / from eager modules and optimizers. A mixin of Executor (executor.py): it uses the executor's prog, rt,
    lowered, state (placeholder name -> local shard), steps, model and optimizer, and its ensure() and
    _placeholder()."""

    def _init_state(self, full: dict | None):
        """Hold `full` (state name -> full tensor; None: the eager model's and optimizer's) as local shards."""
        cap = self.prog.captured
        if full is None:
            full, self.steps = self._full_from(self.model, self.optimizer)
        self.state = {}
        for name, role, sh in zip(cap.input_names, cap.input_roles, self.lowered.input_layouts):
            if role in STATE_ROLES:
                self.state[name] = self.rt.shard(full[name], sh)

    def _layout(self, name):
        cap = self.prog.captured
        return self.lowered.input_layouts[cap.input_names.index(name)]

    def state_full(self) -> dict:
        g = self.prog.graph
        return {n: self.rt.full(t, self._layout(n), g.shapes[g.vid[self._placeholder(n)]])
                for n, t in self.state.items()}

    def gather_parameters(self) -> dict:
        self.ensure()
        g = self.prog.graph
        return {n[len("params."):]: self.rt.full(t, self._layout(n), g.shapes[g.vid[self._placeholder(n)]])
                for n, t in self.state.items() if n.startswith("params.")}

    def _value(self, n):
        """State value n as a DTensor (real ranks) or full tensor (emulation)."""
        g = self.prog.graph
        shape = g.shapes[g.vid[self._placeholder(n)]]
        t = self.state[n]
        return self.rt.dtensor(t, self._layout(n), shape) if hasattr(self.rt, "dtensor") else \
            self.rt.full(t, self._layout(n), shape)

    def state_dict(self) -> dict:
        """{"model": ..., "optimizer": ...} in get_state_dict's layout (see state.py)."""
        self.ensure()
        cap = self.prog.captured
        values: dict = {}
        get = lambda n: values[n] if n in values else values.setdefault(n, self._value(n))
        out = {"model": {k: get(n) for k, n in model_keys(self.model, self.state).items()}}
        if cap.fopt is not None:
            fqns = optimizer_fqns(self.model, self.optimizer)
            trainable = set(cap.trainable)
            state = {}
            for names in fqns:
                for f in names:
                    if f in trainable:
                        d = {"step": torch.tensor(float(self.steps), dtype=torch.float32)}
                        d.update({s: get(f"opt.{s}.{f}") for s in cap.fopt.state_names if f"opt.{s}.{f}" in self.state})
                        state[f] = d
            groups = [{**group_hyper(g), "params": list(f)} for g, f in zip(self.optimizer.param_groups, fqns)]
            out["optimizer"] = {"state": state, "param_groups": groups}
        return out

    def load_state_dict(self, sd: dict, strict: bool = True) -> None:
        """Reshard `sd` (state_dict()'s layout; DTensors of any placement or full tensors) into this program's
        layout; the optimizer's param groups take the checkpoint's hyperparameters, the step count its step."""
        self.ensure()
        cap = self.prog.captured
        if "model" not in sd:
            raise PartitionError(f"load_state_dict: expected the layout of prog.state_dict() ({{'model': ..., "
                                 f"'optimizer': ...}}); got keys {sorted(sd)[:5]}. A plain module state dict loads "
                                 f"as prog.load_state_dict({{'model': sd}}, strict=False).")
        g = self.prog.graph
        shape = lambda n: g.shapes[g.vid[self._placeholder(n)]]
        new, keys = {}, model_keys(self.model, self.state)
        for k, n in keys.items():
            if k in sd["model"] and n not in new:
                new[n] = to_global(sd["model"][k], k, shape(n), self.rt, self._layout(n))
        opt = sd.get("optimizer")
        steps = self.steps
        if opt is not None and cap.fopt is not None:
            for f, d in opt.get("state", {}).items():
                for s, v in d.items():
                    n = f"opt.{s}.{f}"
                    if s == "step":
                        steps = int(float(v.full_tensor() if hasattr(v, "full_tensor") else v))
                    elif n in self.state:
                        new[n] = to_global(v, f"optimizer state {f} {s}", shape(n), self.rt, self._layout(n))
            groups = opt.get("param_groups", [])
            if len(groups) != len(self.optimizer.param_groups):
                raise PartitionError(f"load_state_dict: the checkpoint has {len(groups)} param groups, the "
                                     f"optimizer {len(self.optimizer.param_groups)}.")
            for mine, theirs in zip(self.optimizer.param_groups, groups):
                mine.update(group_hyper(theirs))
            if cap.fopt.kind == "sgd" and not any(s == "step" for d in opt.get("state", {}).values() for s in d):
                steps = 1 if any("momentum_buffer" in d for d in opt.get("state", {}).values()) else 0
        required = set(keys.values()) | ({n for n in self.state if n.startswith("opt.")} if opt is not None else set())
        missing = sorted(required - set(new))
        if strict and missing:
            raise PartitionError(f"load_state_dict: the state dict lacks {len(missing)} value(s) the program holds: "
                                 f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (strict=False keeps "
                                 f"the current ones).")
        self.state.update(new)
        self.steps = steps

    def full_state_dict(self) -> dict:
        """model.state_dict()'s keys -> full tensors (every rank: gathers are collective)."""
        self.ensure()
        full = self.state_full()
        return {k: full[n] for k, n in model_keys(self.model, self.state).items()}

    def export_to(self, model=None, optimizer=None) -> None:
        """Write the current state into an eager module (parameters, buffers) and optimizer (per-parameter state,
        step, the param groups' hyperparameters), as torch.optim would hold them after the same steps."""
        model, optimizer = model or self.model, optimizer or self.optimizer
        self.ensure()
        cap = self.prog.captured
        full = self.state_full()
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        with torch.no_grad():
            for n, t in full.items():
                if n.startswith("params."):
                    params[n[len("params."):]].copy_(t)
                elif n.startswith("buffers."):
                    buffers[n[len("buffers."):]].copy_(t)
        if optimizer is None or cap.fopt is None:
            return
        for gi, (group, names) in enumerate(zip(optimizer.param_groups, optimizer_fqns(model, optimizer))):
            if optimizer is not self.optimizer:
                group.update(group_hyper(self.optimizer.param_groups[gi]))
            for p, f in zip(group["params"], names):
                st = {s: full[f"opt.{s}.{f}"].clone() for s in cap.fopt.state_names if f"opt.{s}.{f}" in full}
                if self.steps == 0 or f not in cap.trainable:
                    optimizer.state.pop(p, None)
                    continue
                if cap.fopt.kind != "sgd":
                    st["step"] = torch.tensor(float(self.steps), dtype=torch.float32)
                optimizer.state[p] = st

    def import_from(self, model=None, optimizer=None) -> None:
        """Take the state from an eager module and optimizer (after editing weights): the inverse of export_to."""
        model, optimizer = model or self.model, optimizer or self.optimizer
        self.ensure()
        if optimizer is not None and optimizer is not self.optimizer and self.optimizer is not None:
            for mine, theirs in zip(self.optimizer.param_groups, optimizer.param_groups):
                mine.update(group_hyper(theirs))
        full, steps = self._full_from(model, optimizer)
        self.state = None
        self._init_state(full)
        self.steps = steps

    def _full_from(self, model, optimizer) -> tuple:
        """Full state tensors by name, and the step count, from an eager module and optimizer."""
        cap = self.prog.captured
        params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
        for t in list(params.values()) + list(buffers.values()):
            if t.device.type == "meta":
                raise PartitionError("partition: the model lives on the meta device, so it cannot run. Build it "
                                     "on a real device (or model.to_empty(device=...) and initialise) first; "
                                     "meta models can be partitioned, printed and simulated.")
        full = {f"params.{k}": p.detach() for k, p in params.items()}
        full.update({f"buffers.{k}": b.detach() for k, b in buffers.items()})
        steps = set()
        if cap.fopt is not None and optimizer is not None:
            for group, names in zip(optimizer.param_groups, optimizer_fqns(model, optimizer)):
                for p, f in zip(group["params"], names):
                    if f not in cap.trainable:
                        continue
                    old = optimizer.state.get(p, {})
                    for s in cap.fopt.state_names:
                        if f"opt.{s}.{f}" in self.state_names():
                            src = old.get(s)
                            full[f"opt.{s}.{f}"] = torch.zeros_like(params[f].detach()) if src is None else \
                                src.detach().to(params[f].device, params[f].dtype, copy=True)
                    if cap.fopt.kind != "sgd":
                        steps.add(int(float(old["step"])) if "step" in old else 0)
                    elif old.get("momentum_buffer") is not None:
                        steps.add(1)
            if len(steps) > 1 and cap.fopt.kind != "sgd":
                raise PartitionError(f"the optimizer's parameters have different step counts {sorted(steps)}; the "
                                     f"program keeps one step count for all of them.")
        return full, max(steps) if steps else 0

    def state_names(self) -> set:
        cap = self.prog.captured
        return {n for n, r in zip(cap.input_names, cap.input_roles) if r in STATE_ROLES}
