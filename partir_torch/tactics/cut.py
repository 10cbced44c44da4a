"""The automatic cut of `pipeline(axis, stages=k)`: module globs for k stages, cut between the model's repeated blocks.

    balanced_cut(cap, 2) on a stock LlamaForCausalLM (modules model.embed_tokens, model.layers.<i>, model.norm,
    lm_head) -> (("model.embed_tokens", "model.rotary_emb", "model.layers.0"),
                 ("model.layers.1", "model.norm", "lm_head"))

The blocks are the longest run of module FQNs `<prefix>.<i>` (a ModuleList of decoder layers), split contiguously
so that the largest stage's forward FLOPs are smallest. Every module outside the blocks is named at the level where
it leaves the blocks' ancestors (`model.norm`, not `model`, whose forward runs the blocks too) and joins the first
stage when its forward runs before the first block, else the last. The ancestors' own ops (the causal mask, the
residual sums between modules) belong to no module glob: assign_stages puts them on the latest stage among their
operands, or copies them onto every stage that reads them.
"""
from __future__ import annotations

import re

import torch

from ..contract import META_MICRO, META_MODULE, Phase, phase_of
from ..errors import PartitionError
from ..rules import tags


def balanced_cut(cap, n: int, name: str = "pipeline") -> tuple:
    """Globs for `n` stages (see the module docstring)."""
    fwd = [x for x in cap.gm.graph.nodes if x.op == "call_function" and phase_of(x) == Phase.FORWARD
           and x.meta.get(META_MICRO, 0) == 0]
    prefix, blocks = _blocks(fwd, n, name)
    pre = f"{prefix}." if prefix else ""
    cost = {b: 0.0 for b in blocks}
    before, after, started = 0.0, 0.0, False
    outside: dict = {}           # module outside the blocks -> ran after the first block (in forward order)
    for x in fwd:
        mod = x.meta.get(META_MODULE) or ""
        b = _block_of(mod, pre)
        if b is not None and b in cost:
            cost[b] += _flops(x)
            started = True
            continue
        top = _outside(mod, prefix)
        if top is not None and top not in outside:
            outside[top] = started
        if started:
            after += _flops(x)
        else:
            before += _flops(x)
    cuts = _split([cost[b] for b in blocks], n, before, after)
    globs = []
    for s in range(n):
        g = [f"{pre}{blocks[i]}" for i in range(cuts[s], cuts[s + 1])]
        if s == 0:
            g = [m for m, late in outside.items() if not late] + g
        if s == n - 1:
            g = g + [m for m, late in outside.items() if late]
        globs.append(tuple(g))
    return tuple(globs)


def _blocks(fwd, n: int, name: str) -> tuple:
    """(prefix, sorted block indices) of the longest run of modules `<prefix>.<i>` the forward runs."""
    runs: dict = {}
    for x in fwd:
        mod = x.meta.get(META_MODULE) or ""
        m = re.search(r"(?:^|\.)(\d+)(?=\.|$)", mod)
        if m:
            runs.setdefault(mod[:m.start(1)].rstrip("."), set()).add(int(m.group(1)))
    if not runs:
        raise PartitionError(f"{name}: stages={n} cuts between the model's repeated blocks (a ModuleList: modules "
                             f"'<name>.<i>'), and its forward runs none. Give the stages as lists of module FQN "
                             f"globs, one list per stage.")
    prefix = max(runs, key=lambda p: len(runs[p]))
    blocks = sorted(runs[prefix])
    if len(blocks) < n:
        raise PartitionError(f"{name}: stages={n} needs at least {n} repeated blocks to cut between; the model's "
                             f"longest run of blocks, '{prefix}', has {len(blocks)}. Use stages={len(blocks)} or "
                             f"fewer, or a model with more layers.")
    return prefix, blocks


def _outside(mod: str, prefix: str):
    """The glob of a module outside the blocks: its shortest prefix that does not hold the blocks (`model.norm` for
    blocks `model.layers.<i>`); None for the blocks' ancestors themselves (their ops follow their operands)."""
    if not mod:
        return None
    parts = mod.split(".")
    for k in range(1, len(parts) + 1):
        p = ".".join(parts[:k])
        if p != prefix and not prefix.startswith(p + "."):
            return p
    return None


def _split(costs: list, n: int, before: float, after: float) -> tuple:
    """Contiguous split of the blocks' costs over n stages minimising the largest stage (the first also runs
    `before`, the last `after`): (0, cut_1, ..., len(costs)). Exhaustive DP: n and the block count are small."""
    k, best = len(costs), {}

    def solve(i, s):     # blocks i.. over stages s..n-1 -> (max cost, cuts)
        if (i, s) not in best:
            if s == n - 1:
                best[(i, s)] = (sum(costs[i:]) + after + (before if s == 0 else 0.0), (k,))
            else:
                r = None
                for j in range(i + 1, k - (n - 1 - s) + 1):
                    sub = solve(j, s + 1)
                    cand = (max(sum(costs[i:j]) + (before if s == 0 else 0.0), sub[0]), (j,) + sub[1])
                    if r is None or cand[0] < r[0]:
                        r = cand
                best[(i, s)] = r
        return best[(i, s)]
    return (0,) + solve(0, 0)[1]


def _block_of(mod: str, pre: str):
    if not mod.startswith(pre):
        return None
    head = mod[len(pre):].split(".")[0]
    return int(head) if head.isdigit() else None


_MATMULS = tags.ops("matmul")


def _flops(node) -> float:
    """Matmul FLOPs, one per element of any other op's result."""
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return 0.0
    if node.target in _MATMULS:
        a = node.args[1] if tags.has(node.target, "matmul_bias") else node.args[0]   # (bias, m1, m2)
        k = a.meta["val"].shape[-1] if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"),
                                                                                   torch.Tensor) else 1
        return 2.0 * v.numel() * k
    return float(v.numel())
