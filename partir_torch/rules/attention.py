"""Attention kernels' rules: the query's positions may be tiled (context parallelism), the keys' may not.

    _scaled_dot_product_flash_attention_for_cpu(q (B,H,L,E), k (B,Hk,S,E), v (B,Hk,S,Ev), p, is_causal,
                                                attn_mask=(B?,H?,L,S)?, scale=?) -> (out (B,H,L,Ev), lse (B,H,L))

Batch and heads are PASS. A query row attends to every key: L is PASS (each rank computes the rows of its own
queries), S, E and Ev stay whole (NEED_REP: the softmax needs whole rows); S is `gathered`: keys and values tiled on
their positions are gathered by lowering without keeping the op from tiling L (rules/factors.py Factor.gathered).
In the backward, dk and dv sum over the query rows: L is REDUCE there (dq keeps it), so a tiled L makes dk and dv
partial(sum), reduced where the keys' layout wants them (the reduce_scatter of context parallelism).

SDPA's `is_causal` aligns the query and key starts (row i sees keys 0..i): a rank holding query rows
[off, off + n) must see keys 0..off + i instead. With is_causal (and L == S, self-attention) L is an *indexed*
factor: its local kernel (lower/cp.py) computes the rank's rows blockwise at the rank's offset. Causal attention
with L != S (a query block after a cache) keeps L whole.
"""
from __future__ import annotations

import torch

from .factors import einsum

aten = torch.ops.aten


def _causal_indexed(ctx, causal_arg: int, q_slot: int, k_slot: int) -> str:
    """"l" when the query positions are addressed by offset (is_causal self-attention), else ""."""
    causal = bool(ctx.arg(causal_arg, "is_causal", False))
    return "l" if causal and ctx.in_shapes[q_slot][-2] == ctx.in_shapes[k_slot][-2] else ""


def _causal_cross(ctx, causal_arg: int, q_slot: int, k_slot: int) -> bool:
    return bool(ctx.arg(causal_arg, "is_causal", False)) and ctx.in_shapes[q_slot][-2] != ctx.in_shapes[k_slot][-2]


def sdpa_cpu(ctx):
    """flash attention for CPU: (q, k, v, [mask]) -> (out, logsumexp); L PASS (indexed when causal), S E Ev whole."""
    mask = ",bhls" if len(ctx.in_shapes) == 4 else ""
    whole = "lsev" if _causal_cross(ctx, 4, 0, 1) else "sev"
    return einsum(f"bhle,bhse,bhsv{mask}->bhlv,bhl", ctx.in_shapes, ctx.out_shapes, need_rep=whole,
                  indexed=_causal_indexed(ctx, 4, 0, 1), gathered="s")


def sdpa_cpu_backward(ctx):
    """(dout, q, k, v, out, lse, [mask]) -> (dq, dk, dv): L is REDUCE for dk and dv (a sum over query rows)."""
    mask = ",bhls" if len(ctx.in_shapes) == 7 else ""
    whole = "lsev" if _causal_cross(ctx, 7, 1, 2) else "sev"
    return einsum(f"bhlv,bhle,bhse,bhsv,bhlv,bhl{mask}->bhle,bhse,bhsv", ctx.in_shapes, ctx.out_shapes,
                  need_rep=whole, indexed=_causal_indexed(ctx, 7, 1, 2), gathered="s")


def rules() -> dict:
    return {
        aten._scaled_dot_product_flash_attention_for_cpu.default: sdpa_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: sdpa_cpu_backward,
    }
