"""Where propagation may tile a factor unevenly (an axis that does not divide it; sharding.chunk_size).

Lowering keeps every rank's shard at the largest chunk with padding at the end of the dim (lower/uneven.py), so a
factor may be tiled unevenly only where that padding stays at the end of every dim holding it: a contiguous split
(not strided), by the last axis of the dim (earlier axes divide it exactly), of a factor that is the major part of
each dim. Where other factors follow it in a dim (a ragged batch B flattened with the sequence into B*T), the dim is
split in whole blocks of their positions (Sharding.blocks: ceil(B / k) blocks of T per rank). Anything else is a
conflict whose reason names the fix (engine.py records it as any other).
"""
from __future__ import annotations

from ..errors import source_location
from ..rules.factors import minor_of


def uneven_axis(rec, c: int, d: int):
    """The axis tiling dim d of canonical value c unevenly (it is then the dim's innermost), else None."""
    size = rec.g.shapes[c][d]
    for a in rec.dim_axes.get((c, d), ()):
        k, m = rec.mesh.shape[a], rec.blocks.get((c, a), 1)
        if (size // m) % k:
            return a
        size //= k
    return None


def slot_refusal(rec, c: int, d: int, axis: str, state: int, block: int):
    """Why dim d of canonical value c (its state `state` on `axis`) cannot take the tiling an op gives it in blocks
    of `block` positions (1: single positions, or even), or None."""
    if state == d and rec.blocks.get((c, axis), 1) != block:
        return f"dim {d} is tiled unevenly in other blocks"
    before = uneven_axis(rec, c, d) if state < 0 else None
    if before is not None and state != d:
        return f"dim {d} is tiled unevenly on axis '{before}' and takes no further axis"
    return None


def factor_block(g, rec, axis: str, i: int, f: int, slots, source, inner: int, done: int) -> tuple:
    """(block, refusal) for tiling factor f of op i on `axis` from neighbour `source`: the block (in positions of
    f) an unevenly tiled source splits it by (1: single positions, or an even source), and why the op cannot be
    tiled unevenly (None when it can; only read when the tiling is uneven)."""
    rule, node = g.ops[i].rule, g.ops[i].node
    factor, k = rule.factors[f], rec.mesh.shape[axis]
    block, why = _source_block(g, rec, axis, rule, node, f, slots, source)
    why = why or _refusal(g, rule, node, f, slots, inner, done, block)
    if why is not None:
        why = (f"a factor of size {factor.size} cannot be tiled unevenly on axis '{axis}' (size {k}): {why}. Make "
               f"the size divisible by {k} (for a batch: drop_last=True in the DataLoader), or tile another dim")
    return block, why


def _source_block(g, rec, axis, rule, node, f, slots, source) -> tuple:
    """The source's own block over the factors minor to f in its dim, and why the op splits those blocks."""
    m = rec.blocks.get((g.canon[source], axis), 1)
    if m == 1:
        return 1, None
    fs = next(dims[d] for _, _, dims, vid in slots if vid == source for d in range(len(dims)) if f in dims[d])
    minor = minor_of(rule, fs, f)
    if fs[0] != f or m % minor:
        return 1, (f"{g.name(source)} is split in blocks of {m} positions, and {node.target} splits those blocks "
                   f"(its dim holds factors of sizes {[rule.factors[x].size for x in fs]}), so padding would sit "
                   f"inside the dim")
    return m // minor, None


def _refusal(g, rule, node, f, slots, inner, done, block):
    """Why f cannot be split with its padding at the end of every dim holding it, or None."""
    factor = rule.factors[f]
    merged = [(g.name(vid), d, tuple(g.shapes[vid])) for _, _, dims, vid in slots
              for d, fs in enumerate(dims) if f in fs and fs[0] != f]
    if inner > 1:
        return "the tiling is strided (a minor part of a merged dim)"
    if factor.size % done:
        return f"an earlier axis already splits it {done} ways unevenly"
    if done > 1 and block > 1:
        return f"an earlier axis already splits it {done} ways and it is split in blocks"
    if merged:
        where = source_location(node)
        return (f"{node.target}{' at ' + where if where else ''} merges it with other dims (dim {merged[0][1]} of "
                f"{merged[0][0]}, shape {merged[0][2]}), so padding would sit inside the merged dim")
    return None
