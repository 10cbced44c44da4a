"""Runs a lowered program step after step: state (parameters, buffers, optimizer state) stays as local shards."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..capture import FORWARD, LOSS_AND_GRADS, TRAIN
from ..errors import PartitionError, internal_error
from ..lower.lower import lower
from .distributed import DistributedRuntime, real_ranks_active
from .emulate import EmulatedRuntime

STATE_ROLES = ("param", "buffer", "opt_state")


class Executor:
    def __init__(self, prog, model, optimizer):
        self.prog, self.model, self.optimizer = prog, model, optimizer
        self.rt = None
        self.lowered = None
        self.state: dict | None = None       # placeholder name -> local tensor
        self.steps = 0

    # -- set-up ----------------------------------------------------------------------------------------------------
    def ensure(self):
        if self.rt is None or not self.rt.valid():
            mesh = self.prog.mesh
            self.rt = DistributedRuntime(mesh, getattr(self.prog, "timeout_s", 300.0)) if real_ranks_active() \
                else EmulatedRuntime(mesh)
            self.lowered = lower(self.prog, self.rt.groups)
            if isinstance(self.rt, DistributedRuntime):
                # group names differ between ranks (each rank numbers its own groups): hash the axis names instead
                code = self.lowered.gm.code
                for axis, gname in self.rt.groups.items():
                    code = code.replace(repr(gname), repr(f"axis:{axis}"))
                if any(str(n.target).startswith(("aten.bernoulli", "aten.rand", "aten.native_dropout"))
                       for n in self.lowered.gm.graph.nodes):
                    # random draws must agree on every rank: include the generator state in the plan
                    code += f"\n# rng {hash(bytes(torch.get_rng_state().numpy()))}"
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
            full = {}
            params = dict(self.model.named_parameters())
            buffers = dict(self.model.named_buffers())
            for t in list(params.values()) + list(buffers.values()):
                if t.device.type == "meta":
                    raise PartitionError("partition: the model lives on the meta device, so it cannot run. Build it "
                                         "on a real device (or model.to_empty(device=...) and initialise) first; "
                                         "meta models can be partitioned, printed and simulated.")
            for k, p in params.items():
                full[f"params.{k}"] = p.detach()
            for k, b in buffers.items():
                full[f"buffers.{k}"] = b.detach()
            if cap.fopt is not None:
                st = cap.fopt.init_state({k: params[k].detach() for k in cap.trainable})
                for s, d in st.items():
                    for k, t in d.items():
                        full[f"opt.{s}.{k}"] = t
                self.steps = int(cap.fopt.init_step())
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
            elif role == "lr":
                lr = cap.fopt.lr
                args.append(self.rt.local(torch.tensor(lr, dtype=torch.float64)))
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

        lines = gm.code.splitlines()
        for fr in reversed(traceback.extract_tb(exc.__traceback__)):
            if fr.filename.startswith("<eval_with_key>") and 0 < fr.lineno <= len(lines):
                name = lines[fr.lineno - 1].strip().split(" = ")[0]
                node = next((n for n in gm.graph.nodes if n.name == name), None)
                src = node.meta.get("partir_src") if node is not None else None
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

    def state_dict(self) -> dict:
        """DTensors (real ranks) with placements matching each value's sharding; emulation: full tensors."""
        self.ensure()
        g = self.prog.graph
        out = {}
        for n, t in self.state.items():
            shape = g.shapes[g.vid[self._placeholder(n)]]
            out[n] = self.rt.dtensor(t, self._layout(n), shape) if hasattr(self.rt, "dtensor") else \
                self.rt.full(t, self._layout(n), shape)
        return out
