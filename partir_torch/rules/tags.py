"""Per-op facts, declared once: tag -> the aten ops that have it, and the few per-op tables keyed by op.

Capture, propagation, tactics, lowering, the runtimes, the simulator and the XLA backend ask these questions of an
op (is it a view? does it draw random numbers? is it a matmul?); they ask here instead of keeping their own lists,
so that a new op is declared in one place:

    from partir_torch.rules import tags
    if tags.has(node.target, "view"): ...

``default_registry().row(op).tags`` and ``RuleRegistry.has_tag(op, tag)`` read the same table. Where two passes
need a different set, the difference is a tag of its own with a name (and a comment) that says why.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

aten, prims = torch.ops.aten, torch.ops.prims

# ---- base families -------------------------------------------------------------------------------------------------
_RESHAPE = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
_TRANSPOSE = frozenset({aten.t.default, aten.transpose.int, aten.permute.default})
_SQUEEZE = frozenset({aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims})
_BROADCAST = frozenset({aten.expand.default})
_VIEW = _RESHAPE | _TRANSPOSE | _SQUEEZE | _BROADCAST
_COPY = frozenset({aten.clone.default, aten.alias.default, aten.contiguous.default, aten.detach.default,
                   aten.lift_fresh_copy.default})
_CAST = frozenset({aten._to_copy.default, prims.convert_element_type.default})
_PART = frozenset({aten.slice.Tensor, aten.select.int})
_SPLIT = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int})
_CONCAT = frozenset({aten.cat.default})
_RANDOM = frozenset({aten.native_dropout.default, aten.rand.default, aten.randn.default, aten.rand_like.default,
                     aten.randn_like.default, aten.bernoulli.default, aten.bernoulli.p})
_MATMUL = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})

TAGS: dict = {
    # views and layout changes, no arithmetic: a replicated copy of the view is the view of a replicated source
    "view": _VIEW,
    "reshape": _RESHAPE,           # view / reshape: the rows a collective moves stay rows (lower/overlap, ring)
    "transpose": _TRANSPOSE,
    "squeeze": _SQUEEZE,           # adds or drops dims of size 1
    "unsqueeze": frozenset({aten.unsqueeze.default}),   # only adds one
    "broadcast": _BROADCAST,
    # lowering's row-moving ops between an all_gather's result and the matmul reading it (lower/ring.py)
    "moves_rows": _RESHAPE | {aten.permute.default, aten.clone.default},       # expand: a view lowering does not hoist (its result is larger than its source)
    # the same values in new or aliased storage
    "copy": _COPY,
    # ops that always write their operands' elements into new storage, computing nothing (lower/copies.py counts
    # them, with the reshapes that cannot be views, as the program's layout copies)
    "layout_copy": frozenset({aten.clone.default, aten.contiguous.default, aten.cat.default, aten.stack.default,
                              aten.index_select.default, aten.constant_pad_nd.default, aten.copy.default}),
    # dtype conversions (mixed precision casts every parameter before its use)
    "cast": _CAST,
    # a contiguous part of the operand (x[a:b], x[i])
    "part": _PART,
    "split": _SPLIT,
    "concat": _CONCAT,
    # views whose result is a function of their operands and arguments alone: two equal calls are one value
    "shareable_view": _VIEW | _PART | {aten.alias.default},
    # a gradient is still the gradient when padded back into its parameter's shape (wpe[:T]), summed
    # (micro-batches, tied weights) or scaled (clipping, loss scaling)
    "pads_back": frozenset({aten.slice_backward.default, aten.select_backward.default}),
    "adds": frozenset({aten.add.Tensor, aten.sub.Tensor}),
    "scales": frozenset({aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}),
    # ops that only unpack a collective's result (a bucket's slices and views, a gathered dim moved back): they move
    # down with their wait (lower/schedule.py)
    "unpacks_collective": _RESHAPE | {aten.slice.Tensor, aten.permute.default, aten.clone.default},
    # ops that only prepare a state gather's input from the state itself (a bucket's copy-in, a mixed-precision cast
    # of the shard): lowering moves them up with the gather, the estimate counts their result as state, the
    # simulator's timeline prefetches them with it
    "prepares_gather": _RESHAPE | _TRANSPOSE | {aten.slice.Tensor, aten.cat.default, aten.flatten.using_ints,
                                                 aten._to_copy.default, aten.clone.default, aten.alias.default,
                                                 aten.contiguous.default, aten.detach.default},
    # ops through which a gradient's sum over ranks is traced back to its terms (lower/pipeline.py)
    "carries_sum": _RESHAPE | _CAST | {aten.add.Tensor, aten.sub.Tensor, torch.ops._c10d_functional.all_reduce.default,
                                       torch.ops._c10d_functional.wait_tensor.default},
    # random draws: drawn whole from the generator on every rank (rules/pointwise.py), kept by remat
    # (contract.draws_random adds every op torch tags nondeterministic_seeded)
    "random": _RANDOM,
    "random_factory": frozenset({aten.rand.default, aten.randn.default}),   # shaped by arguments (rules/nn.py)
    # draws whose tensor operand is only a template (shape, dtype, device): bernoulli_(empty_like(x), p)
    "random_from_template": frozenset({aten.bernoulli.p, aten.rand_like.default, aten.randn_like.default}),
    # factories shaped by their arguments that a draw's template may be (capture/microdraws.py)
    "template_factory": frozenset({aten.empty.memory_format, aten.zeros.default, aten.ones.default,
                                   aten.full.default}),
    # factories whose values are undefined: compared by shape and dtype only
    "uninitialised": frozenset({aten.empty_like.default, aten.empty.memory_format, aten.new_empty.default,
                                aten.empty_strided.default, aten.new_empty_strided.default}),
    # ops whose schema does not say "alias" but that never copy (lowering emits reshape for views)
    "aliases": frozenset({aten._unsafe_view.default, aten.alias.default, aten.lift_fresh.default,
                          aten._reshape_alias.default, aten.reshape.default}),
    "arange": frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step}),
    # views through which the pipeline's capture takes one microbatch of an input (view as (m, B / m, S), select,
    # clone): context parallelism's balancing follows labels back through them (tactics/cpbalance.py)
    "microbatch_view": frozenset({aten.clone.default, aten.select.int, aten.view.default,
                                  aten._unsafe_view.default}),
    # contractions; "matmul_bias": the first operand is a bias added to the product (addmm(bias, m1, m2))
    "matmul": _MATMUL,
    "matmul_bias": frozenset({aten.addmm.default, aten.baddbmm.default}),
    "matmul_2d": frozenset({aten.mm.default, aten.addmm.default}),   # async TP's ring splits these by rows
    # ops that mix positions of a sequence (attention and its pieces): a region of one token's values ends at them
    "mixes_positions": frozenset({aten._scaled_dot_product_flash_attention_for_cpu.default, aten.bmm.default,
                                  aten._softmax.default, aten._safe_softmax.default, aten.where.self,
                                  aten.masked_fill.Scalar, aten.tril.default}),
    # fused attention kernels' forwards: context parallelism checks that it tiled their query rows (tactics/cp.py)
    "attention_kernel": frozenset({aten._scaled_dot_product_flash_attention_for_cpu.default}),
    "attention_backward": frozenset({aten._scaled_dot_product_flash_attention_for_cpu_backward.default}),
    # constant padding (HF's causal-LM loss pads the labels before its one-token shift: tactics/cp.py says so)
    "pads": frozenset({aten.constant_pad_nd.default}),
    # normalisations, reductions and lookups: a layer's region stops at them (tactics/structure.py)
    "ends_layer": frozenset({aten.native_layer_norm.default, aten.sum.dim_IntList, aten.amax.default,
                             aten.mean.dim, aten.sum.default, aten.native_group_norm.default,
                             aten.embedding.default}),
    # how a stacked expert weight (E, ., .) is used: a batched matmul over E or a selection of experts
    "selects_experts": frozenset({aten.bmm.default, aten.baddbmm.default, aten.index_select.default,
                                  aten.index.Tensor}),
    # the ops capture/optim.py's SGD emits (the first step's where, momentum, weight decay, the update's addcmul):
    # lower/fuse.py fuses them
    "sgd_math": frozenset({aten.mul.Tensor, aten.add.Tensor, aten.addcmul.default, aten.where.self, aten.le.Scalar,
                           aten.neg.default, aten._to_copy.default}),
    # the ops capture/optim.py's Adam/AdamW emits (tensor and float64 scalar math): lower/fuse.py fuses them
    "adam_math": frozenset({aten.mul.Tensor, aten.mul.Scalar, aten.lerp.Tensor, aten.lerp.Scalar,
                            aten.addcmul.default, aten.sqrt.default, aten.div.Tensor, aten.add.Tensor,
                            aten.add.Scalar, aten.rsub.Scalar, aten.neg.default, aten.pow.Tensor_Tensor,
                            aten.pow.Tensor_Scalar, aten.pow.Scalar, aten._to_copy.default, aten.maximum.default,
                            aten.sub.Tensor, aten.sub.Scalar}),
    # besides the ops torch tags pointwise, those TorchInductor generates into one kernel with their elementwise
    # neighbours (reductions, normalisations, copies, casts): sim/fusion.py prices compiled programs by it
    "compiled_fuses": frozenset({aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.amax.default,
                                 aten.amin.default, aten.var.correction, aten._softmax.default,
                                 aten._log_softmax.default, aten._softmax_backward_data.default,
                                 aten._log_softmax_backward_data.default, aten.native_layer_norm.default,
                                 aten.native_layer_norm_backward.default, aten.clone.default, aten._to_copy.default,
                                 aten.copy.default}),
    # defined on positive floats only: verify draws their operands positive (no NaN hiding a mismatch)
    "positive_domain": frozenset({aten.sqrt.default, aten.rsqrt.default, aten.log.default, aten.log2.default,
                                  aten.reciprocal.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor}),
}
# composites: read as the union of the tags named
TAGS["same_value"] = TAGS["view"] | TAGS["copy"] | TAGS["cast"] | TAGS["part"]   # still the same tensor (state, grads)
TAGS["reviews"] = TAGS["view"] | TAGS["copy"]          # only re-view their operand: a closed region is cut back to it
TAGS["moves_data"] = TAGS["same_value"] | TAGS["split"] | TAGS["concat"]   # elements moved, none computed

_OF: dict = {}
for _tag, _ops in TAGS.items():
    for _op in _ops:
        _OF.setdefault(_op, set()).add(_tag)
_OF = {op: frozenset(t) for op, t in _OF.items()}


def has(op, tag: str) -> bool:
    """Whether `op` (an fx target) has `tag`. An unknown tag raises (a typo would answer False forever)."""
    ops = TAGS.get(tag)
    if ops is None:
        raise KeyError(f"rules/tags.py declares no tag {tag!r}; tags: {', '.join(sorted(TAGS))}")
    try:
        return op in ops
    except TypeError:            # an unhashable target
        return False


def ops(tag: str) -> frozenset:
    if tag not in TAGS:
        raise KeyError(f"rules/tags.py declares no tag {tag!r}; tags: {', '.join(sorted(TAGS))}")
    return TAGS[tag]


def tags_of(op) -> frozenset:
    """Every tag of `op` (empty for an op no tag names)."""
    try:
        return _OF.get(op, frozenset())
    except TypeError:
        return frozenset()


def schema_names(tag: str) -> frozenset:
    """The aten schema names ("aten::view") of a tag's ops: for the simulator, which classifies every overload."""
    return frozenset(op._schema.name for op in ops(tag))


def fuses_when_compiled(op) -> bool:
    """Whether TorchInductor generates `op` into a fused kernel with its elementwise neighbours (torch's pointwise
    tag, or the "compiled_fuses" tag: reductions, normalisations, copies and casts) rather than calling an extern
    kernel for it."""
    try:
        return op in _OF and "compiled_fuses" in _OF[op] or torch.Tag.pointwise in op.tags
    except (TypeError, AttributeError):       # not an OpOverload (a Python function)
        return False


# ---- partir_torch's own kernels ------------------------------------------------------------------------------------
# Python functions a lowered program calls as one op, declared with @kernel by the module that defines them
# (lower/fuse.py's adam_update, sgd_update): fn -> the argument positions (lists of tensors) whose storage its results
# take when its last argument (donate) is True. The simulator prices them as memory-bound compute (sim/compute.py),
# lets their results alias the donated arguments and counts the bytes they allocate and free inside themselves
# (TRANSIENT, sim/memory.py).
KERNELS: dict = {}
TRANSIENT: dict = {}        # fn -> transient(args, size) -> bytes; size(list of nodes) -> their bytes


def kernel(donates: tuple = (), transient=None):
    """Decorator: declare `fn` one of partir_torch's kernels (see KERNELS). Example: `@kernel(donates=(0, 2))`."""
    def wrap(fn):
        KERNELS[fn] = tuple(donates)
        if transient is not None:
            TRANSIENT[fn] = transient
        return fn
    return wrap


def transient_bytes(target, args, size) -> int:
    """The bytes a kernel call allocates and frees inside itself (TRANSIENT); 0 for any other target."""
    fn = TRANSIENT.get(target) if is_kernel(target) else None
    return 0 if fn is None else fn(args, size)


def is_kernel(target) -> bool:
    """Whether an fx target is one of partir_torch's kernels (KERNELS)."""
    try:
        return target in KERNELS
    except TypeError:            # an unhashable target
        return False


def donated_args(target) -> tuple:
    """The argument positions whose storage a kernel's results take when it donates (KERNELS); () for any other
    target."""
    return KERNELS[target] if is_kernel(target) else ()


# ---- per-op tables -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IndexArg:
    """Where an op reads integer indices into another operand, and what bounds their values.

    arg: the argument position of the index tensor; slot: its tensor-operand slot (registry.tensor_operands);
    bound: ("rows", i) dim 0 of argument i, ("last", i) the last dim of argument i, ("dim",) the indexed operand
    (argument 0) along the op's `dim` argument, ("arg", i, name) an int argument; unique: duplicate indices make the result
    arbitrary (scatter writes one of them)."""

    arg: int
    slot: int
    bound: tuple
    unique: bool = False


INDEX_ARGS = {
    aten.embedding.default: IndexArg(1, 1, ("rows", 0)),
    aten.embedding_dense_backward.default: IndexArg(1, 1, ("arg", 2, "num_weights")),
    aten.index_select.default: IndexArg(2, 1, ("dim",)),
    aten.gather.default: IndexArg(2, 1, ("dim",)),
    aten.scatter.src: IndexArg(2, 1, ("dim",), unique=True),
    aten.scatter.value: IndexArg(2, 1, ("dim",), unique=True),
    aten.scatter_add.default: IndexArg(2, 1, ("dim",)),
    aten.index_add.default: IndexArg(2, 1, ("dim",)),
    aten.scatter_reduce.two: IndexArg(2, 1, ("dim",)),
    aten.nll_loss_forward.default: IndexArg(1, 1, ("last", 0)),
    aten.nll_loss_backward.default: IndexArg(2, 2, ("last", 1)),
}
# ops indexed by a list of index tensors (x[idx], x[idx] = v): argument position of the list
INDEX_LIST_ARG = {aten.index.Tensor: 1, aten.index_put.default: 1, aten.index_put_.default: 1}

# factories shaped like their operand -> (the factory with a static shape, its value argument's index or None)
STATIC_FACTORY = {aten.empty_like.default: (aten.empty.memory_format, None),
                  aten.zeros_like.default: (aten.zeros.default, None),
                  aten.ones_like.default: (aten.ones.default, None),
                  aten.full_like.default: (aten.full.default, 1)}

# the op lowering emits for a view: reshape is the same view when the strides allow it and a copy otherwise
EMITTED_AS = {aten.view.default: aten.reshape.default, aten._unsafe_view.default: aten.reshape.default}

# padding of an uneven tile: op -> {tensor slot: argument index holding the filler} (nll_loss's padded targets
# are its ignore_index, so neither the loss sum nor total_weight counts them)
FILL_FROM_ARG = {aten.nll_loss_forward.default: {1: 4}}

# ops whose result depends on the order of positions along a dim -> the argument holding that dim (context
# parallelism's load balancing permutes the sequence and refuses them: tactics/cpbalance.py)
ORDER_DIM_ARG = {aten.cumsum.default: 1, aten.cumprod.default: 1, aten.roll.default: 2, aten.flip.default: 1,
                 aten.narrow.default: 1}

# the natural einsum of the matmul family for xla/strided.py (capital letters; the bias of addmm is left aside)
MATMUL_DIMS = {aten.mm.default: ("IK", "KJ", "IJ"), aten.bmm.default: ("BIK", "BKJ", "BIJ"),
               aten.addmm.default: ("IK", "KJ", "IJ")}


# -- drawing from the generator (read by the runtimes, lowering's order, remat, the pipeline) --------------------
def draws_random(node) -> bool:
    """Whether fx node `node` draws from the generator: a seeded op (TAGS["random"] and every op tagged
    nondeterministic_seeded; attention kernels only with dropout_p > 0)."""
    if node.op != "call_function":
        return False
    seeded = _SEEDED.get(node.target)
    if seeded is None:
        seeded = _SEEDED[node.target] = _seeded(node.target)
    if seeded == "dropout_p":
        p = node.kwargs.get("dropout_p", node.args[3] if len(node.args) > 3 else 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    return seeded


def _seeded(t):
    """draws_random's answer for an op whatever its arguments (True / False), or "dropout_p" for an attention
    kernel, which draws only with dropout (read once per op: reordering a graph asks it of every node)."""
    if t in TAGS["random"]:
        return True
    if not (isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags
            and "empty" not in t.name()):
        return False
    return "dropout_p" if "scaled_dot_product" in t.name() else True


_SEEDED: dict = {}
