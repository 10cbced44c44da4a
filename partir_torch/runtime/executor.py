"""Runs a lowered program step after step: state (parameters, buffers, optimizer state) stays as local shards."""
from __future__ import annotations

import hashlib

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..capture import FORWARD, LOSS_AND_GRADS, TRAIN
from ..errors import PartitionError, internal_error
from ..lower.lower import lower
from .distributed import DistributedRuntime, real_ranks_active
from .interpret import InterpretedRuntime
from .state import group_hyper, model_keys, optimizer_fqns, to_global
from ..contract import META_SRC

STATE_ROLES = ("param", "buffer", "opt_state")


class Executor:
    # emulated ranks: plain tensors per rank, collectives computed over them (interpret.py); tests swap in
    # emulate.EmulatedRuntime (LocalTensorMode) as a cross-check
    emulator = InterpretedRuntime

    def __init__(self, prog, model, optimizer):
        self.prog, self.model, self.optimizer = prog, model, optimizer
        self.rt = None
        self.lowered = None
        self.state: dict | None = None       # placeholder name -> local tensor
        self.steps = 0
        self.last_grad_norm = None
        self._hyper = None                   # this call's optimizer hyperparameters, read from the param groups

    @property
    def evaluator(self):
        """eval_step / forward on the live state (evaluate.py), one captured program per input signature."""
        if getattr(self, "_evaluator", None) is None:
            from .evaluate import Evaluator

            self._evaluator = Evaluator(self)
        return self._evaluator

    # -- set-up ----------------------------------------------------------------------------------------------------
    def ensure(self):
        if self.rt is None or not self.rt.valid():
            mesh = self.prog.mesh
            compile_ = getattr(self.prog.options, "compile", False)
            self.rt = DistributedRuntime(mesh, self.prog.options.timeout_s, compile=compile_) if \
                real_ranks_active() else self.emulator(mesh, compile=compile_)
            self.lowered = lower(self.prog, self.rt.groups)
            if isinstance(self.rt, DistributedRuntime):
                # group names differ between ranks (each rank numbers its own groups): hash the axis names instead
                code = self.lowered.gm.code
                for axis, gname in self.rt.groups.items():
                    code = code.replace(repr(gname), repr(f"axis:{axis}"))
                if any(str(n.target).startswith(("aten.bernoulli", "aten.rand", "aten.native_dropout"))
                       for n in self.lowered.gm.graph.nodes):
                    # random draws must agree on every rank: include the generator state in the plan
                    # (hashlib: Python's hash() of bytes is salted per process)
                    code += f"\n# rng {hashlib.sha256(bytes(torch.get_rng_state().numpy())).hexdigest()}"
                self.rt.check_plan(code)
            if self.state is not None:   # runtime re-created (emulation): re-shard the state we hold
                full = self.state_full()
                self.state = None
                self._init_state(full)
        if self.state is None:
            self._init_state(None)
        return self.lowered

    def _init_state(self, full: dict | None):
        cap = self.prog.captured
        if full is None:
            full, self.steps = self._full_from(self.model, self.optimizer)
        self.state = {}
        for name, role, sh in zip(cap.input_names, cap.input_roles, self.lowered.input_layouts):
            if role in STATE_ROLES:
                self.state[name] = self.rt.shard(full[name], sh)

    # -- running ---------------------------------------------------------------------------------------------------
    def _args(self, batch, local: bool):
        cap = self.prog.captured
        flat, _ = tree_flatten(tuple(batch))
        n_in = sum(1 for r in cap.input_roles if r == "input")
        if len(flat) != n_in:
            raise PartitionError(f"the program was captured with {n_in} input tensors; got {len(flat)}.")
        args, k = [], 0
        for name, role, sh, shp in zip(cap.input_names, cap.input_roles, self.lowered.input_layouts,
                                       self.lowered.local_shapes):
            if role in STATE_ROLES:
                args.append(self.state[name])
            elif role == "lr":   # hparams.<group>.<name>: read from the optimizer's param groups at every step
                if self._hyper is None:
                    self._hyper = cap.fopt.hyper_values()
                _, g, h = name.split(".")
                args.append(self.rt.local(torch.tensor(self._hyper[(int(g), h)], dtype=torch.float64)))
            elif role == "const":
                args.append(self.rt.shard(cap.consts[name], sh))
            elif role == "step":
                args.append(self.rt.local(torch.tensor(float(self.steps + 1), dtype=torch.float64)))
            else:
                x = flat[k]
                k += 1
                want = self.prog.graph.shapes[self.prog.graph.vid[self._placeholder(name)]]
                self._check_input(name, x)
                if local:
                    if tuple(x.shape) != tuple(shp):
                        raise PartitionError(f"train_step_local: {name} has shape {tuple(x.shape)}, but each rank's "
                                             f"shard must have shape {tuple(shp)} (global {tuple(want)}, {sh}).")
                    args.append(self.rt.local(x))
                else:
                    if tuple(x.shape) != tuple(want):
                        raise PartitionError(f"{name} has shape {tuple(x.shape)}; the program was captured with "
                                             f"{tuple(want)}. Re-partition for new shapes.")
                    args.append(self.rt.shard(x, sh))
        return args + self.rt.coords()

    def _check_input(self, name, x):
        """The call's input against the captured one: type, dtype and device (shapes are checked by the caller,
        against the global or the per-rank shape)."""
        val = self._placeholder(name).meta["val"]
        if not isinstance(x, torch.Tensor):
            raise PartitionError(f"{name} is a {type(x).__name__}; the program was captured with a tensor "
                                 f"{tuple(val.shape)} {val.dtype} there.")
        if x.dtype != val.dtype:
            raise PartitionError(f"{name} has dtype {x.dtype}; the program was captured with {val.dtype} "
                                 f"(shape {tuple(val.shape)}). Convert it (x.to({val.dtype})) or re-partition with "
                                 f"example inputs of this dtype.")
        dev = self.prog.captured.device
        if x.device.type == "meta" or (x.device.type != dev.type and dev.type != "meta"):
            raise PartitionError(f"{name} is on {x.device}; the program runs on {dev.type}. Move the batch there "
                                 f"(x.to('{dev.type}')).")

    def _placeholder(self, name):
        return self.prog.captured.names[name]

    def run(self, batch, local=False):
        """Random ops (dropout) are drawn whole on every rank from the caller's generator and sliced (their rule
        keeps them whole), so a step equals the single-device step given the same generator state; on real ranks
        every process must be seeded alike (checked with the plan at start-up)."""
        low = self.ensure()
        self._hyper = None
        args = self._args(batch, local)
        try:
            return list(self.rt.run(low.gm, args))
        except PartitionError:
            raise
        except Exception as e:  # noqa: BLE001 - a failing per-device op is a bug of ours: name its node
            raise internal_error(self._failing_node(low.gm, e), "running", e) from e

    def _failing_node(self, gm, exc):
        """The captured node whose per-device op raised `exc` (from the generated code's line), else None."""
        import traceback

        name = getattr(exc, "partir_node", None)   # emulated: the interpreter names the node of its segment
        if name is not None:
            node = next((n for n in gm.graph.nodes if n.name == name), None)
            src = node.meta.get(META_SRC) if node is not None else None
            return next((n for n in self.prog.captured.gm.graph.nodes if n.name == src), None) or node
        lines = gm.code.splitlines()
        for fr in reversed(traceback.extract_tb(exc.__traceback__)):
            if fr.filename.startswith("<eval_with_key>") and 0 < fr.lineno <= len(lines):
                name = lines[fr.lineno - 1].strip().split(" = ")[0]
                node = next((n for n in gm.graph.nodes if n.name == name), None)
                src = node.meta.get(META_SRC) if node is not None else None
                orig = next((n for n in self.prog.captured.gm.graph.nodes if n.name == src), None)
                return orig or node
        return None

    def train_step(self, batch, local=False):
        cap = self.prog.captured
        if cap.mode != TRAIN:
            raise PartitionError("train_step needs partition(..., loss_fn=..., optimizer=...).")
        outs = self.run(batch, local)
        self._keep_state(outs)
        self.steps += 1
        if self.optimizer is not None:   # the update ran: lr schedulers stepped after it do not warn
            self.optimizer._opt_called = True
        if "grad_norm" in cap.output_names:
            self.last_grad_norm = self.rt.rank0(outs[cap.output_names.index("grad_norm")])
        return self.rt.rank0(outs[0])

    def loss_and_grads(self, batch):
        cap = self.prog.captured
        if cap.mode != LOSS_AND_GRADS:
            raise PartitionError("loss_and_grads needs partition(..., loss_fn=...) without an optimizer.")
        outs = self.run(batch)
        self._keep_state(outs)
        return self.rt.rank0(outs[0]), {n[len("grads."):]: self.rt.rank0(t)
                                        for n, t in zip(cap.output_names[1:], outs[1:]) if n.startswith("grads.")}

    def _keep_state(self, outs):
        """Updated state outputs (buffers written by the forward: running statistics) replace the state held."""
        for name, t in zip(self.prog.captured.output_names, outs):
            if name in self.state:
                self.state[name] = t

    def forward(self, inputs):
        cap = self.prog.captured
        if cap.mode != FORWARD:
            raise PartitionError("calling the program runs the forward; this program was captured with a loss_fn "
                                 "(use train_step or loss_and_grads).")
        outs = self.run(inputs)
        self._keep_state(outs)
        n = cap.out_spec.num_leaves
        return tree_unflatten([self.rt.rank0(t) for t in outs[:n]], cap.out_spec)

    # -- state -----------------------------------------------------------------------------------------------------
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
