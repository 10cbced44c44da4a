"""Localize shape arguments, so that an aten call runs on local shards.

Lowering replaces a node's tensor operands by their local shards. Arguments that carry *global* sizes (view's
size, expand's size, zeros' size, slice_backward's input_sizes, group_norm's N, C and HxW) must then become local
sizes, or the op fails, or silently computes something else:

    view(x, [8, -1, 64])      # result global (8, 16, 64); tiled 2-way on dim 0 it is (4, 16, 64) locally
    -> view(x, [4, 16, 64])

One generic rule covers most ops: an int-list argument equal to the global shape of a result (a -1 entry matches
any size) becomes that result's local shape. A small table (ROWS) handles what is not a list of result sizes.
Ops where a tiled dim would need the rank's offset (arange) are BLOCKED by their rules and never get here tiled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from .nodes import result_vals
from .views import dense

aten = torch.ops.aten

# Int-list arguments that are never result sizes, whatever their values: dims, split sizes along a dim that is kept
# whole, convolution geometry, spatial output sizes, normalised dims (never tiled). Strides have their own row.
NOT_SHAPES = frozenset({"dim", "dims", "split_sizes", "stride", "padding", "dilation", "kernel_size",
                        "output_padding", "output_size", "normalized_shape", "scale_factors", "pad", "shifts"})


@dataclass
class _Call:
    """A node's arguments being localised, read and written by schema name."""

    node: fx.Node
    args: list
    kwargs: dict
    in_local: list      # per tensor operand slot: local shape
    out_local: list     # per result slot: local shape, or None

    def names(self) -> list:
        return _arg_names(self.node.target)

    def get(self, name: str):
        names = self.names()
        i = names.index(name) if name in names else -1
        return self.args[i] if 0 <= i < len(self.args) else self.kwargs.get(name)

    def set(self, name: str, value) -> None:
        names = self.names()
        i = names.index(name) if name in names else -1
        if 0 <= i < len(self.args):
            self.args[i] = value
        elif name in self.kwargs:
            self.kwargs[name] = value


def _arg_names(target) -> list:
    """The schema's argument names of an op (read once per op: localize_args runs on every op lowered)."""
    names = _ARG_NAMES.get(target)
    if names is None:
        schema = getattr(target, "_schema", None)
        names = _ARG_NAMES[target] = [a.name for a in schema.arguments] if schema is not None else []
    return names


_ARG_NAMES: dict = {}


def localize_args(node: fx.Node, args: tuple, kwargs: dict, in_local: list, out_local: list):
    """Rewrite the shape-carrying arguments of `node` for local operand shapes `in_local` and local result shapes
    `out_local` (orders of registry.tensor_operands / result_vals). Tensor operands in `args`/`kwargs` are left as
    they are. Returns (args, kwargs).

    >>> localize_args(view_node, (x_local, [8, -1, 64]), {}, [(4, 16, 64)], [(4, 16, 64)])
    ((x_local, [4, 16, 64]), {})
    """
    row = ROWS.get(node.target)
    if row is None and not any(map(_is_int_list, args)) and not any(map(_is_int_list, kwargs.values())):
        return tuple(args), dict(kwargs)          # no int list: nothing the generic rule would rewrite
    call = _Call(node, list(args), dict(kwargs), list(in_local), list(out_local))
    _generic(call)
    if row is not None:
        row(call)
    return tuple(call.args), call.kwargs


def _is_int_list(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in x)


def _matches(sizes, shape) -> bool:
    """sizes equals shape, where a -1 in sizes (view / expand) matches any size."""
    return len(sizes) == len(shape) and all(s == -1 or s == n for s, n in zip(sizes, shape))


def _local_for(call: _Call, sizes):
    """The local shape of the first result whose global shape `sizes` is, else None."""
    for val, local in zip(result_vals(call.node), call.out_local):
        if val is not None and local is not None and _matches(sizes, tuple(val.shape)):
            return [int(s) for s in local]
    return None


def _generic(call: _Call) -> None:
    """Every int-list argument (not in NOT_SHAPES) equal to a result's global shape becomes its local shape."""
    names = call.names()
    for i, a in enumerate(call.args):
        name = names[i] if i < len(names) else ""
        if name not in NOT_SHAPES and _is_int_list(a):
            local = _local_for(call, a)
            if local is not None:
                call.args[i] = local
    for name, a in call.kwargs.items():
        if name not in NOT_SHAPES and _is_int_list(a):
            local = _local_for(call, a)
            if local is not None:
                call.kwargs[name] = local


# ---- per-op rows: what the generic rule cannot see ------------------------------------------------------------


def _strides_like(shape, global_stride) -> list:
    """Dense strides for `shape` with the dim order (major to minor) of `global_stride`."""
    order = sorted(range(len(shape)), key=lambda d: (-global_stride[d], d))
    strides, acc = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = acc
        acc *= max(int(shape[d]), 1)
    return strides


def _empty_strided(call: _Call) -> None:
    """empty_strided(size, stride): size is localised generically; the strides follow the local size."""
    stride = call.get("stride")
    if call.out_local and call.out_local[0] is not None and stride is not None:
        call.set("stride", _strides_like(call.out_local[0], stride))


def _group_norm(input_slot: int):
    """native_group_norm(x, w, b, N, C, HxW, group, eps) and its backward carry x's sizes and the number of groups
    (tiled when whole groups are) as ints; mean is the forward's result 1 and the backward's operand 2, (N, G)."""
    def row(call: _Call) -> None:
        shape = call.in_local[input_slot]   # (N, C, *spatial)
        call.set("N", int(shape[0]))
        call.set("C", int(shape[1]))
        call.set("HxW", int(math.prod(shape[2:])))
        mean = call.out_local[1] if input_slot == 0 else call.in_local[2]
        if mean is not None and len(mean) == 2:
            call.set("group", int(mean[1]))
    return row


def _embedding_dense_backward(call: _Call) -> None:
    """num_weights is the gradient's dim 0 (V). V is BLOCKED by the rule, so this only keeps it consistent."""
    if call.out_local and call.out_local[0] is not None:
        call.set("num_weights", int(call.out_local[0][0]))


def _split(call: _Call) -> None:
    """split into equal chunks: when the chunk part of the dim is tiled (a fused q/k/v output), each chunk's
    local size is the results' local size along the dim."""
    outs = [o for o in call.out_local if o is not None]
    if not outs:
        return
    shape = call.in_local[0]
    dim = call.get("dim")
    dim = (0 if dim is None else dim) % len(shape)
    if call.get("split_size") is not None:
        call.set("split_size", int(outs[0][dim]))
    elif call.get("split_sizes") is not None:
        call.set("split_sizes", [int(o[dim]) for o in call.out_local if o is not None])


def _repeat(call: _Call) -> None:
    """repeat(x, repeats): each local dim holds out_local / x_local copies (x's dims align with the last ones)."""
    reps, x, out = call.get("repeats"), call.in_local[0], call.out_local[0]
    if reps is None or out is None:
        return
    lead = len(reps) - len(x)
    call.set("repeats", [int(o) // int(x[d - lead] if d >= lead else 1) for d, o in enumerate(out)])


def _convolution(x_slot: int):
    """convolution and its backward carry the number of groups: a rank holding whole groups (rules/conv.py tiles
    the groups factor) runs its local count, x's local channels over w's channels per group."""
    def row(call: _Call) -> None:
        if call.get("transposed"):
            return      # no rule: never tiled
        x, w = call.in_local[x_slot], call.in_local[x_slot + 1]    # (N, Cin, *sp), (Cout, Cin / groups, *k)
        call.set("groups", int(x[1]) // int(w[1]))
    return row


def _as_strided(size_from):
    """as_strided(x, size, stride, offset) / as_strided_scatter(x, src, size, ...) that rules/views.py tiles are
    dense row-major views of all of x: size becomes the view's local shape, the strides its row-major ones, and the
    offset x's own (a local x may be a view into a larger buffer). Any other as_strided runs as it is."""
    def row(call: _Call) -> None:
        node = _Call(call.node, list(call.node.args), dict(call.node.kwargs), [], [])    # its global arguments
        local, size, stride = size_from(call), node.get("size"), node.get("stride")
        if local is None or list(local) == list(size) or node.get("storage_offset") or not dense(size, stride):
            return      # whole (as it was traced), or not a view the rule tiles
        call.set("size", [int(n) for n in local])
        call.set("stride", _strides_like(local, list(range(len(local), 0, -1))))
        call.set("storage_offset", None)
    return row


ROWS = {
    aten.as_strided.default: _as_strided(lambda call: call.out_local[0]),
    aten.as_strided_scatter.default: _as_strided(lambda call: call.in_local[1]),
    aten.convolution.default: _convolution(0),
    aten.convolution_backward.default: _convolution(1),
    aten.repeat.default: _repeat,
    aten.split.Tensor: _split,
    aten.unsafe_split.Tensor: _split,
    aten.unsafe_split_with_sizes.default: _split,
    aten.split_with_sizes.default: _split,
    aten.empty_strided.default: _empty_strided,
    aten.new_empty_strided.default: _empty_strided,
    aten.native_group_norm.default: _group_norm(0),
    aten.native_group_norm_backward.default: _group_norm(1),
    aten.embedding_dense_backward.default: _embedding_dense_backward,
}
