"""Capture: module + loss + optimizer -> one named aten GraphModule of the whole step (see decompositions.py for
the op set). Inputs may be real, `meta` or fake tensors: everything is traced on fake tensors, so a 10B-parameter
model on `meta` captures without allocating it."""
from __future__ import annotations

import contextlib
import inspect
import os
import traceback
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                          FakeTensorMode)
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch._functorch._aot_autograd.functional_utils import from_fun, has_data_mutation, sync_functional_tensor, to_fun

from ..contract import (META_ACCUMULATE, META_CLIP, META_MICRO, META_NAME, META_OUTPUT, META_PHASE, META_RECOMPUTE,
                        META_REMAT, META_ROLE, forward_nodes, stamp_phases)
from ..errors import PartitionError, TraceError, user_stacklevel, warn
from ..rules import tags
from .branches import Recorder, add_checks, lift_draws, python_draws
from . import gates as gating
from .counts import Padding, Unpadded
from .decompositions import capture_decompositions
from .dims import DimGuards, fake_mode_for, symbolic_decompositions, symbolic_input
from .framestack import call_in_fresh_chunk
from .inputs import as_batch, check_leaves, forward_kwargs
from .lora import bias_last, mark_rank_values
from .sources import library_code, recording_sources
from .stages import recording_modules
from .graphutil import no_gc, source_line, split_for_backward
from .optim import functional_optimizer
from . import settle
from .outputs import flatten_outputs
from .replicate import splice_update
from .tags import tracing_graph, collect_tags, install_hooks
from .moe import hf_experts
from .microdraws import micro_size, whole_batch_draws
from .tidy import identity_indices, share_views, untie_random_templates, untie_unused_weights

FORWARD, LOSS_AND_GRADS, TRAIN, EVAL = "forward", "loss_and_grads", "train", "eval"
# TRAIN: trace the optimizer update once per class of parameters and copy it for each (replicate.py), not op by op
# per parameter; both build the same graph (False: the reference the tests compare with)
REPLICATE_UPDATE = True


@dataclass(frozen=True)
class Captured:
    """The traced step and what its placeholders and outputs mean: built once, by capture(), and frozen."""

    gm: fx.GraphModule
    mode: str                        # FORWARD | LOSS_AND_GRADS | TRAIN | EVAL (the loss only)
    input_names: list                # per placeholder: "params.fc1.weight", "opt.exp_avg.fc1.weight", "lr", "inputs.0"
    input_roles: list                # per placeholder: "param" | "buffer" | "opt_state" | "lr" | "step" | "input"
    output_names: list               # per flat output: "loss", "params.fc1.weight", "grads.fc1.weight", "outputs.0"
    names: dict                      # named value -> node (placeholders, module output tags)
    ties: list                       # (placeholder node, output node): one value for propagation
    out_spec: object = None          # forward mode: the structure of the model's outputs (outputs.OutputSpec)
    fopt: object = None              # FunctionalOptimizer
    param_fqns: list = field(default_factory=list)
    trainable: list = field(default_factory=list)
    buffer_fqns: list = field(default_factory=list)
    device: torch.device = torch.device("cpu")
    consts: dict = field(default_factory=dict)   # "consts.<i>" -> tensor created inside the step (lifted)
    rewrites: tuple = ()                         # names of the capture rewrites applied (mixed precision, remat)
    decompositions: frozenset = frozenset()      # the extra decompositions tactics asked for (op overloads)
    bn_groups: int = 0                           # batch norm statistics per this many ranks' batches (bn_local.py)
    in_spec: object = None                       # pytree spec of the inputs (inputs.<i> in its flattening order)
    # what the step was captured with beyond the inputs, so that it can be captured again for other input shapes
    # (runtime/shapes.py): capture()'s keyword arguments, and each module's training flag (model.modules() order)
    settings: dict = field(default_factory=dict)
    modes: tuple = ()
    # the step branches on tensor values (branches.py): the path this graph is specialised to, one Guard per scalar
    # read (in trace order), and the asserts verified after each step (outputs "asserts.<i>")
    guards: tuple = ()
    checks: tuple = ()
    updated: tuple = ()                          # TRAIN with guards: the parameters this path updates
    gates: object = None                         # gates.Gates: layerdrop gated in one program
    # selections traced at a static size (counts.py): (line, N) each; and (line, why) of those kept as count guards
    padded: tuple = ()
    unpadded: tuple = ()
    # a model that changed itself on its first call (settle.py): the step is the changed model's; first_call (a
    # settle.FirstCall) makes the random draws eager's first call made beyond it, None when there are none
    first_call: object = None


def _trace_device(model, inputs) -> torch.device:
    for t in list(model.parameters()) + [x for x in inputs if isinstance(x, torch.Tensor)]:
        if t.device.type not in ("meta",):
            return t.device if not isinstance(t, FakeTensor) else t.fake_device
    return torch.device("cpu")


def _fakify(mode: FakeTensorMode, t: torch.Tensor, device) -> torch.Tensor:
    if isinstance(t, FakeTensor) or t.device.type == "meta":
        with mode:
            out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
        return out
    return mode.from_tensor(t)


def _tracing_session():
    """torch.compiler.is_compiling() is True while we trace: libraries (Hugging Face's mask utilities) then skip
    the data-dependent fast paths they skip under torch.compile, which a fake-tensor trace cannot take either."""
    ctx = getattr(torch.compiler, "_compile_session_context", None)
    return ctx() if ctx is not None else contextlib.nullcontext()


def _user_frame(exc: BaseException) -> str:
    """The innermost frame of user code (not torch, not partir_torch) in the traceback."""
    found = ""
    for fr in traceback.extract_tb(exc.__traceback__):
        if not library_code(fr.filename) and not fr.filename.startswith("<"):
            found = f"{fr.filename}:{fr.lineno} in {fr.name}: {fr.line}"
    return found


def _functional(step, recorder=None, padding=None):
    """`step` traced under functionalization (AOTAutograd's FunctionalTensorMode, which, unlike
    torch.func.functionalize, lets autograd run above it): in-place ops become out-of-place ones, and a state
    input the step writes into (a batch norm's running statistics) ends as one `copy_` into its placeholder,
    which _state_mutations turns into a state output. recorder: a branches.Recorder answering the step's scalar
    reads, above the functional mode; padding: a counts.Padding tracing selections at a static size, above
    autograd."""
    def body(*args):
        with FunctionalTensorMode(), (recorder if recorder is not None else contextlib.nullcontext()):
            fargs = [to_fun(a) for a in args]
            with padding if padding is not None else contextlib.nullcontext():
                outs = step(*fargs)
                if padding is not None:
                    padding.check_outputs(outs)
            outs = [from_fun(o) for o in outs]
            for a, fa in zip(args, fargs):
                sync_functional_tensor(fa)
                if has_data_mutation(fa):
                    with torch.no_grad():      # a parameter written in place is refused by name afterwards
                        a.copy_(from_fun(fa))
        return outs

    def wrapped(*args):    # below make_fx's frame of one slot per placeholder: see framestack.py
        return call_in_fresh_chunk(body, args)
    return wrapped


def _check_loss(loss, model) -> None:
    if not isinstance(loss, torch.Tensor):
        hint = " (a model output object: return its .loss, e.g. loss_fn=lambda m, x, y: m(input_ids=x, " \
               "labels=y).loss)" if hasattr(loss, "loss") else ""
        raise TraceError(f"partition: loss_fn returned a {type(loss).__name__}, not a tensor{hint}. It must "
                         f"return the scalar loss of {type(model).__name__}'s step.")
    if loss.dim() != 0:
        raise TraceError(f"partition: loss_fn returned a tensor of shape {tuple(loss.shape)}; the loss must be a "
                         f"scalar. Reduce it (.mean() or .sum()) inside loss_fn.")
    if not loss.is_floating_point():
        raise TraceError(f"partition: loss_fn returned a {loss.dtype} scalar; a loss to differentiate must be "
                         f"floating point.")


_DATA_DEPENDENT = ("data-dependent", "data dependent", "_local_scalar_dense", "item()", "DataDependent",
                   "GuardOnDataDependentSymNode", "nonzero", "dynamic output shape", "DynamicOutputShape")


def _check_signature(loss_fn, model, example_inputs) -> None:
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):    # builtins and C callables have no signature to check
        return
    try:
        sig.bind(model, *example_inputs)
    except TypeError as e:
        only = example_inputs[0] if len(example_inputs) == 1 else None
        hint = ""
        if isinstance(only, dict):
            hint = (" A single dict as example_inputs is one input: loss_fn(model, batch), e.g. "
                    "loss_fn=lambda m, batch: m(**batch).loss.")
        elif isinstance(only, torch.Tensor):
            hint = " A single tensor as example_inputs is one input: loss_fn(model, x)."
        raise TraceError(f"partition: loss_fn is called as loss_fn(model, *example_inputs), here with the model and "
                         f"{len(example_inputs)} input(s), but its signature {sig} does not accept that ({e}). "
                         f"Give loss_fn one parameter per element of example_inputs after the model.{hint}") from None


def _inputs_text(example_inputs) -> str:
    flat, _ = tree_flatten(tuple(example_inputs))
    return ", ".join(f"inputs.{i} {tuple(x.shape)} {x.dtype}" for i, x in enumerate(flat)
                     if isinstance(x, torch.Tensor))


def _trace_error(e: BaseException, mode: str, model, example_inputs=()) -> TraceError:
    """One TraceError whose advice matches the cause."""
    where = _user_frame(e)
    text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    full = f"{type(e).__name__} {e}"
    if "dtype" in full or "scalar type" in full:
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        advice = (f"A dtype mismatch: the example inputs are {_inputs_text(example_inputs)}; the parameters are "
                  f"{', '.join(dtypes)}. Give the inputs the dtypes the model expects (token ids as torch.long, "
                  f"features in the parameters' dtype).")
    elif "leaf Variable that requires grad" in full:
        advice = ("The forward writes into a parameter in place. Parameters change only through the optimizer: "
                  "compute a new tensor instead (or register the value as a buffer).")
    elif any(k in full for k in _DATA_DEPENDENT):
        advice = ("The step branches on tensor values or has a data-dependent shape (if x.sum() > 0, .item(), "
                  "nonzero, boolean-mask indexing). Rewrite it with torch.where / masks, or move the branch out of "
                  "the model.")
    elif "fake" in full.lower() and ("kernel" in full or "impl" in full):
        advice = ("An op has no fake-tensor (shape) implementation. Register one with torch.library.register_fake "
                  "for the custom op named above.")
    elif isinstance(e, NotImplementedError):
        advice = "An op used by the step is not implemented for tracing on this device; see the op named above."
    else:
        advice = ("This is where tracing the step on fake tensors stopped; the line above is the last frame of "
                  "your code. If the model runs eagerly, please report it with this message.")
    return TraceError(f"partition: the {mode.replace('_', ' ')} step of {type(model).__name__} could not be "
                      f"traced into one graph: {text}" + (f"\n  at {where}" if where else "") + "\n" + advice)


_INDEX_ARGS = {op: index.arg for op, index in tags.INDEX_ARGS.items()}


def _check_indices(gm: fx.GraphModule, model) -> None:
    """Eager torch refuses floating-point indices (token ids given as floats); a trace on fake tensors would
    truncate them silently."""
    for n in gm.graph.nodes:
        at = _INDEX_ARGS.get(n.target)
        idx = n.args[at] if at is not None and len(n.args) > at else None
        val = idx.meta.get("val") if isinstance(idx, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            where = source_line(n)
            raise TraceError(f"partition: {n.target} in {type(model).__name__} is given {val.dtype} indices of "
                             f"shape {tuple(val.shape)} (token ids as floats?)" + (f"\n  at {where}" if where else "")
                             + "\nIndices must be integer tensors (torch.long); eager PyTorch raises here too. "
                               "Pass the batch's ids as x.long().")


def _refuse_state_constants(consts: dict, model) -> None:
    """A constant sharing memory with a parameter is a parameter read behind the traced step's back (through .data,
    or a copy cached on the module): baking it in would freeze it silently. (A buffer read through an alias, as HF's
    original_inv_freq, is a true constant: buffers change only where the forward writes them.)"""
    owners = {t.untyped_storage().data_ptr(): f"params.{k}" for k, t in model.named_parameters()
              if t.device.type != "meta" and t.numel()}
    for name, t in consts.items():
        if t.device.type != "meta" and t.numel() and t.untyped_storage().data_ptr() in owners:
            raise TraceError(f"partition: the step of {type(model).__name__} reads "
                             f"{owners[t.untyped_storage().data_ptr()]} outside the module's parameters (through "
                             f".data, .detach() of a cached copy, or a tensor captured before the call), so it would "
                             f"be frozen into the program as {name}. Read the parameter through the module in the "
                             f"forward instead.")


def _lift_constants(gm: fx.GraphModule, names: list, roles: list) -> dict:
    """Tensors created inside the step and kept as attributes by make_fx (torch.tensor(...), an HF cache's empty
    tensors) become placeholders `consts.<i>` (role "const"): ordinary values with rules, fed at every call."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    consts, lifted = {}, {}          # name -> tensor; attribute -> its placeholder (one per attribute)
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        t = getattr(gm, node.target, None)
        if not isinstance(t, torch.Tensor):
            continue
        if node.target not in lifted:
            name = f"consts.{len(consts)}"
            with gm.graph.inserting_after(placeholders[-1]):
                ph = gm.graph.placeholder(name.replace(".", "_"))
            ph.meta.update(node.meta)
            placeholders.append(ph)
            lifted[node.target] = ph
            consts[name] = t.detach()
            names.append(name), roles.append("const")
        node.replace_all_uses_with(lifted[node.target])
        gm.graph.erase_node(node)
    for target in lifted:
        delattr(gm, target)
    return consts


def _state_mutations(gm: fx.GraphModule, names: list, roles: list, out_names: list, model) -> None:
    """A buffer the step writes into (running statistics) becomes a state output named like its placeholder (tied
    to it, so it keeps its layout step after step); writes into the caller's batch are dropped; writes into
    parameters or optimizer state are refused."""
    role_of = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], zip(names, roles)))
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    extra = []
    for node in list(gm.graph.nodes):
        if node.target is not torch.ops.aten.copy_.default or node.args[0].op != "placeholder":
            continue
        name, role = role_of[node.args[0]]
        if role in ("param", "opt_state"):
            raise TraceError(f"partition: the step of {type(model).__name__} writes into {name} in place. "
                             f"Parameters and optimizer state change only through the optimizer: compute a new "
                             f"tensor instead (or register the value as a buffer).")
        if role == "buffer":
            extra.append(node.args[1])
            out_names.append(name)
        gm.graph.erase_node(node)
    if extra:
        out_node.args = (list(out_node.args[0]) + extra,)
    gm.graph.lint()


def _loss_dtype(loss: torch.Tensor) -> torch.Tensor:
    """The step's loss in fp32 at least (a bf16 loss is accumulated and reported in fp32); a float64 loss stays
    float64, as eager returns it."""
    return loss if loss.dtype == torch.float64 else loss.float()


def _micro_batches(batch, k: int, dims=None) -> list:
    """k micro-batches of the step's batch: micro-batch j holds samples j, j + k, j + 2k, ... of every input
    (x.unflatten(d, (B // k, k)).select(d + 1, j), i.e. x[j::k]): the (B // k) factor keeps the batch dim's tiling,
    so each micro-batch is spread over every rank that splits the batch and no input is gathered. dims: input index
    -> batch dim, or None for an input every micro-batch sees whole (default: dim 0 of every input)."""
    if k == 1:
        return [batch]
    flat, spec = tree_flatten(tuple(batch))
    dims = {i: 0 for i in range(len(flat))} if dims is None else {i: dims.get(i, 0) for i in range(len(flat))}
    for i, x in enumerate(flat):
        d = dims[i]
        if d is not None and (x.dim() <= d or x.shape[d] % k):
            raise PartitionError(f"partition: accumulate={k} splits dim {d} of inputs.{i} (shape "
                                 f"{tuple(x.shape)}) into {k} micro-batches; {k} does not divide it. Use a batch "
                                 f"size divisible by {k}, or name the batch dim with accumulate_dims={{{i}: dim}} "
                                 f"(None: the input is shared by every micro-batch).")
    # contiguous, as a batch the user passes is (BART's labels.view(-1) needs it)
    return [tree_unflatten([x if dims[i] is None else x.unflatten(dims[i], (x.shape[dims[i]] // k, k))
                            .select(dims[i] + 1, j).contiguous() for i, x in enumerate(flat)], spec)
            for j in range(k)]


def _accumulate_early(gm: fx.GraphModule) -> None:
    """Each micro-batch gradient sum (tagged in the step) moves to right after the later of its operands: the
    previous micro-batches' sum and this gradient are freed as the backward goes, and the summed gradient's
    reduction can start there, as eager .backward() accumulates into .grad."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in list(gm.graph.nodes):
        if (n.meta.get("custom") or {}).get(META_ACCUMULATE) and n.all_input_nodes:
            max(n.all_input_nodes, key=order.__getitem__).append(n)
    gm.graph.lint()


def _clip_by_global_norm(grads: dict, max_norm: float, like: dict) -> tuple:
    """torch.nn.utils.clip_grad_norm_: total = ||(||g||_2 for g)||_2, each g scaled by min(1, max / (total +
    1e-6)). The total is sqrt of one sum of every gradient's squares (the same number): over a tiled gradient
    the sum is partial and is reduced on the axes it is tiled on, a replicated one is counted once. Each square
    is taken as addcmul(zeros_like(s), g, g) (exactly g * g) with s the parameter's optimizer state (else the
    parameter): the zeros carry the state's layout and sit in the optimizer region, so a gradient is squared in
    the layout the update reads it in (a ZeRO shard after its reduce_scatter), not gathered whole for the norm.
    The ops are tagged (META_CLIP, fx custom meta) for a pipeline's lowering, which sums each stage's squares on
    its own ranks and all-reduces the partial totals on the pipeline axis (lower/pipeline.py)."""
    total = None
    for k, g in grads.items():
        with _clip_tag("square"):
            sq = torch.addcmul(torch.zeros_like(like[k], dtype=torch.float32), g.float(), g.float()).sum()
        with _clip_tag("sum"):
            total = sq if total is None else total + sq
    with _clip_tag("coef"):
        norm = total.sqrt()
        coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    with _clip_tag("scale"):
        return {k: g * coef.to(g.dtype) for k, g in grads.items()}, norm


@contextlib.contextmanager
def _clip_tag(what: str):
    with fx_traceback.preserve_node_meta(), fx_traceback.annotate({META_CLIP: what}):
        yield


@dataclass
class _Layout:
    """The placeholders of the traced step, in order: trainable and frozen parameters, buffers, optimizer state,
    per-group hyperparameters and the step count (TRAIN), then the flattened example inputs."""

    mode: str
    trainable: list
    frozen: list
    buffers: list
    state_keys: list                 # (state name, parameter fqn) per optimizer-state placeholder
    hyper_keys: list                 # (group, hyperparameter) per "hparams.<g>.<name>" placeholder
    fopt: object
    names: list = field(default_factory=list)
    roles: list = field(default_factory=list)
    flat: list = field(default_factory=list)
    n_state: int = 0                 # placeholders before the inputs
    in_spec: object = None

    def add(self, name: str, role: str, value) -> None:
        self.names.append(name), self.roles.append(role), self.flat.append(value)


def _layout(model, example_inputs, optimizer, mode, fake_mode, device, param_steps=False,
            dynamic=None) -> _Layout:
    """Fake placeholders for the module's state, the optimizer's state and hyperparameters, and the inputs.
    param_steps: TRAIN also has one step count per trainable parameter, `step.<fqn>` (a step that branches: a
    parameter the path leaves without a gradient keeps its count, as torch.optim keeps it)."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    trainable = [k for k, p in params.items() if p.requires_grad] if mode not in (FORWARD, EVAL) else []
    fopt = functional_optimizer(optimizer, {id(p): k for k, p in params.items()}) if mode == TRAIN else None
    fake = lambda t: _fakify(fake_mode, t, device)
    fparams = {k: fake(p.detach()) for k, p in params.items()}
    for k in trainable:
        fparams[k].requires_grad_(True)
    opt_state: dict = {}
    state_keys: list = []
    if fopt is not None:
        with fake_mode:
            opt_state = fopt.init_state({k: fparams[k] for k in trainable})
        state_keys = [(s, k) for s in fopt.state_names for k in trainable if k in opt_state.get(s, {})]
    lay = _Layout(mode, trainable, [k for k in params if k not in trainable], list(buffers), state_keys,
                  fopt.hyper_keys() if mode == TRAIN else [], fopt)
    for k in lay.trainable + lay.frozen:
        lay.add(f"params.{k}", "param", fparams[k])
    for k, b in buffers.items():
        lay.add(f"buffers.{k}", "buffer", fake(b))
    for s, k in state_keys:
        lay.add(f"opt.{s}.{k}", "opt_state", opt_state[s][k])
    if mode == TRAIN:   # per-group hyperparameters (role "lr": optimizer scalars) and the step count, fed per step
        with fake_mode:
            for g, h in lay.hyper_keys:
                lay.add(f"hparams.{g}.{h}", "lr", torch.zeros((), dtype=torch.float64, device=device))
            lay.add("step", "step", torch.zeros((), dtype=torch.float64, device=device))
            for k in lay.trainable if param_steps else ():
                lay.add(f"step.{k}", "step", torch.zeros((), dtype=torch.float64, device=device))
    lay.n_state = len(lay.flat)
    _, lay.in_spec = tree_flatten(example_inputs)
    for i, x in enumerate(check_leaves(example_inputs)):
        dims = {d for j, d in dynamic or () if j == i}
        lay.add(f"inputs.{i}", "input", symbolic_input(fake_mode, x, dims) if dims else fake(x))
    return lay


class _Step:
    """The function make_fx traces: flat placeholders in, flat outputs out (their names in `out_names`)."""

    def __init__(self, model, lay: _Layout, loss_fn, options, clip_grad_norm, accumulate, accumulate_dims):
        self.model, self.lay, self.loss_fn, self.options = model, lay, loss_fn, options
        self.clip_grad_norm, self.accumulate, self.accumulate_dims = clip_grad_norm, accumulate, accumulate_dims
        self.out_names: list = []
        self.out_spec = None
        self.module_recorder = None                # stages._Recorder when capture records modules (pipelines)
        self.record_modules = False
        self.updated, self.anchor = None, None     # TRAIN: the update's parameters, the last node before it
        self.gate_tracer = None                    # gates.GateTracer while the step's layerdrop is traced gated
        self.gates = None                          # gates.Gates when the step's layerdrop is gated
        self.running_stats = {f"{fqn}.{n}" if fqn else n for fqn, mod in model.named_modules()
                              if isinstance(mod, torch.nn.modules.batchnorm._NormBase)
                              for n, _ in mod.named_buffers(recurse=False)}

    def __call__(self, *args):
        lay = self.lay
        nt, nf, nb = len(lay.trainable), len(lay.frozen), len(lay.buffers)
        p = dict(zip(lay.trainable + lay.frozen, args[:nt + nf]))
        b = dict(zip(lay.buffers, args[nt + nf:nt + nf + nb]))
        batch = tree_unflatten(list(args[lay.n_state:]), lay.in_spec)
        if lay.mode == FORWARD:
            return self._forward(p, b, batch)
        # running statistics stay out of the capture tactics' casts (as under autocast, batch norm keeps them fp32:
        # an update written into a bf16 copy would be lost); other buffers (rope tables) are cast like parameters
        kept = {k: v for k, v in b.items() if k in self.running_stats}
        state, fargs = {**p, **{k: v for k, v in b.items() if k not in kept}}, batch
        for opt in self.options:
            state, fargs = opt.transform_step(state, fargs)
        state = {**state, **kept}
        if lay.mode == EVAL:
            self.out_names[:] = ["loss"]
            return [self._eval_loss(state, fargs)]
        loss, grads, unused = self._loss_and_grads(p, state, fargs)
        if lay.mode == LOSS_AND_GRADS:
            self.out_names[:] = ["loss"] + [f"grads.{k}" for k in lay.trainable]
            return [loss] + [grads[k] for k in lay.trainable]
        # parameters the loss does not reach have no gradient: torch.optim skips them (no weight decay, no state)
        grads = {k: g for k, g in grads.items() if k not in unused}
        return self._update(p, grads, loss, args[nt + nf + nb:lay.n_state])

    def _eval_loss(self, state, fargs):
        """The loss without gradients; with accumulate=k (a pipeline's eval step on real ranks: evaluate.py) the
        mean of its k micro-batches' losses, each op marked with its micro-batch as the training step's are."""
        k, loss = self.accumulate, None
        for j, micro in enumerate(_micro_batches(fargs, k, self.accumulate_dims)):
            if self.module_recorder is not None:
                self.module_recorder.micro = j
            with torch.no_grad(), _reparametrize_module(self.model, state, tie_weights=True):
                part = self.loss_fn(self.model, *micro)
                _check_loss(part, self.model)
                part = _loss_dtype(part) if k == 1 else _loss_dtype(part) / k
            loss = part if loss is None else loss + part
        if self.module_recorder is not None:
            self.module_recorder.micro = None
        return loss

    def _forward(self, p, b, batch):
        kwargs = forward_kwargs(self.model, tuple(batch))     # a dict batch: model(**batch)
        out = functional_call(self.model, {**p, **b}, () if kwargs is not None else tuple(batch), kwargs)
        flat_out, self.out_spec = flatten_outputs(out)     # an HF KV cache: its tensors, rebuilt per call
        self.out_names[:] = [f"outputs.{i}" for i in range(len(flat_out))]
        return flat_out

    def _loss_and_grads(self, p, state, fargs):
        trainable, k_acc = self.lay.trainable, self.accumulate
        loss, grads, unused = None, None, set()
        for j, micro in enumerate(_micro_batches(fargs, k_acc, self.accumulate_dims)):
            if self.module_recorder is not None:   # a pipeline's capture: the ops of micro-batch j (stages.py)
                self.module_recorder.micro = j
            # the module holds the traced state until the backward has run: checkpointed blocks recompute their
            # forward inside it
            with torch.enable_grad(), _reparametrize_module(self.model, state, tie_weights=True):
                part = self.loss_fn(self.model, *micro)
                _check_loss(part, self.model)
                part = _loss_dtype(part) if k_acc == 1 else _loss_dtype(part) / k_acc
                # the backward as autograd runs it (AOTAutograd's joint trace): custom autograd.Functions,
                # old-style or with setup_context, and library ops with registered autograd are differentiated as
                # in eager
                got = torch.autograd.grad(part, [p[k] for k in trainable], allow_unused=True)
            unused = {k for k, g in zip(trainable, got) if g is None}     # the loss does not reach them
            got = {k: torch.zeros_like(p[k]) if g is None else g for k, g in zip(trainable, got)}
            # micro-batch gradients summed as eager .backward() accumulates them: partial sums stay partial, so
            # the gradient reduction happens once per step
            if grads is None:
                grads = got
            else:   # tagged: _accumulate_early moves each sum next to the gradient it adds
                with fx_traceback.preserve_node_meta(), fx_traceback.annotate({META_ACCUMULATE: True}):
                    grads = {k: grads[k] + got[k] for k in trainable}
            loss = part.detach() if loss is None else loss + part.detach()
        if self.module_recorder is not None:
            self.module_recorder.micro = None
        return loss, grads, unused

    def _update(self, p, grads, loss, rest):
        """The optimizer step: rest = the optimizer-state placeholders, the hyperparameters, the step count."""
        lay = self.lay
        n_s, n_h = len(lay.state_keys), len(lay.hyper_keys)
        st: dict = {}
        for (s, k), t in zip(lay.state_keys, rest[:n_s]):
            st.setdefault(s, {})[k] = t
        norm = None
        if self.clip_grad_norm is not None:
            like = {k: next((st[s][k] for s in st if k in st[s]), p[k]) for k in grads}
            grads, norm = _clip_by_global_norm(grads, self.clip_grad_norm, like)
        self.out_names[:] = ["loss"] + [f"params.{k}" for k in lay.trainable] \
            + [f"opt.{s}.{k}" for s, k in lay.state_keys] + (["grad_norm"] if norm is not None else [])
        if REPLICATE_UPDATE:   # the update is spliced in after the trace (replicate.py): return what it reads
            self.updated, self.anchor = lay.fopt.updated(grads), next(iter(reversed(tracing_graph().nodes)))
            return [loss] + [grads[k] for k in self.updated] + ([norm] if norm is not None else [])
        with torch.no_grad():
            new_p, new_s = lay.fopt.update({k: p[k] for k in lay.trainable}, grads, st, None, rest[n_s + n_h],
                                           hparams=dict(zip(lay.hyper_keys, rest[n_s:n_s + n_h])))
        return [loss] + [new_p[k] for k in lay.trainable] + [new_s[s][k] for s, k in lay.state_keys] \
            + ([norm] if norm is not None else [])


def _template_tracer(table):
    """Traces an optimizer template (replicate.py) as the step is traced: functionalized, under no_grad."""
    def trace(fn, example_inputs):
        with torch.no_grad():
            return make_fx(_functional(fn), tracing_mode="fake", decomposition_table=table)(*example_inputs)
    return trace


def _data_dependent(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)):
            return True
        e = e.__cause__ or e.__context__
    return False


def _real_values(model, example_inputs):
    """name -> the real full tensor of a step placeholder, for the branches' values (branches.py): the module's
    parameters and buffers, the example inputs; None where there is none (meta, fake)."""
    table = {f"params.{k}": p for k, p in model.named_parameters()}
    table.update({f"buffers.{k}": b for k, b in model.named_buffers()})
    table.update({f"inputs.{i}": x for i, x in enumerate(check_leaves(example_inputs))})

    def real(name):
        t = table.get(name)
        if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor) or t.device.type == "meta":
            return None
        return t.detach()
    return real


def _trace(step, lay, table, recorder, padding=None):
    drawn: list = []
    with _tracing_session(), _use_lazy_graph_module(True), no_gc(), recording_sources(), hf_experts(), \
            python_draws(drawn), \
            (recording_modules(step.model) if step.record_modules else contextlib.nullcontext()) as modules:
        # lazy: code generated on first use (below); sources: the user's line of each forward op (sources.py)
        step.module_recorder = modules
        gm = make_fx(_functional(step, recorder, padding), tracing_mode="fake", decomposition_table=table)(*lay.flat)
        if isinstance(recorder, Recorder):       # the guards' programs, from the graph as traced
            recorder.build()
        if step.updated is not None:
            masks = step.gate_tracer.masks(gm, lay, step.updated) if step.gate_tracer is not None else None
            splice_update(gm, lay, step.updated, step.anchor, _template_tracer(table), masks)
    if drawn:
        warn(f"partition: the step draws from Python's or NumPy's random generator at {'; '.join(drawn[:3])}: the "
             f"capture fixed that draw, so every step takes the path it chose. Draw with torch (torch.rand([])): "
             f"partir_torch then decides the branch at every step, as eager does.", stacklevel=user_stacklevel())
    return gm


def _traced_with_branches(model, example_inputs, make_step, table, device, values):
    """The step traced with a Recorder (branches.py): specialised to the path its real values take, the
    generator left as it was (the guards' draws are the step's own). Selections are traced at a static size
    (counts.py); one whose padding reaches a consumer without a padding rule makes the step traced again with that
    selection's count a guard. Returns (gm, step, recorder, padding, [Unpadded])."""
    refused: list = []
    while True:
        step = make_step()
        recorder = Recorder(step.lay.names, values or _real_values(model, example_inputs))
        padding = Padding({u.where for u in refused}, recorder._node)
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                    recorder.counting_nonzero():
                gm = _trace(step, step.lay, table, recorder, padding)
            return gm, step, recorder, padding, refused
        except Exception as e:  # noqa: BLE001 - a padded selection met a consumer without a padding rule
            u = _unpadded(e)
            if u is None or u.where in {r.where for r in refused}:
                raise
            refused.append(u)


def _traced_with_gates(model, example_inputs, make_step, table, values):
    """The step traced once with its layerdrop gated (gates.py): (gm, step, recorder, padding), step.gates set; the
    reads of data before the step's first draw (HF's check of the labels) are path guards of `recorder`
    (branches.py), selections are traced padded (counts.py; one that is not: the step is traced as paths).
    Raises gates.NotGated (its reason None when the step's reads are no layerdrop at all)."""
    step = make_step()
    recorder = Recorder(step.lay.names, values or _real_values(model, example_inputs))
    tracer = gating.GateTracer(model, recorder)
    padding = Padding(set(), recorder._node)
    step.gate_tracer = tracer
    handles = tracer.hooks()
    try:
        gm = _trace(step, step.lay, table, tracer, padding)
        tracer.check(model, gm, step.lay.names)
        step.gates = tracer.build(gm)
        recorder.build()
        return gm, step, recorder, padding
    except Exception as e:  # noqa: BLE001 - any failure of the gated trace: the step is traced as paths
        found = _in_chain(e, gating.NotGated)
        if found is not None:
            raise found from None
        if _data_dependent(e):
            raise gating.NotGated(None) from None
        raise gating.NotGated(f"the gated trace failed ({type(e).__name__}: {str(e)[:200]})") from None
    finally:
        for h in handles:
            h.remove()


def _in_chain(e: BaseException, kind):
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _unpadded(e: BaseException):
    """The Unpadded that caused e (make_fx may wrap it), or None."""
    return _in_chain(e, Unpadded)


def capture(model: torch.nn.Module, example_inputs, loss_fn=None, optimizer=None, options=(),
            decompositions=None, clip_grad_norm=None, accumulate=1, accumulate_dims=None,
            eval_loss=False, values=None, record_modules=False, bn_groups: int = 0) -> Captured:
    """options: capture-time tactics (MixedPrecision, Remat) that shape the traced step; decompositions: extra
    ones a tactic needs (see decompositions.py). clip_grad_norm, accumulate, accumulate_dims: see partition().
    eval_loss: the loss only, no gradients (mode EVAL). values: name -> real full tensor of a placeholder, for a
    step that branches on tensor values (branches.py; default: the module's and the example inputs' own). Such a
    step is traced twice: the plain trace stops at the first branch, and the step is traced again with a
    branches.Recorder (no cost for a step without branches). record_modules: every op records its module
    and micro-batch (stages.py; what a pipeline tactic cuts the step by). bn_groups: see Captured. The Captured is
    built here, once, and frozen: passes after it (the rewrites' rewrite(cap)) edit its graph, never its fields."""
    example_inputs = as_batch(example_inputs)
    mode = FORWARD if loss_fn is None else EVAL if eval_loss else (LOSS_AND_GRADS if optimizer is None else TRAIN)
    (gm, step, lay, recorder, padding, unpadded), first_call = _settled(model, lambda: _trace_step(
        model, example_inputs, loss_fn, optimizer, options, decompositions, mode, clip_grad_norm, accumulate,
        accumulate_dims, values, record_modules, fake_mode_for(None)))
    device = _trace_device(model, example_inputs)
    names, roles, out_names = lay.names, lay.roles, step.out_names
    checks = add_checks(gm, recorder.checks, out_names) if recorder is not None else []
    if recorder is not None:
        lift_draws(gm, recorder.drawn, names, roles)
    if step.gates is not None:         # every draw is made before the step, a skipped layer's not at all
        lift_draws(gm, gating.traced_draws(gm), names, roles)
    if first_call is not None and first_call.lifted:
        nodes = {n.name: n for n in gm.graph.nodes}
        lift_draws(gm, [nodes[k] for k in first_call.lifted], names, roles)
    _check_indices(gm, model)
    consts = _lift_constants(gm, names, roles)
    _refuse_state_constants(consts, model)
    untie_random_templates(gm)
    untie_unused_weights(gm)
    identity_indices(gm)
    _state_mutations(gm, names, roles, out_names, model)
    if accumulate > 1:
        _accumulate_early(gm)
    fields = _annotate(gm, mode, names, roles, out_names, step.out_spec, lay.fopt,
                       [k for k, _ in model.named_parameters()], lay.trainable, lay.buffers, device)
    if accumulate > 1:      # one device's dropout masks, each micro-batch reading its samples of them
        whole_batch_draws(gm, accumulate, micro_size(example_inputs, accumulate, accumulate_dims))
    if recorder is not None:
        fields.update(guards=tuple(recorder.guards), checks=tuple(checks), updated=tuple(step.updated or ()),
                      padded=tuple(padding.selections) if padding is not None else (),
                      unpadded=tuple((u.where, u.why) for u in unpadded))
    if step.gates is not None:
        fields.update(gates=step.gates, updated=tuple(step.updated or ()))
    cap = Captured(**fields, consts=consts, in_spec=lay.in_spec,
                   settings=dict(clip_grad_norm=clip_grad_norm, accumulate=accumulate, accumulate_dims=accumulate_dims,
                                 eval_loss=eval_loss, record_modules=record_modules),
                   modes=tuple(m.training for m in model.modules()), first_call=first_call,
                   rewrites=tuple(opt.name for opt in options),
                   decompositions=frozenset((decompositions or {}).keys()), bn_groups=bn_groups)
    # the passes above edit gm.graph only; gm is a lazy GraphModule: its code is generated when first called or
    # read (gm.code), not after each pass (about 0.5 s for a 20k-node step); partitioning reads only the graph
    gm.recompile()
    for opt in options:
        opt.rewrite(cap)
    return cap



def _settled(model, trace):
    """trace() (a _trace_step) of a model that may change itself on its first call (settle.py): when the trace
    changed the module tree, the step is traced again on the changed model, the steady step eager runs from its
    second call on. Returns (trace()'s result, a settle.FirstCall or None)."""
    before = settle.snapshot(model)
    got = trace()
    moved = settle.changes(before, settle.snapshot(model))
    if not moved:
        return got, None
    settle.refuse_new_state(before, model, moved)
    again = settle.snapshot(model)
    steady = trace()
    if settle.changes(again, settle.snapshot(model)):
        raise TraceError(f"partition: {type(model).__name__} changes its modules at every call "
                         f"({'; '.join(moved[:3])}), so no step is steady enough to capture. Build the modules "
                         f"once (in __init__, or on the first call only).")
    fc = settle.first_call_draws(got[0], steady[0], can_lift=steady[3] is None)
    drawn = "" if fc is None else (
        f"; the first step makes the {len(fc.extras.graph.output_node().args[0])} random draw(s) that call made "
        f"beyond it ({'; '.join(fc.lines[:2])}{' ...' if len(fc.lines) > 2 else ''})" + (
            ", in eager's order" + (f" ({len(fc.lifted)} dropout draw(s) eager made before them are made before "
                                    f"each step and fed to it)" if fc.lifted else "") if fc.exact else
            ", before the step's own: eager made them after some of those, so the first step's draws differ from "
            "eager's first call (the generator ends where eager's does: every later step's draws are eager's)"))
    warn(f"partition: the first call of {type(model).__name__} changed the model ({len(moved)} module(s): "
         f"{'; '.join(moved[:3])}{' ...' if len(moved) > 3 else ''}): the step is captured as the changed model "
         f"runs from its second call on{drawn}.", stacklevel=user_stacklevel())
    return steady, fc


def _trace_step(model, example_inputs, loss_fn, optimizer, options, decompositions, mode, clip_grad_norm, accumulate,
                accumulate_dims, values, record_modules, fake_mode, dynamic=None):
    """The step traced on fake tensors of `fake_mode` (inputs' dims in `dynamic` symbolic: dims.py): (gm, step,
    layout, recorder, padding, unpadded), the last three None / () for a step without branches."""
    if loss_fn is not None:
        _check_signature(loss_fn, model, example_inputs)
    device = _trace_device(model, example_inputs)
    lay = _layout(model, example_inputs, optimizer, mode, fake_mode, device, dynamic=dynamic)
    step = _Step(model, lay, loss_fn, options, clip_grad_norm, accumulate, accumulate_dims)
    step.record_modules = record_modules
    handles = install_hooks(model)
    for opt in options:
        handles += opt.install(model)
    recorder, padding, unpadded = None, None, ()
    try:
        table = {**capture_decompositions(), **(decompositions or {}),
                 **(symbolic_decompositions() if dynamic else {})}
        try:
            gm = _trace(step, lay, table, None)
        except Exception as e:  # noqa: BLE001 - a branch on a tensor value: traced again, specialised to its path
            if not _data_dependent(e) or dynamic:
                raise
            gm = None
        if gm is None:
            def make_step():
                lay = _layout(model, example_inputs, optimizer, mode, fake_mode, device, param_steps=True)
                step = _Step(model, lay, loss_fn, options, clip_grad_norm, accumulate, accumulate_dims)
                step.record_modules = record_modules
                return step
            gm, why = None, None
            if gating.enabled() and accumulate == 1 and not record_modules:
                try:
                    gm, step, recorder, padding = _traced_with_gates(model, example_inputs, make_step, table,
                                                                     values)
                except gating.NotGated as e:
                    why = e.reason
            if gm is None:
                gm, step, recorder, padding, unpadded = _traced_with_branches(model, example_inputs, make_step,
                                                                               table, device, values)
            if why is not None and values is None:     # said by partition, not again at each new path
                warn(f"partition: the step's random branches are not layerdrop's shape ({why}); it is traced "
                     f"as paths, one program per combination of their values, each captured when first met.",
                     stacklevel=user_stacklevel())
            lay = step.lay
    except PartitionError:
        raise
    except Exception as e:  # noqa: BLE001 - every trace failure becomes one clear error
        raise _trace_error(e, mode, model, example_inputs) from e
    finally:
        for h in handles:
            h.remove()
    return gm, step, lay, recorder, padding, unpadded


def dim_guards(model, example_inputs, loss_fn=None, optimizer=None, options=(), decompositions=None,
               clip_grad_norm=None, accumulate=1, accumulate_dims=None, eval_loss=False, record_modules=False,
               positions=()) -> DimGuards:
    """The step traced as capture() traces it, with the input sizes at `positions` symbolic: (input index, dim)
    pairs, all one symbol s, or {(input index, dim): symbol name}. The guards on them (dims.py). Raises what the
    trace raises. A training step is traced without its optimizer's update: the update reads the parameters, their
    gradients and the optimizer's state, all of the parameters' static shapes, so no decision on an input size is
    made there (a tenth of the symbolic trace, which costs about three concrete captures)."""
    example_inputs = as_batch(example_inputs)
    mode = FORWARD if loss_fn is None else EVAL if eval_loss else LOSS_AND_GRADS
    fake_mode = fake_mode_for(positions)
    _, _, lay, _, _, _ = _trace_step(model, example_inputs, loss_fn, None, options, decompositions, mode,
                                     clip_grad_norm, accumulate, accumulate_dims, None, record_modules, fake_mode,
                                     dynamic=frozenset(positions))
    flat = {int(n.split(".")[1]): x for n, x in zip(lay.names, lay.flat) if n.startswith("inputs.")}
    names = dict(positions) if isinstance(positions, dict) else None
    return DimGuards.collect(fake_mode, {(i, d): flat[i].shape[d] for i, d in positions}, names)

_VIEWS = tags.ops("view") | tags.ops("cast")   # a parameter seen through views and casts


def _split_param_views(gm) -> None:
    """A view of a parameter used by the forward and the backward (t(W) feeding x @ W.T and, later, dx = dy @ W)
    is duplicated for the backward, so that a tiled parameter is gathered for each phase and its gathered copy
    does not live from forward to backward (ZeRO-3's memory saving)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    fwd = forward_nodes(gm)
    for n in nodes:
        if n.op != "call_function" or n.target not in _VIEWS or n not in fwd:
            continue
        if not all(a.op == "placeholder" or a.target in _VIEWS for a in n.all_input_nodes):
            continue
        split_for_backward(gm, n, fwd, index)
    gm.graph.lint()


def _annotate(gm, mode, names, roles, out_names, out_spec, fopt, param_fqns, trainable, buffer_fqns, device):
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    named = {}
    for node, name, role in zip(placeholders, names, roles):
        node.meta[META_NAME], node.meta[META_ROLE] = name, role
        named[name] = node
    stamp_phases(gm, forward_only=mode in (FORWARD, EVAL))     # the rewrites below stamp the nodes they add
    if mode != FORWARD:
        _split_param_views(gm)
    bias_last(gm)
    share_views(gm, same=(META_PHASE, META_MICRO, META_REMAT, META_RECOMPUTE, META_CLIP, "custom"))
    mark_rank_values(gm)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    for node in outs:
        if isinstance(node, fx.Node):
            node.meta[META_OUTPUT] = True
    ties = [(named[name], node) for name, node in zip(out_names, outs)
            if name in named and isinstance(node, fx.Node) and node is not named[name]]
    for name, node in collect_tags(gm).items():
        named.setdefault(name, node)
    for name, node in zip(out_names, outs):
        if name.startswith("grads.") or name == "loss" or name.startswith("outputs."):
            named.setdefault(name, node)
    return dict(gm=gm, mode=mode, input_names=names, input_roles=roles, output_names=out_names, names=named,
                ties=ties, out_spec=out_spec, fopt=fopt, param_fqns=param_fqns, trainable=trainable,
                buffer_fqns=buffer_fqns, device=device)
