"""Per-op compute cost: FLOPs and bytes from FX meta, roofline time with Hockney-style efficiency curves.

time = ||(F / (mm_efficiency * peak(dtype)) + mm_half_time,  bytes / (hbm_efficiency * hbm_bw) + kernel_overhead)||_p

(p = ``Hardware.roofline_p``; p -> infinity is the classic max() roofline)

The first leg is Hockney's r_inf / n_1/2 model (Hockney 1991): efficiency F / (F + F_1/2) rises with the work and
saturates at the best-shape fraction; F_1/2 is fit so a 1024^3 fp16 GEMM on A100 gets 38% of peak (MAMF). Ops
without a FLOP formula are memory bound. FLOPs come from ``torch.utils.flop_counter``'s registered formulas (mm,
addmm, bmm, baddbmm, convolution(+backward), the SDPA kernels), plus the CPU flash-attention kernels below.
Views, getitem and metadata ops cost nothing.

The fused optimizer updates of eager programs (lower/fuse.py's `adam_update` and `sgd_update`, the kernels of
torch.optim's foreach/fused Adam and SGD) are costed as the fused kernels run: one memory-bound kernel per param
group, reading parameter, gradient and state once and writing parameter and state once (Adam: 7 passes over the
parameter bytes, against about 15 for the op-by-op update), plus one kernel overhead.
"""
from __future__ import annotations

import math
import operator

import numpy as np
import torch
from torch.fx import Node
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ..rules import tags
from ..rules.registry import linked
from .hardware import Hardware

aten = torch.ops.aten

# Op classes.
FREE, COMPUTE, COLLECTIVE, WAIT = 0, 1, 2, 3

COLLECTIVE_NAMES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                    "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced")
COLLECTIVE_KIND = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
                   "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}
# partir's own collectives: lower/ring.py's ring step of async_tp, lower/bucketops.py's bucket collectives
_PARTIR_COLLECTIVES = {"ring_shift": "collective_permute", "all_gather_bucket": "all_gather",
                       "all_reduce_bucket": "all_reduce"}
# Ops whose schema does not say "alias" but that never copy (functionalization's reshape result, ...).
_ALIAS_OPS = tags.schema_names("aliases")   # lowering emits reshape for views: a view whenever the strides allow
# Ops that allocate without running a kernel: free in time, but they hold memory.
_ALLOC_OPS = tags.schema_names("uninitialised")


def cpu_flash_fwd(q, k, v, *args, out_val=None, **kwargs):
    return sdpa_flop_count(q.shape, k.shape, v.shape)          # same math as the CUDA flash kernel


def cpu_flash_bwd(grad_out, q, k, v, *args, out_val=None, **kwargs):
    return sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)


def experts_flops(hidden, top_k_index, top_k_weights, gate_up, down, *args, out_val=None, **kwargs):
    """partir::experts_grouped (rules/moe.py): each (token, expert) pair through its expert's two projections."""
    return 2 * top_k_index.numel() * (math.prod(gate_up.shape[1:]) + math.prod(down.shape[1:]))


def experts_backward_flops(grad, hidden, top_k_index, top_k_weights, gate_up, down, *args, out_val=None, **kwargs):
    """Its backward: the forward recomputed, then input and weight gradients of both projections (3 forwards)."""
    return 3 * experts_flops(hidden, top_k_index, top_k_weights, gate_up, down)


# schema name -> formula, for the ops whose registry row links a formula here (rules/registry.py LINKS)
EXTRA_FLOPS = {op._schema.name: fn for op, fn in linked("flops", "sim.compute", globals()).items()}

_CLASS_CACHE: dict = {}


def op_class(target) -> tuple:
    """(class, info) for a call_function target. FREE ops: info is "view" (aliases its first argument),
    "getitem", "alloc" (allocates, no kernel) or "meta"/None (no tensor result); COLLECTIVE: the kind;
    COMPUTE: the FLOP formula or None (memory bound)."""
    hit = _CLASS_CACHE.get(id(target))            # by id: OpOverload.__hash__ is slow Python
    if hit is None:
        hit = _CLASS_CACHE[id(target)] = (*_classify(target), target)   # keep target alive: ids stay unique
    return hit[0], hit[1]


def _classify(target) -> tuple:
    if target is operator.getitem:
        return FREE, "getitem"
    if tags.is_kernel(target):
        return COMPUTE, None                                    # lower/fuse.py's updates: memory bound
    if not isinstance(target, torch._ops.OpOverload):
        return FREE, None                                       # Python / SymInt arithmetic
    ns, name = target.namespace, target._schema.name
    base = name.split("::")[-1]
    if ns == "partir" and base in _PARTIR_COLLECTIVES:
        return COLLECTIVE, _PARTIR_COLLECTIVES[base]
    if ns == "_c10d_functional":
        if base == "wait_tensor":
            return WAIT, None
        if base in COLLECTIVE_NAMES:
            return COLLECTIVE, COLLECTIVE_KIND.get(base.replace("_coalesced", ""), base)
    schema = target._schema
    rets = schema.returns
    if name in _ALLOC_OPS:
        return FREE, "alloc"
    if name in _ALIAS_OPS or (rets and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)):
        return FREE, "view"
    if rets and all(str(r.type) in ("SymInt", "int", "float", "bool", "Scalar") for r in rets):
        return FREE, "meta"                                     # sym_size, _local_scalar_dense, ...
    if not rets:
        return FREE, "meta"                                     # _assert_*, record_stream
    formula = EXTRA_FLOPS.get(name) or flop_registry.get(target.overloadpacket)
    return COMPUTE, formula


def val_bytes(v) -> int:
    """Bytes of a meta val (tensor, or list/tuple of them); 0 for anything else."""
    return sum(elem_bytes(v))


def elem_bytes(v) -> list:
    """Bytes of each tensor a meta val holds: [b] for a tensor, one entry per element for a tuple/list."""
    if isinstance(v, torch.Tensor):
        return [v.numel() * v.element_size()]
    if isinstance(v, (tuple, list)):
        return [val_bytes(x) for x in v]
    return []


def val_facts(v) -> tuple:
    """(signature, per-tensor bytes) of a meta val, in one pass (shape and dtype only: fake-tensor method calls
    are slow)."""
    if isinstance(v, torch.Tensor):
        shape, dtype = tuple(v.shape), v.dtype
        return (shape, dtype), [math.prod(shape) * dtype.itemsize]
    return val_sig(v), elem_bytes(v)


def val_sig(v):
    """Hashable (shape, dtype) signature of a meta val."""
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), v.dtype
    if isinstance(v, (tuple, list)):
        return tuple(val_sig(x) for x in v)
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)


def _meta(a):
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


class CostModel:
    """Per-op costs for one hardware, cached by (target, input signatures, non-tensor args).

    ``cost(node, target, formula, sigs, nbytes)`` -> (flops, seconds, dtype name); ``formula`` is what
    :func:`op_class` returned for the target, ``sigs`` / ``nbytes`` the per-node val caches of the simulator.
    """

    def __init__(self, hw: Hardware):
        self.hw = hw
        self._cache: dict = {}

    def cost(self, node, target, formula, sigs: dict, nbytes: dict) -> tuple:
        """(flops, seconds, dtype name) of one compute node. ``sigs``/``nbytes``: per-node val caches."""
        try:                                  # fast path: Node and scalar args
            key = (id(target), sigs[node], *[sigs[a] if a.__class__ is Node else a for a in node.args],
                   *node.kwargs.items())
            hit = self._cache.get(key)
        except TypeError:                     # a list argument (dims, sizes): freeze it
            key = (id(target), sigs[node], _freeze(node.args, sigs), _freeze(tuple(node.kwargs.items()), sigs))
            hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._compute(node, formula, nbytes)
        return hit

    def _compute(self, node, formula, nbytes) -> tuple:
        hw = self.hw
        in_bytes = 0
        dtype = None
        for a in _operands(node):                # every operand read, a repeated one (mm(x, x)) each time: the
            in_bytes += nbytes.get(a, 0)         # cost cache's key has one entry per argument too
            if dtype is None:
                v = a.meta.get("val")
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    dtype = v.dtype
        total = in_bytes + nbytes.get(node, 0)
        t_mem = memory_time(hw, total)
        flops = formula_flops(node, formula) if formula is not None else 0
        if flops <= 0:
            return 0, t_mem, None
        dtype = dtype or torch.float32
        # a step runs at the clock the chip sustains (hw.sustained_clock), kernel benchmarks at their own
        t = kernel_time(hw, flops / hw.sustained_clock, total, dtype, _is_attention(node.target))
        return flops, t, str(dtype).replace("torch.", "")


def formula_flops(node, formula) -> int:
    """FLOPs of one node by its op's formula (op_class) on its meta vals; 0 when the formula cannot read them."""
    try:
        args = torch.fx.node.map_aggregate(node.args, _meta)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, _meta)
        return int(formula(*args, out_val=node.meta.get("val"), **kwargs))
    except Exception:                                    # a formula that cannot read these args
        return 0


def _operands(node) -> list:
    out: list = []
    torch.fx.node.map_arg((node.args, node.kwargs), out.append)
    return out


def memory_time(hw: Hardware, nbytes: float) -> float:
    """Seconds of a memory-bound kernel that reads and writes ``nbytes`` in all."""
    return nbytes / (hw.hbm_efficiency * hw.hbm_bw) + hw.kernel_overhead_s


def kernel_time(hw: Hardware, flops: float, nbytes: float, dtype, attention: bool = False) -> float:
    """Roofline of one FLOP-carrying kernel: its Hockney compute leg and its memory leg, combined as a p-norm
    (``hw.roofline_p``): a kernel near the ridge point (a tall-skinny GEMM) overlaps its operand streaming with its
    math only in part, so it takes longer than the slower leg alone; far from the ridge the slower leg wins, and as
    p grows the classic max() roofline is the limit."""
    eff = hw.attn_efficiency if attention else hw.mm_efficiency
    if hw.fp8_efficiency and str(dtype).replace("torch.", "").startswith("float8"):
        eff = hw.fp8_efficiency
    t_flop = flops / (eff * hw.peak_flops(dtype)) + hw.mm_half_time_s
    # the kernel's fixed cost is the compute leg's half-time; its memory leg is the streaming alone (the memory-bound
    # kernels' launch overhead, hw.kernel_overhead_s, is not charged a second time)
    return float(combine_legs(t_flop, nbytes / (hw.hbm_efficiency * hw.hbm_bw), hw.roofline_p))


def combine_legs(t_flop, t_mem, p: float):
    """(t_flop^p + t_mem^p)^(1/p), elementwise on floats or numpy arrays (sim/quick.py); p >= 64: the max."""
    hi = np.maximum(t_flop, t_mem)
    if p >= 64:
        return hi
    safe = np.where(hi > 0, hi, 1.0)             # scaled by the larger leg so that large p does not overflow
    return np.where(hi > 0, hi * ((t_flop / safe) ** p + (t_mem / safe) ** p) ** (1 / p), 0.0)


def _is_attention(target) -> bool:
    return "scaled_dot_product" in str(target)


def _freeze(a, sigs):
    if isinstance(a, (list, tuple)):
        return tuple(_freeze(x, sigs) for x in a)
    if isinstance(a, Node):
        return sigs[a]
    try:
        hash(a)
        return a
    except TypeError:
        return repr(a)
