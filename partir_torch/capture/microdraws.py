"""One device's dropout masks for a step captured in micro-batches (accumulate=k, a pipeline's micro-batches).

One device draws each dropout mask once, for the whole batch: `bernoulli(empty([B, T, d]), p)`. The step traced
in k micro-batches draws at each dropout site k smaller masks, one per micro-batch, so the generator hands out the
same numbers in another arrangement: another mask for every sample. `whole_batch_draws` puts one device's draw back:
the k draws of a site become one draw of the whole batch's shape, made where micro-batch 0 drew, and micro-batch j
reads its samples of it, as _micro_batches gives it its samples of the inputs (j, j + k, j + 2k, ...):

    mask = bernoulli(empty([b * k * r, ...]), p)                   # b: samples per micro-batch
    mask_j = mask.view(b, k, r, ...).select(1, j)  (.reshape(b * r, ...) where r > 1: (B*T, d) and (B*H, T, T))

The batch is taken to be the major dim of each mask (dim 0 of (B, T, d), (B, H, T, T), and of the folded (B*T, d)
and (B*H, T, T)), as in the Hugging Face models of the coverage sweep; a mask whose dim 0 is not a multiple of b, or sites
whose k draws differ in shape, keep their per-micro-batch draws (the pipeline tactic warns of draws without the
WHOLE_DRAW mark).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..contract import Phase, phase_of
from ..rules import tags

aten = torch.ops.aten
# a draw that reads only its template's shape (tidy.untie_random_templates made the template a static factory)
_DRAWS = tags.ops("random_from_template")
_FACTORIES = tags.ops("template_factory")
WHOLE_DRAW = "partir_whole_draw"       # node.meta: a draw made for the whole batch, read by every micro-batch


def _template_draws(gm: fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _DRAWS
            and isinstance(n.args[0], fx.Node) and n.args[0].target in _FACTORIES and len(n.args[0].users) == 1
            and phase_of(n) == Phase.FORWARD]


def _key(n: fx.Node) -> tuple:
    v = n.meta["val"]
    return n.target, tuple(v.shape), v.dtype, tuple(n.args[1:]), tuple(sorted(n.kwargs.items()))


def whole_batch_draws(gm: fx.GraphModule, k: int, b: int) -> int:
    """Rewrite the k micro-batches' draws of each dropout site into one whole-batch draw sliced per micro-batch
    (see the module docstring); b: samples per micro-batch. Returns the number of draws left per micro-batch."""
    draws = _template_draws(gm)
    if k < 2 or not draws or len(draws) % k:
        return len(draws) if k > 1 else 0
    per = len(draws) // k                   # micro-batch j's sites: draws[j * per: (j + 1) * per], traced in order
    sites = [[draws[j * per + i] for j in range(k)] for i in range(per)]
    left = 0
    for site in sites:
        shape = site[0].meta["val"].shape
        if len({_key(n) for n in site}) != 1 or not len(shape) or shape[0] % b:
            left += k
            continue
        _merge(gm, site, k, b)
    gm.graph.lint()
    return left


def _merge(gm: fx.GraphModule, site: list, k: int, b: int) -> None:
    """site: the draws of micro-batches 0..k-1 at one dropout site (equal shapes)."""
    first = site[0]
    tmpl = first.args[0]
    shape = list(first.meta["val"].shape)
    r, rest = shape[0] // b, shape[1:]
    g = gm.graph
    with g.inserting_before(tmpl):
        whole_t = g.call_function(tmpl.target, ([shape[0] * k] + rest,) + tuple(tmpl.args[1:]), dict(tmpl.kwargs))
    whole_t.meta.update(tmpl.meta)
    whole_t.meta["val"] = tmpl.meta["val"].new_empty([shape[0] * k] + rest)
    with g.inserting_after(whole_t):
        whole = g.call_function(first.target, (whole_t,) + tuple(first.args[1:]), dict(first.kwargs))
    whole.meta.update(first.meta)
    whole.meta["val"] = first.meta["val"].new_empty([shape[0] * k] + rest)
    whole.meta[WHOLE_DRAW] = True
    split = [b, k] + ([r] if r > 1 else []) + rest      # (b, k, [r,] ...): micro-batch j's samples at [:, j]
    for j, n in enumerate(site):
        v = whole.meta["val"].view(split)
        made, at = [], whole if j == 0 else n
        for target, args, val in ((aten.view.default, (whole, split), v),
                                  (aten.select.int, (None, 1, j), v.select(1, j)),
                                  (aten.reshape.default, (None, shape), n.meta["val"])):
            if target is aten.reshape.default and r == 1:
                break
            with g.inserting_after(at):
                at = g.call_function(target, (made[-1] if made else args[0],) + args[1:])
            at.meta.update(n.meta)
            at.meta["val"] = val
            made.append(at)
        n.replace_all_uses_with(made[-1])
        t = n.args[0]
        g.erase_node(n)
        g.erase_node(t)


def micro_size(example_inputs, k: int, dims=None) -> int:
    """Samples per micro-batch: the batch dim of the first input split into micro-batches (capture's
    _micro_batches: dim 0 of every input, or accumulate_dims), divided by k; 0 when no input is split."""
    from torch.utils._pytree import tree_flatten

    for i, x in enumerate(tree_flatten(tuple(example_inputs))[0]):
        d = 0 if dims is None else dims.get(i, 0)
        if d is not None and isinstance(x, torch.Tensor) and x.dim() > d:
            return x.shape[d] // k
    return 0
