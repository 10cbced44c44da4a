"""Runs a plan's per-device program step after step on a backend (backend.py), with the state it holds as local
shards (state.py's HeldState)."""
from __future__ import annotations

import hashlib

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..capture import FORWARD, LOSS_AND_GRADS, TRAIN
from ..capture.inputs import conform
from ..contract import EXC_NODE, META_SRC, STATE_ROLES, Role
from ..errors import PartitionError, internal_error
from . import faults
from .backend import backend_for
from .interpret import InterpretedRuntime
from .state import HeldState


class Executor:
    """Runs the plan's lowered program (Plan.lowered, bound to the backend's process groups) on the state it holds:
    set-up (backend, binding, state), argument assembly and the steps. Moving the state in and out (state_dict,
    load_state_dict, export_to, ...) is the HeldState's (state.py)."""

    # emulated ranks: plain tensors per rank, collectives computed over them (interpret.py); tests swap in
    # emulate.EmulatedRuntime (LocalTensorMode) as a cross-check
    emulator = InterpretedRuntime

    def __init__(self, plan, model, optimizer, loss_fn=None, backend=None):
        self.plan, self.model, self.optimizer, self.loss_fn = plan, model, optimizer, loss_fn
        self._backend = backend              # a fixed backend (prog.to_xla()); None: backend_for() decides
        self.rt = None
        self.lowered = None                  # what self.rt runs: plan.lowered() bound to its process groups
        self._held = HeldState(plan, model, optimizer)
        self.last_grad_norm = None
        self._hyper = None                   # this call's optimizer hyperparameters, read from the param groups
        self._evaluator = None
        self.failure = None                  # real ranks: the error of a step that failed (its groups released)
        self._digest = ""                    # real ranks: the plan's digest, part of every call's agreement

    @property
    def steps(self) -> int:
        return self._held.steps

    @property
    def state(self) -> dict:
        """Placeholder name -> local shard held (after ensure())."""
        return self._held.state

    def held(self) -> HeldState:
        """The state, on a live backend."""
        self.ensure()
        return self._held

    @property
    def evaluator(self):
        """eval_step / forward on the live state (evaluate.py), one captured program per input signature."""
        if self._evaluator is None:
            from .evaluate import Evaluator

            self._evaluator = Evaluator(self)
        return self._evaluator

    # -- set-up ----------------------------------------------------------------------------------------------------
    def ensure(self):
        if self.failure is not None:
            raise type(self.failure)(f"partir_torch: this program cannot run on: an earlier call failed on this rank "
                                     f"and released its process groups. That error:\n{self.failure}")
        if self.rt is None or not self.rt.valid():
            rt = self._backend or backend_for(self.plan.mesh, self.plan.options, self.emulator)
            self.lowered = rt.program(self.plan)
            if rt.kind == "distributed":
                text = self._plan_text(self.plan.lowered())
                rt.check_plan(text)
                self._digest = hashlib.sha256(text.encode()).hexdigest()[:16]
            if self.plan.options.measure_memory:
                rt.measure_memory = True         # the backend measures each step (runtime/memtrack.py)
            self.rt = rt
            self._held.attach(rt)
        return self.lowered

    def _plan_text(self, canonical) -> str:
        """What every rank must agree on: the program's code on canonical group names (each rank numbers its own
        process groups) and, when the step draws random numbers, the generator state."""
        code = canonical.gm.code
        if any(str(n.target).startswith(("aten.bernoulli", "aten.rand", "aten.native_dropout"))
               for n in canonical.gm.graph.nodes):
            # random draws must agree on every rank (hashlib: Python's hash() of bytes is salted per process)
            code += f"\n# rng {hashlib.sha256(bytes(torch.get_rng_state().numpy())).hexdigest()}"
        return code

    # -- running ---------------------------------------------------------------------------------------------------
    def _args(self, batch, local: bool):
        cap = self.plan.captured
        flat, _ = tree_flatten(conform(tuple(batch), cap.in_spec))
        n_in = sum(1 for r in cap.input_roles if r == "input")
        if len(flat) != n_in:
            raise PartitionError(f"the program was captured with {n_in} input tensors; got {len(flat)}.")
        args, k = [], 0
        for name, role, sh, shp in zip(cap.input_names, cap.input_roles, self.lowered.input_layouts,
                                       self.lowered.local_shapes):
            if role in STATE_ROLES:
                args.append(self.state[name])
            elif role == Role.LR:   # hparams.<group>.<name>: read from the optimizer's param groups at every step
                if self._hyper is None:
                    self._hyper = cap.fopt.hyper_values(self.optimizer)   # this program's optimizer
                _, g, h = name.split(".")
                args.append(self.rt.local(torch.tensor(self._hyper[(int(g), h)], dtype=torch.float64)))
            elif role == Role.CONST:
                args.append(self.rt.shard(cap.consts[name], sh))
            elif role == Role.STEP:
                args.append(self.rt.local(torch.tensor(float(self.steps + 1), dtype=torch.float64)))
            else:
                x = flat[k]
                k += 1
                want = self.plan.graph.shapes[self.plan.graph.vid[self._placeholder(name)]]
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
        dev = self.plan.captured.device
        if x.device.type == "meta" or (x.device.type != dev.type and dev.type != "meta"):
            raise PartitionError(f"{name} is on {x.device}; the program runs on {dev.type}. Move the batch there "
                                 f"(x.to('{dev.type}')).")

    def _placeholder(self, name):
        return self.plan.captured.names[name]

    def run(self, batch, local=False, what="the program"):
        """Random ops (dropout) are drawn whole on every rank from the caller's generator and sliced (their rule
        keeps them whole), so a step equals the single-device step given the same generator state; on real ranks
        every process must be seeded alike (checked with the plan at start-up)."""
        low = self.ensure()
        self._hyper = None
        self.agree(what, tree_flatten(tuple(batch))[0])
        args = self._args(batch, local)
        return self.execute(low.gm, args, what)

    def agree(self, what: str, flat) -> None:
        """Real ranks: the ranks agree on the program, the step and the inputs' shapes and dtypes before any
        collective of `what` (faults.py); a difference raises on every rank."""
        if self.rt.kind == "distributed":
            self.rt.agree(faults.describe_call(what, self._digest, self.steps, flat), what)

    def execute(self, gm, args, what: str) -> list:
        """Run gm; a failure is named: RankFailureError when a peer died or hung (real ranks), else InternalError
        (a failing per-device op is a bug of ours). On real ranks a failed step releases the process groups, so the
        peers fail at once too, and the program refuses further calls."""
        try:
            return list(self.rt.run(gm, args))
        except Exception as e:  # noqa: BLE001 - named below
            if self.rt.kind == "distributed":
                peer = faults.peer_failure_kind(e) is not None
                missing = self.rt.release(roll_call=peer)      # first: the peers waiting on this rank fail now
                if peer:
                    err = faults.step_failure(what, self.rt.rank, self.plan.mesh,
                                              faults.collective_of(faults.node_at(gm, e)), e, self.rt.timeout_s,
                                              missing=missing)
                else:
                    err = e if isinstance(e, PartitionError) else internal_error(self._failing_node(gm, e),
                                                                                 "running", e)
                self.failure = err
                if err is e:
                    raise
                raise err from e
            if isinstance(e, PartitionError):
                raise
            raise internal_error(self._failing_node(gm, e), "running", e) from e

    def _failing_node(self, gm, exc):
        """The captured node whose per-device op raised `exc` (from the generated code's line), else None."""
        name = getattr(exc, EXC_NODE, None)   # emulated: the interpreter names the node of its segment
        node = next((n for n in gm.graph.nodes if n.name == name), None) if name is not None else \
            faults.node_at(gm, exc)
        if node is None:
            return None
        src = node.meta.get(META_SRC)
        return next((n for n in self.plan.captured.gm.graph.nodes if n.name == src), None) or node

    def peak_memory(self) -> dict:
        """{rank: peak live tensor bytes} of the last program run (runtime/memtrack.py says what counts)."""
        if not self.plan.options.measure_memory:
            raise PartitionError("prog.peak_memory() returns the peaks measured during the last step, and this "
                                 "program does not measure them. Partition with measure_memory=True (off by "
                                 "default: it costs a Python callback per op).")
        if self.rt is not None and not hasattr(self.rt, "last_peak"):
            raise PartitionError(f"prog.peak_memory(): the {type(self.rt).__name__} backend does not measure memory; "
                                 f"the interpreted emulator (the default without torch.distributed) and real ranks "
                                 f"do.")
        peak = getattr(self.rt, "last_peak", None)
        if peak is None:
            raise PartitionError("prog.peak_memory(): no step has run yet; run prog.train_step(...) first.")
        return dict(peak)

    def train_step(self, batch, local=False):
        cap = self.plan.captured
        if cap.mode != TRAIN:
            raise PartitionError("train_step needs partition(..., loss_fn=..., optimizer=...).")
        outs = self.run(batch, local, f"{'train_step_local' if local else 'train_step'} (step {self.steps + 1})")
        self._keep_state(outs)
        self._held.steps += 1
        if self.optimizer is not None:   # the update ran: lr schedulers stepped after it do not warn
            self.optimizer._opt_called = True
        if "grad_norm" in cap.output_names:
            self.last_grad_norm = self.rt.rank0(outs[cap.output_names.index("grad_norm")])
        return self.rt.rank0(outs[0])

    def loss_and_grads(self, batch):
        cap = self.plan.captured
        if cap.mode != LOSS_AND_GRADS:
            raise PartitionError("loss_and_grads needs partition(..., loss_fn=...) without an optimizer.")
        outs = self.run(batch, what="loss_and_grads")
        self._keep_state(outs)
        return self.rt.rank0(outs[0]), {n[len("grads."):]: self.rt.rank0(t)
                                        for n, t in zip(cap.output_names[1:], outs[1:]) if n.startswith("grads.")}

    def _keep_state(self, outs):
        """Updated state outputs (buffers written by the forward: running statistics) replace the state held."""
        for name, t in zip(self.plan.captured.output_names, outs):
            if name in self.state:
                self.state[name] = t

    def forward(self, inputs):
        cap = self.plan.captured
        if cap.mode != FORWARD:
            raise PartitionError("calling the program runs the forward; this program was captured with a loss_fn "
                                 "(use train_step or loss_and_grads).")
        outs = self.run(inputs, what="forward")
        self._keep_state(outs)
        n = cap.out_spec.num_leaves
        return tree_unflatten([self.rt.rank0(t) for t in outs[:n]], cap.out_spec)
