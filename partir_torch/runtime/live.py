"""The "live" tactic: a program seeded with the layouts another plan keeps its state and inputs in (the eval and
forward programs on the training state: evaluate.py; a path of a step that branches that the schedule refuses:
shapes.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ..contract import Role
from ..sharding import REPLICATED

LIVE = "live"


@dataclass(frozen=True)
class LiveLayout:
    """The eval program's one tactic: seed every state value and input on every axis as the training plan keeps
    it, one pass per training stage (axes that share a dim compose in the same order as in training: megatron's
    "model" before ZeRO's "batch" on a weight's dim 0). Propagation does the rest."""

    train: object            # the training Plan
    name: str = LIVE
    axis: str = ""

    def apply(self, ctx) -> None:
        pp = self.train.pipeline.axis          # stages, not layouts (None: no pipeline)
        stages = [(s.tactic, s.axis) for s in self.train.stages if s.axis in self.train.mesh.axes and s.axis != pp]
        for k, (tactic, axis) in enumerate(stages):
            last = all(a != axis for _, a in stages[k + 1:])
            seeds = _seeds(self.train, ctx.captured, axis, tactic, last)
            if seeds:
                ctx.seed_and_propagate(axis, seeds, LIVE)


def _seeds(train, cap, axis, tactic, last) -> list:
    """(name, dim[, split factor]) or (name, REPLICATED) on `axis` for the values training's `tactic` decided
    there (last: also those no tactic decided): state as training keeps it; inputs tiled like training's inputs
    where the size divides."""
    mesh = train.mesh
    seeds = []
    decisions = train.decisions
    for name, role in zip(cap.input_names, cap.input_roles):
        vid = train.graph.name_to_vid.get(name)
        by = decisions.tactic_of(vid, axis) if vid is not None else "-"     # "-": no tactic decided it
        if not (by == tactic if by != "-" else last):
            continue
        if role in (Role.PARAM, Role.BUFFER, Role.OPT_STATE):
            sh = decisions.sharding(vid)
            d = sh.tiled_axes().get(axis)
            if d is None:
                seeds.append((name, REPLICATED))
            else:
                stride = dict(sh.strides).get(axis)
                seeds.append((name, d) + ((stride,) if stride and stride > 1 else ()))
        elif role == Role.INPUT and name in train.graph.name_to_vid:
            sh = decisions.sharding(vid)
            d = sh.tiled_axes().get(axis)
            shape = cap.names[name].meta["val"].shape
            if d is not None and d < len(shape):
                k = 1
                for a in sh.dims[d][:sh.dims[d].index(axis) + 1]:
                    k *= mesh.shape[a]
                if shape[d] % k == 0:
                    seeds.append((name, d))
    return seeds
