"""Local kernels of causal attention whose query positions are tiled (context parallelism, rules/attention.py).

A rank holding query rows [off, off + n) of a causal self-attention over S keys computes its rows against all the
keys (gathered by lowering: the all_gather of the CP tactic) with row i seeing keys 0..off + i. SDPA's is_causal
would align the rank's first query with the first key, so it is replaced by an explicit additive mask
(0 where key <= query position, -inf elsewhere), added to the caller's mask when there is one:

    mask[i, j] = 0 if j <= off + i else -inf          # (n, S), broadcast over batch and heads

Every row keeps key 0, so no row is all -inf; the kernels are the same aten ops with is_causal=False.
"""
from __future__ import annotations

import math
import operator

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


# -- ring attention (attention="ring"): the keys and values stay tiled and travel around the axis ---------------------
#
# Rank r of n holds query rows and key/value chunk r (c positions each). Step i (0 <= i < n) computes the query
# rows against chunk src = (r - i) mod n, received from the rank before while step i - 1 computed, and merges the
# partial results with an online softmax (Liu et al. 2023, "Ring Attention with Blockwise Transformers"):
#
#     lse = logaddexp(lse, lse_i);  out = out * exp(lse_old - lse) + out_i * exp(lse_i - lse)
#
# A row that sees no key of a chunk (the chunks after it under a causal mask) gets lse_i = -inf (the CPU kernel
# returns 0 there). The backward runs the ring again with the forward's out and global lse (each block's
# probabilities are then exact): dq sums over the steps; each chunk's dk and dv travel with it, accumulated by every
# rank it visits, and one last step hands them to their owner, so no reduce_scatter is needed.
_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
RING_OPS = (_FWD, _BWD)


class Ring:
    """Emits one ring attention op into the lowerer's graph (lw: lower.lower.Lowerer)."""

    def __init__(self, lw, node, axis, n, c, causal, mask, like):
        self.lw, self.em, self.node, self.axis = lw, lw.em, node, axis
        self.n, self.c, self.causal, self.mask, self.like = n, c, causal, mask, like
        self.r = self.em.coords[axis]

    def shift(self, x, shape, dtype, value):
        """Issue one ring step of x (to the next rank); read it with wait()."""
        from ..contract import META_COLLECTIVE, META_IN_SHAPE
        from .records import COLLECTIVE_PERMUTE, CollectiveRecord
        from .ring import RING_SHIFT

        em = self.em
        s = em.call(RING_SHIFT, x, 1, em.groups[self.axis], meta_shape=tuple(shape))
        s.meta[META_IN_SHAPE] = tuple(shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        why, source, op = em.cause(COLLECTIVE_PERMUTE, self.axis) if em.cause is not None else ("", "", "")
        tactic = self.lw.d.tactic_of(self.lw.g.vid[value], self.axis) or ""
        rec = CollectiveRecord(COLLECTIVE_PERMUTE, self.axis, self.n, int(nbytes), str(dtype).replace("torch.", ""),
                               tactic, self.lw.g.name(self.lw.g.vid[value]), s.name, "", 2, em.phase,
                               em.families.get(tactic, ""), why, source, op)
        s.meta[META_COLLECTIVE] = rec
        em.records.append(rec)
        return s, tuple(shape)

    def wait(self, sent):
        s, shape = sent
        return self.em.call(torch.ops._c10d_functional.wait_tensor.default, s, meta_shape=shape)

    def block_mask(self, i: int):
        """(c, c) additive mask of step i (None when there is none): causal at the chunks' offsets, plus the
        caller's mask's columns of chunk src."""
        em, c = self.em, self.c
        if not self.causal and self.mask is None:
            return None
        src = em.call(aten.remainder.Scalar, em.call(aten.add.Scalar, self.r, self.n - i), self.n, meta_shape=())
        cols = em.call(aten.add.Tensor, em.call(aten.arange.default, c, meta_shape=(c,)),
                       em.call(aten.mul.Scalar, src, c, meta_shape=()), meta_shape=(c,))
        out = None
        if self.causal:
            rows = em.call(aten.add.Tensor, em.call(aten.arange.default, c, meta_shape=(c,)),
                           em.call(aten.mul.Scalar, self.r, c, meta_shape=()), meta_shape=(c,))
            seen = em.call(aten.le.Tensor, em.call(aten.unsqueeze.default, cols, 0, meta_shape=(1, c)),
                           em.call(aten.unsqueeze.default, rows, 1, meta_shape=(c, 1)), meta_shape=(c, c))
            zero = em.call(aten.new_zeros.default, self.like, [c, c], meta_shape=(c, c))
            ninf = em.call(aten.new_full.default, self.like, [c, c], float("-inf"), meta_shape=(c, c))
            out = em.call(aten.where.self, seen, zero, ninf, meta_shape=(c, c))
        if self.mask is not None:
            part = em.call(aten.index_select.default, self.mask, -1, cols)
            out = part if out is None else em.call(aten.add.Tensor, part, out)
        return out

    def forward(self, q, k, v, kv_shape, p, kw, dtype, values):
        """(out, lse) of this rank's query rows, from n steps."""
        em = self.em
        out = lse = None
        for i in range(self.n):
            if i < self.n - 1:
                sk = self.shift(k, kv_shape, dtype, values[0])
                sv = self.shift(v, kv_shape, dtype, values[1])
            m = self.block_mask(i)
            res = em.call(_FWD, q, k, v, p, False, kwargs=dict(kw, attn_mask=m) if m is not None else kw)
            o_i = em.call(operator.getitem, res, 0)
            l_i = em.call(operator.getitem, res, 1)
            if m is not None:     # rows that see no key of this chunk: lse -inf (the kernel says 0)
                valid = em.call(aten.ne.Scalar, em.call(aten.amax.default, m, [-1]), float("-inf"))
                l_i = em.call(aten.where.self, valid, l_i, em.call(aten.full_like.default, l_i, float("-inf")))
            if i == 0:
                out, lse = o_i, l_i
            else:
                new = em.call(aten.logaddexp.default, lse, l_i)
                a = em.call(aten.unsqueeze.default, em.call(aten.exp.default, em.call(aten.sub.Tensor, lse, new)), -1)
                b = em.call(aten.unsqueeze.default, em.call(aten.exp.default, em.call(aten.sub.Tensor, l_i, new)), -1)
                out = em.call(aten.add.Tensor, em.call(aten.mul.Tensor, out, a), em.call(aten.mul.Tensor, o_i, b))
                lse = new
            if i < self.n - 1:
                k, v = self.wait(sk), self.wait(sv)
        if self.n > 1:
            out = em.call(aten._to_copy.default, out, kwargs={"dtype": dtype})
        return out, lse

    def backward(self, g, q, k, v, out, lse, kv_shape, p, kw, dtype, values):
        """(dq, dk, dv): dq of this rank's rows, dk and dv of this rank's key chunk, summed over the ring."""
        em = self.em
        dq = ak = av = rk = rv = None
        for i in range(self.n):
            if i < self.n - 1:
                sk = self.shift(k, kv_shape, dtype, values[0])
                sv = self.shift(v, kv_shape, dtype, values[1])
            m = self.block_mask(i)
            res = em.call(_BWD, g, q, k, v, out, lse, p, False, kwargs=dict(kw, attn_mask=m) if m is not None else kw)
            dq_i, dk_i, dv_i = (em.call(operator.getitem, res, j) for j in range(3))
            dq = dq_i if dq is None else em.call(aten.add.Tensor, dq, dq_i)
            ak = dk_i if rk is None else em.call(aten.add.Tensor, self.wait(rk), dk_i)
            av = dv_i if rv is None else em.call(aten.add.Tensor, self.wait(rv), dv_i)
            rk = self.shift(ak, kv_shape, dtype, values[0])
            rv = self.shift(av, kv_shape, dtype, values[1])
            if i < self.n - 1:
                k, v = self.wait(sk), self.wait(sv)
        return dq, self.wait(rk), self.wait(rv)


def ring_axis(lw, i: int):
    """The ring axis tiling op i's query rows (None: lower the op as usual, keys and values gathered)."""
    op = lw.g.ops[i]
    q_dims = op.rule.operands[0 if op.node.target is _FWD else 1]
    for f, axes in lw.d.op_factor_axes(i).items():
        for a in axes:
            if a in lw.ring and len(q_dims) > 2 and f in q_dims[2]:
                return a
    return None


def _tiled_on(have, want, axis):
    """`have` is `want` with `axis` added last on dim 2 (the key positions), nothing else."""
    dims = [tuple(d) for d in want.dims]
    if len(dims) < 3 or have.partial or want.partial:
        return False
    dims[2] = dims[2] + (axis,)
    return tuple(have.dims) == tuple(dims) and not dict(have.strides).get(axis) and not have.blocks


def ring_attention(lw, node, i: int, ins, outs, axis: str) -> bool:
    """Lower attention op i as a ring on `axis` (lw: the Lowerer); False when its keys and values do not arrive
    tiled on their positions on `axis` alone (the op is then lowered with them gathered)."""
    from .lower import _strip

    fwd = node.target is _FWD
    kj = 1 if fwd else 2
    args, kw = list(node.args), dict(node.kwargs)
    vk, vv = lw.g.vid[args[kj]], lw.g.vid[args[kj + 1]]
    have_k, have_v = _strip(lw.layout[vk]), _strip(lw.layout[vv])
    if not (_tiled_on(have_k, ins[kj], axis) and _tiled_on(have_v, ins[kj + 1], axis)):
        return False
    pj = 3 if fwd else 6                   # dropout_p, then is_causal
    p = args[pj] if len(args) > pj else kw.pop("dropout_p", 0.0)
    if p:
        from ..errors import PartitionError

        raise PartitionError(f"ring attention on axis '{axis}': {node.format_node()} has dropout_p={p}; the ring "
                             f"computes each key chunk's probabilities apart, so attention dropout cannot match one "
                             f"device. Use attention dropout 0, or context_parallel(attention='allgather').")
    causal = bool(args[pj + 1] if len(args) > pj + 1 else kw.pop("is_causal", False))
    lw.em.phase = lw.phase
    slot = 0
    local = []
    for j, a in enumerate(args[:kj + 2] if fwd else args[:6]):
        want = (have_k if j == kj else have_v if j == kj + 1 else ins[j])
        lw.em.cause = lw._cause(a, node)
        local.append(lw.fetch(a, want, node))
        slot += 1
    mask = None
    if kw.get("attn_mask") is not None:
        lw.em.cause = lw._cause(kw["attn_mask"], node)
        mask = lw.fetch(kw["attn_mask"], ins[slot], node)[0]
    kw.pop("attn_mask", None)
    kw.pop("is_causal", None)
    n = lw.mesh.shape[axis]
    q_shape = local[0 if fwd else 1][1]
    kv_shape = local[kj][1]
    lw.em.cause = lw._cause(args[kj], node)
    dtype = args[0 if fwd else 1].meta["val"].dtype
    ring = Ring(lw, node, axis, n, q_shape[2], causal, mask, local[0 if fwd else 1][0])
    xs = [x for x, _ in local]
    if fwd:
        res = ring.forward(xs[0], xs[1], xs[2], kv_shape, 0.0, kw, dtype, (args[1], args[2]))
        produced = list(outs)
    else:
        res = ring.backward(*xs, kv_shape, 0.0, kw, dtype, (args[2], args[3]))
        produced = [outs[0], have_k, have_v]
    lw.env[node] = tuple(res)
    lw.produced_of[node] = produced
    return True


def drop_ring_wants(lw) -> None:
    """The keys and values of ring attention ops are read tiled: their gathered layout is no consumer's want
    (Lowerer.settle would gather them where they are made)."""
    for i, op in enumerate(lw.g.ops):
        if op.node.target in RING_OPS and ring_axis(lw, i) is not None:
            kj = 1 if op.node.target is _FWD else 2
            for a, want in ((op.node.args[kj], lw.layouts_of[i][0][kj]), (op.node.args[kj + 1], lw.layouts_of[i][0][kj + 1])):
                wants = lw.wants.get(a, {})
                if wants.get(want) is op.node:
                    del wants[want]
