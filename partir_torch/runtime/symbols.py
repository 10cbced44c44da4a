"""Which input sizes are symbols (issue 40): declared with Options(dynamic=...), or learned from the second distinct
size of a dim, and the sizes a fit builds its programs at.

    Options(dynamic={"inputs.0": {1: "seq"}, "inputs.1": {1: "seq"}})   # the batch dim (0) is a symbol too,
                                                                         # "batch", unless declared {0: None}

A Symbols value maps (input index, dim) positions to a symbol name; a signature's sizes under it are one size per
name (None where the signature differs from the first program's elsewhere, or where the positions of one name
differ). runtime/dims.py fits the programs of a Symbols as one program in those sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import PartitionError
from .shapes import show

BATCH = "batch"


@dataclass(frozen=True)
class Symbols:
    """((input index, dim), name) pairs, sorted; names in order of first appearance."""

    where: tuple

    @property
    def names(self) -> tuple:
        return tuple(dict.fromkeys(n for _, n in self.where))

    @property
    def positions(self) -> dict:
        return dict(self.where)

    def sizes(self, first_sig: tuple, sig: tuple) -> tuple | None:
        """sig's size per name, or None (sig is no point of these symbols)."""
        if len(sig) != len(first_sig):
            return None
        pos, got = self.positions, {}
        for i, ((shape, dtype), (was, was_dtype)) in enumerate(zip(sig, first_sig)):
            if dtype != was_dtype or len(shape) != len(was):
                return None
            for d, (n, m) in enumerate(zip(shape, was)):
                name = pos.get((i, d))
                if name is None:
                    if n != m:
                        return None
                elif got.setdefault(name, n) != n:
                    return None
        return tuple(got[n] for n in self.names)

    def signature(self, first_sig: tuple, sizes: tuple) -> tuple:
        """first_sig with each symbol's positions at its size in `sizes`."""
        at = dict(zip(self.names, sizes))
        pos = self.positions
        return tuple((tuple(at[pos[(i, d)]] if (i, d) in pos else n for d, n in enumerate(shape)), dtype)
                     for i, (shape, dtype) in enumerate(first_sig))

    def __str__(self):
        return "; ".join(f"{n}: " + ", ".join(f"inputs.{i} dim {d}" for (i, d), m in self.where if m == n)
                         for n in self.names)


def batch_positions(first_sig: tuple) -> dict:
    """The batch dim by default: dim 0 of every input whose dim 0 has inputs.0's size."""
    if not first_sig or not first_sig[0][0]:
        return {}
    b = first_sig[0][0][0]
    return {(i, 0): BATCH for i, (shape, _) in enumerate(first_sig) if shape and shape[0] == b}


def declared(spec: dict, first_sig: tuple) -> Symbols:
    """Options.dynamic checked against the example inputs' signature: a PartitionError naming the input, the dim
    and the fix for an unknown input, a dim out of range, or one name on dims of different sizes."""
    where = {}
    static = set()
    for key, dims in spec.items():
        i = int(key.split(".")[1]) if key.startswith("inputs.") and key.split(".")[1].isdigit() else None
        if i is None or i >= len(first_sig):
            have = ", ".join(f"inputs.{j} {tuple(s)}" for j, (s, _) in enumerate(first_sig))
            raise PartitionError(f"partition: dynamic= names {key!r}, and the example inputs are {have}. Name an "
                                 f"input as 'inputs.<i>' (its index in example_inputs, flattened).")
        shape = first_sig[i][0]
        for d, name in dims.items():
            if not -len(shape) <= d < len(shape):
                raise PartitionError(f"partition: dynamic= marks dim {d} of {key}, which has shape {tuple(shape)} "
                                     f"({len(shape)} dims). Use a dim in 0..{len(shape) - 1}.")
            d %= len(shape)
            if name is None:
                static.add((i, d))
            else:
                where[(i, d)] = name
    for pos, name in batch_positions(first_sig).items():
        if pos not in static and pos not in where:
            where[pos] = BATCH
    sizes: dict = {}
    for (i, d), name in sorted(where.items()):
        n = first_sig[i][0][d]
        was = sizes.setdefault(name, ((i, d), n))
        if was[1] != n:
            raise PartitionError(f"partition: dynamic= names dim {d} of inputs.{i} (size {n}) and dim {was[0][1]} "
                                 f"of inputs.{was[0][0]} (size {was[1]}) both {name!r}; one name is one size in "
                                 f"every batch. Give them different names, or fix the example inputs "
                                 f"[{show(first_sig)}].")
    return Symbols(tuple(sorted(where.items())))


def learned(first_sig: tuple, sig: tuple, known: Symbols | None, batch: bool) -> Symbols | None:
    """The symbols a new signature makes: each group of positions that differ from first_sig by the same pair of
    sizes is one symbol (named "batch" when all are dim 0, else "s", "s2", ...), with the known symbols and, when
    `batch`, the batch dim by default; None where sig has another rank or dtype."""
    if len(sig) != len(first_sig):
        return None
    groups: dict = {}
    for i, ((shape, dtype), (was, was_dtype)) in enumerate(zip(sig, first_sig)):
        if dtype != was_dtype or len(shape) != len(was):
            return None
        for d, (n, m) in enumerate(zip(shape, was)):
            if n != m:
                groups.setdefault((m, n), []).append((i, d))
    where = dict(known.where) if known is not None else {}
    if any(len({where.get(p) for p in pos}) > 1 or (where.get(pos[0]) is not None and
                                                    len(pos) != sum(n == where[pos[0]] for n in where.values()))
           for pos in groups.values()):
        where = {}            # a group across known symbols: the symbols again from the differences alone
    for pos in groups.values():
        if where.get(pos[0]) is not None:
            continue          # a known symbol
        taken = set(where.values())
        name = BATCH if all(d == 0 for _, d in pos) and BATCH not in taken else \
            next(n for n in ("s", *(f"s{k}" for k in range(2, 99))) if n not in taken)
        where.update({p: name for p in pos})
    if batch and BATCH not in where.values():
        where.update({p: BATCH for p in batch_positions(first_sig) if p not in where})
    return Symbols(tuple(sorted(where.items())))


def candidates(v0: int, v1: int | None, step: int) -> list:
    """Sizes a fit may build at, best first: with v1 (a second size seen), the midpoint of v0 and v1 where it is a
    multiple of `step` from both, then the progression of v0 and v1 (it keeps what the mesh divides); without, v0
    plus or minus multiples of `step` (the mesh's size times the micro-batches). All >= 2 (0 and 1 are never
    symbols). The midpoint first: a point between sizes seen is the least likely to sit where the model's graph
    changes at a guard's edge (a position table sliced to its full length, T = 64 of 64 rows, is no slice at all)."""
    d = (v1 - v0) if v1 is not None else step
    mid = [(v0 + v1) // 2] if v1 is not None and (v1 - v0) % (2 * step) == 0 else []
    out = [v0 + k * d for k in (1, -1, 2, -2, 3, -3)] if v1 is None else \
        mid + [v1 + d, v0 - d, v1 + 2 * d, v0 - 2 * d, v1 + 3 * d]
    return [v for v in dict.fromkeys(out) if v >= 2 and v not in (v0, v1)]


def resized_batch(batch, sig: tuple):
    """batch (a pytree of tensors) with each input at its shape in sig, its values repeated along each resized dim
    (index i of a dim reads i modulo the old size): real, valid values (token ids stay ids) for a program a fit
    builds at sizes not seen."""
    flat, spec = tree_flatten(batch)
    out = []
    for x, (shape, _) in zip(flat, sig):
        for d, n in enumerate(shape):
            if x.shape[d] != n:
                x = x.index_select(d, torch.arange(n, device=x.device) % x.shape[d])
        out.append(x)
    return tree_unflatten(out, spec)
