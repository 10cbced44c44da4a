"""Expert parallelism (EP): stacked expert weights tiled on an axis; with per-expert token buffers (GShard's
capacity dispatch) the token groups are tiled on the same axis and the buffers exchanged by all_to_all."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from ..capture.graphutil import descendants
from ..errors import PartitionError
from .base import TacticBase, declare
from .presets import DataParallel
from .structure import expert_weights, forward_uses
from ..contract import META_ROLE, forward_nodes
from ..rules.moe import EXPERTS_OP


@declare("expert", macro=True)
@dataclass(frozen=True)
class ExpertParallel(TacticBase):
    """EP: stacked expert weights (parameters (E, ., .) used by a batched matmul over E, e.g. w1 (E, d, h) in
    einsum("becd,edh->bech"), or selected per token; see structure.expert_weights) tiled on dim 0 of `axis`. A
    dense model raises a PartitionError.

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
    params: str | None = None      # FQN glob of the expert weights; None: found by use (structure.expert_weights)

    @classmethod
    def macro_actions(cls, ctx, axis: str, name: str) -> list:
        return [("expert_parallel", "preset", (cls(axis, name=name),))]

    def apply(self, ctx) -> None:
        ctx.mesh.check_axis(self.axis, self.name)
        k = ctx.mesh.shape[self.axis]
        experts = expert_weights(ctx.captured) if self.params is None else self._selected(ctx)
        if not experts:
            grouped = sum(1 for n in ctx.captured.gm.graph.nodes if n.target is EXPERTS_OP)
            if grouped:
                raise PartitionError(
                    f"{self.name}: the model's {grouped} MoE layer(s) run Hugging Face's grouped-mm experts, captured "
                    f"as partir::experts_grouped (one per-token op that keeps tokens on their rank under data "
                    f"parallelism, rules/moe.py); it needs every expert's weights on the rank, so expert "
                    f"parallelism over axis '{self.axis}' (size {k}) cannot split them. Shard the experts' weights "
                    f"with zero(3) instead, or leave expert_parallel out of the schedule.")
            raise PartitionError(f"{self.name}: the model has no stacked expert weights (parameters (E, ., .) used "
                                 f"by a batched matmul over E or selected per token); expert parallelism does not "
                                 f"apply to a dense model.")
        bad = [n for n in experts if ctx.value_meta(n)["shape"][0] % k]
        if bad:
            raise PartitionError(f"{self.name}: {bad[0]} has {ctx.value_meta(bad[0])['shape'][0]} experts, not "
                                 f"divisible by axis '{self.axis}' (size {k}): expert parallelism needs equal "
                                 f"expert groups (its token exchange is one all_to_all of equal blocks; uneven "
                                 f"groups are not supported yet). Use a number of experts divisible by {k}, or "
                                 f"shard the experts with zero(3) / megatron, which tile unevenly.")
        seeds = [(n, 0) for n in experts]
        if self._exchanges_tokens(ctx, seeds):
            ctx.seed_and_propagate(self.axis, seeds, self.name, closed=True)
            tokens = [(n, d) for n, d in DataParallel(self.axis, name=self.name).seeds(ctx)
                      if ctx.is_unknown(self.axis, n)]
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

    def _selected(self, ctx) -> list:
        names = [n for n in ctx.value_names() if n.startswith("params.")
                 and fnmatch.fnmatchcase(n[len("params."):], self.params)]
        if not names:
            some = [n[len("params."):] for n in ctx.value_names() if n.startswith("params.")][:4]
            raise PartitionError(f"{self.name}: params={self.params!r} matches no parameter FQN (they look like "
                                 f"{', '.join(some)}, ...).")
        flat = [n for n in names if len(ctx.value_meta(n)["shape"]) < 2 or ctx.value_meta(n)["shape"][0] <= 1]
        if flat:
            raise PartitionError(f"{self.name}: {flat[0]} has shape {ctx.value_meta(flat[0])['shape']}: expert "
                                 f"weights stack the experts on dim 0 (E, ...). Narrow params={self.params!r}.")
        return names

    def _check_expert_compute(self, ctx, experts) -> None:
        """Every forward use of an expert weight (past views of it) must compute on tiled experts; otherwise the
        weights would be gathered at use, which is not expert parallelism."""
        g = ctx.graph
        fwd = forward_nodes(g.gm)
        op_index = {op.node: i for i, op in enumerate(g.ops)}
        for n in experts:
            for u in forward_uses(g.values[g.name_to_vid[n]], fwd):
                i = op_index.get(u)
                if i is None or ctx.op_tactic(self.axis, i) == self.name:
                    continue
                by = ctx.op_tactic(self.axis, i)
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
        trial = ctx.trial()
        region = set(trial.seed_and_propagate(axis, [(n, 0) for n, _ in seeds], self.name, closed=True))
        assign = trial.op_decisions(axis)
        inputs = [n for n in g.gm.graph.nodes if n.op == "placeholder" and n.meta.get(META_ROLE) == "input"]
        from_inputs = descendants(inputs)
        boundary = []
        for c in region:
            for v in g.tied[c]:
                ops = ((g.producer[v],) if g.producer[v] >= 0 else ()) + tuple(g.users[v])
                if any(i not in assign and g.ops[i].rule is not None for i in ops):
                    boundary.append(v)
        return bool(boundary) and all(g.values[v] in from_inputs for v in boundary)


def expert_parallel(axis: str = "expert", name: str = "EP", params: str | None = None) -> ExpertParallel:
    """Expert parallelism on `axis` (see ExpertParallel); `params` (FQN glob, e.g. "layers.*.moe.w?") names the
    expert weights where finding them by use is not wanted."""
    return ExpertParallel(axis, name, params)
