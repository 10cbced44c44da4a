"""Hugging Face's grouped-mm experts as one per-token op, so data parallelism keeps every token on its rank.

HF's default MoE experts (transformers' `grouped_mm_experts_forward`: Mixtral, Qwen3-MoE, OLMoE, ...) sort the
(token, expert) pairs of the whole batch by expert, gather the tokens into that order, run one grouped matmul per
projection over contiguous groups, and scatter the results back. Traced op by op, the sort and the gathers are over
the global token dim, which a batch split cannot pass: every layer would gather its MoE input on every rank. Yet
each token's output depends on that token alone; so during capture (capture/moe.py) the experts call is recorded
as `partir::experts_grouped`, one op whose rule keeps the token dim split, and whose kernel is HF's own function run
on the rank's tokens (same math per token: each rank sorts, groups and multiplies its own tokens). Its backward is
`partir::experts_grouped_backward`: HF's function again under autograd on the same operands (the forward
recomputed, as activation checkpointing would), the token gradients split like the tokens, the expert weights'
gradients partial sums over the ranks' tokens, reduced like any other gradient.

    out = experts_grouped(hidden (T, D), top_k_index (T, k), top_k_weights (T, k), gate_up (E, ., .), down (E, ., .),
                          key)

`key` names the experts module's static attributes (activation, gating, layout flags) in `EXPERTS`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .factors import einsum

EXPERTS: dict = {}          # key -> (HF's forward function, a stand-in for the module without its weights)


def _run(key: int, hidden, top_k_index, top_k_weights, gate_up, down):
    fn, stand_in = EXPERTS[key]
    me = stand_in.with_weights(gate_up, down)
    return fn(me, hidden, top_k_index, top_k_weights)


@torch.library.custom_op("partir::experts_grouped", mutates_args=())
def experts_grouped(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor,
                    key: int) -> Tensor:
    return _run(key, hidden, top_k_index, top_k_weights, gate_up, down)


@experts_grouped.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up, down, key):
    return hidden.new_empty(hidden.shape)


def _usable(t: Tensor) -> Tensor:
    t = t.detach()
    return t.clone() if t.is_inference() else t


@torch.library.custom_op("partir::experts_grouped_backward", mutates_args=())
def experts_grouped_backward(grad: Tensor, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                             gate_up: Tensor, down: Tensor, key: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # the runtimes run steps without autograd (no_grad, inference_mode): this op's own graph needs it, on copies
    # that are not inference tensors
    with torch.inference_mode(False), torch.enable_grad():
        leaves = [_usable(t).requires_grad_() for t in (hidden, top_k_weights, gate_up, down)]
        out = _run(key, leaves[0], _usable(top_k_index), *leaves[1:])
        grads = torch.autograd.grad(out, leaves, _usable(grad), allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))


@experts_grouped_backward.register_fake
def _(grad, hidden, top_k_index, top_k_weights, gate_up, down, key):
    return (hidden.new_empty(hidden.shape), top_k_weights.new_empty(top_k_weights.shape),
            gate_up.new_empty(gate_up.shape), down.new_empty(down.shape))


def _setup(ctx, inputs, output):
    hidden, top_k_index, top_k_weights, gate_up, down, key = inputs
    ctx.save_for_backward(hidden, top_k_index, top_k_weights, gate_up, down)
    ctx.key = key


def _backward(ctx, grad):
    hidden, top_k_index, top_k_weights, gate_up, down = ctx.saved_tensors
    d_hidden, d_weights, d_gate_up, d_down = experts_grouped_backward(grad, hidden, top_k_index, top_k_weights,
                                                                      gate_up, down, ctx.key)
    return d_hidden, None, d_weights, d_gate_up, d_down, None


experts_grouped.register_autograd(_backward, setup_context=_setup)

EXPERTS_OP = torch.ops.partir.experts_grouped.default
EXPERTS_BACKWARD_OP = torch.ops.partir.experts_grouped_backward.default

# tokens t pass; everything else whole (the hidden dim d, the k choices, every expert weight dim)
_WHOLE = "dkeabcf"


def experts_rule(ctx):
    return einsum("td,tk,tk,eab,ecf->td", ctx.in_shapes, ctx.out_shapes, need_rep=_WHOLE)


def experts_backward_rule(ctx):
    """The token gradients split like the tokens; the weights' gradients, missing t, are partial sums."""
    return einsum("td,td,tk,tk,eab,ecf->td,tk,eab,ecf", ctx.in_shapes, ctx.out_shapes, need_rep=_WHOLE)




def rules() -> dict:
    return {EXPERTS_OP: experts_rule, EXPERTS_BACKWARD_OP: experts_backward_rule}

