"""Attention of a rank's query rows under context parallelism (rules/attention.py, tactics/cp.py), blockwise.

Rank r holds query rows [r c, (r + 1) c) of a self-attention over S = m c keys. It computes them against the m
key blocks in ring order, block (r - i) mod m at step i, and merges the partial results with an online softmax
(Liu et al. 2023, "Ring Attention with Blockwise Transformers"; lse = the kernel's logsumexp per row):

    lse = logaddexp(lse, lse_i);  out = out * exp(lse_old - lse) + out_i * exp(lse_i - lse)

Under a causal mask no (c, S) mask is ever built: step 0 is the diagonal block (SDPA's is_causal, aligned), and
every later block is wholly visible (i <= r) or wholly hidden (its lse_i set to -inf; in the backward its dout is
scaled by 0, so its gradients are 0). A caller's mask (padding) gives each block its columns; a row that sees no
key of a block gets lse_i = -inf there (the CPU kernel returns 0 for it).

The blocks come from one of two sources:
- "allgather": the keys and values gathered by lowering (CP's all_gather); block j is an index_select, and the
  backward assembles dK, dV over the gathered positions (partial sums, reduce-scattered by lowering);
- "ring": the keys and values stay tiled; each step's block arrives from the rank before (a collective_permute in
  flight while the step computes), and in the backward each block's dK, dV travel with it, accumulated by every
  rank it visits, one last step handing them to their owner: no all_gather or reduce_scatter at all.
The backward runs the same blocks with the forward's out and global lse, so each block's probabilities are exact.
"""
from __future__ import annotations

import math
import operator

import torch

from ..sharding import Sharding
from .zigzag import Zigzag, zigzag_axis

aten = torch.ops.aten
_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
RING_OPS = (_FWD, _BWD)


class Blockwise:
    """Emits the blockwise attention of one op. rb: this rank's block index (0-d node); m blocks of c rows."""

    def __init__(self, em, rb, m: int, c: int, causal: bool, mask, like, kw: dict):
        self.em, self.rb, self.m, self.c, self.causal, self.mask, self.like = em, rb, m, c, causal, mask, like
        self.kw = {k: v for k, v in kw.items() if k not in ("attn_mask", "is_causal", "dropout_p")}

    def call(self, target, *args, **kwargs):
        return self.em.call(target, *args, **kwargs)

    def cols(self, i: int):
        """Key positions of step i's block: ((rb - i) mod m) c + [0, c)."""
        src = self.call(aten.remainder.Scalar, self.call(aten.add.Scalar, self.rb, self.m - i), self.m)
        return self.call(aten.add.Tensor, self.call(aten.arange.default, self.c),
                         self.call(aten.mul.Scalar, src, self.c))

    def _block_mask(self, i: int):
        """(the additive mask of step i or None, is_causal of its kernel call)."""
        if self.mask is None:
            return None, self.causal and i == 0
        part = self.call(aten.index_select.default, self.mask, -1, self.cols(i))
        if self.causal and i == 0:      # the caller's mask and the diagonal's causal mask, (c, c) only
            ar = self.call(aten.arange.default, self.c)
            seen = self.call(aten.le.Tensor, self.call(aten.unsqueeze.default, ar, 0),
                             self.call(aten.unsqueeze.default, ar, 1))
            tri = self.call(aten.where.self, seen, self.call(aten.new_zeros.default, self.like, [self.c, self.c]),
                            self.call(aten.new_full.default, self.like, [self.c, self.c], float("-inf")))
            part = self.call(aten.add.Tensor, part, tri)
        return part, False

    def _hidden(self, i: int):
        """Step i's block is after this rank's rows under the causal mask (a 0-d bool), or None."""
        return self.call(aten.lt.Scalar, self.rb, i) if self.causal and i > 0 else None

    def forward(self, q, block):
        """(out, lse) of this rank's rows; block(i) -> (k_i, v_i)."""
        out = lse = None
        for i in range(self.m):
            k, v = block(i)
            mask, causal = self._block_mask(i)
            kw = dict(self.kw, attn_mask=mask) if mask is not None else self.kw
            res = self.call(_FWD, q, k, v, 0.0, causal, kwargs=kw)
            o_i, l_i = self.call(operator.getitem, res, 0), self.call(operator.getitem, res, 1)
            ninf = self.call(aten.full_like.default, l_i, float("-inf"))
            if mask is not None:      # rows that see no key of this block: lse -inf (the kernel says 0)
                l_i = self.call(aten.where.self, self.call(aten.ne.Scalar, self.call(aten.amax.default, mask, [-1]),
                                                           float("-inf")), l_i, ninf)
            hidden = self._hidden(i)
            if hidden is not None:
                l_i = self.call(aten.where.self, hidden, ninf, l_i)
            if out is None:
                out, lse = o_i, l_i
                continue
            new = self.call(aten.logaddexp.default, lse, l_i)
            a = self.call(aten.unsqueeze.default, self.call(aten.exp.default, self.call(aten.sub.Tensor, lse, new)), -1)
            b = self.call(aten.unsqueeze.default, self.call(aten.exp.default, self.call(aten.sub.Tensor, l_i, new)), -1)
            out = self.call(aten.add.Tensor, self.call(aten.mul.Tensor, out, a), self.call(aten.mul.Tensor, o_i, b))
            lse = new
        if self.m > 1:                # the merge computed in lse's precision: back to the query's dtype
            out = self.call(aten.type_as.default, out, q)
        return out, lse

    def backward(self, g, q, out, lse, block, collect):
        """dq of this rank's rows; each block's (dk_i, dv_i) handed to collect(i, dk_i, dv_i)."""
        dq = None
        for i in range(self.m):
            k, v = block(i)
            mask, causal = self._block_mask(i)
            kw = dict(self.kw, attn_mask=mask) if mask is not None else self.kw
            hidden = self._hidden(i)
            g_i = g if hidden is None else self.call(
                aten.mul.Tensor, g, self.call(aten.logical_not.default, hidden))     # a hidden block: dout 0
            res = self.call(_BWD, g_i, q, k, v, out, lse, 0.0, causal, kwargs=kw)
            dq_i, dk_i, dv_i = (self.call(operator.getitem, res, j) for j in range(3))
            dq = dq_i if dq is None else self.call(aten.add.Tensor, dq, dq_i)
            collect(i, dk_i, dv_i)
        return dq


# -- "allgather": the indexed kernels of the attention ops (rules/registry.py LINKS; lower/lower.py _indexed) -------
def _gathered(em, args, kwargs, off, n, size, q_at):
    q, k = args[q_at], args[q_at + 1]
    _check_dropout(args, kwargs, q_at)
    rb = em.call(aten.div.Tensor_mode, off, n, kwargs={"rounding_mode": "floor"})
    bw = Blockwise(em, rb, size // n, n, True, kwargs.get("attn_mask"), q, kwargs)

    def block(i):
        cols = bw.cols(i)
        return tuple(em.call(aten.index_select.default, x, 2, cols) for x in (k, args[q_at + 2]))
    return bw, block


def _check_dropout(args, kwargs, q_at):
    pj = 3 if q_at == 0 else 6
    p = args[pj] if len(args) > pj else kwargs.get("dropout_p", 0.0)
    if p:
        from ..errors import PartitionError

        raise PartitionError(f"context parallelism: a causal attention with dropout_p={p} has its query rows tiled; "
                             f"attention dropout per key block cannot match one device. Use attention dropout 0 "
                             f"(attention_dropout=0.0 in the model's config) with context_parallel.")


def sdpa_causal(em, args, kwargs, off, n, size, zigzag=False):
    """_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal=True, ...) of this rank's query
    rows [off, off + n) against the gathered keys and values (zigzag: the rank's two chunks, lower/zigzag.py)."""
    if zigzag:
        zz = _zigzag(em, args, kwargs, off, n, size, 0)
        return em.call(_PAIR, *zz.forward(args[0], zz.gathered(*args[:3])))
    bw, block = _gathered(em, args, kwargs, off, n, size, 0)
    out, lse = bw.forward(args[0], block)
    return em.call(_PAIR, out, lse)


def sdpa_causal_backward(em, args, kwargs, off, n, size, zigzag=False):
    """Its backward (dout, q, k, v, out, lse, ...): dq of this rank's rows; dk and dv over all the gathered positions
    (partial sums over the ranks' rows, reduced by lowering)."""
    g, q, k, v, out, lse = args[:6]
    if zigzag:
        zz = _zigzag(em, args, kwargs, off, n, size, 1)
        return em.call(_TRIPLE, *zz.gathered_backward(g, q, k, v, out, lse))
    bw, block = _gathered(em, args, kwargs, off, n, size, 1)
    parts, cols = [], []

    def collect(i, dk, dv):
        parts.append((dk, dv))
        cols.append(bw.cols(i))

    dq = bw.backward(g, q, out, lse, block, collect)
    where = em.call(aten.cat.default, cols)                      # ring order -> positions
    dk = em.call(aten.index_copy.default, em.call(aten.zeros_like.default, k), 2, where,
                 em.call(aten.cat.default, [p[0] for p in parts], 2))
    dv = em.call(aten.index_copy.default, em.call(aten.zeros_like.default, v), 2, where,
                 em.call(aten.cat.default, [p[1] for p in parts], 2))
    return em.call(_TRIPLE, dq, dk, dv)


def _zigzag(em, args, kwargs, off, n, size, q_at):
    """The Zigzag kernel of this rank (rank off / n, its n rows two chunks of n / 2), checked as _gathered checks."""
    from .zigzag import Zigzag

    _check_dropout(args, kwargs, q_at)
    if kwargs.get("attn_mask") is not None:
        from ..errors import PartitionError

        raise PartitionError("context_parallel(load_balance=True): a causal attention with an attn_mask as well "
                             "is not built for the zigzag layout. Use load_balance=False, or a causal attention "
                             "without an explicit mask (SDPA's is_causal).")
    rank = em.call(aten.div.Tensor_mode, off, n, kwargs={"rounding_mode": "floor"})
    return Zigzag(em, rank, size // n, n // 2, kwargs)


def _pair(a, b):
    return a, b


def _triple(a, b, c):
    return a, b, c


_PAIR, _TRIPLE = _pair, _triple


# -- "ring": the lowering of an attention op whose keys and values stay tiled (Lowerer._op's hook) -------------------
def ring_axis(lw, i: int):
    """The ring axis tiling op i's query rows (None: lower the op as usual, keys and values gathered)."""
    op = lw.g.ops[i]
    q_dims = op.rule.operands[0 if op.node.target is _FWD else 1]
    for f, axes in lw.d.op_factor_axes(i).items():
        for a in axes:
            if a in lw.ring and len(q_dims) > 2 and f in q_dims[2]:
                return a
    return None


def drop_ring_wants(lw) -> None:
    """The keys and values of ring attention ops are read tiled: their gathered layout is no consumer's want
    (Lowerer.settle would gather them where they are made)."""
    for i, op in enumerate(lw.g.ops):
        if op.node.target in RING_OPS and ring_axis(lw, i) is not None:
            kj = 1 if op.node.target is _FWD else 2
            for j in (kj, kj + 1):
                wants = lw.wants.get(op.node.args[j], {})
                if wants.get(lw.layouts_of[i][0][j]) is op.node:
                    del wants[lw.layouts_of[i][0][j]]


def _strip(sh: Sharding) -> Sharding:
    """The layout part of a sharding (lower.lower._strip: explicitly-replicated markers do not change the data)."""
    return Sharding(sh.dims, sh.partial, strides=sh.strides, blocks=sh.blocks) if sh.replicated else sh


def _tiled_on(have, want, axis) -> bool:
    """`have` is `want` with `axis` added last on dim 2 (the key positions), nothing else."""
    dims = [tuple(d) for d in want.dims]
    if len(dims) < 3 or have.partial or want.partial:
        return False
    dims[2] = dims[2] + (axis,)
    return tuple(have.dims) == tuple(dims) and not dict(have.strides).get(axis) and not have.blocks


class _Ring:
    """The transfers of one ring attention op: ring_shift steps (lower/ring.py's primitive), recorded as CP's."""

    def __init__(self, lw, axis, shape, dtype, values):
        self.lw, self.em, self.axis, self.shape, self.dtype, self.values = lw, lw.em, axis, tuple(shape), dtype, values

    def shift(self, x, which: int):
        """Issue one ring step of x (to the next rank); read it with wait()."""
        from ..contract import META_COLLECTIVE, META_IN_SHAPE
        from .records import COLLECTIVE_PERMUTE, CollectiveRecord
        from .ring import RING_SHIFT

        em, lw = self.em, self.lw
        s = em.call(RING_SHIFT, x, 1, em.groups[self.axis], meta_shape=self.shape)
        s.meta[META_IN_SHAPE] = self.shape
        nbytes = math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()
        vid = lw.g.vid[self.values[which]]
        em.cause = lw._cause(self.values[which], self.values[2])
        why, source, op = em.cause(COLLECTIVE_PERMUTE, self.axis)
        tactic = lw.d.tactic_of(vid, self.axis) or ""
        rec = CollectiveRecord(COLLECTIVE_PERMUTE, self.axis, lw.mesh.shape[self.axis], int(nbytes),
                               str(self.dtype).replace("torch.", ""), tactic, lw.g.name(vid), s.name, "", 2, em.phase,
                               em.families.get(tactic, ""), why, source, op)
        s.meta[META_COLLECTIVE] = rec
        em.records.append(rec)
        return s

    def wait(self, s):
        return self.em.call(torch.ops._c10d_functional.wait_tensor.default, s, meta_shape=self.shape)

    def blocks(self, k, v):
        """block(i) for Blockwise: step 0 the local k, v; each later block received while the step before computes."""
        held, sent = [k, v], []

        def block(i):
            if i > 0:
                held[:] = [self.wait(s) for s in sent]
            if i < self.lw.mesh.shape[self.axis] - 1:
                sent[:] = [self.shift(held[0], 0), self.shift(held[1], 1)]
            return tuple(held)
        return block


def ring_attention(lw, node, i: int, ins, outs, axis: str) -> bool:
    """Lower attention op i as a ring on `axis` (lw: the Lowerer); False when its keys and values do not arrive
    tiled on their positions on `axis` alone (the op is then lowered with them gathered, and a warning says so)."""
    from ..errors import PartitionError, warn

    fwd = node.target is _FWD
    kj, pj = (1, 3) if fwd else (2, 6)                  # keys' slot; dropout_p's, then is_causal's
    args, kw = list(node.args), dict(node.kwargs)
    have = [_strip(lw.layout[lw.g.vid[args[j]]]) for j in (kj, kj + 1)]
    if not all(_tiled_on(h, ins[j], axis) for h, j in zip(have, (kj, kj + 1))):
        warn(f"context_parallel(attention='ring') on axis '{axis}': the keys and values of {node.name} are not "
             f"tiled on their positions on '{axis}' alone; this attention gathers them (the 'allgather' form).")
        return False
    p = args[pj] if len(args) > pj else kw.get("dropout_p", 0.0)
    if p:
        raise PartitionError(f"ring attention on axis '{axis}': {node.name} has dropout_p={p}; attention dropout "
                             f"per key block cannot match one device. Use attention dropout 0, or "
                             f"context_parallel(attention='allgather').")
    causal = bool(args[pj + 1] if len(args) > pj + 1 else kw.get("is_causal", False))
    lw.em.phase = lw.phase
    local = []
    for j, a in enumerate(args[:pj]):
        lw.em.cause = lw._cause(a, node)
        local.append(lw.fetch(a, have[j - kj] if j in (kj, kj + 1) else ins[j], node))
    mask = kw.get("attn_mask")
    if mask is not None:
        lw.em.cause = lw._cause(mask, node)
        mask = lw.fetch(mask, ins[pj], node)[0]
    q, q_shape = local[kj - 1]
    xs = [x for x, _ in local]
    ring = _Ring(lw, axis, local[kj][1], args[kj].meta["val"].dtype, (args[kj], args[kj + 1], node))
    n = lw.mesh.shape[axis]
    bw = Blockwise(lw.em, lw.em.coords[axis], n, q_shape[2], causal, mask, q, kw)
    run_fwd, run_bwd = bw.forward, bw.backward
    if causal and zigzag_axis(lw.cap) == axis:        # load balancing: the zigzag ring (lower/zigzag.py)
        if mask is not None:
            raise PartitionError(f"context_parallel(load_balance=True) on axis '{axis}': {node.name} is causal with an "
                                 f"attn_mask as well, not built for the zigzag layout. Use load_balance=False, or "
                                 f"a causal attention without an explicit mask (SDPA's is_causal).")
        zz = Zigzag(lw.em, lw.em.coords[axis], n, q_shape[2] // 2, kw)
        run_fwd, run_bwd = zz.ring_forward, zz.ring_backward
    if fwd:
        out, lse = run_fwd(q, ring.blocks(xs[1], xs[2]))
        lw.env[node], lw.produced_of[node] = lw.em.call(_PAIR, out, lse), list(outs)
        return True
    acc = []                           # each block's dK, dV accumulated by the ranks it visits, then handed on

    def collect(i, dk, dv):
        if acc:
            dk, dv = (lw.em.call(aten.add.Tensor, ring.wait(s), d) for s, d in zip(acc, (dk, dv)))
        acc[:] = [ring.shift(dk, 0), ring.shift(dv, 1)]

    dq = run_bwd(xs[0], q, xs[4], xs[5], ring.blocks(xs[2], xs[3]), collect)
    lw.env[node] = lw.em.call(_TRIPLE, dq, ring.wait(acc[0]), ring.wait(acc[1]))
    lw.produced_of[node] = [outs[0], have[0], have[1]]
    return True
