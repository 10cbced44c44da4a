"""The op registry: one row per aten op overload with everything partir_torch knows of it.

``default_registry().row(aten.embedding.default)`` is an :class:`OpRow`:

- ``rule``: its tile-mapping rule (an einsum spec string, or a builder function of the node), from the rule module
  named by ``family`` (rules/pointwise.py, matmul.py, ... nn.py);
- ``localize``: how its shape arguments become local (rules/localize.py: a row of ``ROWS``, else "generic");
- ``local``: how it runs on its shards: "as is" (the aten op on local shards), or the lower/indexed.py kernel it
  runs when its indexed factor is tiled;
- ``flops``: the FLOP count the simulator charges: torch.utils.flop_counter's formula, a sim/compute.py formula, or
  "none" (memory bound, or free for a view: the simulator charges bytes);
- ``xla``: how torch-xla runs it: "as is", "view copy" (a view's ``_copy`` op), or an xla/kernels.py function.

The links to lower/, sim/ and xla/ are declared here (``LINKS``, ``FAMILY_LINKS``) by qualified name: those
packages build their tables from them (``linked``), since rules/ imports none of them. A field nothing declares is
None: a gap (tests/test_registry.py lists them).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.fx as fx

from ..errors import PartitionError, warn
from .factors import OpRule, einsum
from .group_bn import GROUP_BN_BACKWARD_OP, GROUP_BN_OP
from .moe import EXPERTS_BACKWARD_OP, EXPERTS_OP
from . import tags
from .nodes import result_vals  # noqa: F401 - propagation and verify read it from here

aten = torch.ops.aten

AS_IS = "as is"           # local: the aten op on local shards; xla: torch-xla has a kernel (or a composite) for it
NONE = "none"             # flops: no FLOP formula: memory bound (free for a view); the simulator charges bytes
TORCH = "torch.utils.flop_counter"   # flops: torch's registered formula (mm, addmm, bmm, convolution, sdpa, ...)
VIEW_COPY = "view copy"   # xla: a view op runs as its `_copy` op (xla/kernels.xla_target)
GENERIC = "generic"       # localize: int-list arguments equal to a result's global shape become its local shape
USER = "user"             # family of a rule registered by the user


@dataclass
class NodeCtx:
    """What a rule builder sees of one node: its args (fx.Nodes kept) and tensor slot shapes."""

    node: fx.Node
    operands: list          # tensor operand fx.Nodes, in flattened-arg order (one slot each)
    in_shapes: list         # their global shapes
    out_shapes: list        # per result slot: shape, or None when that result is not a tensor
    out_dtypes: list

    @property
    def args(self):
        return self.node.args

    @property
    def kwargs(self):
        return self.node.kwargs

    def arg(self, i: int, name: str, default=None):
        if len(self.node.args) > i:
            return self.node.args[i]
        return self.node.kwargs.get(name, default)


def tensor_operands(node: fx.Node) -> list:
    """Tensor-valued fx.Node operands in flattened (args, kwargs) order (pytree's order, without its generic walk:
    this runs for every node of the graph, several times)."""
    out: list = []

    def walk(a):
        if isinstance(a, fx.Node):
            if isinstance(a.meta.get("val"), torch.Tensor):
                out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                walk(x)
        elif isinstance(a, dict):
            for x in a.values():
                walk(x)

    walk(node.args)
    walk(node.kwargs)
    return out


def make_ctx(node: fx.Node) -> NodeCtx:
    ops = tensor_operands(node)
    outs = result_vals(node)
    return NodeCtx(node, ops, [tuple(o.meta["val"].shape) for o in ops],
                   [None if v is None else tuple(v.shape) for v in outs],
                   [None if v is None else v.dtype for v in outs])


def _op_key(op):
    """Rules are keyed by OpOverload; an OpOverloadPacket registers all its overloads."""
    return op


class RuleRegistry:
    """Maps aten ops to rules. Build your own for tests (`RuleRegistry(table)`), or use `default_registry()`.

    A rule is an einsum spec string (see factors.einsum) or a callable `(NodeCtx) -> OpRule | None` (None: no
    rule applies to these arguments; the node is a barrier).
    """

    def __init__(self, table: dict | None = None, families: dict | None = None):
        self._rules: dict = {}
        self._families: dict = {}
        self._warned: set = set()
        for op, rule in (table or {}).items():
            self.register(op, rule, family=(families or {}).get(op, USER))

    def register(self, op, rule, override: bool = False, family: str = USER) -> None:
        """Add a rule for `op` (an OpOverload, or a packet: every overload). A second rule for an op is refused
        unless override=True; an einsum spec must name one operand per tensor argument of the op's schema.
        `family`: the rule module it comes from (its row's default links, FAMILY_LINKS)."""
        if isinstance(op, torch._ops.OpOverloadPacket):
            for name in op.overloads():
                self.register(getattr(op, name), rule, override, family)
            return
        if not isinstance(rule, (str, Callable)):
            raise PartitionError(f"register_rule: the rule for {op} must be an einsum spec string ('mk,kn->mn') or "
                                 f"a callable (NodeCtx) -> OpRule | None, got {rule!r}.")
        if op in self._rules and not override:
            raise PartitionError(f"register_rule: {op} already has a rule; pass override=True to replace it.")
        if isinstance(rule, str):
            _check_spec(op, rule)
        self._rules[op] = rule
        self._families[op] = family

    def has_tag(self, op, tag: str) -> bool:
        """Whether `op` has `tag` (rules/tags.py: "view", "random", "matmul", ...); any op, with a rule or not."""
        return tags.has(op, tag)

    def __contains__(self, op) -> bool:
        return op in self._rules

    def ops(self):
        return list(self._rules)

    def copy(self) -> "RuleRegistry":
        r = RuleRegistry()
        r._rules = dict(self._rules)
        r._families = dict(self._families)
        return r

    def row(self, op) -> "OpRow":
        """Everything known of `op` (which must have a rule): rule, localisation, local kernel, FLOPs, XLA form."""
        return op_row(op, self._rules[op], self._families.get(op, USER))

    def rows(self) -> list:
        return [self.row(op) for op in self._rules]

    def build(self, node: fx.Node) -> OpRule | None:
        """The rule instantiated for this node, or None (a barrier: values stay whole on every axis)."""
        rule = self._rules.get(node.target)
        if rule is None:
            if node.target not in self._warned:
                self._warned.add(node.target)
                warn(f"partir_torch: no sharding rule for {node.target}; its operands and results stay "
                     f"replicated (a barrier). Register one with partir_torch.register_rule.", stacklevel=2)
            return None
        ctx = make_ctx(node)
        if isinstance(rule, str):
            return einsum(rule, ctx.in_shapes, ctx.out_shapes)
        return rule(ctx)


_DEFAULT: RuleRegistry | None = None


def default_registry() -> RuleRegistry:
    global _DEFAULT
    if _DEFAULT is None:
        from . import tables

        _DEFAULT = RuleRegistry(tables.all_rules(), tables.families())
    return _DEFAULT


def register_rule(op, rule, override: bool = False) -> None:
    """Register a rule for a (user) op in the default registry: `register_rule(torch.ops.mylib.op.default, "mk,kn->mn")`.
    Replacing a built-in (or earlier) rule needs override=True."""
    default_registry().register(op, rule, override)


def _check_spec(op, spec: str) -> None:
    """An einsum spec's operands against the op's tensor arguments: 'mk,kn->mn' needs two (a list argument, as
    cat's, cannot be checked)."""
    if "->" not in spec:
        raise PartitionError(f"register_rule: spec {spec!r} for {op} has no '->' (write it as 'mk,kn->mn').")
    schema = getattr(op, "_schema", None)
    if schema is None:
        return
    kinds = [str(a.type) for a in schema.arguments]
    if any("[]" in k and "Tensor" in k for k in kinds):
        return
    tensors = [a for a, k in zip(schema.arguments, kinds) if k.startswith("Tensor") or k == "Optional[Tensor]"]
    required = [a for a, k in zip(schema.arguments, kinds) if k.startswith("Tensor")]
    n = len(spec.split("->")[0].split(","))
    if not len(required) <= n <= len(tensors):
        raise PartitionError(f"register_rule: spec {spec!r} names {n} operand(s), but {op} takes "
                             f"{len(required)}" + (f" to {len(tensors)}" if len(tensors) > len(required) else "")
                             + f" tensor argument(s) ({', '.join(a.name for a in tensors)}).")


# ---- the rest of an op's row: local kernel, FLOPs, XLA form -------------------------------------------------------


@dataclass(frozen=True)
class Links:
    """What an op needs besides its rule; None = not declared. A link to a function is its qualified name below
    partir_torch ("lower.indexed.embedding"); the package that runs it builds its table from it (`linked`)."""

    local: str | None = None
    flops: str | None = None
    xla: str | None = None


PLAIN = Links(local=AS_IS, flops=NONE, xla=AS_IS)

# rule module -> what every op of it needs, unless LINKS says otherwise. Matmul and convolution get their FLOPs from
# torch's flop counter, op by op; nn.py's ops are all in LINKS.
FAMILY_LINKS = {
    "pointwise": PLAIN, "reduction": PLAIN, "views": PLAIN, "stacking": PLAIN, "indexing": PLAIN,
    "matmul": Links(local=AS_IS, xla=AS_IS),
    "conv": Links(local=AS_IS, xla=AS_IS),
}

_INDEXED = "lower.indexed."        # kernels for a tiled indexed factor (vocabulary, classes, positions)
LINKS = {
    aten.embedding.default: Links(local=_INDEXED + "embedding", flops=NONE, xla=AS_IS),
    aten.embedding_dense_backward.default: Links(local=_INDEXED + "embedding_dense_backward", flops=NONE, xla=AS_IS),
    aten.nll_loss_forward.default: Links(local=_INDEXED + "nll_loss_forward", flops=NONE,
                                         xla="xla.kernels.nll_loss_forward"),   # torch-xla's total_weight differs
    aten.nll_loss_backward.default: Links(local=_INDEXED + "nll_loss_backward", flops=NONE, xla=AS_IS),
    aten.arange.default: Links(local=_INDEXED + "arange", flops=NONE, xla=AS_IS),
    aten.arange.start: Links(local=_INDEXED + "arange", flops=NONE, xla=AS_IS),
    aten.arange.start_step: Links(local=_INDEXED + "arange", flops=NONE, xla=AS_IS),
    # CPU-only kernels of the captured step, and kernels torch-xla lowers so that the SPMD partitioner gathers them
    # (local: causal attention on query rows at an offset, context parallelism: lower/cp.py)
    aten._scaled_dot_product_flash_attention_for_cpu.default: Links(
        local=_INDEXED + "sdpa_causal", flops="sim.compute.cpu_flash_fwd", xla="xla.kernels.sdpa_cpu"),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: Links(
        local=_INDEXED + "sdpa_causal_backward", flops="sim.compute.cpu_flash_bwd",
        xla="xla.kernels.sdpa_cpu_backward"),
    aten.native_layer_norm.default: Links(local=AS_IS, flops=NONE, xla="xla.kernels.layer_norm"),
    aten.native_layer_norm_backward.default: Links(local=AS_IS, flops=NONE, xla="xla.kernels.layer_norm_backward"),
    aten.native_group_norm.default: Links(local=AS_IS, flops=NONE, xla="xla.kernels.group_norm"),
    aten.native_group_norm_backward.default: Links(local=AS_IS, flops=NONE, xla="xla.kernels.group_norm_backward"),
    aten.upsample_nearest2d_backward.default: Links(local=AS_IS, flops=NONE,
                                                    xla="xla.kernels.upsample_nearest2d_backward"),
    # random draws: on the host from torch's generator, as one device draws them (XLA's generator draws others)
    aten.native_dropout.default: Links(local=AS_IS, flops=NONE, xla="xla.kernels.native_dropout"),
    aten.rand.default: Links(local=AS_IS, flops=NONE, xla="xla.kernels.rand"),
    aten.randn.default: Links(local=AS_IS, flops=NONE, xla="xla.kernels.randn"),
    aten.rand_like.default: Links(local=AS_IS, flops=NONE, xla="xla.kernels.rand_like"),
    aten.randn_like.default: Links(local=AS_IS, flops=NONE, xla="xla.kernels.randn_like"),
    aten.bernoulli.p: Links(local=AS_IS, flops=NONE, xla="xla.kernels.bernoulli_p"),
    # torch-xla reads fill's 0-d value tensor on the host (.item()), which splits the step (T5's _shift_right)
    aten.fill.Tensor: Links(local=AS_IS, flops=NONE, xla="xla.kernels.fill_tensor"),
    # torch-xla 2.9 has no kernel and no composite for glu's backward: the XLA form is missing
    aten.glu_backward.default: Links(local=AS_IS, flops=NONE),
    # nn.Unfold / nn.Fold: memory-bound rearrangements; torch-xla 2.9 has no kernel for them
    aten.im2col.default: Links(local=AS_IS, flops=NONE), aten.col2im.default: Links(local=AS_IS, flops=NONE),
    # bilinear upsampling (MobileViT): torch-xla has kernels
    aten.upsample_bilinear2d.default: Links(local=AS_IS, flops=NONE, xla=AS_IS),
    aten.upsample_bilinear2d.vec: Links(local=AS_IS, flops=NONE, xla=AS_IS),
    aten.upsample_bilinear2d_backward.default: Links(local=AS_IS, flops=NONE, xla=AS_IS),
    # gated delta-net chunks (n^2 k per batch: charged as memory bound) and unfold's backward: no torch-xla kernel
    aten.linalg_solve_triangular.default: Links(local=AS_IS, flops=NONE),
    aten.unfold_backward.default: Links(local=AS_IS, flops=NONE),
    # FFTs (FNet): charged as memory bound; torch-xla 2.9 has no kernel for them
    aten._fft_c2c.default: Links(local=AS_IS, flops=NONE), aten._fft_r2c.default: Links(local=AS_IS, flops=NONE),
    aten._fft_c2r.default: Links(local=AS_IS, flops=NONE),
    # HF's grouped-mm experts as one per-token op (rules/moe.py): its kernel is HF's function on the local tokens;
    # torch-xla would need grouped_mm (or its fallback's per-expert loop) traced on XLA tensors: not declared
    EXPERTS_OP: Links(local=AS_IS, flops="sim.compute.experts_flops"),
    EXPERTS_BACKWARD_OP: Links(local=AS_IS, flops="sim.compute.experts_backward_flops"),
    # batch norm over groups of the batch (rules/group_bn.py, batchnorm="local"): eager's kernel per group, memory
    # bound; on XLA it would need its loop traced on XLA tensors: not declared
    GROUP_BN_OP: Links(local=AS_IS, flops=NONE), GROUP_BN_BACKWARD_OP: Links(local=AS_IS, flops=NONE),
}
LINKS.update({op: PLAIN for op in (    # the rest of nn.py: memory-bound kernels torch-xla runs as they are
    aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default, aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default, aten.glu.default, aten.sort.default, aten.sort.stable, aten.topk.default,
    aten.native_dropout_backward.default, aten.tril.default, aten.triu.default,
    aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.scalar_tensor.default,
    aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
    aten.new_full.default, aten.empty_strided.default, aten.new_empty_strided.default,
    aten.upsample_nearest2d.default, aten.upsample_nearest2d.vec, aten.avg_pool2d.default,
    aten.avg_pool2d_backward.default, aten.max_pool2d_with_indices.default,
    aten.max_pool2d_with_indices_backward.default)})


@dataclass(frozen=True)
class OpRow:
    """Everything partir_torch knows of one op (see the module docstring); None marks a gap."""

    op: object
    rule: object
    family: str
    localize: object
    local: str | None
    flops: str | None
    xla: str | None
    tags: frozenset = frozenset()   # rules/tags.py: the per-op facts other passes ask ("view", "random", ...)

    def gaps(self) -> list:
        """The fields nothing declares: ["flops"], ["xla"], ..."""
        return [f for f in ("local", "flops", "xla") if getattr(self, f) is None]

    def __str__(self):
        loc = self.localize if isinstance(self.localize, str) else f"localize.{self.localize.__qualname__}"
        return (f"{self.op}: rule {self.family}.{_rule_name(self.rule)}  localize {loc}  local {self.local}  "
                f"flops {self.flops}  xla {self.xla}" + (f"  tags {','.join(sorted(self.tags))}" if self.tags else ""))


def _rule_name(rule) -> str:
    """An einsum spec as written ('mk,kn->mn', also inside a builder's closure), else the builder's name."""
    if isinstance(rule, str):
        return repr(rule)
    specs = [c.cell_contents for c in getattr(rule, "__closure__", None) or ()
             if isinstance(c.cell_contents, str) and "->" in c.cell_contents]
    return repr(specs[0]) if specs else getattr(rule, "__qualname__", repr(rule)).replace(".<locals>.rule", "")


def op_row(op, rule, family: str) -> OpRow:
    """The row of `op`: its declared links (LINKS, then its family's), what the op's schema and torch already say
    (a view's XLA form is its _copy op; torch's flop counter has a formula), and its localisation."""
    from torch.utils.flop_counter import flop_registry

    from .localize import ROWS

    declared, default = LINKS.get(op, Links()), FAMILY_LINKS.get(family, Links())
    pick = {f.name: getattr(declared, f.name) for f in fields(Links)}
    if pick["flops"] is None and getattr(op, "overloadpacket", None) in flop_registry:
        pick["flops"] = TORCH
    if pick["xla"] is None and _view_copy(op) is not None:
        pick["xla"] = VIEW_COPY
    pick = {k: v if v is not None else getattr(default, k) for k, v in pick.items()}
    return OpRow(op, rule, family, ROWS.get(op, GENERIC), **pick, tags=tags.tags_of(op))


def _view_copy(op):
    """The `_copy` op of an aten view op (view -> view_copy), or None."""
    if not (isinstance(op, torch._ops.OpOverload) and op.is_view and op.namespace == "aten"):
        return None
    packet = getattr(aten, op._schema.name.split("::")[1] + "_copy", None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


def linked(field: str, module: str, namespace: dict) -> dict:
    """{op: function} for every op whose declared `field` ("local", "flops", "xla") links a function of `module`
    ("lower.indexed"), looked up in that module's `namespace` (its globals()): how lower/, sim/ and xla/ build
    their per-op tables from the rows. A link to a function that does not exist fails here, at import."""
    prefix = module + "."
    out = {}
    for op, links in LINKS.items():
        name = getattr(links, field)
        if name and name.startswith(prefix):
            fn = namespace.get(name[len(prefix):])
            if fn is None:
                raise RuntimeError(f"rules/registry.py links {op} ({field}) to {name}, which does not exist")
            out[op] = fn
    return out
