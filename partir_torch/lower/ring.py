"""Collective matmuls (Options.async_tp): sequence parallelism's all_gather -> matmul and matmul -> reduce_scatter
decomposed into ring steps, each step's point-to-point transfer in flight while the matmul of the chunk at hand
computes (Wang et al., ASPLOS 2023, "Overlap communication with dependent computation via decomposition";
torchtitan's async TP, which Inductor lowers to symmetric-memory kernels on GPUs).

all_gather -> matmul (a column-parallel linear's input; a row-parallel linear's output gradient): rank r of n

    y = mm(all_gather(x), w)     ->   x_0 = x; for i < n: issue x_{i+1} = ring_shift(x_i)   (i < n - 1)
                                                          y_i = mm(x_i, w)      (x_i: rank r - i's chunk)
                                      y = the y_i at their ranks' rows; the gathered x, assembled the same way,
                                      for the readers that are not such matmuls (the weight gradient)

all_gather -> a matmul that sums over the gathered rows (a weight gradient, mm(t(x), b)):

    g = mm(t(all_gather(x)), b)  ->   g = sum over steps of mm(t(x_i), b's rows where x_i's rows sit)

matmul -> reduce_scatter (a row-parallel linear's output; the sum of matmuls that is a column-parallel linear's
input gradient):

    z = reduce_scatter(mm(a, w))  ->  for i < n: q = r - 1 - i (mod n); p_i = mm(the rows of a in chunk q, w)
                                                 acc = p_0, then wait(ring_shift(acc)) + p_i
                                      z = acc (after n - 1 steps q = r: this rank's chunk, summed over the ring)

The bytes are those of the collective ((n - 1) / n of the array per rank, in n - 1 transfers); only the first
(all_gather) or last (reduce_scatter) chunk's matmul is not overlapped. The chunks are the collective's dim (the
sequence), possibly strided in the matmul's rows (a (B, T) token grid with T tiled): rows are selected and placed
with index_select at the rank's coordinate, so one program serves every rank. A sum is reassociated only across
ranks (n = 2: the same additions), so the step computes what the collective did up to that order.

`ring_shift(x, shift, group)` is the point-to-point primitive: every rank sends x to the rank `shift` further
along the group's ring and receives from the one `shift` before; it is asynchronous like the functional
collectives (its result is read through wait_tensor). The emulator (runtime/interpret.py) hands values over; the
simulator (sim/comm.py) costs one link transfer per step.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.fx as fx

from ..contract import META_COLLECTIVE, META_IN_SHAPE, META_LOCAL_SHAPE
from ..rules import tags
from .order import reorder
from .overlap import _VIEWS     # the row-moving views lowering emits (one table for both overlap passes)
from .records import ALL_GATHER, COLLECTIVE_PERMUTE, REDUCE_SCATTER, TACTIC

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
WAIT = c10d.wait_tensor.default
_MM = tags.ops("matmul_2d")


class _Works(torch._C._distributed_c10d.Work):
    """The send and the receive of one ring step, waited for together by wait_tensor on the received value."""

    def __init__(self, works):
        super().__init__()
        self.works = works

    def wait(self, timeout=None):
        for w in self.works:
            w.wait()
        return True


@torch.library.custom_op("partir::ring_shift", mutates_args=())
def ring_shift(x: torch.Tensor, shift: int, group: str) -> torch.Tensor:
    """x sent to the rank `shift` places further along process group `group`; returns what the rank `shift` places
    before sent. Asynchronous: read the result through wait_tensor."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(group)
    n, me = pg.size(), pg.rank()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    ops = [dist.P2POp(dist.isend, x.contiguous(), dist.get_global_rank(pg, (me + shift) % n), pg),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(pg, (me - shift) % n), pg)]
    torch._C._distributed_c10d._register_work(out, _Works(dist.batch_isend_irecv(ops)))
    return out


@ring_shift.register_fake
def _(x, shift, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


RING_SHIFT = torch.ops.partir.ring_shift.default


def async_tp(graph: fx.Graph, records: list, coords: dict) -> list:
    """Rewrite every matching tensor-parallel all_gather / reduce_scatter in place (see the module docstring);
    returns the records with each rewritten collective replaced by its ring steps' records."""
    replaced: dict = {}
    index = {n: i for i, n in enumerate(graph.nodes)}     # the readers' order (new nodes are not readers)
    for c in [n for n in graph.nodes if n.op == "call_function" and META_COLLECTIVE in n.meta]:
        rec = c.meta[META_COLLECTIVE]
        if rec.why != TACTIC or rec.group_size < 2 or rec.members or c.meta.get(META_IN_SHAPE) is None:
            continue
        ring = _Ring(graph, c, rec, coords[rec.axis], index)
        if rec.kind == ALL_GATHER:
            done = ring.gather()
        elif rec.kind == REDUCE_SCATTER and rec.reduce_op == "sum":
            done = ring.scatter()
        else:
            continue
        if done is not None:
            replaced[rec.node] = done
    if replaced:
        reorder(graph)
    return [r for rec in records for r in replaced.get(rec.node, [rec])]


def _only_user(n):
    users = list(n.users)
    return users[0] if len(users) == 1 else None



def _shape(n):
    v = n.meta.get("val")
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _keeps_rows(n, k: int) -> bool:
    """n moves rows only: a reshape keeping the last dim (of size k), a permute keeping it last, or a clone."""
    if n.target in _VIEWS:
        before = _shape(n.args[0])
        return before is not None and before[-1] == k and list(n.args[1])[-1] == k
    if n.target is aten.permute.default:
        dims = list(n.args[1])
        return dims[-1] in (-1, len(dims) - 1)
    return n.target is aten.clone.default


class _Ring:
    """One collective's rewrite, in the collective's frame: it runs on dim 0 of its operand, (n * c, *rest) whole,
    and lowering reaches the matmul's rows from there (or there from them) through a chain of reshapes, permutes
    and clones that only moves rows (the last dim, the matmul's k or n, stays whole and last). A matmul is row-wise,
    so it commutes with such a chain: the ring computes the chunks' matmuls in the collective's frame and replays
    the chain on the result (on the operand, for a reduce_scatter)."""

    def __init__(self, graph, c, rec, coord, index):
        self.g, self.c, self.rec, self.coord, self.index = graph, c, rec, coord, index
        self.n = rec.group_size
        self.wait = next((u for u in c.users if u.target is WAIT), None)
        self.front = list(c.meta[META_IN_SHAPE])              # the operand: (n * c, *rest) or (c, *rest)
        self.records: list = []

    def _call(self, target, *args, shape=None, **kwargs):
        node = self.g.call_function(target, tuple(args), kwargs)
        node.meta[META_LOCAL_SHAPE] = tuple(shape) if shape is not None else None
        return node

    def _shift(self, x, shape) -> fx.Node:
        """One ring step of x (every rank sends its x to the next): the issued transfer. Its wait is emitted after
        the step's matmuls (lower/schedule.py then keeps them between the two)."""
        s = self._call(RING_SHIFT, x, 1, self.c.args[-1], shape=shape)
        rec = dataclasses.replace(self.rec, kind=COLLECTIVE_PERMUTE, nbytes=self.rec.nbytes // self.n, node=s.name,
                                  reduce_op="", members=())
        s.meta[META_COLLECTIVE] = rec
        s.meta[META_IN_SHAPE] = tuple(shape)
        self.records.append(rec)
        return s

    def _replay(self, chain, x):
        """The chain's ops applied to x, whose last dim may differ from the one the chain was built for."""
        for op in chain:
            args = list(op.args)
            if op.target in _VIEWS:
                args[1] = list(args[1])[:-1] + [-1]
            x = self.g.call_function(op.target, (x, *args[1:]), dict(op.kwargs))
        return x

    def _ids(self, shape, chain):
        """Per row at the chain's end, its row in the chain's start (whose shape is `shape`): the chain replayed on
        row numbers, flattened. A small int tensor; the data moves once, by index_select with these."""
        rows = math.prod(shape[:-1])
        ids = self._call(aten.reshape.default, self._call(aten.arange.default, rows), list(shape[:-1]) + [1])
        return self._call(aten.reshape.default, self._replay(chain, ids), [-1])

    def _step_of(self, ids):
        """Collective-frame rows -> their position among the chunks concatenated in arrival order (step i holds
        rank r - i's chunk: rank q's rows come at step (r - q) mod n)."""
        per = math.prod(self.front[:-1])                      # rows of one rank's chunk
        q = self._call(aten.div.Scalar_mode, ids, per, rounding_mode="floor")
        step = self._call(aten.remainder.Scalar, self._call(aten.sub.Tensor, self.coord, q), self.n)
        return self._call(aten.add.Tensor, self._call(aten.mul.Scalar, step, per),
                          self._call(aten.remainder.Scalar, ids, per))

    def _chunk_ids(self, ids, q_plus, c):
        """The entries of `ids` (per collective-frame row) of chunk q = (coord + q_plus) mod n, c rows each."""
        q = self._call(aten.remainder.Scalar, self._call(aten.add.Scalar, self.coord, q_plus), self.n, shape=())
        at = self._call(aten.add.Tensor, self._call(aten.arange.default, c), self._call(aten.mul.Scalar, q, c))
        return self._call(aten.index_select.default, ids, 0, at)

    # -- all_gather -> matmul --------------------------------------------------------------------------------------
    def gather(self):
        if self.wait is None or len(self.front) < 2:
            return None
        k, chain, r = self.front[-1], [], self.wait
        while (u := _only_user(r)) is not None and tags.has(u.target, "moves_rows") \
                and _keeps_rows(u, k):
            chain.append(u)
            r = u
        if len(_shape(r) or ()) != 2:
            return None
        rows_of = [u for u in r.users if u.target in _MM and u.args[_lhs(u)] is r and sum(a is r for a in u.args) == 1]
        # mm(t(r), b): r's rows summed over (a weight gradient), when it is of the collective's phase: a forward
        # gather's weight gradient runs in the backward, long after the ring, and reads the gathered copy instead
        summed = [x for x in map(_contracted, r.users) if x is not None] if self.rec.phase != "forward" else []
        if not rows_of and not summed:
            return None
        last = max([u for u in rows_of] + [x[-1] for x in summed], key=lambda u: self.index.get(u, -1))
        whole = [self.n * self.front[0]] + self.front[1:]
        with self.g.inserting_before(last):
            ids = self._ids(whole, chain)                     # per row of r, its row in the collective's frame
            inv = self._call(aten.argsort.default, ids) if summed else None     # and back
            cur, chunks, outs = self.c.args[0], [], {u: [] for u in rows_of}
            acc = {x[-1]: None for x in summed}
            for i in range(self.n):
                sent = self._shift(cur, self.front) if i < self.n - 1 else None
                rows = self._call(aten.reshape.default, cur, [-1, k])
                for u in rows_of:
                    args = list(u.args)
                    args[_lhs(u)] = rows
                    outs[u].append(self._call(u.target, *args))
                if summed:                                    # rank r - i's rows of b, where r's rows of it sit
                    mine = self._chunk_ids(inv, self.n - i, math.prod(self.front[:-1]))
                    for *_, mm in summed:
                        part = self._call(aten.mm.default, self._call(aten.t.default, rows),
                                          self._call(aten.index_select.default, mm.args[1], 0, mine))
                        acc[mm] = part if acc[mm] is None else self._call(aten.add.Tensor, acc[mm], part)
                chunks.append(rows)
                cur = self._call(WAIT, sent, shape=self.front) if sent is not None else None
            at = self._step_of(ids)                           # r's rows in the arrival order of the chunks
            for u in rows_of:
                u.replace_all_uses_with(self._call(aten.index_select.default, self._call(aten.cat.default, outs[u]),
                                                   0, at))
            for mm, total in acc.items():
                mm.replace_all_uses_with(total)
            others = len(r.users) - len(rows_of) - len(summed)
            new_r = self._call(aten.index_select.default, self._call(aten.cat.default, chunks), 0, at) \
                if others else None
        for u in rows_of + [n for x in summed for n in reversed(x)]:   # after the insertions (`last` is one)
            self.g.erase_node(u)
        if new_r is not None:
            r.replace_all_uses_with(new_r)
        for n in [r] + list(reversed(chain[:-1])) + [self.wait, self.c] if chain else [self.wait, self.c]:
            if not n.users:
                self.g.erase_node(n)
        return self.records

    # -- matmul -> reduce_scatter ----------------------------------------------------------------------------------
    def scatter(self):
        if self.wait is None or len(self.front) < 2:
            return None
        chain, x = [], self.c.args[0]
        while tags.has(x.target, "moves_rows") and len(x.users) == 1 \
                and _keeps_rows(x, self.front[-1]):
            chain.insert(0, x)
            x = x.args[0]
        tree = _sum_of_matmuls(x, self.front[-1])
        if tree is None:
            return None
        chunk = [self.front[0] // self.n] + self.front[1:]
        with self.g.inserting_before(self.c):
            ids = self._ids(_shape(x), chain)                 # collective-frame row -> the matmuls' row
            acc = None
            for i in range(self.n):
                sent = self._shift(acc, chunk) if acc is not None else None     # in flight while part_i computes
                rows = self._chunk_ids(ids, self.n - 1 - i, math.prod(chunk[:-1]))   # chunk q = r - 1 - i
                part = self._call(aten.reshape.default, self._part(tree, rows), chunk[:-1] + [-1], shape=chunk)
                acc = part if sent is None else self._call(aten.add.Tensor, self._call(WAIT, sent, shape=chunk), part)
        self.wait.replace_all_uses_with(acc)
        for n in [self.wait, self.c] + list(reversed(chain)) + _tree_nodes(tree):
            if not n.users:
                self.g.erase_node(n)
        return self.records

    def _part(self, tree, rows):
        """The tree's value at the matmuls' rows `rows`: each matmul on those rows of its left operand."""
        if tree[0] == "add":
            return self._call(aten.add.Tensor, self._part(tree[2], rows), self._part(tree[3], rows))
        a, w = tree[1].args
        return self._call(aten.mm.default, self._call(aten.index_select.default, a, 0, rows), w)


def _lhs(u) -> int:
    return 1 if u.target is aten.addmm.default else 0


def _contracted(u):
    """(transpose, [clone,] mm) when `u` transposes a 2-D value only for one matmul to contract over its rows
    (mm(t(r), b): a weight gradient); else None."""
    if not (u.target is aten.t.default or (u.target is aten.permute.default and list(u.args[1]) == [1, 0])):
        return None
    nodes, x = [u], u
    if (c := _only_user(x)) is not None and c.target is aten.clone.default:
        nodes.append(c)
        x = c
    mm = _only_user(x)
    if mm is None or mm.target is not aten.mm.default or mm.args[0] is not x or mm.args[1] is x:
        return None
    return (*nodes, mm)


def _sum_of_matmuls(x, k: int):
    """x (last dim k) as a tree of add.Tensor over matmuls, each read only there and each mm(a, w) or a row-moving
    view of it: ("add", node, left, right) | ("mm", mm node, view node or None)."""
    if x.target is aten.add.Tensor and len(x.args) == 2 and not x.kwargs and len(x.users) == 1 \
            and all(isinstance(a, fx.Node) for a in x.args) and _shape(x.args[0]) == _shape(x) \
            and _shape(x.args[1]) == _shape(x):
        left, right = (_sum_of_matmuls(a, k) for a in x.args)
        return None if left is None or right is None else ("add", x, left, right)
    view, mm = None, x
    if x.target in _VIEWS and len(x.users) == 1:
        if not _keeps_rows(x, k):
            return None
        view, mm = x, x.args[0]
    if mm.target is not aten.mm.default or len(mm.users) != 1 or _shape(mm.args[0]) is None \
            or (_shape(mm) or (0,))[-1] != k:
        return None
    return ("mm", mm, view)


def _tree_nodes(tree) -> list:
    """The tree's nodes, readers before what they read (the erase order)."""
    if tree[0] == "add":
        return [tree[1]] + _tree_nodes(tree[2]) + _tree_nodes(tree[3])
    return [n for n in (tree[2], tree[1]) if n is not None]
