"""XlaProgram: a partitioned step run by torch-xla's SPMD partitioner under partir's decisions.

The captured *global* step graph runs op by op on XLA tensors (lazily traced, compiled once per graph):

- every input, parameter, buffer and optimizer-state value is placed with `xs.mark_sharding` from its partir
  Sharding, and every value computed gets its Sharding as a constraint (the same call on an intermediate tensor);
- where partir's lowering reshards, i.e. an op uses an operand (or makes a result) in another layout than the
  value keeps (lower.op_layouts), a copy constrained to the op's layout makes XLA reshard at that op, that way;
- backward uses of parameters go through an optimization barrier, so ZeRO-3 gathers them again (as partir does)
  instead of reusing the forward's gathered copy;
- CPU-only kernels of the capture run as XLA ops (kernels.py), so the step stays one XLA program.

GSPMD is then left to choose little more than how to reduce partial values (pending reductions have no HLO
sharding; neither have strided tilings). State stays on the devices between steps.

    xprog = prog.to_xla()                 # PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 for 8 virtual devices
    loss = xprog.train_step(tokens, targets)
    print(xprog.compare())                # partir's collectives next to those of XLA's partitioned HLO
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..capture import FORWARD, LOSS_AND_GRADS, TRAIN
from ..capture.graphutil import forward_nodes
from ..errors import PartitionError
from . import device as xdev
from .hlo import parse_collectives
from .kernels import xla_target

STATE_ROLES = ("param", "buffer", "opt_state")


def _host_op_counts() -> dict:
    """torch-xla's per-op counters of ops it ran on the host (its CPU fallback): 'aten::<op>' -> calls."""
    import torch_xla.debug.metrics as met

    return {k: met.counter_value(k) for k in met.counter_names() if k.startswith("aten::")}


def param_derived(gm) -> set:
    """Parameter placeholders and the forward nodes computed from parameters alone (transposes, casts): the values
    partir gathers again at their backward uses (ZeRO-3 does not keep a gathered copy alive from the forward)."""
    fwd = forward_nodes(gm)
    out = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.meta.get("partir_role") == "param":
            out.add(n)
        elif n.op == "call_function" and n in fwd and n.all_input_nodes and all(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


class _Run(fx.Interpreter):
    """Runs the captured graph on XLA tensors; after each node, its sharding constraint (if any). Backward uses of
    parameter-derived values read them through an optimization barrier: a separate HLO value, so XLA reshards it
    again there (as partir does) instead of reusing the forward's gathered copy."""

    def __init__(self, gm, dev, mesh, constraints: dict, regather: set = frozenset(), op_specs=None):
        super().__init__(gm, garbage_collect_values=True)
        self.dev, self.mesh, self.constraints = dev, mesh, constraints
        self.operand_specs, self.result_specs = op_specs or ({}, {})
        self.regather, self.fwd = regather, forward_nodes(gm) if regather else set()
        self.copies: dict = {}

    def _backward_copy(self, node, value):
        if node.name not in self.copies:
            import torch_xla

            copy = value.clone()
            torch_xla._XLAC._xla_optimization_barrier_([copy])
            spec = self.constraints.get(node.name)
            if spec is not None:
                _mark(copy, self.mesh, spec)
            self.copies[node.name] = copy
        return self.copies[node.name]

    def fetch_args_kwargs_from_env(self, n):
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        env = {}
        if self.regather and n.op == "call_function" and n not in self.fwd:
            env = {a: self._backward_copy(a, self.env[a]) for a in n.all_input_nodes if a in self.regather}
        for a, spec in self.operand_specs.get(n.name, {}).items():
            env[a] = _constrained(env.get(a, self.env[a]), self.mesh, spec)   # as this op uses it (a reshard)
        if env:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env.get(a, self.env[a]))
        return args, kwargs

    def call_function(self, target, args, kwargs):
        # factory ops were traced with the capture device: create on the XLA device instead
        if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type != "xla":
            kwargs = {**kwargs, "device": self.dev}
        return xla_target(target)(*args, **kwargs)

    def run_node(self, n):
        out = super().run_node(n)
        made = self.result_specs.get(n.name)
        if made is not None and isinstance(out, torch.Tensor):   # computed in one layout, kept in another:
            out = _constrained(out, self.mesh, made)             # partir reshards the result right after the op
        spec = self.constraints.get(n.name)
        if spec is not None and isinstance(out, torch.Tensor):
            _mark(out, self.mesh, spec)
        return out


def _mark(t, mesh, spec):
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(t, mesh, spec)


def _constrained(t, mesh, spec):
    """A copy of `t` under a sharding constraint (a custom-sharding node even when `t` is device data, where
    mark_sharding would move the data instead)."""
    import torch_xla.distributed.spmd as xs

    x = t.clone()
    xs.annotate_custom_sharding(x, mesh, spec)
    return x


class XlaProgram:
    """The same partitioned program on torch-xla SPMD: train_step / forward / loss_and_grads, state_dict, hlo,
    collectives, compare. Build it with `prog.to_xla()`."""

    def __init__(self, prog):
        import torch_xla

        xdev.enable()
        self.prog, self.cap = prog, prog.captured
        self.device = torch_xla.device()
        self.mesh = xdev.xs_mesh(prog.mesh)
        g = prog.graph
        self.layouts = {}        # placeholder name -> Sharding
        for node, name in zip(self._placeholders(), self.cap.input_names):
            self.layouts[name] = prog.sharding_of_vid(g.vid[node])
        self.constraints = self._constraints()
        self.op_specs = self._op_specs()
        self._regather = param_derived(self.cap.gm) if self.cap.mode != FORWARD else frozenset()
        self.state: dict | None = None
        self.steps = 0
        self._modules: dict = {}      # mode -> dump file of its post-partitioning HLO
        self.host_ops: list = []      # aten ops torch-xla ran on the host (see _check_host_ops)

    def _placeholders(self):
        return [n for n in self.cap.gm.graph.nodes if n.op == "placeholder"]

    def _constraints(self) -> dict:
        """FX node name -> partition spec, for every value whose layout XLA can be told: each value's final
        partir sharding (axes no tactic decided are replicated, as in partir's lowering)."""
        g, out = self.prog.graph, {}
        for node in self.cap.gm.graph.nodes:
            if node.op != "call_function" or node not in g.vid:
                continue
            spec = xdev.partition_spec(self.prog.sharding_of_vid(g.vid[node]))
            if spec is not None:
                out[node.name] = spec
        return out

    def _op_specs(self) -> tuple:
        """Where partir's lowering reshards, from lower.op_layouts (the layouts each op computes under):
        ({FX node name: {operand node: spec}} for operands the op uses laid out otherwise than their value, and
        {FX node name: spec} for results the op makes in another layout than their value keeps). Constrained
        copies there make XLA reshard at the same op, the same way (e.g. a dispatch einsum computed on local token
        groups and its result exchanged by all_to_all, not the tokens gathered)."""
        from ..lower.lower import op_layouts
        from ..rules.registry import tensor_operands

        g, operands, results = self.prog.graph, {}, {}
        spec_of = lambda v: xdev.partition_spec(self.prog.sharding_of_vid(v))   # noqa: E731
        for i, op in enumerate(g.ops):
            if op.node.op != "call_function":      # ops without a rule too: partir makes their operands whole
                continue
            wants, makes = op_layouts(self.prog, i)
            for a, v, want in zip(tensor_operands(op.node), op.operands, wants):
                spec = xdev.partition_spec(want) if want is not None else None
                if spec is not None and spec != spec_of(v):
                    operands.setdefault(op.node.name, {}).setdefault(a, spec)
            for v, make in zip(op.results, makes):
                spec = xdev.partition_spec(make) if v is not None and make is not None else None
                if spec is not None and spec != spec_of(v):
                    results[g.values[v].name] = spec
        return operands, results

    # -- state -------------------------------------------------------------------------------------------------------
    def _placed(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """`t` on the XLA devices, laid out as partir lays out the value `name`."""
        x = t.detach().to(self.device)
        spec = xdev.partition_spec(self.layouts[name])
        if spec is None:
            raise PartitionError(f"to_xla: {name} is laid out {self.layouts[name]} (a strided tiling), which an XLA "
                                 f"tile assignment cannot express. Tile the dim whole (e.g. without vocab=True / "
                                 f"packed projections) for the XLA backend.")
        if any(spec):
            _mark(x, self.mesh, spec)
        return x

    def _ensure_state(self):
        if self.state is not None:
            return
        model, cap = self.prog.model, self.cap
        full = {f"params.{k}": p.detach() for k, p in model.named_parameters()}
        full.update({f"buffers.{k}": b.detach() for k, b in model.named_buffers()})
        if cap.fopt is not None:
            params = dict(model.named_parameters())
            for s, d in cap.fopt.init_state({k: params[k].detach() for k in cap.trainable}).items():
                full.update({f"opt.{s}.{k}": t for k, t in d.items()})
            self.steps = int(cap.fopt.init_step())
        for t in full.values():
            if t.device.type == "meta":
                raise PartitionError("to_xla: the model lives on the meta device, so it cannot run. Build it on a "
                                     "real device (or model.to_empty(device=...) and initialise) first.")
        self.state = {name: self._placed(full[name], name)
                      for name, role in zip(cap.input_names, cap.input_roles) if role in STATE_ROLES}

    def state_dict(self) -> dict:
        """Parameters, buffers and optimizer state as full CPU tensors, keyed by named value ("params.<fqn>",
        "buffers.<fqn>", "opt.<state>.<fqn>")."""
        self._ensure_state()
        return {n: t.cpu() for n, t in self.state.items()}

    def gather_parameters(self) -> dict:
        """Full parameter tensors on the CPU, keyed by FQN."""
        return {n[len("params."):]: t for n, t in self.state_dict().items() if n.startswith("params.")}

    # -- running -----------------------------------------------------------------------------------------------------
    def _args(self, batch) -> list:
        cap = self.cap
        flat, _ = tree_flatten(tuple(batch))
        n_in = sum(1 for r in cap.input_roles if r == "input")
        if len(flat) != n_in:
            raise PartitionError(f"the program was captured with {n_in} input tensors; got {len(flat)}.")
        args, k, hyper = [], 0, None
        for node, name, role in zip(self._placeholders(), cap.input_names, cap.input_roles):
            if role in STATE_ROLES:
                args.append(self.state[name])
            elif role == "lr":     # hparams.<group>.<name> (lr, betas, ...): read from the optimizer at every step
                if hyper is None:
                    hyper = cap.fopt.hyper_values() if hasattr(cap.fopt, "hyper_values") else {}
                _, g, h = name.split(".") if name.startswith("hparams.") else ("", 0, "lr")
                value = hyper.get((int(g), h), getattr(cap.fopt, "lr", None))
                args.append(torch.tensor(value, dtype=torch.float64).to(self.device))
            elif role == "step":
                args.append(torch.tensor(float(self.steps + 1), dtype=torch.float64).to(self.device))
            elif role == "const":
                args.append(self._placed(cap.consts[name], name))
            else:
                x = flat[k]
                k += 1
                want = node.meta["val"]
                if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(want.shape) or x.dtype != want.dtype:
                    got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
                    raise PartitionError(f"{name} is {got}; the program was captured with {tuple(want.shape)} "
                                         f"{want.dtype}. Re-partition for new shapes or dtypes.")
                args.append(self._placed(x, name))
        return args

    def _run(self, batch, mode: str) -> list:
        import torch_xla

        self._ensure_state()
        args = self._args(batch)
        before = xdev.dumped_modules() if mode not in self._modules and xdev._dump_dir else None
        host_before = _host_op_counts()
        regather = self._regather if mode != FORWARD else frozenset()
        outs = _Run(self.cap.gm, self.device, self.mesh, self.constraints, regather, self.op_specs).run(*args)
        for name, t in zip(self.cap.output_names, outs):
            if name in self.state:       # updated state (tied to its input: same layout, constrained above)
                self.state[name] = t
        torch_xla.sync()
        if before is not None:
            self._remember_module(mode, before)
        self._check_host_ops(host_before)
        return list(outs)

    def _check_host_ops(self, before: dict) -> None:
        """Ops torch-xla ran on the host during this step split it into several XLA programs (hlo() holds one of
        them): name them once (compare() reports them too); kernels.py is where an XLA form goes."""
        new = [op for op, n in _host_op_counts().items() if n > before.get(op, 0) and op not in self.host_ops]
        if new:
            self.host_ops += new
            warnings.warn(f"to_xla: torch-xla ran {', '.join(new)} on the host: the step is split into several XLA "
                          f"programs and hlo()/compare() see the largest only. Give the op an XLA form in "
                          f"partir_torch/xla/kernels.py.", stacklevel=3)

    def _remember_module(self, mode: str, before: dict) -> None:
        """The largest module compiled by this step's sync is the step (small ones move data)."""
        new = {f: size for f, size in xdev.dumped_modules().items() if f not in before}
        if new:
            self._modules[mode] = max(new, key=new.get)

    def train_step(self, *batch) -> torch.Tensor:
        """One step (forward, backward, optimizer update) on the global batch; returns the loss (CPU tensor)."""
        if self.cap.mode != TRAIN:
            raise PartitionError("train_step needs partition(..., loss_fn=..., optimizer=...).")
        outs = self._run(batch, TRAIN)
        self.steps += 1
        return outs[0].cpu()

    def loss_and_grads(self, *batch):
        if self.cap.mode != LOSS_AND_GRADS:
            raise PartitionError("loss_and_grads needs partition(..., loss_fn=...) without an optimizer.")
        outs = self._run(batch, LOSS_AND_GRADS)
        return outs[0].cpu(), {n[len("grads."):]: t.cpu() for n, t in zip(self.cap.output_names, outs)
                               if n.startswith("grads.")}

    def forward(self, *inputs):
        """The model's outputs on the live state (programs captured without a loss_fn)."""
        if self.cap.mode != FORWARD:
            raise PartitionError("forward needs a program captured without loss_fn (partition(model, mesh, "
                                 "schedule, example_inputs)); this one has a loss_fn: use train_step.")
        outs = self._run(inputs, FORWARD)
        n = self.cap.out_spec.num_leaves
        return tree_unflatten([t.cpu() for t in outs[:n]], self.cap.out_spec)

    __call__ = forward

    # -- XLA's program -----------------------------------------------------------------------------------------------
    def hlo(self) -> str:
        """The post-partitioning HLO (after XLA's SPMD partitioner) of the step, as XLA compiled it at the first
        call (train_step, or forward / loss_and_grads); runs nothing itself."""
        if not self._modules:
            raise PartitionError("XlaProgram.hlo(): run a step first (train_step / forward / loss_and_grads); the "
                                 "HLO is the one XLA compiled for it.")
        mode = self.cap.mode if self.cap.mode in self._modules else next(iter(self._modules))
        with open(os.path.join(xdev.dump_dir(), self._modules[mode])) as f:
            return f.read()

    def collectives(self) -> list:
        """XlaCollectives of the partitioned HLO: kind, mesh axis, bytes, dtype (fields as prog.collectives())."""
        return parse_collectives(self.hlo(), self.prog.mesh)

    def compare(self, tolerance: float = 0.05):
        """partir's per-device collectives against XLA's, per kind and axis (count and bytes). See compare.py."""
        from .compare import compare

        return compare(self.prog, self.collectives(), tolerance, host_ops=self.host_ops)
