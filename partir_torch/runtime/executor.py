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
from .state import STATE_ROLES, StateIO
from ..contract import META_SRC


class Executor(StateIO):
    """Runs the lowered program on the state it holds as local shards: set-up (runtime, lowering, state), argument
    assembly and the steps. Moving the state in and out (state_dict, load_state_dict, export_to, ...) is StateIO's
    (state.py)."""

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
