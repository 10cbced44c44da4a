"""LoRA adapters found by structure: a linear whose output is summed with a low-rank branch of the same input,
base(x) + s * B(A(dropout(x))) (peft's `lora.Linear` wrapping `base_layer` with `lora_A` and `lora_B`, or any
module written that way). The wrapper takes its base linear's role in a Megatron pair (tactics/structure.py
reads the adapters' matmuls as part of the base linear, not as a column/row pair of their own), and its adapters
are split the way that keeps the pair's activations as the base pair has them:

    column-parallel base (W tiled on its output features): lora_B tiled on its output features (as W, in the same
        q/k/v chunks of a fused projection), lora_A whole: each rank adds its slice of the features.
    row-parallel base (W tiled on its input features, the output partial): lora_A tiled on its input features,
        lora_B whole: x A^T is partial like x W^T, and the two partial outputs are summed by the base's all_reduce.

The adapters' own gradients take one more small reduction on the tensor-parallel axis (dA of a column wrapper is
a sum over the ranks' output features; dB of a row wrapper reads the rank-r activation summed over them): r-wide
values, not activations.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ..contract import META_NAME, META_PARTIAL_FANOUT, forward_nodes
from ..rules import tags
from .linears import _CASTS, _RESHAPES, _linear, param_source, source

aten = torch.ops.aten

_PASS = _RESHAPES | _CASTS          # ops between an adapter's matmuls and the wrapper's sum that keep its values
_RANDOM = tags.ops("random")


@dataclass(frozen=True)
class Adapter:
    """One LoRA wrapper: its base linear's weight, its adapters' weights (lora_A (r, in) and lora_B (out, r) as
    names of the captured graph), the wrapper's FQN (the common prefix of the three) and rank r."""

    base: str
    a: str
    b: str
    wrapper: str
    rank: int


def lora_adapters(captured) -> list:
    """Every LoRA adapter of the forward (Adapter), in graph order; a base with several active adapters (peft sums
    them one after another) has one Adapter each."""
    return [ad for ad, _ in _found_in(captured)]


def adapter_ends(captured) -> dict:
    """{node: base weight}: where each adapter branch joins its base's output (the scaled lora_B output the sum
    reads). linear_regions counts it inside its base linear's region, so the sum does not end that region."""
    return {end: ad.base for ad, end in _found_in(captured)}


def _found_in(captured) -> list:
    """_found of a captured step, read once per step (graphutil.memo_of_step)."""
    from .graphutil import memo_of_step

    return memo_of_step(captured, "lora._found", lambda: _found(captured.gm))


def _found(gm) -> list:
    fwd = forward_nodes(gm)
    out, seen = [], set()
    for n in gm.graph.nodes:
        found = _adapter_at(n, fwd) if n in fwd else None
        if found is not None and found[0].b not in seen:
            seen.add(found[0].b)
            out.append(found)
    return out


def _adapter_at(nb, fwd) -> tuple | None:
    """The Adapter whose lora_B matmul is `nb`: its input is a linear's output (lora_A), its output (past views and
    a scaling) is added to another linear's output (the base, past its bias add), and lora_A reads the base's input
    (past views and a dropout mask). Returns (Adapter, the branch's last node before the sum)."""
    b = _linear(nb)
    if b is None:
        return None
    na = source(nb.args[0], _PASS)
    a = _linear(na) if isinstance(na, torch.fx.Node) else None
    if a is None or sum(u in fwd for u in na.users) != 1:     # x A^T feeds lora_B only (the backward reads it too)
        return None
    end, total = _branch_end(nb)
    if total is None:
        return None
    other = next(x for x in total.args if x is not end)
    nbase = _base_output(other)
    base = _linear(nbase) if nbase is not None else None
    if base is None or nbase is nb or base[0] in (a[0], b[0]):
        return None
    if _input(na.args[0]) is not _input(nbase.args[0]):
        return None
    rank = na.meta["val"].shape[-1]
    return Adapter(base[0], a[0], b[0], _common(base[0], a[0], b[0]), rank), end


def _branch_end(nb) -> tuple:
    """(the last node of lora_B's output before the wrapper's sum, the sum), following single users through views,
    casts and a multiplication by a scalar (peft's `scaling`); (None, None) if it meets anything else."""
    x = nb
    for _ in range(8):
        users = list(x.users)
        if len(users) != 1:
            return None, None
        u = users[0]
        if u.target is aten.add.Tensor and len(u.args) == 2 and all(isinstance(a, torch.fx.Node) for a in u.args):
            return x, u
        scaled = u.target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar) \
            and u.args[0] is x and not isinstance(u.args[1], torch.fx.Node)
        if u.target not in _PASS and not scaled:
            return None, None
        x = u
    return None, None


def _base_output(node):
    """The base linear's matmul behind the other operand of the wrapper's sum: past views, casts, a bias add (a
    parameter added) and the sums of earlier adapters; None if there is none."""
    x = node
    for _ in range(8):
        x = source(x, _PASS)
        if not isinstance(x, torch.fx.Node) or x.op != "call_function":
            return None
        if x.target is aten.mm.default:
            return x
        if x.target is not aten.add.Tensor:
            return None
        x = x.args[0]
    return None


def _input(node):
    """A linear's input past views, casts and a dropout mask (x * mask, the mask made by a random op)."""
    x = source(node, _PASS)
    while isinstance(x, torch.fx.Node) and x.target is aten.mul.Tensor and len(x.args) == 2 \
            and isinstance(x.args[1], torch.fx.Node) and _is_random(x.args[1]):
        x = source(x.args[0], _PASS)
    if isinstance(x, torch.fx.Node) and x.target is aten.native_dropout.default:
        x = source(x.args[0], _PASS)
    if isinstance(x, torch.fx.Node) and x.target is operator.getitem \
            and getattr(x.args[0], "target", None) is aten.native_dropout.default:
        x = source(x.args[0].args[0], _PASS)
    return x


def _is_random(node, depth: int = 4) -> bool:
    """Is `node` computed from a random op within a few steps (dropout's mask: bernoulli, then a rescale)?"""
    if not isinstance(node, torch.fx.Node) or depth < 0:
        return False
    if node.target in _RANDOM:
        return True
    return any(_is_random(a, depth - 1) for a in node.all_input_nodes)


def _common(*names: str) -> str:
    """The FQN prefix the names share, cut at a dot (the wrapper module: 'layers.0.q_proj' of
    'layers.0.q_proj.base_layer.weight' and 'layers.0.q_proj.lora_A.default.weight'), without 'params.'."""
    parts = [n[len("params."):].split(".") if n.startswith("params.") else n.split(".") for n in names]
    common = []
    for xs in zip(*parts):
        if len(set(xs)) != 1:
            break
        common.append(xs[0])
    return ".".join(common)


def mark_rank_values(gm) -> None:
    """Mark each adapter's rank-r activation x A^T (forward) and its gradient dout B (backward) META_PARTIAL_FANOUT:
    where the tensor-parallel axis leaves them partial (a row wrapper's x A^T, a column wrapper's dout B), the
    partial passes to both of their users (the next matmul and the adapter's weight gradient) instead of being
    reduced where it is made: the next matmul's partial joins the base linear's reduction (the all_reduce of the
    pair), and the weight gradient is reduced as a gradient, r-wide. Capture marks them (a mark changes nothing
    where no axis leaves them partial)."""
    ab = {w: ad for ad, _ in _found(gm) for w in (ad.a, ad.b)}
    for n in gm.graph.nodes:
        if n.target is not aten.mm.default:
            continue
        found = param_source(n.args[1])
        name = found[0].meta.get(META_NAME) if found else None
        ad = ab.get(name)
        if ad is None or found[1] != (name == ad.a):
            continue      # x A^T reads lora_A transposed; dout B reads lora_B as stored
        x = n
        while True:
            x.meta[META_PARTIAL_FANOUT] = True
            users = list(x.users)
            if len(users) != 1 or users[0].target not in _PASS:
                break
            x = users[0]


def bias_last(gm) -> None:
    """(base(x) + bias) + s * B(A(x)) -> (base(x) + s * B(A(x))) + bias, for each LoRA wrapper whose base linear has
    a bias (HF Conv1D's addmm, nn.Linear's): a row-parallel base's output and its adapter's are both partial sums,
    and summed before the bias they are reduced by one all_reduce, as the base linear alone is; with the bias
    between them, each would be reduced on its own. The reshape between the bias add and the sum (Conv1D's view
    back to (B, T, out)) moves onto the matmul. The same sum, in another order (fp32 rounding only)."""
    changed = False
    for ad, end in _found(gm):
        total = next(iter(end.users))
        base_side = next(x for x in total.args if x is not end)
        view = base_side if base_side.target in _RESHAPES else None
        biased = view.args[0] if view is not None else base_side
        if biased.target is not aten.add.Tensor or len(biased.users) != 1 or (view and len(view.users) != 1):
            continue
        mm, bias = biased.args
        if not isinstance(mm, torch.fx.Node) or mm.target is not aten.mm.default or param_source(bias) is None \
                or bias.meta["val"].dim() != 1 or bias.meta["val"].shape[0] != total.meta["val"].shape[-1]:
            continue
        with gm.graph.inserting_before(total):
            shaped = mm
            if view is not None:
                shaped = gm.graph.call_function(view.target, (mm, *view.args[1:]), dict(view.kwargs))
                shaped.meta.update(view.meta)
            summed = gm.graph.call_function(aten.add.Tensor, (shaped, end))
            summed.meta.update(total.meta)
        total.args = (summed, bias)
        for dead in (view, biased):
            if dead is not None and not dead.users:
                gm.graph.erase_node(dead)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
