"""Causal load balancing for context parallelism (issue 38): the zigzag layout and its blockwise attention.

A sequence of S = 2 n c positions is cut into 2n chunks of c; rank r of the CP axis (size n) holds chunks r and
2n-1-r, its 2c local rows being slot 0 (chunk r) then slot 1 (chunk 2n-1-r). Storage order is therefore

    zigzag_order(8, 2) = [0 1 | 6 7 | 2 3 | 4 5]      (c = 2: rank 0 holds chunks 0, 3; rank 1 chunks 1, 2)

Under a causal mask chunk i sees chunks 0..i, so rank r's rows see

    slot 0: chunks 0 .. r-1 whole, chunk r diagonal;   slot 1: chunks 0 .. 2n-2-r whole, chunk 2n-1-r diagonal

2n-1 whole c x c blocks and 2 diagonal ones on every rank: equal work, 2n c^2 pairs, against (4n - 2) c^2 when a
contiguous tiling computes every key block of its 2c rows (lower/cp.py: n blocks of (2c)^2, the diagonal half
skipped): n / (2n - 1) of it, 4/7 at n = 4, 1/2 as n grows. One program runs on every rank (SPMD): the steps are
the same on every rank, only their indices depend on the rank r (a 0-d tensor of the program):

    gathered keys (allgather): the diagonals; slot 1 against chunks 0 .. n-1 in one call (2n-1-r >= n sees them
        all); then n-1 blocks, step t = (slot 0, chunk t) when t < r, else (slot 1, chunk n + t - r)
    ring (keys from rank src = (r - s) mod n at step s = 1 .. n-1, holding chunks src and 2n-1-src):
        (slot 1, the first chunk) and (slot b, chunk b of the pair) with b = [src > r];
        step 0 adds (slot 1, the rank's own first chunk) to the diagonals

(the ring form is the schedule of Zhu et al.'s ring-flash-attention `zigzag_ring_flash_attn`). Partial results
merge by online softmax as in lower/cp.py; a block's result is merged into the slot it belongs to (its lse set to
-inf for the other slot when the slot depends on the rank), and the backward adds each block's dq into its slot's
accumulator (masked by the slot when it depends on the rank).
"""
from __future__ import annotations

import operator

import torch

from ..contract import META_ZIGZAG

aten = torch.ops.aten
_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def zigzag_axis(cap):
    """The axis of a captured step's zigzag layout (tactics/cpbalance.py), None without load balancing."""
    return (cap.gm.meta.get(META_ZIGZAG) or {}).get("axis")


def zigzag_order(length: int, n: int) -> torch.Tensor:
    """The original positions in zigzag storage order: rank r's 2c rows are chunks r and 2n-1-r (c = length / 2n).
    x.index_select(d, zigzag_order(S, n)) lays a sequence dim out so that tiling it contiguously on n ranks is the
    zigzag layout; index_select with zigzag_inverse undoes it."""
    c = length // (2 * n)
    chunks = [j for r in range(n) for j in (r, 2 * n - 1 - r)]
    return (torch.tensor(chunks).unsqueeze(1) * c + torch.arange(c)).reshape(-1)


def zigzag_inverse(length: int, n: int) -> torch.Tensor:
    return torch.argsort(zigzag_order(length, n))


class Zigzag:
    """Emits the zigzag blockwise attention of one op on one rank. em: the emitter (em.call(target, *args,
    kwargs=)); r: this rank's index on the CP axis (a 0-d node); n: the axis size; c: rows per chunk; kw: the
    kernel's other keyword arguments (scale)."""

    def __init__(self, em, r, n: int, c: int, kw: dict):
        self.em, self.r, self.n, self.c, self._ar = em, r, n, c, None
        self.kw = {k: v for k, v in kw.items() if k not in ("attn_mask", "is_causal", "dropout_p")}

    def call(self, target, *args, **kwargs):
        return self.em.call(target, *args, **kwargs)

    def arange(self):
        """[0, c), made once per kernel."""
        if self._ar is None:
            self._ar = self.call(aten.arange.default, self.c)
        return self._ar

    def rows(self, slot):
        """Positions slot c + [0, c) of a 2c-row dim (slot: an int or a 0-d node)."""
        at = slot * self.c if isinstance(slot, int) else self.call(aten.mul.Scalar, slot, self.c)
        return self.call(aten.add.Tensor, self.arange(), at)

    def pick(self, x, slot):
        """Slot `slot`'s c rows of x (dim 2: q, out and dout are (B, H, 2c, E), lse is (B, H, 2c)); a view when the
        slot is known when lowering."""
        if isinstance(slot, int):
            return self.call(aten.slice.Tensor, x, 2, slot * self.c, (slot + 1) * self.c)
        return self.call(aten.index_select.default, x, 2, self.rows(slot))

    # -- the steps -------------------------------------------------------------------------------------------------
    def gathered_steps(self):
        """[(slot, storage positions of its keys, causal)] of the allgather form: the two diagonals; slot 1 (chunk
        2n-1-r >= n) against the whole first half, chunks 0..n-1, in one call; then n-1 blocks of c whose slot
        depends on the rank: step t is slot 0 against chunk t when t < r, else slot 1 against chunk n + t - r."""
        r, n, c = self.r, self.n, self.c
        own = self.call(aten.mul.Scalar, r, 2 * c)                       # rank r's rows start at 2 r c
        steps = [(0, self.call(aten.add.Tensor, self.arange(), own), True),
                 (1, self.call(aten.add.Tensor, self.arange(), self.call(aten.add.Scalar, own, c)), True)]
        starts = self.call(aten.mul.Scalar, self.call(aten.arange.default, n), 2 * c)      # chunk j < n: rank j
        first = self.call(aten.add.Tensor, self.call(aten.unsqueeze.default, starts, 1),
                          self.call(aten.unsqueeze.default, self.arange(), 0))
        steps.append((1, self.call(aten.view.default, first, [n * c]), False))
        if n == 1:
            return steps
        t = self.call(aten.arange.default, n - 1)
        slot = self.call(aten._to_copy.default, self.call(aten.ge.Tensor, t, r), kwargs={"dtype": torch.long})
        chunk = self.call(aten.add.Tensor, t, self.call(aten.mul.Tensor, slot, self.call(aten.rsub.Scalar, r, n)))
        cols = self.call(aten.add.Tensor, self.call(aten.unsqueeze.default, self._storage_start(chunk), 1),
                         self.call(aten.unsqueeze.default, self.arange(), 0))                    # (n - 1, c)
        for i in range(n - 1):
            steps.append((self.call(aten.select.int, slot, 0, i), self.call(aten.select.int, cols, 0, i), False))
        return steps

    def _storage_start(self, chunk):
        """Where original chunk j starts in zigzag storage order (as CP's all_gather concatenates the ranks' tiles):
        rank j (slot 0) for j < n, rank 2n-1-j (slot 1) after, elementwise."""
        n = self.n
        hi = self.call(aten._to_copy.default, self.call(aten.ge.Scalar, chunk, n), kwargs={"dtype": torch.long})
        flip = self.call(aten.rsub.Scalar, self.call(aten.mul.Scalar, chunk, 2), 2 * n - 1)      # 2n-1-2j
        owner = self.call(aten.add.Tensor, chunk, self.call(aten.mul.Tensor, hi, flip))
        return self.call(aten.mul.Scalar, self.call(aten.add.Tensor, self.call(aten.mul.Scalar, owner, 2), hi),
                         self.c)

    # -- forward and backward over a list of steps (slot, k, v, causal) --------------------------------------------
    def forward(self, q, steps):
        """(out, lse) of this rank's 2c rows. steps: [(slot, k, v, causal)], the two diagonals (slots 0, 1) first."""
        acc = []
        for slot, k, v, causal in steps:
            res = self.call(_FWD, self.pick(q, slot), k, v, 0.0, causal, kwargs=self.kw)
            o, lse = self.call(operator.getitem, res, 0), self.call(operator.getitem, res, 1)
            if len(acc) < 2:
                acc.append((o, lse))
                continue
            if isinstance(slot, int):     # a slot known when lowering
                acc[slot] = self._merge(acc[slot], o, lse)
                continue
            ninf = self.call(aten.full_like.default, lse, float("-inf"))
            for s in (0, 1):             # the block belongs to one slot, known per rank: -inf for the other
                mine = self.call(aten.eq.Scalar, slot, s)
                acc[s] = self._merge(acc[s], o, self.call(aten.where.self, mine, lse, ninf))
        out = self.call(aten.cat.default, [acc[0][0], acc[1][0]], 2)
        lse = self.call(aten.cat.default, [acc[0][1], acc[1][1]], 2)
        return self.call(aten.type_as.default, out, q), lse

    def _merge(self, acc, o, lse):
        out0, lse0 = acc
        new = self.call(aten.logaddexp.default, lse0, lse)
        a = self.call(aten.unsqueeze.default, self.call(aten.exp.default, self.call(aten.sub.Tensor, lse0, new)), -1)
        b = self.call(aten.unsqueeze.default, self.call(aten.exp.default, self.call(aten.sub.Tensor, lse, new)), -1)
        return self.call(aten.add.Tensor, self.call(aten.mul.Tensor, out0, a), self.call(aten.mul.Tensor, o, b)), new

    def backward(self, g, q, out, lse, steps, collect):
        """dq of this rank's 2c rows; each step's (dk, dv) handed to collect(t, dk, dv)."""
        dq = [None, None]
        for t, (slot, k, v, causal) in enumerate(steps):
            dk, dv = self._block_backward(dq, g, q, out, lse, slot, k, v, causal)
            collect(t, dk, dv)
        return self._cat(dq)

    def _block_backward(self, dq, g, q, out, lse, slot, k, v, causal):
        """One block's backward: its dq added to the slot's accumulator in dq (a pair); returns its dk, dv."""
        pick = [self.pick(x, slot) for x in (g, q, out, lse)]
        res = self.call(_BWD, pick[0], pick[1], k, v, pick[2], pick[3], 0.0, causal, kwargs=self.kw)
        dq_t, dk, dv = (self.call(operator.getitem, res, j) for j in range(3))
        self._add_at(dq, slot, dq_t)
        return dk, dv

    def _add_at(self, acc: list, slot, x) -> None:
        """acc[slot] += x for a pair of per-slot accumulators (None: empty); a slot known per rank adds x masked
        to both."""
        for s in ((slot,) if isinstance(slot, int) else (0, 1)):
            y = x if isinstance(slot, int) else self.call(aten.mul.Tensor, x, self.call(
                aten.type_as.default, self.call(aten.eq.Scalar, slot, s), x))
            acc[s] = y if acc[s] is None else self.call(aten.add.Tensor, acc[s], y)

    def _cat(self, acc: list):
        return self.call(aten.cat.default, acc, 2)

    # -- the two forms -----------------------------------------------------------------------------------------------
    def gathered(self, q, k, v):
        """Steps of the allgather form: k, v gathered in zigzag storage order (B, Hk, S, E)."""
        return [(slot, *(self.call(aten.index_select.default, x, 2, cols) for x in (k, v)), causal)
                for slot, cols, causal in self.gathered_steps()]

    def gathered_backward(self, g, q, k, v, out, lse):
        """(dq, dk, dv) of the allgather form; dk and dv over every gathered position (this rank's partial sums)."""
        dk, dv = self.call(aten.zeros_like.default, k), self.call(aten.zeros_like.default, v)
        dq = [None, None]
        for slot, cols, causal in self.gathered_steps():
            kv = [self.call(aten.index_select.default, x, 2, cols) for x in (k, v)]
            dk_t, dv_t = self._block_backward(dq, g, q, out, lse, slot, *kv, causal)
            dk = self.call(aten.index_add.default, dk, 2, cols, dk_t)
            dv = self.call(aten.index_add.default, dv, 2, cols, dv_t)
        return self._cat(dq), dk, dv

    def ring_group(self, s: int):
        """[(slot, half of the received pair, causal)] of ring step s (the pair of rank src = (r - s) mod n)."""
        if s == 0:
            return [(0, 0, True), (1, 1, True), (1, 0, False)]
        src = self.call(aten.remainder.Scalar, self.call(aten.add.Scalar, self.r, self.n - s), self.n)
        b = self.call(aten._to_copy.default, self.call(aten.gt.Tensor, src, self.r), kwargs={"dtype": torch.long})
        return [(1, 0, False), (b, b, False)]       # src < r: both slots see chunk src; src > r: slot 1 sees both

    def ring_forward(self, q, block):
        """(out, lse) of the ring form. block(s) -> the (k, v) pair (2c rows) of rank (r - s) mod n, step 0 the
        rank's own (called in step order: the ring's next transfer is in flight while a step computes)."""
        steps = []
        for s in range(self.n):
            k, v = block(s)
            steps += [(slot, self.pick(k, h), self.pick(v, h), c) for slot, h, c in self.ring_group(s)]
        return self.forward(q, steps)

    def ring_backward(self, g, q, out, lse, block, collect):
        """dq of the ring form; each step's pair gradients (dk, dv of its 2c rows) handed to collect(s, dk, dv) once
        the step has computed them (for the ring to pass them on with the pair)."""
        dq = [None, None]
        for s in range(self.n):
            k, v = block(s)
            dk, dv = [None, None], [None, None]
            for slot, h, causal in self.ring_group(s):
                dk_t, dv_t = self._block_backward(dq, g, q, out, lse, slot, self.pick(k, h), self.pick(v, h), causal)
                self._add_at(dk, h, dk_t)
                self._add_at(dv, h, dv_t)
            collect(s, *(self._cat([x if x is not None else self.call(aten.zeros_like.default, y)
                                    for x, y in zip(acc, (acc[1], acc[0]))]) for acc in (dk, dv)))
        return self._cat(dq)
