"""Finding a model's structure in its captured graph, for presets that work on models they have never seen:
column-parallel / row-parallel linear pairs (nn.Linear or HF Conv1D weights, fused q/k/v projections, gated MLPs),
their weights' layouts, and embedding tables.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract import META_NAME, META_ROLE, forward_nodes
from ..capture.linears import _CASTS, _RESHAPES, _linear, is_param_cast, linear_weight, param_source, source  # noqa: F401
from ..capture.lora import adapter_ends, lora_adapters
from ..rules import tags

aten = torch.ops.aten

_VIEWS = tags.ops("moves_data")
_MIXERS = tags.ops("mixes_positions")
_STOP = tags.ops("ends_layer")


# ops that move a value's dims without touching its elements (between a fused projection's reshape and its select)
_MOVES = tags.ops("squeeze") | tags.ops("transpose") | _CASTS


def _fused_chunks(node) -> int:
    """Number of equal chunks a linear's output is split into along its features (3 for a fused q/k/v), else 1:
    split into equal parts (HF GPT-2's c_attn), or reshaped to (..., c, F/c) and taken apart by select / unbind
    on the c dim (nn.MultiheadAttention's packed in_proj). A split of a minor part the features were reshaped into
    (CodeGen's (groups, q|v|k)) is not a split of the features: contiguous tiles keep whole groups."""
    x, feats = node, node.meta["val"].shape[-1]
    for _ in range(6):
        users = list(x.users)
        if len(users) != 1:
            return 1
        u = users[0]
        if u.target in (aten.split.Tensor, aten.split_with_sizes.default):
            shape = x.meta["val"].shape
            dim = u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)
            if not len(shape) or dim % len(shape) != len(shape) - 1 or shape[-1] != feats:
                return 1
            outs = [o for o in u.meta["val"]]
            return len(outs) if len({tuple(o.shape) for o in outs}) == 1 else 1
        if u.target in _RESHAPES:
            shape = u.meta["val"].shape
            if len(shape) >= 2 and shape[-1] != feats and shape[-2] * shape[-1] == feats \
                    and _taken_apart(u, shape[-2]):
                return shape[-2]
        if u.target is not aten.add.Tensor and u.target not in _RESHAPES and u.target not in _CASTS:
            return 1
        x = u
    return 1


def _taken_apart(node, c: int) -> bool:
    """Is `node`'s value, past moves of its dims, taken apart into its c parts by select / unbind on a dim of
    size c?"""
    x = node
    for _ in range(6):
        users, shape = list(x.users), x.meta["val"].shape
        if len(users) == 1 and users[0].target is aten.unbind.int and shape[users[0].args[1]] == c:
            return True
        if len(users) == c and all(u.target is aten.select.int and shape[u.args[1]] == c for u in users):
            return True
        if len(users) != 1 or users[0].target not in _MOVES:
            return False
        x = users[0]
    return False


def _heads(node, chunks: int) -> int | None:
    """Attention heads in each chunk of a linear's output: found at the reshape that splits a chunk's f features
    into (heads, head_dim) (or (batch * heads, head_dim), as nn.MultiheadAttention folds them), following the
    output through its bias add, reshapes, dim moves and the chunks' split / select; a reshape to (..., 1, f) is
    one head (multi-query K/V). None: the features never meet a head reshape (an MLP's hidden features)."""
    import operator

    f = node.meta["val"].shape[-1] // chunks
    stack, seen = [node], set()
    while stack:
        x = stack.pop()
        for u in x.users:
            if u in seen or len(seen) > 64:
                continue
            seen.add(u)
            if u.target in _RESHAPES or u.target is aten.unsqueeze.default:
                ins, out = x.meta["val"].shape, u.meta["val"].shape
                if len(ins) and ins[-1] == f and len(out) and out[-1] < f and f % out[-1] == 0:
                    return f // out[-1]
                if len(ins) and ins[-1] == f and tuple(out) == tuple(ins[:-1]) + (1, f):
                    return 1
            if u.target in _RESHAPES or u.target in _MOVES or u.target in (
                    aten.add.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.select.int,
                    aten.unbind.int, aten.clone.default, operator.getitem):
                stack.append(u)
    return None


@dataclass(frozen=True)
class Linear:
    """A linear's weight as the forward uses it: which dim holds its output features, how many fused chunks
    (q/k/v) they form, and how many attention heads each chunk has (None where they are not heads)."""

    weight: str
    out_dim: int
    chunks: int = 1
    heads: int | None = None


def linear_layout(captured) -> dict:
    """weight name -> Linear for every linear of the forward."""
    out = {}
    for n in captured.gm.graph.nodes:
        found = _linear(n)
        if found and found[0] not in out:
            chunks = _fused_chunks(n)
            out[found[0]] = Linear(found[0], found[1], chunks, _heads(n, chunks))
    return out


def find_linear_pairs(captured) -> tuple:
    """(column-parallel weights, row-parallel weights), found by structure: a linear whose output reaches another
    linear's input through head reshapes, activations, gating products and attention (but no residual add, norm
    or reduction) is column-parallel; the one it reaches is row-parallel."""
    col, row = [], []
    for c, r in linear_regions(captured):
        col += c
        row += r
    order = {n: i for i, n in enumerate(captured.input_names)}
    return sorted(set(col), key=order.get), sorted(set(row), key=order.get)


def linear_regions(captured) -> list:
    """[(column-parallel weights, row-parallel weights)] per region: the linears whose outputs meet (q, k, v in
    attention; gate and up in SwiGLU) and the linears that region feeds (see find_linear_pairs). A LoRA wrapper is
    its base linear: the adapters' matmuls are no linears of their own, and the adapter branch's output is in its
    base's region, so the wrapper's sum continues it (tactics/lora.py). Read once per captured step
    (graphutil.memo_of_step): a copy of the lists is returned."""
    from ..capture.graphutil import memo_of_step

    return [(list(c), list(r)) for c, r in memo_of_step(captured, "linear_regions", lambda: _regions(captured))]


def _regions(captured) -> list:
    gm = captured.gm
    nodes = list(gm.graph.nodes)
    fwd = forward_nodes(gm)
    rows: list = []            # (row weight, region id)
    regions = _Regions()
    region_of: dict = {}       # node -> region id (find() gives the merged region)
    static = _static_nodes(nodes)
    adapters = {w for ad in lora_adapters(captured) for w in (ad.a, ad.b)}
    ends: dict = {}            # base weight -> its adapter branches' last nodes
    for end, base in adapter_ends(captured).items():
        ends.setdefault(base, []).append(end)
    for n in nodes:
        if n not in fwd:
            continue
        w = linear_weight(n, gm.graph)
        if w is None or w in adapters:
            continue
        if n.args[0] in region_of:
            rows.append((w, region_of[n.args[0]]))
            continue
        # grow the region of this linear's output
        stack = [n]
        region_of[n] = regions.new(w)
        for end in ends.get(w, ()):
            region_of[end] = region_of[n]
        while stack:
            x = stack.pop()
            for u in x.users:
                if u in region_of:
                    regions.union([region_of[u], region_of[x]])
                    continue
                if u not in fwd or u.target in _STOP:
                    continue
                if linear_weight(u, gm.graph) is not None:
                    continue
                if u.target in _VIEWS or u.target in _MIXERS or _is_pointwise_within(u, region_of, fwd, static):
                    region_of[u] = regions.union([region_of[a] for a in u.all_input_nodes if a in region_of])
                    stack.append(u)
    # a region fed by several linears (q, k, v; gate and up): all of them are column-parallel
    order = {n: i for i, n in enumerate(captured.input_names)}
    grouped: dict = {}
    for w, rid in rows:
        root = regions.find(rid)
        grouped.setdefault(root, []).append(w)
    return [(sorted(set(regions.weights(root)), key=order.get), sorted(set(ws), key=order.get))
            for root, ws in grouped.items()]


def linear_weights(captured) -> list:
    """Every linear's weight name in the forward, in parameter order."""
    order = {n: i for i, n in enumerate(captured.input_names)}
    return sorted(set(linear_layout(captured)), key=order.get)


def _static_nodes(nodes) -> set:
    """Nodes computed from parameters, buffers and constants only (rotary tables, masks): not a residual stream."""
    static = set()
    for n in nodes:
        if n.op == "placeholder":
            if n.meta.get(META_ROLE) in ("param", "buffer", "const"):
                static.add(n)
        elif n.op == "call_function" and all(a in static for a in n.all_input_nodes):
            static.add(n)
    return static


def _is_pointwise_within(u, region_of, fwd, static) -> bool:
    import operator

    if u.target is operator.getitem:
        return True
    from ..rules.pointwise import NONLINEAR

    if u.target not in NONLINEAR and u.target not in (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor,
                                                       aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar,
                                                       aten.neg.default, aten.add.Scalar):
        return False
    for a in u.args:
        if isinstance(a, torch.fx.Node) and a not in region_of:
            if a in static:
                continue
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor) and val.numel() <= 1:
                continue
            if a.op == "placeholder" or a in fwd:
                # a residual stream or another branch: the region ends here (unless it is itself a region value
                # of a different linear, e.g. gate * up in SwiGLU)
                return False
    return True


class _Regions:
    """Union-find over the regions grown from linears: co-operands (q, k, v meeting in attention; gate and up in
    SwiGLU) merge their regions in near-constant time, keeping the structure search linear in the graph."""

    def __init__(self):
        self.parent: list = []
        self.members: list = []

    def new(self, weight: str) -> int:
        self.parent.append(len(self.parent))
        self.members.append([weight])
        return len(self.parent) - 1

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, ids: list) -> int:
        roots = list(dict.fromkeys(self.find(i) for i in ids))
        first = roots[0]
        for r in roots[1:]:
            self.parent[r] = first
            self.members[first] += self.members[r]
            self.members[r] = []
        return first

    def weights(self, i: int) -> list:
        return list(self.members[self.find(i)])


def embedding_tables(captured) -> list:
    """Parameters used as the table of an aten.embedding (names), in parameter order."""
    out = []
    for n in captured.gm.graph.nodes:
        if n.target is aten.embedding.default:
            found = param_source(n.args[0])
            if found and not found[1] and found[0].meta[META_NAME] not in out:
                out.append(found[0].meta[META_NAME])
    return out


def output_heads(captured, lay: dict, tables: list) -> list:
    """Linear weights whose output features number the rows of an embedding table in ``tables`` (an untied output
    head: its logits span the vocabulary), in layout order. ``lay``: linear_layout(captured)."""
    shape = {n.meta[META_NAME]: tuple(n.meta["val"].shape) for n in captured.gm.graph.nodes
             if n.op == "placeholder" and META_NAME in n.meta and "val" in n.meta}
    vocab = {shape[t][0] for t in tables if t in shape}
    return [w for w, lin in lay.items() if w not in tables and w in shape and shape[w][lin.out_dim] in vocab]


def forward_uses(node, fwd) -> list:
    """The forward ops that use `node`'s value past views of it (the ops that compute with a parameter)."""
    stack, seen, out = [node], set(), []
    while stack:
        for u in stack.pop().users:
            if u in seen or u not in fwd:
                continue
            seen.add(u)
            if u.target in _VIEWS:
                stack.append(u)
            else:
                out.append(u)
    return out


_EXPERT_USES = tags.ops("selects_experts")


def expert_weights(captured) -> list:
    """Names of stacked expert weights: parameters (E, ., .) with E > 1 whose forward use, past views, is a batched
    matmul over dim 0 or a selection of experts (index_select / indexing), as einsum("...d,edh->...") and per-token
    expert selection trace. Convolution kernels and embeddings are not experts."""
    gm = captured.gm
    fwd = forward_nodes(gm)
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder" or n.meta.get(META_ROLE) != "param":
            continue
        val = n.meta.get("val")
        if val is None or val.dim() != 3 or val.shape[0] <= 1:
            continue
        uses = {u.target for u in forward_uses(n, fwd)}
        if uses & _EXPERT_USES and not uses & {aten.convolution.default}:
            out.append(n.meta[META_NAME])
    return out
