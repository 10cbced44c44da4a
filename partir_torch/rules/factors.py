"""Factor notation for tile-mapping rules (the PartIR / Shardy idea, as data).

A rule, instantiated for one node, names a *factor* for every operand and result dim. Tiling a factor on a mesh
axis tiles every dim it appears in (as the dim's major factor):

- PASS: tiled on operands and results alike (matmul's m and n, every pointwise dim).
- REDUCE: appears in operands but not in (some) results; tiling it makes those results partial(op)
  (matmul's k gives partial(sum); amax's reduced dim gives partial(max)).
- NEED_REP: must be whole on every rank (softmax's dim, sort's dim); never tiled.
- BLOCKED: cannot be reasoned about (the remainder of a reshape that does not factor); never tiled.

A dim made of several factors (reshape (B*T, C) -> (B, T, C)) lists them major to minor: dim 0 of the input is
(B, T); tiling that dim tiles B. Size-1 dims have no factor.

`linear` lists the ways a partial value may flow through the op: each entry is (operand slots that carry the
partial, the reduce ops for which the op is linear); all other operands must then be replicated on that axis.
add is linear in both operands together (sum only); mul in either one; view-like ops in their one operand for
sum, max and min.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

PASS, REDUCE, NEED_REP, BLOCKED = "pass", "reduce", "need_rep", "blocked"
ALL_OPS = ("sum", "max", "min")
SUM = ("sum",)


@dataclass(frozen=True)
class Factor:
    size: int
    kind: str = PASS
    reduce_op: str = "sum"   # REDUCE only: the pending reduction the result gets
    # the op addresses this dim by positions held in another tensor (embedding's vocabulary, nll_loss's classes):
    # tiled, each rank shifts the positions by its offset and masks those outside its shard (lower/indexed.py)
    indexed: bool = False
    # NEED_REP only: a neighbour tiled on it is gathered by lowering and does not keep propagation from deciding
    # the op on another factor (attention's keys under context parallelism: the query rows are tiled, the keys
    # gathered; rules/attention.py)
    gathered: bool = False

    def __str__(self):
        tag = {PASS: "", REDUCE: f"!{self.reduce_op}", NEED_REP: "*", BLOCKED: "#"}[self.kind]
        return f"{self.size}{tag}"


Dims = tuple  # per dim: tuple of factor ids, major to minor


@dataclass(frozen=True)
class OpRule:
    """A rule instantiated for one node. operands[i] / results[j] are Dims or None (slot ignored / not a tensor)."""

    factors: tuple
    operands: tuple
    results: tuple
    linear: tuple = ()
    sliced_results: bool = False     # results are computed whole; a tiling their users ask for is a local slice

    def slots(self):
        """(is_result, index, dims) for every tensor slot."""
        for i, dims in enumerate(self.operands):
            if dims is not None:
                yield False, i, dims
        for j, dims in enumerate(self.results):
            if dims is not None:
                yield True, j, dims

    def __str__(self):
        names = "abcdefghijklmnopqrstuvwxyz"

        def fmt(dims):
            if dims is None:
                return "_"
            return "".join(names[fs[0]] if len(fs) == 1 else "(" + "".join(names[f] for f in fs) + ")" if fs
                           else "1" for fs in dims)

        lhs = ",".join(fmt(d) for d in self.operands)
        rhs = ",".join(fmt(d) for d in self.results)
        fs = " ".join(f"{names[i]}={f}" for i, f in enumerate(self.factors))
        return f"{lhs}->{rhs} [{fs}]"


class RuleBuilder:
    """Collects factors while a rule is being built for one node."""

    def __init__(self):
        self.factors: list = []

    def new(self, size: int, kind: str = PASS, reduce_op: str = "sum", indexed: bool = False,
            gathered: bool = False) -> int:
        self.factors.append(Factor(int(size), kind, reduce_op, indexed, gathered))
        return len(self.factors) - 1

    def dims(self, shape, kind: str = PASS) -> list:
        """A fresh factor per dim of size > 1."""
        return [(self.new(s, kind),) if s > 1 else () for s in shape]

    def rule(self, operands, results, linear=(), sliced_results=False) -> OpRule:
        tup = lambda x: None if x is None else tuple(tuple(d) for d in x)
        return OpRule(tuple(self.factors), tuple(tup(o) for o in operands), tuple(tup(r) for r in results),
                      tuple((frozenset(s), tuple(ops)) for s, ops in linear), sliced_results)


def einsum(spec: str, in_shapes, out_shapes, need_rep: str = "", blocked: str = "", reduce: dict | None = None,
           linear=(), indexed: str = "", gathered: str = "") -> OpRule:
    """Build a rule from an einsum-like spec: 'mk,kn->mn'. '_' marks an ignored operand.

    Letters missing from some result are REDUCE (sum unless `reduce` says otherwise); letters in `need_rep` /
    `blocked` are never tiled (those in `gathered` too, but a neighbour tiled on them is gathered without
    blocking the op: Factor.gathered). A dim of size 1 where its letter is larger (broadcast) gets no factor.
    """
    lhs, rhs = spec.split("->")
    ins, outs = lhs.split(","), rhs.split(",")    # 'k,k->': one scalar result
    reduce = reduce or {}
    sizes: dict = {}
    for part, shapes in ((ins, in_shapes), (outs, out_shapes)):
        for letters, shape in zip(part, shapes):
            if letters == "_" or shape is None:
                continue
            assert len(letters) == len(shape), f"rule {spec!r} does not fit shape {tuple(shape)}"
            for ch, s in zip(letters, shape):
                if s != 1:
                    sizes[ch] = max(sizes.get(ch, 1), s)
    out_letters = set("".join(outs))
    b = RuleBuilder()
    ids: dict = {}
    for ch, s in sizes.items():
        if ch in need_rep:
            kind = NEED_REP
        elif ch in blocked:
            kind = BLOCKED
        elif ch not in out_letters or any(ch not in o for o in outs) or ch in reduce:
            kind = REDUCE
        else:
            kind = PASS
        ids[ch] = b.new(s, kind, reduce.get(ch, "sum"), ch in indexed, kind == NEED_REP and ch in gathered)

    def dims(letters, shape):
        if letters == "_" or shape is None:
            return None
        return [(ids[ch],) if s != 1 and ch in ids else () for ch, s in zip(letters, shape)]

    return b.rule([dims(l, s) for l, s in zip(ins, in_shapes)], [dims(l, s) for l, s in zip(outs, out_shapes)],
                  linear)


def reshape_factors(b: RuleBuilder, in_shape, out_shape):
    """Factors for a reshape: the finest common refinement of both shapes, found by a gcd walk.

    Returns (in_dims, out_dims). Where the shapes do not factor into each other, the rest of that group is one
    BLOCKED factor (it can never be tiled).
    """
    in_dims = [[] for _ in in_shape]
    out_dims = [[] for _ in out_shape]
    i = j = 0
    rem_i = in_shape[0] if in_shape else 1
    rem_j = out_shape[0] if out_shape else 1
    while i < len(in_shape) or j < len(out_shape):
        if i < len(in_shape) and rem_i == 1:
            i += 1
            rem_i = in_shape[i] if i < len(in_shape) else 1
            continue
        if j < len(out_shape) and rem_j == 1:
            j += 1
            rem_j = out_shape[j] if j < len(out_shape) else 1
            continue
        if i >= len(in_shape) or j >= len(out_shape):
            break
        g = math.gcd(rem_i, rem_j)
        if g == 1:
            # shapes interleave (e.g. (6, 4) -> (4, 6) after the common 2): block the rest of this group
            f = b.new(rem_i * rem_j, BLOCKED)
            prod_i, prod_j = rem_i, rem_j
            in_dims[i].append(f)
            out_dims[j].append(f)
            while prod_i != prod_j:
                if prod_i < prod_j:
                    i += 1
                    prod_i *= in_shape[i]
                    in_dims[i].append(f)
                else:
                    j += 1
                    prod_j *= out_shape[j]
                    out_dims[j].append(f)
            rem_i = rem_j = 1
            continue
        f = b.new(g)
        in_dims[i].append(f)
        out_dims[j].append(f)
        rem_i //= g
        rem_j //= g
    return in_dims, out_dims


def stride_of(rule, fs, f) -> int:
    """Product of the sizes of the factors before f in a dim's factor list (1 when f is the major factor)."""
    s = 1
    for x in fs:
        if x == f:
            return s
        s *= rule.factors[x].size
    return s


def minor_of(rule, fs, f) -> int:
    """Product of the sizes of the factors after f in a dim's factor list: positions of the dim per position of f
    (1 when f is the minor factor)."""
    out = 1
    for x in fs[fs.index(f) + 1:]:
        out *= rule.factors[x].size
    return out
