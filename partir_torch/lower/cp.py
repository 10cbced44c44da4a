"""Local kernels of causal attention whose query positions are tiled (context parallelism, rules/attention.py).

A rank holding query rows [off, off + n) of a causal self-attention over S keys computes its rows against all the
keys (gathered by lowering: the all_gather of the CP tactic) with row i seeing keys 0..off + i. SDPA's is_causal
would align the rank's first query with the first key, so it is replaced by an explicit additive mask
(0 where key <= query position, -inf elsewhere), added to the caller's mask when there is one:

    mask[i, j] = 0 if j <= off + i else -inf          # (n, S), broadcast over batch and heads

Every row keeps key 0, so no row is all -inf; the kernels are the same aten ops with is_causal=False.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def causal_mask(em, like, off, n: int, size: int):
    """(n, size) additive mask in `like`'s dtype: query rows at positions off + [0, n) over keys [0, size)."""
    rows = em.call(aten.add.Tensor, em.call(aten.arange.default, n, meta_shape=(n,)), off, meta_shape=(n,))
    keys = em.call(aten.arange.default, size, meta_shape=(size,))
    seen = em.call(aten.le.Tensor, em.call(aten.unsqueeze.default, keys, 0, meta_shape=(1, size)),
                   em.call(aten.unsqueeze.default, rows, 1, meta_shape=(n, 1)), meta_shape=(n, size))
    zero = em.call(aten.new_zeros.default, like, [n, size], meta_shape=(n, size))
    ninf = em.call(aten.new_full.default, like, [n, size], float("-inf"), meta_shape=(n, size))
    return em.call(aten.where.self, seen, zero, ninf, meta_shape=(n, size))


def _with_mask(em, like, mask, off, n, size):
    causal = causal_mask(em, like, off, n, size)
    return causal if mask is None else em.call(aten.add.Tensor, mask, causal)


def sdpa_causal(em, args, kwargs, off, n, size):
    """_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal=True, attn_mask, scale) on this
    rank's query rows."""
    q, k, v = args[:3]
    p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    kw = dict(kwargs)
    kw["attn_mask"] = _with_mask(em, q, kw.get("attn_mask"), off, n, size)
    kw.pop("is_causal", None)
    kw.pop("dropout_p", None)
    return em.call(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, p, False, kwargs=kw)


def sdpa_causal_backward(em, args, kwargs, off, n, size):
    """Its backward (dout, q, k, v, out, lse, dropout_p, is_causal=True, attn_mask, scale): dq of this rank's rows,
    dk and dv partial sums over them (lowering reduces them)."""
    g, q, k, v, out, lse = args[:6]
    p = args[6] if len(args) > 6 else kwargs.get("dropout_p", 0.0)
    kw = dict(kwargs)
    kw["attn_mask"] = _with_mask(em, q, kw.get("attn_mask"), off, n, size)
    kw.pop("is_causal", None)
    kw.pop("dropout_p", None)
    return em.call(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, g, q, k, v, out, lse, p,
                   False, kwargs=kw)
