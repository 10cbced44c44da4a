"""Small rewrites of the traced step that keep propagation from tying values that are not related by data."""
from __future__ import annotations

import torch
import torch.fx as fx
from ..rules import tags

aten = torch.ops.aten

# random draws whose tensor operand is only a template (shape, dtype, device): dropout as nn.Dropout traces it,
# bernoulli_(empty_like(x), p)
_TEMPLATE_RANDOM = tags.ops("random_from_template")
# factories shaped like their operand -> the factory with a static shape (value argument index, else None)
LIKE = tags.STATIC_FACTORY


def untie_random_templates(gm: fx.GraphModule) -> None:
    """`bernoulli(empty_like(x), p)`: the draw reads only the template's shape, but `empty_like` would tie its
    layout to x's, and random draws stay whole (rules/pointwise.py RANDOM), so a batch-tiled x would be gathered
    to make an uninitialised template whole. The template becomes a factory of x's static shape instead."""
    for n in list(gm.graph.nodes):
        if n.target not in LIKE or not n.users or any(u.target not in _TEMPLATE_RANDOM for u in n.users):
            continue
        val = n.meta["val"]
        target, value_at = LIKE[n.target]
        args = (list(val.shape),) if value_at is None else (list(val.shape), n.args[value_at])
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(target, args, {"dtype": val.dtype, "device": val.device})
        new.meta.update(n.meta)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
    gm.graph.lint()     # capture() regenerates gm's code once, after its last rewrite



def untie_unused_weights(gm: fx.GraphModule) -> int:
    """`convolution_backward(dy, x, w, ..., output_mask=[False, ...])`: without grad_input the kernel reads only
    w's shape (grad_weight is dy and x convolved), yet as an operand w would be gathered whole for the backward
    under ZeRO-3 (a ViT's patch embedding: its weight gathered twice a step, once for nothing; XLA drops that
    gather as dead code). The operand becomes zeros of w's static shape: a factory, laid out as the op wants,
    that moves nothing. Returns how many it rewrote."""
    done = 0
    for n in list(gm.graph.nodes):
        if n.target is not aten.convolution_backward.default or len(n.args) < 11 or n.args[10][0]:
            continue
        w = n.args[2]
        val = w.meta.get("val") if isinstance(w, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not hasattr(val, "fake_mode"):
            continue
        with gm.graph.inserting_before(n):
            z = gm.graph.call_function(aten.zeros.default, (list(val.shape),),
                                       {"dtype": val.dtype, "device": val.device})
        z.meta.update({k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")})
        with val.fake_mode:
            z.meta["val"] = torch.zeros(val.shape, dtype=val.dtype, device=val.device)
        n.args = (*n.args[:2], z, *n.args[3:])
        done += 1
    if done:
        gm.graph.lint()
    return done

# ops through which an arange's values reach an index unchanged, only its shape gaining dims of size 1
_SHAPE_ONLY = tags.ops("reshape") | tags.ops("unsqueeze")
_ARANGES = tags.ops("arange")
_INDEXERS = tags.INDEX_LIST_ARG


def _is_positions(node, n: int) -> bool:
    """Does `node` hold 0, 1, ..., n - 1 along one dim of size n (every other dim of size 1)? An arange(n) (or
    arange(0, n[, 1]), plus 0) seen through views that only add dims of size 1."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor) or sorted(val.shape, reverse=True)[:1] != [n] or val.numel() != n:
        return False
    while node.op == "call_function" and (node.target in _SHAPE_ONLY or
                                          (node.target == aten.add.Tensor and node.args[1] == 0)):
        node = node.args[0]
    if node.op != "call_function" or node.target not in _ARANGES:
        return False
    a = list(node.args) + [node.kwargs.get(k) for k in ("start", "end", "step") if k in node.kwargs]
    start, end, step = (0, a[0], 1) if node.target == aten.arange.default else \
        (a[0], a[1], a[2] if len(a) > 2 else 1)
    return (start, end, step) == (0, n, 1)


def identity_indices(gm: fx.GraphModule) -> int:
    """`x[arange(B)[:, None, ...], j]`: indexing dim 0 by its own positions is `x[:, j]` (HF builds its attention
    masks so: `padding_mask[batch_idx, kv_idx]`). Written as advanced indexing, the batch dim is an indexed dim,
    which the rules keep whole (a data-parallel step would gather the mask); as a full slice it passes through.
    Rewrites index and index_put where the first index is dim 0's positions along the first broadcast dim and
    every other index has size 1 there (so the result's layout is unchanged). Returns how many were rewritten."""
    done = 0
    for n in list(gm.graph.nodes):
        at = _INDEXERS.get(n.target)
        if at is None or not isinstance(n.args[0], fx.Node):
            continue
        x, indices = n.args[0].meta["val"], list(n.args[at])
        if len(indices) < 2 or not isinstance(indices[0], fx.Node) or any(not isinstance(i, fx.Node)
                                                                           for i in indices[1:]):
            continue
        shapes = [tuple(i.meta["val"].shape) for i in indices]
        nb = max(len(s) for s in shapes)
        first = shapes[0]
        if (len(first) != nb or first[0] != x.shape[0] or x.shape[0] < 2 or not _is_positions(indices[0], x.shape[0])
                or any(len(s) == nb and s[0] != 1 for s in shapes[1:])):
            continue
        rest = []
        with gm.graph.inserting_before(n):
            for i, s in zip(indices[1:], shapes[1:]):
                if len(s) == nb:
                    sq = gm.graph.call_function(aten.squeeze.dim, (i, 0))
                    sq.meta.update({k: v for k, v in n.meta.items() if k != "val"})
                    sq.meta["val"] = i.meta["val"].squeeze(0)
                    i = sq
                rest.append(i)
        n.args = (n.args[0], [None] + rest, *n.args[at + 1:])
        done += 1
    if done:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
    return done


# views whose result is a function of their operands and arguments alone: two equal calls are one value
_SHARED_VIEWS = tags.ops("shareable_view")


def share_views(gm: fx.GraphModule, same=()) -> int:
    """Equal views of one value made in one phase are one node. Each F.linear reading one activation makes its
    own `view(x, [B*T, d])` (q, k and v of an attention; gate and up of a gated MLP): as separate values, each
    would be resharded on its own (sequence parallelism gathered the norm output once per projection: 2.5x the
    bytes of Megatron's program). `same`: meta keys that must agree too (phase, micro-batch, recomputation), so
    views that capture duplicates on purpose (remat's recomputed copies) stay apart; views of step inputs are left
    as they are (a parameter's views per phase and micro-batch: one ZeRO-3 gather each).
    The first node is kept; the other's module-output tags move to it. Returns how many were removed."""
    from ..contract import META_TAG, META_TAGS

    seen: dict = {}
    done = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _SHARED_VIEWS or _of_state(n):
            continue
        try:
            key = (n.target, _frozen(n.args), _frozen(tuple(sorted(n.kwargs.items()))),
                   tuple(repr(n.meta.get(k)) for k in same))
            hash(key)
        except TypeError:
            continue
        first = seen.setdefault(key, n)
        if first is n:
            continue
        tags = list(first.meta.get(META_TAGS, ())) + [t for t in n.meta.get(META_TAGS, ())
                                                       if t not in first.meta.get(META_TAGS, ())]
        if tags:
            first.meta[META_TAGS] = tags
            first.meta.setdefault(META_TAG, tags[0])
        n.replace_all_uses_with(first)
        gm.graph.erase_node(n)
        done += 1
    if done:
        gm.graph.lint()
    return done


def _of_state(n: fx.Node) -> bool:
    """A view of a step input (a parameter, its cast): capture keeps one per use on purpose (a gather per phase
    and micro-batch under ZeRO-3)."""
    while n.op == "call_function" and (n.target in _SHARED_VIEWS or n.target == aten._to_copy.default):
        n = n.args[0]
    return n.op == "placeholder"


def _frozen(a):
    if isinstance(a, (list, tuple)):
        return (type(a).__name__,) + tuple(_frozen(x) for x in a)
    return a
