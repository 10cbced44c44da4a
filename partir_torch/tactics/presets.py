"""Preset tactics: each returns a tactic (an object with .name, .axis and .apply(ctx)).

- data_parallel (BP): the batch dim of every input.
- megatron (MP): column-parallel then row-parallel linears, found by structure (see find_linear_pairs) or given
  by a plan; heads and hidden activations follow by propagation.
- zero (Z1/Z2/Z3): optimizer state (Z1, Z2) and parameters (Z3) tiled, decided inside the optimizer update only,
  so parameters are gathered where the forward and backward use them.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch

from ..capture.graphutil import descendants, forward_nodes
from ..errors import PartitionError
from ..propagate.engine import VIEW_OPS
from ..propagate.state import REPLICATED as REP, UNKNOWN
from .manual import ManualPartition

aten = torch.ops.aten


@dataclass(frozen=True)
class DataParallel:
    """BP: tile the batch dim of every input on `axis`. By default the batch dim is dim 0 of each input whose
    dim 0 has the batch size (the dim-0 size most inputs share); other inputs (a graph's edge list (2, E), a
    shared mask) stay whole. dims: {input index: dim or None} overrides per input."""

    axis: str = "batch"
    dims: dict | None = None
    name: str = "BP"

    def seeds(self, ctx) -> list:
        inputs = sorted((n for n in ctx.value_names() if n.startswith("inputs.")), key=lambda n: int(n.split(".")[1]))
        shapes = {n: ctx.value_meta(n)["shape"] for n in inputs}
        sizes = [s[0] for s in shapes.values() if s]
        batch = max(set(sizes), key=sizes.count) if sizes else None
        out = []
        for n in inputs:
            i = int(n.split(".")[1])
            if self.dims and i in self.dims:
                d = self.dims[i]
            else:
                d = 0 if shapes[n] and shapes[n][0] == batch else None
            if d is not None:
                out.append((n, d % len(shapes[n])))
        if not out:
            raise PartitionError(f"{self.name}: no input has a batch dim to tile on axis '{self.axis}'.")
        return out

    def apply(self, ctx) -> None:
        ctx.mesh.check_axis(self.axis, self.name)
        ctx.seed_and_propagate(self.axis, self.seeds(ctx), self.name)


def data_parallel(axis: str = "batch", dims: dict | None = None, name: str = "BP") -> DataParallel:
    """Tile the batch dim of every input on `axis` (see DataParallel)."""
    return DataParallel(axis, dims, name)


# -- Megatron ------------------------------------------------------------------------------------------------------
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
          aten.transpose.int, aten.t.default, aten.expand.default, aten.clone.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor,
          aten.cat.default, aten.contiguous.default, aten._to_copy.default, aten.alias.default}
_MIXERS = {aten._scaled_dot_product_flash_attention_for_cpu.default, aten.bmm.default, aten._softmax.default,
           aten._safe_softmax.default, aten.where.self, aten.masked_fill.Scalar, aten.tril.default}
_STOP = {aten.native_layer_norm.default, aten.sum.dim_IntList, aten.amax.default, aten.mean.dim, aten.sum.default,
         aten.native_group_norm.default, aten.embedding.default}


def _linear(node):
    """(W's name, W's output-feature dim) if `node` is a linear: mm(x, t(W)) (nn.Linear, W is (out, in)) or
    mm(x, W) (Hugging Face's Conv1D, W is (in, out)), W a parameter placeholder; else None."""
    if node.target is not aten.mm.default:
        return None
    w = node.args[1]
    if getattr(w, "target", None) is aten.t.default and w.args[0].op == "placeholder" \
            and w.args[0].meta.get("partir_role") == "param":
        return w.args[0].meta["partir_name"], 0
    if w.op == "placeholder" and w.meta.get("partir_role") == "param" and len(w.meta["val"].shape) == 2:
        return w.meta["partir_name"], 1
    return None


def _linear_weight(node, graph=None):
    found = _linear(node)
    return found[0] if found else None


def _fused_chunks(node) -> int:
    """Number of equal chunks a linear's output is split into along its features (3 for a fused q/k/v), else 1."""
    x = node
    for _ in range(4):
        users = list(x.users)
        if len(users) != 1:
            return 1
        u = users[0]
        if u.target in (aten.split.Tensor, aten.split_with_sizes.default):
            outs = [o for o in u.meta["val"]]
            return len(outs) if len({tuple(o.shape) for o in outs}) == 1 else 1
        if u.target not in (aten.add.Tensor, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            return 1
        x = u
    return 1


def linear_layout(captured) -> dict:
    """weight name -> (output-feature dim, fused chunks) for every linear of the forward."""
    out = {}
    for n in captured.gm.graph.nodes:
        found = _linear(n)
        if found and found[0] not in out:
            out[found[0]] = (found[1], _fused_chunks(n))
    return out


def find_linear_pairs(captured) -> tuple:
    """(column-parallel weights, row-parallel weights), found by structure: a linear whose output reaches another
    linear's input through head reshapes, activations, gating products and attention (but no residual add, norm
    or reduction) is column-parallel; the one it reaches is row-parallel."""
    gm = captured.gm
    nodes = list(gm.graph.nodes)
    out = next(n for n in nodes if n.op == "output")
    fwd = forward_nodes(gm) if captured.mode != "forward" else set(nodes)
    col, row = [], []
    regions = _Regions()
    region_of: dict = {}       # node -> region id (find() gives the merged region)
    static = _static_nodes(nodes)
    for n in nodes:
        if n not in fwd:
            continue
        w = _linear_weight(n, gm.graph)
        if w is None:
            continue
        if n.args[0] in region_of:
            row.append(w)
            col.extend(regions.weights(region_of[n.args[0]]))
            continue
        # grow the region of this linear's output
        stack = [n]
        region_of[n] = regions.new(w)
        while stack:
            x = stack.pop()
            for u in x.users:
                if u in region_of:
                    regions.union([region_of[u], region_of[x]])
                    continue
                if u not in fwd or u.target in _STOP:
                    continue
                if _linear_weight(u, gm.graph) is not None:
                    continue
                if u.target in _VIEWS or u.target in _MIXERS or _is_pointwise_within(u, region_of, fwd, static):
                    region_of[u] = regions.union([region_of[a] for a in u.all_input_nodes if a in region_of])
                    stack.append(u)
    # a region fed by several linears (q, k, v; gate and up): all of them are column-parallel
    order = {n: i for i, n in enumerate(captured.input_names)}
    return sorted(set(col), key=order.get), sorted(set(row), key=order.get)


def _static_nodes(nodes) -> set:
    """Nodes computed from parameters, buffers and constants only (rotary tables, masks): not a residual stream."""
    static = set()
    for n in nodes:
        if n.op == "placeholder":
            if n.meta.get("partir_role") in ("param", "buffer"):
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


def _embedding_tables(captured) -> list:
    """Parameters used as the table of an aten.embedding (names), in parameter order."""
    out = []
    for n in captured.gm.graph.nodes:
        if n.target is aten.embedding.default:
            w = n.args[0]
            if w.op == "placeholder" and w.meta.get("partir_role") == "param" and w.meta["partir_name"] not in out:
                out.append(w.meta["partir_name"])
    return out


@dataclass(frozen=True)
class Megatron:
    """Megatron tensor parallelism on `axis`. plan: {FQN glob: "colwise" | "rowwise" | "vocab"} overrides
    detection. vocab=True also tiles the embedding tables on the vocabulary (a tied output projection then
    produces vocabulary-tiled logits and the cross-entropy runs vocabulary-parallel)."""

    axis: str = "model"
    plan: dict | None = None
    name: str = "MP"
    vocab: bool = False

    def decompositions(self) -> dict:
        from ..capture.decompositions import softmax_decompositions

        return softmax_decompositions() if self.vocab or any(v == "vocab" for v in (self.plan or {}).values()) \
            else {}

    def seeds(self, ctx) -> list:
        names = set(ctx.value_names())
        vocab = []
        if self.plan:
            col, row = [], []
            for glob, kind in self.plan.items():
                hits = [n[len("params."):] for n in names if n.startswith("params.")
                        and fnmatch.fnmatchcase(n[len("params."):], glob) and n.endswith("weight")]
                if kind not in ("colwise", "rowwise", "vocab"):
                    raise PartitionError(f"{self.name}: plan value {kind!r} for {glob!r} must be 'colwise', "
                                         f"'rowwise' or 'vocab'.")
                if not hits:
                    raise PartitionError(f"{self.name}: plan entry {glob!r} matches no parameter weight.")
                {"colwise": col, "rowwise": row, "vocab": vocab}[kind].extend(f"params.{h}" for h in hits)
        else:
            col, row = find_linear_pairs(ctx.captured)
        if not col:
            raise PartitionError(f"{self.name}: found no column-parallel/row-parallel linear pair in this model "
                                 f"(a linear feeding another through activations or attention). Pass "
                                 f"plan={{'<fqn glob>': 'colwise' | 'rowwise'}}.")
        if self.vocab and not self.plan:
            vocab = _embedding_tables(ctx.captured)
        lay = linear_layout(ctx.captured)
        seeds = []
        for w in col:   # output features; a fused q/k/v output is tiled strided, so each chunk keeps its heads
            out_dim, chunks = lay.get(w, (0, 1))
            seeds.append((w, out_dim, chunks))
            bias = w[:-len("weight")] + "bias"
            if bias in names:
                seeds.append((bias, 0, chunks))
        seeds += [(w, 1 - lay.get(w, (0, 1))[0]) for w in row] + [(w, 0) for w in vocab]
        return seeds

    def apply(self, ctx) -> None:
        ctx.mesh.check_axis(self.axis, self.name)
        ctx.seed_and_propagate(self.axis, self.seeds(ctx), self.name)


def megatron(axis: str = "model", plan: dict | None = None, name: str = "MP", vocab: bool = False) -> Megatron:
    return Megatron(axis, plan, name, vocab)


@dataclass(frozen=True)
class EmbeddingSharding:
    """EMB: every embedding table tiled on `axis`, on the vocabulary (dim="vocab": masked local lookups, partial
    sums) or the feature dim (dim="feature": each rank looks up its slice of every row)."""

    axis: str = "model"
    dim: str = "vocab"
    name: str = "EMB"

    def __post_init__(self):
        if self.dim not in ("vocab", "feature"):
            raise PartitionError(f"embedding: dim must be 'vocab' or 'feature', got {self.dim!r}.")

    def decompositions(self) -> dict:
        from ..capture.decompositions import softmax_decompositions

        return softmax_decompositions() if self.dim == "vocab" else {}

    def apply(self, ctx) -> None:
        ctx.mesh.check_axis(self.axis, self.name)
        tables = _embedding_tables(ctx.captured)
        if not tables:
            raise PartitionError(f"{self.name}: the model has no embedding table (aten.embedding on a parameter).")
        d = 0 if self.dim == "vocab" else 1
        ctx.seed_and_propagate(self.axis, [(t, d) for t in tables], self.name)


def embedding(axis: str = "model", dim: str = "vocab", name: str = "EMB") -> EmbeddingSharding:
    return EmbeddingSharding(axis, dim, name)


# -- sequence parallelism ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SequenceParallel:
    """Sequence parallelism (Korthikanti et al. 2022) on the tensor-parallel axis: the activations entering each
    column-parallel region are tiled on their sequence dim. Propagation carries the tiling through the norms,
    dropout and residual adds; the row-parallel all_reduce becomes a reduce_scatter (partial -> seq-tiled) and
    the column-parallel input an all_gather, with no rule that knows about either."""

    axis: str = "model"
    seq_dim: int = 1
    name: str = "SP"

    def apply(self, ctx) -> None:
        ctx.mesh.check_axis(self.axis, self.name)
        col, _ = find_linear_pairs(ctx.captured)
        if not col:
            raise PartitionError(f"{self.name}: sequence parallelism needs Megatron-style linear pairs; found none.")
        col_names = set(col)
        seeds, seen = [], set()
        for n in ctx.captured.gm.graph.nodes:
            w = _linear_weight(n, None)
            if w not in col_names:
                continue
            x = n.args[0]
            if x.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
                x = x.args[0]
            shape = x.meta["val"].shape
            if x in seen or len(shape) <= self.seq_dim:
                continue
            seen.add(x)
            if ctx.prop.state(self.axis, ctx.graph.vid[x]) == UNKNOWN:
                seeds.append((x, self.seq_dim))
        ctx.seed_nodes_and_propagate(self.axis, seeds, self.name)


def sequence_parallel(axis: str = "model", seq_dim: int = 1, name: str = "SP") -> SequenceParallel:
    return SequenceParallel(axis, seq_dim, name)


# -- expert parallelism and multi-query attention ------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertParallel:
    """EP: stacked expert weights (parameters of rank >= 3 whose dim 0 counts the experts, e.g. w1 (E, d, h))
    tiled on dim 0 of `axis`. A dense model raises a PartitionError.

    Models that move tokens into per-expert buffers (GShard's capacity dispatch: (groups, E, C, d)) get token
    exchange: the expert region (every op whose operands and results all carry the expert dim: the expert
    matmuls, their backward, the experts' optimizer update) is decided first and sealed; then the token groups
    (the batch dim of the inputs) are tiled on the same axis, so the dense layers run data parallel on it, the
    dispatch and combine einsums run on local groups, and the buffers move between tiled(groups) and
    tiled(experts) by one all_to_all each way (two forward, two backward per MoE layer). Expert gradients need no
    reduction on that axis: each rank already holds all tokens routed to its experts. A data_parallel on the same
    axis afterwards adds nothing; one before it has already decided the experts, which is an error (put
    expert_parallel first).

    Models that combine expert outputs densely (every expert applied to every token, then a gate-weighted sum over
    experts) have no buffers to exchange: there each rank runs its experts on the tokens it holds and the combine
    becomes partial(sum), reduced once per MoE layer (tokens stay as earlier tactics left them)."""

    axis: str = "expert"
    name: str = "EP"

    def apply(self, ctx) -> None:
        ctx.mesh.check_axis(self.axis, self.name)
        k = ctx.mesh.shape[self.axis]
        g, prop = ctx.graph, ctx.prop
        experts = [n for n in ctx.value_names() if n.startswith("params.") and len(ctx.value_meta(n)["shape"]) >= 3
                   and ctx.value_meta(n)["shape"][0] > 1]
        if not experts:
            raise PartitionError(f"{self.name}: the model has no stacked expert weights (parameters of rank >= 3, "
                                 f"experts on dim 0); expert parallelism does not apply to a dense model.")
        bad = [n for n in experts if ctx.value_meta(n)["shape"][0] % k]
        if bad:
            raise PartitionError(f"{self.name}: {bad[0]} has {ctx.value_meta(bad[0])['shape'][0]} experts, not "
                                 f"divisible by axis '{self.axis}' (size {k}). Use a number of experts divisible "
                                 f"by {k}.")
        seeds = [(n, 0) for n in experts]
        if self._exchanges_tokens(ctx, seeds):
            ctx.seed_and_propagate(self.axis, seeds, self.name, closed=True)
            tokens = [(n, d) for n, d in DataParallel(self.axis, name=self.name).seeds(ctx)
                      if prop.state(self.axis, g.name_to_vid[n]) == UNKNOWN]
            ctx.seed_and_propagate(self.axis, tokens, self.name)
            for n in experts:
                ctx.note(n, f"{self.name}: experts tiled on axis '{self.axis}' (size {k}); token buffers exchanged "
                            f"by all_to_all with the token groups tiled on the same axis")
        else:
            ctx.seed_and_propagate(self.axis, seeds, self.name)
            for n in experts:
                ctx.note(n, f"{self.name}: experts tiled on axis '{self.axis}' (size {k}); the model combines "
                            f"expert outputs densely (no per-expert token buffers), so the combine is reduced")
        self._check_expert_compute(ctx, experts)

    def _check_expert_compute(self, ctx, experts) -> None:
        """Every forward use of an expert weight (past views of it) must compute on tiled experts; otherwise the
        weights would be gathered at use, which is not expert parallelism."""
        g, st = ctx.graph, ctx.prop.axes[self.axis]
        fwd = forward_nodes(g.gm)
        op_index = {op.node: i for i, op in enumerate(g.ops)}
        for n in experts:
            stack, seen = [g.values[g.name_to_vid[n]]], set()
            while stack:
                node = stack.pop()
                for u in node.users:
                    if u in seen or u not in fwd or u not in op_index:
                        continue
                    seen.add(u)
                    if u.target in VIEW_OPS:
                        stack.append(u)
                        continue
                    i = op_index[u]
                    if st.assign_tactic.get(i) == self.name:
                        continue
                    by = st.assign_tactic.get(i)
                    why = (f"already decided on that axis by {by}; put expert_parallel('{self.axis}') before {by} "
                           f"in the schedule" if by else
                           "which EP could not decide on a slice of the experts (an op that selects expert weights "
                           "per token, such as index_select, would gather all experts on every rank); dispatch "
                           "tokens to per-expert buffers (GShard capacity dispatch) or combine expert outputs "
                           "densely")
                    raise PartitionError(
                        f"{self.name}: {n} (experts on dim 0, tiled on axis '{self.axis}' of size "
                        f"{ctx.mesh.shape[self.axis]}) is used by {u.target} ({u.name}), {why}.")

    def _exchanges_tokens(self, ctx, seeds) -> bool:
        """Trial of the closed expert region on a copy of the decisions: does it end at token buffers, i.e. is
        every value on its boundary an activation (computed from the inputs), with at least one such value?"""
        g, axis = ctx.graph, self.axis
        trial = ctx.prop.snapshot()
        vids = [g.name_to_vid[n] for n, _ in seeds]
        for v in vids:
            trial.seed(axis, v, 0, self.name)
        region = set(trial.run(axis, self.name, vids, closed=True))
        assign = trial.axes[axis].assign
        inputs = [n for n in g.gm.graph.nodes if n.op == "placeholder" and n.meta.get("partir_role") == "input"]
        from_inputs = descendants(inputs)
        boundary = []
        for c in region:
            for v in g.tied[c]:
                ops = ((g.producer[v],) if g.producer[v] >= 0 else ()) + tuple(g.users[v])
                if any(i not in assign and g.ops[i].rule is not None for i in ops):
                    boundary.append(v)
        return bool(boundary) and all(g.values[v] in from_inputs for v in boundary)


def expert_parallel(axis: str = "expert", name: str = "EP") -> ExpertParallel:
    return ExpertParallel(axis, name)


@dataclass(frozen=True)
class MultiQuery:
    """MQ (PartIR's inference sharding for multi-query / grouped-query attention): heads="q" tiles the query
    heads (wq column-parallel, wo row-parallel) while the shared K/V projections stay explicitly replicated (each
    rank slices the K/V heads it needs locally, no communication); heads="batch" tiles the batch of every input
    with K/V replicated."""

    axis: str = "model"
    mode: str = "q"
    name: str = "MQ"

    def __post_init__(self):
        if self.mode not in ("q", "batch"):
            raise PartitionError(f"multi_query: mode must be 'q' or 'batch', got {self.mode!r}.")

    def apply(self, ctx) -> None:
        ctx.mesh.check_axis(self.axis, self.name)
        col, row = find_linear_pairs(ctx.captured)
        kv = [w for w in col if w.rsplit(".", 2)[-2] in ("wk", "wv", "k_proj", "v_proj", "key", "value")]
        if not kv:
            raise PartitionError(f"{self.name}: found no key/value projections (linears named wk/wv, k_proj/v_proj "
                                 f"feeding attention).")
        seeds = [(w, REP) for w in kv]
        if self.mode == "batch":
            seeds += [(n, 0) for n in ctx.value_names() if n.startswith("inputs.") and ctx.value_meta(n)["shape"]]
        else:
            attn_out = {w.rsplit(".", 2)[0] for w in kv}
            seeds += [(w, 0) for w in col if w not in kv and w.rsplit(".", 2)[0] in attn_out]
            seeds += [(w, 1) for w in row if w.rsplit(".", 2)[0] in attn_out]
        ctx.seed_and_propagate(self.axis, seeds, self.name)


def multi_query(axis: str = "model", mode: str = "q", name: str = "MQ") -> MultiQuery:
    return MultiQuery(axis, mode, name)


# -- ZeRO ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Zero:
    """ZeRO stage 1/2/3 on `axis`. Each parameter's tiled dim: 0 if its (local) size divides by the axis size,
    else its largest divisible dim; tensors with no divisible dim stay replicated (explain() says so).
    Z1 and Z2 lower to the same program here: the gradient reduction feeding a tiled update is one reduce_scatter
    either way (the all_reduce + slice peephole), and parameters are gathered once after the update."""

    stage: int
    axis: str = "batch"
    name: str = ""

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise PartitionError(f"zero: stage must be 1, 2 or 3, got {self.stage!r}.")
        if not self.name:
            object.__setattr__(self, "name", f"Z{self.stage}")

    def _dim(self, ctx, name) -> int | None:
        g, prop = ctx.graph, ctx.prop
        vid = g.name_to_vid[name]
        shape = g.shapes[vid]
        k = ctx.mesh.shape[self.axis]
        c = g.canon[vid]
        # a dim an earlier axis tiles strided (the q/k/v part of a fused projection's output dim) cannot take
        # another axis on its own (see Propagator._set): tile another dim, or keep it whole
        strided = {d for d in range(len(shape)) if any(prop.strides.get((c, a), 1) > 1
                                                       for a in prop.dim_axes.get((c, d), ()))}
        sizes = [(prop.local_dim(vid, d), d) for d in range(len(shape)) if d not in strided]
        if sizes and sizes[0][1] == 0 and sizes[0][0] % k == 0:
            return 0
        ok = [d for s, d in sorted(sizes, reverse=True) if s % k == 0]
        return ok[0] if ok else None

    def apply(self, ctx) -> None:
        ctx.mesh.check_axis(self.axis, self.name)
        cap = ctx.captured
        if cap.fopt is None and self.stage < 3:
            raise PartitionError(f"{self.name}: ZeRO-{self.stage} shards optimizer state; pass optimizer= to "
                                 f"partition (or use zero(3) to shard parameters only).")
        seeds = []
        k = ctx.mesh.shape[self.axis]
        for fqn in cap.trainable:
            p = f"params.{fqn}"
            if ctx.prop.state(self.axis, ctx.graph.name_to_vid[p]) != UNKNOWN:
                ctx.note(p, f"{self.name}: already decided on axis '{self.axis}' by an earlier tactic; left as is")
                continue
            d = self._dim(ctx, p)
            states = [n for n in (f"opt.{s}.{fqn}" for s in (cap.fopt.state_names if cap.fopt else ()))
                      if n in ctx.graph.name_to_vid]
            if d is None:
                ctx.note(p, f"{self.name}: no dim of {tuple(ctx.graph.shapes[ctx.graph.name_to_vid[p]])} is "
                            f"divisible by axis '{self.axis}' (size {k}) (a dim an earlier axis tiles strided does "
                            f"not count); replicated")
                continue
            seeds += [(s, d) for s in states]
            seeds.append((p, d) if self.stage == 3 else (p, REP))
        region = ctx.optimizer_region() if cap.fopt is not None else set()
        if cap.fopt is None:   # zero(3) without an optimizer: parameters stored tiled, gathered at every use
            region = set()
        ctx.seed_and_propagate(self.axis, seeds, self.name, region)


def zero(stage: int, axis: str = "batch", name: str = "") -> Zero:
    return Zero(stage, axis, name)
