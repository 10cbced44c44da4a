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

import weakref

import torch

from ..contract import STATE_ROLES
from ..errors import PartitionError
from .layout import padded, same_layout
from .owner import Owner, internal
from .writeback import check_target, group_hyper, optimizer_fqns, write_into



def model_keys(model: torch.nn.Module, state_names) -> dict:
    """model.state_dict() key -> program state name ("params.<fqn>" / "buffers.<fqn>"). Tied parameters appear
    under every key the module's own state_dict uses, all mapped to the one state value."""
    canon = {id(p): f"params.{k}" for k, p in model.named_parameters()}
    canon.update({id(b): f"buffers.{k}" for k, b in model.named_buffers()})
    out = {}
    with internal():                 # the keys only: not a read of stale values (owner.py)
        sd = model.state_dict(keep_vars=True)
    for k, t in sd.items():
        name = canon.get(id(t))
        if name is not None and name in state_names:
            out[k] = name
    return out


def to_global(value, name: str, shape, rt, sh):
    """A loaded value (DTensor of any placement/mesh, or full tensor) as this rank's shard under `sh`."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        same = rt.device_mesh is value.device_mesh and \
            tuple(value.placements) == tuple(sh.placements(rt.mesh))
        if same and tuple(value.shape) == tuple(shape):
            return padded(value.to_local().detach(), sh, rt.mesh, shape).clone()
        value = value.full_tensor()
    if not isinstance(value, torch.Tensor):
        raise PartitionError(f"load_state_dict: {name} is a {type(value).__name__}, not a tensor.")
    if tuple(value.shape) != tuple(shape):
        raise PartitionError(f"load_state_dict: {name} has shape {tuple(value.shape)}; the program holds "
                             f"{tuple(shape)}. Load a checkpoint of the same model.")
    return rt.shard(value, sh)


class HeldState:
    """The state a program holds between steps (parameters, buffers, optimizer state as local shards on a backend,
    and the step count), and moving it in and out: gathered, as a state dict in the layout above (and back,
    resharded), and to / from eager modules and optimizers. The Executor (executor.py) owns one and attaches it to
    its backend (attach)."""

    def __init__(self, plan, model, optimizer):
        self.plan, self.model, self.optimizer = plan, model, optimizer
        cap, g = plan.captured, plan.graph
        # each state value's layout: its final decisions (what lowering keeps it in between steps)
        self.layouts = {name: plan.sharding(g.vid[node]) for name, node in cap.names.items()
                        if node.op == "placeholder" and node in g.vid}
        self.rt = None
        self.state: dict | None = None       # placeholder name -> local tensor
        self.steps = 0
        self.param_steps: dict = {}          # fqn -> its own step count, where a step that branches left it behind
        # who holds the newer weights: this state or the eager module (owner.py)
        self.owner = Owner(model, weakref.WeakMethod(self.state_full), weakref.WeakMethod(self._write_back),
                           optimizer)

    def attach(self, rt) -> None:
        """Hold the state on backend `rt`: first from the eager model and optimizer, later (a new backend) the
        state held so far, moved over."""
        full = self.state_full() if self.state is not None else None
        self.rt = rt
        self.state = None
        self._init_state(full)

    def _init_state(self, full: dict | None):
        """Hold `full` (state name -> full tensor; None: the eager model's and optimizer's) as local shards."""
        cap = self.plan.captured
        taken = full is None
        if taken:
            self.owner.claim("the program's first call")
            full, self.steps = self._full_from(self.model, self.optimizer)
        self.state = {}
        # real ranks of a pipelined program (p2p.py): a rank holds only its stages' state (others' as empty tensors)
        for name, role in zip(cap.input_names, cap.input_roles):
            if role in STATE_ROLES and not self._held_here(name):
                self.state[name] = torch.empty(0, dtype=full[name].dtype, device=self.rt.device)
            elif role in STATE_ROLES:
                try:
                    self.state[name] = self.rt.shard(full[name], self.layouts[name])
                except PartitionError as e:      # a layout this backend cannot hold: name the value
                    raise PartitionError(f"{name}: {e}") from None
        if taken:
            self.owner.synced()

    def guard(self, what: str, refuse: bool = True) -> None:
        """Before a call that reads the state: an eager edit of the module since the state last equalled it is
        taken again while the program has not moved the state, and (refuse) refused once it has (owner.py); the
        readers of the program's own state (gather_parameters, state_dict) pass refuse=False: the program's state
        is what they ask for."""
        if refuse:
            self.owner.refuse_released(what)  # a program whose module a newer one took: no step, no evaluation
        edited = self.owner.edited()
        if not edited or self.owner.released is not None:   # a released program reads its own state
            return
        if self.owner.ahead:
            if refuse and not self.owner.written_back():
                self.owner.refuse_edit(what, edited)
            return
        steps = self.steps
        self.import_from(self.model, self.optimizer)
        if self.plan.captured.fopt is not None and self.plan.captured.fopt.kind == "sgd":
            self.steps = steps                   # SGD keeps no step count of its own to read back

    def relayout(self, layouts: dict) -> None:
        """Hold each state value in `layouts` (the layouts of the program of another input shape, runtime/shapes.py);
        a value in another layout is resharded through its full value (exact; gathers on real ranks)."""
        for n, sh in layouts.items():
            have = self.layouts[n]
            if not same_layout(sh, have):
                self.state[n] = self.rt.shard(self._full(n, self.state[n], have), sh)
                self.layouts[n] = sh

    def _layout(self, name):
        return self.layouts[name]

    def _shape(self, name):
        g = self.plan.graph
        return g.shapes[g.vid[self.plan.captured.names[name]]]

    def _full(self, n, t, layout=None):
        """State value n whole; on real ranks of a pipelined program, read from the stage that holds it."""
        layout = self._layout(n) if layout is None else layout
        if self.rt.stages is not None:
            dtype = self.plan.captured.names[n].meta["val"].dtype
            return self.rt.stages.full_owned(t, layout, self._shape(n), n, dtype)
        return self.rt.full(t, layout, self._shape(n))

    def state_full(self) -> dict:
        return {n: self._full(n, t) for n, t in self.state.items()}

    def full(self, name: str) -> torch.Tensor:
        """One state value whole (gathered on real ranks)."""
        return self.rt.full(self.state[name], self._layout(name), self._shape(name))

    def gather_parameters(self) -> dict:
        self.guard("gather_parameters", refuse=False)
        return {n[len("params."):]: self._full(n, t) for n, t in self.state.items() if n.startswith("params.")}

    def _value(self, n):
        """State value n as a DTensor (real ranks) or full tensor (emulation); on real ranks of a pipelined program,
        None where another stage holds it."""
        if self.rt.stages is not None:
            return self.rt.stages.value_owned(self.state[n], self._layout(n), self._shape(n), n)
        return self.rt.value(self.state[n], self._layout(n), self._shape(n))

    def _held_here(self, n) -> bool:
        """Whether this rank holds state value n (all do, but on real ranks of a pipelined program: the ranks of its
        stage, of each stage reading a tied weight)."""
        return self.rt.stages is None or self.rt.stages.holds(n)

    def state_dict(self) -> dict:
        """{"model": ..., "optimizer": ...} in get_state_dict's layout (see state.py)."""
        self.guard("state_dict", refuse=False)
        cap = self.plan.captured
        values: dict = {}
        get = lambda n: values[n] if n in values else values.setdefault(n, self._value(n))
        out = {"model": {k: get(n) for k, n in model_keys(self.model, self.state).items() if self._held_here(n)}}
        if cap.fopt is not None:
            fqns = optimizer_fqns(self.model, self.optimizer)
            trainable = set(cap.trainable)
            state = {}
            for names in fqns:
                for f in names:
                    if f in trainable and self._held_here(f"params.{f}"):
                        d = {"step": torch.tensor(float(self.param_steps.get(f, self.steps)), dtype=torch.float32)}
                        d.update({s: get(f"opt.{s}.{f}") for s in cap.fopt.state_names if f"opt.{s}.{f}" in self.state})
                        state[f] = d
            groups = [{**group_hyper(g), "params": list(f)} for g, f in zip(self.optimizer.param_groups, fqns)]
            out["optimizer"] = {"state": state, "param_groups": groups}
        return out

    def load_state_dict(self, sd: dict, strict: bool = True) -> None:
        """Reshard `sd` (state_dict()'s layout; DTensors of any placement or full tensors) into this program's
        layout; the optimizer's param groups take the checkpoint's hyperparameters, the step count its step."""
        cap = self.plan.captured
        if "model" not in sd:
            raise PartitionError(f"load_state_dict: expected the layout of prog.state_dict() ({{'model': ..., "
                                 f"'optimizer': ...}}); got keys {sorted(sd)[:5]}. A plain module state dict loads "
                                 f"as prog.load_state_dict({{'model': sd}}, strict=False).")
        shape = self._shape
        new, keys = {}, model_keys(self.model, self.state)
        for k, n in keys.items():
            if k in sd["model"] and n not in new and self._held_here(n):
                new[n] = to_global(sd["model"][k], k, shape(n), self.rt, self._layout(n))
        opt = sd.get("optimizer")
        steps = self.steps
        if opt is not None and cap.fopt is not None:
            for f, d in opt.get("state", {}).items():
                for s, v in d.items():
                    n = f"opt.{s}.{f}"
                    if s == "step":
                        steps = int(float(v.full_tensor() if hasattr(v, "full_tensor") else v))
                    elif n in self.state and self._held_here(n):
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
        missing = sorted(n for n in required - set(new) if self._held_here(n))
        if strict and missing:
            raise PartitionError(f"load_state_dict: the state dict lacks {len(missing)} value(s) the program holds: "
                                 f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (strict=False keeps "
                                 f"the current ones).")
        self.state.update(new)
        self.steps = steps
        self.moved()

    def full_state_dict(self) -> dict:
        """model.state_dict()'s keys -> full tensors (every rank: gathers are collective)."""
        self.guard("full_state_dict", refuse=False)
        full = self.state_full()
        return {k: full[n] for k, n in model_keys(self.model, self.state).items()}

    def export_to(self, model=None, optimizer=None) -> None:
        """Write the current state into an eager module (parameters, buffers) and optimizer (per-parameter state,
        step, the param groups' hyperparameters), as torch.optim would hold them after the same steps. Names,
        shapes and dtypes are checked first: on a mismatch nothing is written."""
        model, optimizer = model or self.model, optimizer or self.optimizer
        if model is self.model:
            self.owner.refuse_released("export_to")
        check_target(self, model, optimizer)
        write_into(self, model, optimizer)
        if model is self.model:
            self.owner.synced()

    def moved(self) -> None:
        """The held state changed (a step, a buffer update, a load): the module is written through where that
        needs no collective (owner.py), else it is stale until export_to."""
        self.owner.moved()
        if self.through():
            write_into(self, self.model, self.optimizer)
            self.owner.synced()

    def through(self) -> bool:
        """Whether the state is written into the eager module after every call that moves it: always in emulation,
        on real ranks where every state value is whole on each rank (no gather needed; owner.py)."""
        if self.model is None or self.rt is None or self.owner.released is not None:
            return False
        return all(self.rt.local_full(self.layouts[n]) for n in self.state)

    def _write_back(self):
        """For owner.take_over: the state written back into the module it was taken from (collective on real
        ranks), or None where the state was never taken."""
        if self.state is None or self.rt is None or self.model is None:
            return None
        return lambda: self.export_to(self.model, self.optimizer)

    def _put(self, n: str, dest: torch.Tensor) -> torch.Tensor:
        """State value n whole, written into `dest` in place (gathered on real ranks where it is tiled)."""
        if self.rt.stages is not None:
            dest.copy_(self._full(n, self.state[n]))
        else:
            self.rt.full_into(dest, self.state[n], self._layout(n), self._shape(n))
        return dest

    def import_from(self, model=None, optimizer=None) -> None:
        """Take the state from an eager module and optimizer (after editing weights): the inverse of export_to."""
        model, optimizer = model or self.model, optimizer or self.optimizer
        if self.model is not None and self.state is not None:
            self.owner.claim("import_from")          # this program takes its module back (owner.py)
            self.owner.released = None
        if optimizer is not None and optimizer is not self.optimizer and self.optimizer is not None:
            for mine, theirs in zip(self.optimizer.param_groups, optimizer.param_groups):
                mine.update(group_hyper(theirs))
        full, steps = self._full_from(model, optimizer)
        self.state = None
        self._init_state(full)
        self.steps = steps
        self.owner.synced()                  # the module's current tensors are what the program holds (or, from
        if model is not self.model:          # another module, what it no longer holds: the program is ahead)
            self.moved()

    def _full_from(self, model, optimizer) -> tuple:
        """Full state tensors by name, and the step count, from an eager module and optimizer."""
        cap = self.plan.captured
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
        cap = self.plan.captured
        return {n for n, r in zip(cap.input_names, cap.input_roles) if r in STATE_ROLES}

