"""Causal load balancing for context parallelism: the zigzag layout as a permutation of the sequence.

    schedule = [T.context_parallel("cp", load_balance=True)]

With the sequence of length S cut into 2n chunks of c = S / 2n, rank r of the CP axis (size n) holds chunks r and
2n-1-r (lower/zigzag.py), so that under a causal mask every rank sees the same number of key blocks. The layout is
a permutation applied once, so that the rest of the program is an ordinary contiguous tiling of the permuted
sequence:

- the runtime lays each sequence input (ids, labels, masks, positions given by the caller) out in zigzag order
  before tiling it (runtime/call.py reads the mark META_ZIGZAG this rewrite leaves on their placeholders);
- the program computes on the permuted sequence, so whatever depends on the ORDER of positions is rewritten at
  capture to use each element's original position: every arange(S) (HF's cache_position, position ids and the
  query and key indices of its masks) becomes the original positions in zigzag order, so rotary tables and masks
  are right; the causal-LM label shift (pad + slice [1:]) becomes a lookup of the label at the next ORIGINAL
  position (an index_select of the padded labels);
- SDPA's causal kernel, tiled, runs lower/zigzag.py's blocks (2 diagonal and 2n-1 visible c x c blocks per rank,
  allgather or ring), which address the gathered keys in zigzag order;
- a train step's outputs (loss, gradients) do not depend on the order of positions; a sequence-dim output would.

The loss is a sum over positions divided by their count, so it equals one device's up to summation order.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.fx as fx

from ..contract import META_ZIGZAG
from ..errors import PartitionError
from ..rules import tags

aten = torch.ops.aten


def _node(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    """graph.call_function with its meta value computed from its arguments' (fake) values."""
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    node = graph.call_function(target, tuple(args), kwargs)
    node.meta["val"] = target(*vals, **kwargs)
    return node


def _floor(g, x, c: int):
    return _node(g, aten.div.Tensor_mode, x, c, rounding_mode="floor")


def _original(g, p, n: int, c: int):
    """The original position of storage position p (zigzag order): chunk r or 2n-1-r of rank r = p // 2c."""
    q = _floor(g, p, c)                                          # the storage chunk: 2 r + slot
    rank, hi = _floor(g, q, 2), _node(g, aten.remainder.Scalar, q, 2)
    flip = _node(g, aten.rsub.Scalar, _node(g, aten.mul.Scalar, rank, 2), 2 * n - 1)     # 2n-1-2r
    chunk = _node(g, aten.add.Tensor, rank, _node(g, aten.mul.Tensor, hi, flip))
    within = _node(g, aten.sub.Tensor, p, _node(g, aten.mul.Scalar, q, c))
    return _node(g, aten.add.Tensor, _node(g, aten.mul.Scalar, chunk, c), within)


def _storage(g, o, n: int, c: int, length: int):
    """The storage position of original position o (o == length, the pad after the last: length)."""
    chunk = _floor(g, o, c)
    hi = _node(g, aten._to_copy.default, _node(g, aten.ge.Scalar, chunk, n), dtype=o.meta["val"].dtype)
    flip = _node(g, aten.rsub.Scalar, _node(g, aten.mul.Scalar, chunk, 2), 2 * n - 1)    # 2n-1-2j
    rank = _node(g, aten.add.Tensor, chunk, _node(g, aten.mul.Tensor, hi, flip))
    slot_start = _node(g, aten.mul.Scalar, _node(g, aten.add.Tensor, _node(g, aten.mul.Scalar, rank, 2), hi), c)
    st = _node(g, aten.add.Tensor, slot_start, _node(g, aten.sub.Tensor, o, _node(g, aten.mul.Scalar, chunk, c)))
    end = _node(g, aten.eq.Scalar, o, length)
    return _node(g, aten.where.self, end, _node(g, aten.full_like.default, st, length), st)


def _is_positions(node: fx.Node, length: int) -> bool:
    """arange(length) or arange(0, length) (step 1)."""
    if node.op != "call_function" or not tags.has(node.target, "arange"):
        return False
    start, end, step = ((0, node.args[0], 1) if node.target is aten.arange.default
                        else (node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else 1))
    return (start, end, step) == (0, length, 1)


def _labels_of(x: fx.Node) -> fx.Node | None:
    """The integer placeholder whose last dim x is: itself, or a microbatch of it (the pipeline's capture views the
    batch as (microbatches, B / m, S), then selects and clones one): views that keep the last dim, selects of another
    dim. None otherwise."""
    while x.op != "placeholder":
        if not tags.has(x.target, "microbatch_view") or not isinstance(x.args[0], fx.Node):
            return None
        src, val = x.args[0].meta["val"], x.meta["val"]
        if x.target is aten.select.int and x.args[1] % src.dim() == src.dim() - 1:
            return None
        if src.dim() == 0 or val.dim() == 0 or src.shape[-1] != val.shape[-1]:
            return None
        x = x.args[0]
    return x


def _label_slices(gm, seq_dim: int) -> list:
    """HF's label shift: slice(constant_pad_nd(labels (B, S) integer placeholder or a microbatch of it, [0, 1]),
    seq_dim, 1, end)."""
    out = []
    for pad in gm.graph.nodes:
        if pad.target is not aten.constant_pad_nd.default or not isinstance(pad.args[0], fx.Node):
            continue
        src = _labels_of(pad.args[0])
        if src is None or src.meta["val"].is_floating_point() or list(pad.args[1]) != [0, 1]:
            continue
        out += [u for u in pad.users if u.target is aten.slice.Tensor and u.args[1] % src.meta["val"].dim() ==
                seq_dim % src.meta["val"].dim() and u.args[2] == 1]
    return out


def _descendants(nodes) -> set:
    seen, work = set(), list(nodes)
    while work:
        x = work.pop()
        if x not in seen:
            seen.add(x)
            work += list(x.users)
    return seen


def _index_by_storage(g, positions: list, laid: set, n: int, c: int, length: int) -> list:
    """An original position (a value computed from the rewritten aranges) that indexes a dim of the sequence
    length of a value computed from the laid-out inputs (HF's padding mask looks attention_mask up at the key
    indices) is mapped to where that position is stored. A table that is not (a rotary cache indexed by position)
    keeps the original positions."""
    derived, done = _descendants(positions), []
    for node in [x for x in g.nodes if x in derived and x.op == "call_function"]:
        src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if node.target is aten.index.Tensor:
            slots = [(d, ix) for d, ix in enumerate(node.args[1]) if ix in derived]
        elif node.target is aten.index_select.default:
            slots = [(node.args[1], node.args[2])] if node.args[2] in derived else []
        else:
            continue
        for d, ix in slots:
            if src not in laid or src.meta["val"].shape[d] != length:
                continue
            with g.inserting_before(node):
                at = _storage(g, ix, n, c, length)
            node.replace_input_with(ix, at)
            done.append(f"{node.name}: indexes dim {d} of {src.name} at the storage of the original positions")
    return done


def _order_dependent(node: fx.Node, length: int) -> int | None:
    """The dim of the sequence length on which `node` depends on the order of positions (a partial slice, a pad, a
    cumsum, a roll, a flip, a cat), else None."""
    t, args = node.target, node.args
    val = args[0].meta.get("val") if args and isinstance(args[0], fx.Node) else None
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    dims = []
    if t is aten.slice.Tensor:
        d = args[1] if len(args) > 1 else 0
        start, end = (args[2] if len(args) > 2 else 0) or 0, args[3] if len(args) > 3 else None
        dims = [d] if start != 0 or (end is not None and end < shape[d]) else []
    elif t is aten.constant_pad_nd.default:
        dims = [len(shape) - 1 - i // 2 for i, p in enumerate(args[1]) if p]
    elif t in tags.ORDER_DIM_ARG:
        d = args[tags.ORDER_DIM_ARG[t]]
        dims = list(d) if isinstance(d, (list, tuple)) else [d]
    elif t is aten.cat.default:
        d = args[1] if len(args) > 1 else 0
        shape = tuple(node.meta["val"].shape)
        parts = [x for x in args[0] if x.meta["val"].dim() == len(shape) and x.meta["val"].shape[d] > 0]
        dims = [d] if len(parts) > 1 else []
    return next((d % len(shape) for d in dims if shape and shape[d % len(shape)] == length), None)


def _live(g) -> set:
    """The nodes the step's outputs read (a value nobody reads, such as a KV cache's window kept for decoding that
    a training step drops, is not refused)."""
    seen, work = set(), [x for x in g.nodes if x.op == "output"]
    while work:
        x = work.pop()
        if x not in seen:
            seen.add(x)
            work += x.all_input_nodes
    return seen


def _refuse_order_dependent(g, name: str, axis: str, n: int, length: int, label_pads: set) -> None:
    from ..errors import source_location

    live = _live(g)
    for node in g.nodes:
        if node.op != "call_function" or node in label_pads or node not in live:
            continue
        d = _order_dependent(node, length)
        if d is not None:
            raise PartitionError(
                f"{name}: load_balance=True computes on the sequence in zigzag order (axis '{axis}', size {n}), and "
                f"{node.format_node()} at {source_location(node) or 'the step'} depends on the order of dim {d} "
                f"(size {length}, the sequence): only positions (arange), HF's label shift (pad + slice [1:] of the "
                f"labels) and lookups at positions are rewritten for it (a document mask found from position_ids "
                f"that restart, packed sequences, is not). Use load_balance=False (plain CP gathers what this op "
                f"needs: exact), or, for a label shift of your own, shift the labels the way the model's own loss "
                f"does (labels=).")


def rewrite(cap, name: str, axis: str, seq_dim: int, n: int) -> list:
    """Rewrite the captured step for the zigzag layout on an axis of size n (see the module docstring). Returns
    what it did, one line each (the tactic says it)."""
    gm = cap.gm
    phs = [cap.names[x] for x in cap.input_names if x.startswith("inputs.")]
    shapes = {p: tuple(p.meta["val"].shape) for p in phs}
    lengths = Counter(s[seq_dim] for s in shapes.values() if len(s) > seq_dim)
    if not lengths:
        raise PartitionError(f"{name}: no input has a dim {seq_dim} (seq_dim) to lay out in zigzag order on axis "
                             f"'{axis}' (size {n}). Pass seq_dim=.")
    length = lengths.most_common(1)[0][0]
    if length % (2 * n):
        fit = -(-length // (2 * n)) * 2 * n
        raise PartitionError(f"{name}: load_balance=True cuts the sequence length {length} into 2 x {n} chunks "
                             f"(axis '{axis}', size {n}): {2 * n} does not divide {length}. Use a sequence length "
                             f"divisible by {2 * n} (e.g. {fit}, padding with the model's pad token and "
                             f"ignore_index labels).")
    c, g, done = length // (2 * n), gm.graph, []
    for p, s in shapes.items():
        if len(s) > seq_dim and s[seq_dim] == length:
            p.meta[META_ZIGZAG] = (seq_dim, n)
    positions = []
    for node in [x for x in g.nodes if _is_positions(x, length)]:
        users = list(node.users)
        with g.inserting_before(node.next):
            positions.append(_original(g, node, n, c))
        for u in users:
            u.replace_input_with(node, positions[-1])
        done.append(f"arange({length}) {node.name}: original positions")
    laid = _descendants([p for p, s in shapes.items() if len(s) > seq_dim and s[seq_dim] == length])
    done += _index_by_storage(g, positions, laid, n, c, length)
    label_slices = _label_slices(gm, seq_dim)
    _refuse_order_dependent(g, name, axis, n, length, {x for sl in label_slices for x in (sl, sl.args[0])})
    for sl in label_slices:
        with g.inserting_before(sl.next):
            p = g.call_function(aten.arange.default, (length,), {"dtype": torch.long, "device": sl.meta["val"].device})
            with sl.meta["val"].fake_mode:
                p.meta["val"] = torch.arange(length, dtype=torch.long, device=sl.meta["val"].device)
            nxt = _storage(g, _node(g, aten.add.Scalar, _original(g, p, n, c), 1), n, c, length)
            shifted = _node(g, aten.index_select.default, sl.args[0], seq_dim, nxt)
        sl.replace_all_uses_with(shifted)
        g.erase_node(sl)
        done.append(f"label shift {sl.name}: the label at the next original position")
    g.lint()
    gm.recompile()
    gm.meta[META_ZIGZAG] = {"axis": axis, "n": n, "done": tuple(done)}
    return done

