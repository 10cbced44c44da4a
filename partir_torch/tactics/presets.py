"""Preset tactics: each returns a tactic (an object with .name, .axis and .apply(ctx)).

- data_parallel (BP): the batch dim of every input.
- megatron (MP): column-parallel then row-parallel linears, found by structure (see find_linear_pairs) or given
  by a plan; heads and hidden activations follow by propagation.
- zero (Z1/Z2/Z3): optimizer state (Z1, Z2) and parameters (Z3) tiled, decided inside the optimizer update only,
  so parameters are gathered where the forward and backward use them.
- embedding (EMB), sequence_parallel (SP), multi_query (MQ); expert_parallel (EP) is in experts.py, the structure
  search the presets share (linear pairs, fused projections, embedding tables) in structure.py.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, replace

import torch

from ..capture.lora import lora_adapters
from ..contract import Role, forward_nodes
from ..errors import PartitionError, closest, warn
from ..sharding import REPLICATED
from .manual import ManualPartition
from .base import SeedTactic, TacticBase, declare
from .structure import (Linear, embedding_tables, find_linear_pairs, is_param_cast, linear_layout,
                        linear_regions, linear_weight, output_heads, source)

aten = torch.ops.aten


@declare("data_parallel", macro=True)
@dataclass(frozen=True)
class DataParallel(SeedTactic):
    """BP: tile the batch dim of every input on `axis`. By default the batch dim is dim 0 of each input whose
    dim 0 has the batch size (the dim-0 size most inputs share); other inputs (a graph's edge list (2, E), a
    shared mask) stay whole. dims: {input index: dim or None} overrides per input.

    batchnorm: "global" (the default: equals one device) normalises over the whole batch, one all_reduce of (2, C)
    moments per norm in forward and one in backward; "local" normalises each rank's batch by its own statistics,
    as DDP does (no collective; running statistics are rank 0's, as DDP keeps them: capture/bn_local.py).
    bn_groups: the axis size "local" was captured for, set from the mesh by `bound` (pt.partition does it)."""

    axis: str = "batch"
    dims: dict | None = None
    name: str = "BP"
    batchnorm: str = "global"
    bn_groups: int = 0

    def __post_init__(self):
        if self.batchnorm not in ("global", "local"):
            raise PartitionError(f"data_parallel(batchnorm={self.batchnorm!r}): batchnorm is 'global' (statistics "
                                 f"over the whole batch, as one device) or 'local' (each rank's own, as DDP).")

    @classmethod
    def macro_actions(cls, ctx, axis: str, name: str) -> list:
        return [("data_parallel", "preset", (cls(axis, name=name),))]

    def bound(self, mesh) -> "DataParallel":
        """This tactic with the axis size per-rank batch norm groups by (unchanged for "global")."""
        if self.batchnorm != "local" or self.axis not in mesh.shape:
            return self
        return replace(self, bn_groups=mesh.shape[self.axis])

    def decompositions(self) -> dict:
        if self.batchnorm != "local":
            return {}
        if not self.bn_groups:
            raise PartitionError(f"{self.name}: data_parallel({self.axis!r}, batchnorm='local') takes each rank's "
                                 f"statistics, so the capture needs the size of axis '{self.axis}': pass the mesh "
                                 f"(plan.capture_for(..., mesh=mesh)), or partition with pt.partition.")
        from ..capture.bn_local import local_decompositions

        return local_decompositions(self.bn_groups)

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


def data_parallel(axis: str = "batch", dims: dict | None = None, name: str = "BP",
                  batchnorm: str = "global") -> DataParallel:
    """Tile the batch dim of every input on `axis` (see DataParallel). batchnorm="local": per-rank batch norm
    statistics, as DDP (no collective); "global" (default): over the whole batch, as one device."""
    return DataParallel(axis, dims, name, batchnorm)


# -- Megatron ------------------------------------------------------------------------------------------------------
@declare("megatron", macro=True)
@dataclass(frozen=True)
class Megatron(SeedTactic):
    """Megatron tensor parallelism on `axis`. plan: {FQN glob: "colwise" | "rowwise" | "vocab"} overrides
    detection. vocab=True also tiles the embedding tables on the vocabulary, and an untied output head (a linear
    whose output features number the table's rows) on its output features: the logits are vocabulary-tiled, tied
    head or not, and the cross-entropy runs vocabulary-parallel."""

    axis: str = "model"
    plan: dict | None = None
    name: str = "MP"
    vocab: bool = False

    @classmethod
    def macro_actions(cls, ctx, axis: str, name: str) -> list:
        """Megatron alone, with sequence parallelism, and with the embedding tables tiled on the vocabulary too
        (its gradient is the size of the table)."""
        return [("megatron", "preset", (cls(axis, name=name),)),
                ("megatron + sequence_parallel", "preset", (cls(axis, name=name), SequenceParallel(axis, name=name))),
                ("megatron(vocab) + sequence_parallel", "preset",
                 (cls(axis, name=name, vocab=True), SequenceParallel(axis, name=name)))]

    def decompositions(self) -> dict:
        from ..capture.decompositions import softmax_decompositions

        return softmax_decompositions() if self.vocab or any(v == "vocab" for v in (self.plan or {}).values()) \
            else {}

    def seeds(self, ctx) -> list:
        names = set(ctx.value_names())
        vocab, kept, why = [], [], {}
        lay = linear_layout(ctx.captured)
        adapters = lora_adapters(ctx.captured)
        if self.plan:     # a LoRA adapter the plan's globs also match follows its base (_adapter_seeds)
            col, row, vocab = self._planned(names)
            ab = {w for ad in adapters for w in (ad.a, ad.b)}
            col, row = [w for w in col if w not in ab], [w for w in row if w not in ab]
            if not col:
                raise PartitionError(f"{self.name}: plan={self.plan!r} names no 'colwise' weight; Megatron tiles a "
                                     f"column-parallel linear's output features and the row-parallel linear it "
                                     f"feeds. Add the first linear of each pair as '<fqn glob>.weight': 'colwise'.")
        else:
            col, row, kept, why, blocked = self._found(ctx, lay)
            # a weight shared between layers (ALBERT) can sit in a column slot in one and a row slot in another:
            # it cannot be both, so it stays whole there
            both = set(col) & set(row)
            for w in both:
                why[w] = "it is shared between a column-parallel and a row-parallel use (layers sharing weights)"
            col, row = [w for w in col if w not in both], [w for w in row if w not in both]
            kept = list(dict.fromkeys(kept + sorted(both)))
            if not col:
                raise _no_pair_error(self.name, self.axis, ctx.mesh.shape[self.axis], blocked)
        tables = embedding_tables(ctx.captured)
        paired = set(col + row + kept) | {w for ad in adapters for w in (ad.a, ad.b)}     # adapters follow their base
        heads = [w for w in output_heads(ctx.captured, lay, tables) if w not in paired]
        if self.vocab and not self.plan:
            vocab = tables + heads
        if not self.plan:
            self._report(ctx, lay, col + row + vocab, why, heads)
        seeds = []
        for w in col:   # output features; a fused q/k/v output is tiled strided, so each chunk keeps its heads
            lin = lay.get(w, Linear(w, 0))
            seeds.append((w, lin.out_dim, lin.chunks))
            bias = w[:-len("weight")] + "bias"
            if bias in names:
                seeds.append((bias, 0, lin.chunks))
        seeds += [(w, 1 - lay.get(w, Linear(w, 0)).out_dim) for w in row]
        seeds += [(w, lay[w].out_dim if w in lay else 0) for w in vocab]     # a table's rows, a head's outputs
        return seeds + [(w, REPLICATED) for w in kept] + self._adapter_seeds(ctx, lay, adapters, col, row, names)

    def _adapter_seeds(self, ctx, lay, adapters, col, row, names) -> list:
        """A LoRA wrapper takes its base linear's role (capture/lora.py): a column-parallel base's lora_B is tiled
        on its output features as the base weight (in the same q/k/v chunks), its lora_A whole; a row-parallel
        base's lora_A is tiled on its input features, its lora_B whole; a base left whole keeps both adapters
        whole. explain() names the wrapper and the role its base took."""
        seeds, col, row = [], set(col), set(row)
        for ad in adapters:
            a, b, base = lay[ad.a], lay[ad.b], lay.get(ad.base, Linear(ad.base, 0))
            bias = ad.b[:-len("weight")] + "bias"
            bias = [bias] if ad.b.endswith("weight") and bias in names else []
            where = f"the LoRA wrapper '{ad.wrapper}' (rank {ad.rank})"
            if ad.base in col:
                seeds += [(ad.b, b.out_dim, base.chunks), (ad.a, REPLICATED)] + [(x, 0, base.chunks) for x in bias]
                role = ("column-parallel", "lora_B tiled on its output features as the base weight, lora_A whole: "
                        "each rank adds its slice of the wrapper's output features")
            elif ad.base in row:
                seeds += [(ad.a, 1 - a.out_dim), (ad.b, REPLICATED)] + [(x, REPLICATED) for x in bias]
                role = ("row-parallel", "lora_A tiled on its input features as the base weight, lora_B whole: the "
                        "adapter's partial output is summed with the base's by the same all_reduce")
            else:
                seeds += [(ad.a, REPLICATED), (ad.b, REPLICATED)] + [(x, REPLICATED) for x in bias]
                role = ("left whole", "both adapters whole, as their base")
            ctx.note(ad.base, f"{self.name}: {role[0]} on axis '{self.axis}' as the base linear of {where}; {role[1]}")
            for w in (ad.a, ad.b):
                ctx.note(w, f"{self.name}: adapter of {where}, whose base linear {_short(ad.base)} is {role[0]} on "
                            f"axis '{self.axis}': {role[1]}")
        return seeds

    def _found(self, ctx, lay) -> tuple:
        """(column-parallel, row-parallel, kept whole, {weight: why}, blocked) from the structure search: in each region, a
        column linear whose heads (or, without heads, output features) the axis cannot divide is kept whole
        (explicitly replicated, as multi_query does for one shared K/V head); a region left with no column linear
        keeps its row linears whole too. The reasons go to explain() and summary(); `blocked` lists each column
        linear the axis size does not divide as (weight, what, size), for the error when none is left."""
        k = ctx.mesh.shape[self.axis]
        col, row, kept, why, blocked = [], [], [], {}, []
        for cols, rows in linear_regions(ctx.captured):
            ok = []
            for w in cols:
                lin = lay[w]
                feats = ctx.value_meta(w)["shape"][lin.out_dim] // lin.chunks
                if lin.heads is not None and lin.heads % k:
                    why[w] = (f"its output has {lin.heads} attention head{'s' if lin.heads > 1 else ''}, not "
                              f"divisible by axis '{self.axis}' (size {k}): kept whole, each rank slices the heads "
                              f"it needs (as multi_query does for shared K/V)")
                    kept.append(w)
                    blocked.append((w, "attention heads", lin.heads))
                elif feats % k and (ctx.options.strict or lin.chunks > 1):
                    # uneven features split as torch.chunk does, unless strict=True or a packed projection (its
                    # chunks are tiled strided, which an uneven split cannot be)
                    why[w] = f"{feats} output features, not divisible by axis '{self.axis}' (size {k})"
                    blocked.append((w, "output features", feats))
                else:
                    ok.append(w)
            if ok:
                col += ok
                row += rows
            else:
                for w in rows:
                    why[w] = f"the linears feeding it ({', '.join(_short(c) for c in cols)}) stay whole"
        return col, row, kept, why, blocked

    def _planned(self, names) -> tuple:
        """(column-parallel, row-parallel, vocabulary-tiled) weights named by `plan`'s FQN globs."""
        col, row, vocab = [], [], []
        params = sorted(n[len("params."):] for n in names if n.startswith("params."))
        for glob, kind in self.plan.items():
            if kind not in ("colwise", "rowwise", "vocab"):
                raise PartitionError(f"{self.name}: plan value {kind!r} for {glob!r} must be 'colwise', "
                                     f"'rowwise' or 'vocab'.")
            hits = [n for n in params if fnmatch.fnmatchcase(n, glob) and n.endswith("weight")]
            if not hits:
                raise _plan_miss_error(self.name, glob, params)
            {"colwise": col, "rowwise": row, "vocab": vocab}[kind].extend(f"params.{h}" for h in hits)
        return col, row, vocab

    def _report(self, ctx, lay, tiled, why, heads=()) -> None:
        """One warning and one summary() remark naming the linears left replicated on the axis, with the reason;
        explain(weight) shows it too. An output head left whole says what it costs and the fix."""
        why = dict(why)
        adapters = {w for ad in lora_adapters(ctx.captured) for w in (ad.a, ad.b)}   # they follow their base
        for w in heads:
            if w not in why and w not in tiled and ctx.is_unknown(self.axis, w):
                why[w] = (f"the output head: every rank computes the whole vocabulary's logits (and their "
                          f"gradient), often the largest activation of a language model; megatron('{self.axis}', "
                          f"vocab=True) tiles it and the embedding on the vocabulary")
        for w in lay:
            if w not in why and w not in tiled and w not in adapters and ctx.is_unknown(self.axis, w):
                why[w] = ("not in a column/row-parallel pair: its output reaches no other linear through "
                          "activations or attention (an output head, a router, an encoder's last layer)")
        if not why:
            return
        by_reason: dict = {}
        for w, text in why.items():
            ctx.note(w, f"{self.name}: left replicated on axis '{self.axis}': {text}")
            by_reason.setdefault(text, []).append(_short(w))
        lines = [f"{self.name} left {len(why)} linear weight{'s' if len(why) > 1 else ''} replicated on axis "
                 f"'{self.axis}':"]
        for text, ws in by_reason.items():
            lines.append(f"  {', '.join(ws[:6])}{f' and {len(ws) - 6} more' if len(ws) > 6 else ''}: {text}")
        ctx.remark(self.name, "\n".join(lines))
        warn("partir_torch: " + "\n".join(lines), stacklevel=2)


def _no_pair_error(name: str, axis: str, k: int, blocked: list) -> PartitionError:
    """Megatron found no column linear to tile: none in the model, or (`blocked`: (weight, what, size)) none whose
    heads or output features axis size k divides."""
    if not blocked:
        return PartitionError(f"{name}: found no column-parallel/row-parallel linear pair in this model (a linear "
                              f"feeding another through activations or attention). Pass "
                              f"plan={{'<fqn glob>.weight': 'colwise' | 'rowwise'}}.")
    sizes = [size for _, _, size in blocked]
    g = math.gcd(*sizes)
    fits = [d for d in range(2, g + 1) if g % d == 0][:4]
    groups: dict = {}        # (what, size) -> weights
    for w, what, size in blocked:
        groups.setdefault((what, size), []).append(_short(w))
    listed = "; ".join(f"{size} {what} in {ws[0]}" + (f" and {len(ws) - 1} more" if len(ws) > 1 else "")
                       for (what, size), ws in groups.items())
    fix = (f"Give axis '{axis}' a size that divides them ({' or '.join(map(str, fits))} here)" if fits else
           f"No axis size above 1 divides all of them: give axis '{axis}' a size that divides the dims of the "
           f"linears you want tiled")
    return PartitionError(f"{name}: found column-parallel/row-parallel linear pairs, but none can be tiled on axis "
                          f"'{axis}' (size {k}): {k} does not divide their dims ({listed}). {fix}, or name the "
                          f"linears to tile with plan={{'<fqn glob>.weight': 'colwise' | 'rowwise'}}.")


def _plan_miss_error(name: str, glob: str, params: list) -> PartitionError:
    """A megatron plan glob that matches no parameter weight: name the modules it matches (a module FQN instead
    of its '.weight') or the nearest weights."""
    weights = [p for p in params if p.endswith("weight")]
    modules = sorted({p.rpartition(".")[0] for p in params if fnmatch.fnmatchcase(p.rpartition(".")[0], glob)})
    if modules:
        shown = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
        hint = (f"; it names the module{'s' if len(modules) > 1 else ''} {shown}, and plan globs name parameters. "
                f"Use {glob + '.weight'!r}")
    else:
        near = closest(glob, weights)
        hint = f". Did you mean {' or '.join(repr(n) for n in near)}?" if near else \
            f". Weights look like {', '.join(repr(w) for w in weights[:3])}"
    return PartitionError(f"{name}: plan entry {glob!r} matches no parameter weight{hint}"
                          + ("" if hint.endswith("?") else "."))


def _short(name: str) -> str:
    return name[len("params."):] if name.startswith("params.") else name


def megatron(axis: str = "model", plan: dict | None = None, name: str = "MP", vocab: bool = False) -> Megatron:
    return Megatron(axis, plan, name, vocab)


@declare("embedding")
@dataclass(frozen=True)
class EmbeddingSharding(TacticBase):
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
        tables = embedding_tables(ctx.captured)
        if not tables:
            raise PartitionError(f"{self.name}: the model has no embedding table (aten.embedding on a parameter).")
        d = 0 if self.dim == "vocab" else 1
        ctx.seed_and_propagate(self.axis, [(t, d) for t in tables], self.name)


def embedding(axis: str = "model", dim: str = "vocab", name: str = "EMB") -> EmbeddingSharding:
    return EmbeddingSharding(axis, dim, name)


# -- sequence parallelism ----------------------------------------------------------------------------------------
@declare("sequence")
@dataclass(frozen=True)
class SequenceParallel(TacticBase):
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
        fwd = forward_nodes(ctx.captured.gm)
        for n in ctx.captured.gm.graph.nodes:
            w = linear_weight(n, None) if n in fwd else None
            if w not in col_names:
                continue
            x = source(n.args[0])   # past casts, then the (B, T, d) activation behind its (B*T, d) view
            if x.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
                x = source(x.args[0])
            shape = x.meta["val"].shape
            if x in seen or len(shape) <= self.seq_dim:
                continue
            seen.add(x)
            if ctx.is_unknown(self.axis, x):
                seeds.append((x, self.seq_dim))
        ctx.seed_nodes_and_propagate(self.axis, seeds, self.name)


def sequence_parallel(axis: str = "model", seq_dim: int = 1, name: str = "SP") -> SequenceParallel:
    return SequenceParallel(axis, seq_dim, name)


# -- multi-query attention (expert parallelism is in experts.py) ------------------------------------------------------------------
@declare("multi_query")
@dataclass(frozen=True)
class MultiQuery(TacticBase):
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
        seeds = [(w, REPLICATED) for w in kv]
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
@declare("zero", macro=True, names={"Z1": "zero1", "Z2": "zero2", "Z3": "zero3"})
@dataclass(frozen=True)
class Zero(TacticBase):
    """ZeRO stage 1/2/3 on `axis`. Each parameter's tiled dim: 0 if its (local) size divides by the axis size,
    else its largest divisible dim; tensors with no divisible dim stay replicated (explain() says so).
    Z1 and Z2 lower to the same program here: the gradient reduction feeding a tiled update is one reduce_scatter
    either way (the all_reduce + slice peephole), and parameters are gathered once after the update.
    Frozen parameters (requires_grad=False: a LoRA base, a frozen encoder) have no gradient and no optimizer state:
    ZeRO-3 stores them tiled and gathers them at every use, as FSDP2 does; ZeRO-1/2 have nothing of theirs to
    shard, and explain() says so for each.
    reshard_after_forward (stage 3, FSDP2's flag): True gathers each parameter again for the backward (the least
    memory); False keeps the copy gathered in the forward until its last use in the backward: one gather per step,
    as ZeRO-1/2, issued ahead of its use in the next forward (Megatron's --overlap-param-gather) instead of after
    the update."""

    stage: int
    axis: str = "batch"
    name: str = ""
    reshard_after_forward: bool = True

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise PartitionError(f"zero: stage must be 1, 2 or 3, got {self.stage!r}.")
        if self.reshard_after_forward is not True and (self.stage != 3 or self.reshard_after_forward is not False):
            raise PartitionError(f"zero: reshard_after_forward must be True or False and applies to stage 3 (stored "
                                 f"sharded, gathered at use); got {self.reshard_after_forward!r} with stage "
                                 f"{self.stage}.")
        if not self.name:
            object.__setattr__(self, "name", f"Z{self.stage}")

    @property
    def family(self) -> str:
        return f"zero{self.stage}"

    @classmethod
    def macro_actions(cls, ctx, axis: str, name: str) -> list:
        """Completions of the search: ZeRO-3, and ZeRO-1 when the step has an optimizer."""
        out = [("zero(3)", "zero", (cls(3, axis, name=name),))]
        if ctx.captured.fopt is not None:
            out.append(("zero(1)", "zero", (cls(1, axis, name=name),)))
        return out

    def _dim(self, ctx, name) -> int | None:
        shape = ctx.value_meta(name)["shape"]
        k = ctx.mesh.shape[self.axis]
        # a dim an earlier axis tiles strided (the q/k/v part of a fused projection's output dim) cannot take
        # another axis on its own (see Propagator._set): tile another dim, or keep it whole
        strided = {d for d in range(len(shape)) if any(ctx.stride(name, a) > 1 for a in ctx.dim_axes(name, d))}
        sizes = [(ctx.local_dim(name, d), d) for d in range(len(shape)) if d not in strided]
        if sizes and sizes[0][1] == 0 and sizes[0][0] % k == 0:
            return 0
        ok = [d for s, d in sorted(sizes, reverse=True) if s % k == 0]
        if ok or ctx.options.strict:
            return ok[0] if ok else None
        # no dim divides: the largest dim of more than one position that earlier axes split exactly, tiled
        # unevenly (torch.chunk sizes, as FSDP2 shards dim 0; sharding.chunk_size)
        exact = [(s, d) for s, d in sizes if s > 1 and shape[d] % math.prod(
            ctx.mesh.shape[a] for a in ctx.dim_axes(name, d)) == 0]
        return max(exact, key=lambda sd: (sd[0], -sd[1]))[1] if exact else None

    def _shards_nothing(self, ctx, indivisible, k) -> None:
        """Raise: the axis divides no dim of any parameter left to this tactic (a no-op would pass silently)."""
        def local(p):
            return tuple(ctx.local_dim(p, d) for d in range(len(ctx.graph.shapes[ctx.graph.name_to_vid[p]])))

        shown = ", ".join(f"{p[len('params.'):]} {local(p)}" for p in indivisible[:3])
        more = " ..." if len(indivisible) > 3 else ""
        raise PartitionError(f"{self.name}: axis '{self.axis}' (size {k}) divides no dim of any parameter it could "
                             f"shard ({len(indivisible)} parameters, local shapes e.g. {shown}{more}): "
                             f"zero({self.stage}) would shard nothing. Use a mesh axis whose size divides the "
                             f"parameters' dims, drop strict=True (dims a mesh axis does not divide are then sharded "
                             f"unevenly), or leave zero out of the schedule.")

    def apply(self, ctx) -> None:
        ctx.mesh.check_axis(self.axis, self.name)
        cap = ctx.captured
        if cap.fopt is None and self.stage < 3:
            raise PartitionError(f"{self.name}: ZeRO-{self.stage} shards optimizer state; pass optimizer= to "
                                 f"partition (or use zero(3) to shard parameters only).")
        seeds = []
        tiled_at: dict = {}     # (module fqn, shape) -> the dim its parameter of that shape is tiled on
        k = ctx.mesh.shape[self.axis]
        trainable = set(cap.trainable)
        indivisible = []
        for fqn in _param_fqns(cap):
            p = f"params.{fqn}"
            if fqn not in trainable and self.stage < 3:
                ctx.note(p, f"{self.name}: frozen (requires_grad=False): no gradient and no optimizer state, so "
                            f"nothing to shard; replicated as the model holds it (zero(3) would shard it)")
                continue
            if not ctx.is_unknown(self.axis, p):
                ctx.note(p, f"{self.name}: already decided on axis '{self.axis}' by an earlier tactic; left as is")
                continue
            d = self._dim(ctx, p)
            states = [n for n in (f"opt.{s}.{fqn}" for s in (cap.fopt.state_names if cap.fopt else ()))
                      if n in ctx.graph.name_to_vid]
            if d is None:
                ctx.note(p, f"{self.name}: no dim of {tuple(ctx.graph.shapes[ctx.graph.name_to_vid[p]])} is "
                            f"divisible by axis '{self.axis}' (size {k}) (a dim an earlier axis tiles strided does "
                            f"not count){' (strict=True)' if ctx.options.strict else ' and none is large enough to tile unevenly'}; replicated")
                indivisible.append(p)
                continue
            seeds += [(s, d) for s in states]
            seeds.append((p, d) if self.stage == 3 else (p, REPLICATED))
            if fqn not in trainable:
                ctx.note(p, f"{self.name}: frozen (requires_grad=False): stored tiled on dim {d} over axis "
                            f"'{self.axis}' and gathered at each use; no gradient, no optimizer state")
            tiled_at[(fqn.rpartition(".")[0], ctx.graph.shapes[ctx.graph.name_to_vid[p]])] = d
        if indivisible and not tiled_at:
            self._shards_nothing(ctx, indivisible, k)
        if self.stage == 3:   # a module's buffers shaped like its tiled parameter (running statistics) go with it
            for fqn in cap.buffer_fqns:
                b = f"buffers.{fqn}"
                vid = ctx.graph.name_to_vid.get(b)
                d = tiled_at.get((fqn.rpartition(".")[0], ctx.graph.shapes[vid])) if vid is not None else None
                if d is not None and ctx.is_unknown(self.axis, vid):
                    seeds.append((b, d))
        region = ctx.optimizer_region() if cap.fopt is not None else set()
        if cap.fopt is None:   # zero(3) without an optimizer: parameters stored tiled, gathered at every use
            region = set()
        if self.stage == 3:    # a parameter's cast (mixed precision) runs on the shard: gathered in param_dtype
            region |= {i for i, op in enumerate(ctx.graph.ops) if is_param_cast(op.node)}
        ctx.seed_and_propagate(self.axis, seeds, self.name, region)


def _param_fqns(cap) -> list:
    """Every parameter of the step, trainable first (capture's placeholder order), frozen ones too."""
    return [n[len("params."):] for n, r in zip(cap.input_names, cap.input_roles) if r == Role.PARAM]


def zero(stage: int, axis: str = "batch", name: str = "", reshard_after_forward: bool = True) -> Zero:
    return Zero(stage, axis, name, reshard_after_forward)
