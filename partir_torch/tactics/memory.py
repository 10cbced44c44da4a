"""Memory tactics, applied as rewrites of the captured step (they act at capture, wherever they sit in the
schedule; partition() hands them to capture):

- mixed_precision: bf16 (or fp16) compute with fp32 master weights and optimizer state; gradients reach their
  collective in `reduce_dtype`.
- remat: activation checkpointing of matching modules: the backward recomputes their forward instead of keeping
  its intermediates alive.
"""
from __future__ import annotations

import fnmatch
import operator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.fx as fx

from ..capture.graphutil import split_for_backward
from ..contract import (META_NO_PARTIAL_PASS, META_PHASE, META_RECOMPUTE, META_RECOMPUTE_OF, META_REMAT, META_ROLE,
    META_SAVED, META_TAG, META_TAGS, Phase, phase_of, traced_forward)
from ..errors import PartitionError
from ..rules import tags

aten = torch.ops.aten


@dataclass(frozen=True)
class MixedPrecision:
    """Parameters (and floating-point inputs) are cast to `param_dtype` for the forward and backward; the fp32
    parameters, gradients and optimizer state stay fp32. A gradient is reduced in `reduce_dtype`: fp32 (the
    partial gradient flows through its up-cast and is reduced in fp32) or param_dtype (reduced before the
    up-cast, half the bytes)."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    name: str = "MixedPrecision"
    in_eval: ClassVar[bool] = True     # eval_step computes the loss in the training dtype too
    axis = ""

    def __post_init__(self):
        for d in (self.param_dtype, self.reduce_dtype):
            if not isinstance(d, torch.dtype) or not d.is_floating_point:
                raise PartitionError(f"mixed_precision: {d!r} is not a floating-point torch dtype.")
        if self.reduce_dtype not in (torch.float32, self.param_dtype):
            raise PartitionError(f"mixed_precision: reduce_dtype must be torch.float32 or param_dtype "
                                 f"({self.param_dtype}), got {self.reduce_dtype}.")

    def install(self, model) -> list:
        return []

    def transform_step(self, state: dict, args: tuple):
        cast = lambda t: t.to(self.param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        return {k: cast(v) for k, v in state.items()}, tuple(cast(a) for a in args)

    def rewrite(self, cap) -> None:
        """Each phase casts the parameters it uses (split_param_casts); reduce_dtype == param_dtype: stop partial
        gradients at their up-cast, so they are reduced in the compute dtype (the engine never passes a partial
        through a node marked this way)."""
        split_param_casts(cap.gm)
        hoist_gradient_casts(cap.gm)
        if self.reduce_dtype == torch.float32:
            return
        for n in cap.gm.graph.nodes:
            if n.target is aten._to_copy.default and n.kwargs.get("dtype") == torch.float32:
                src = n.args[0].meta.get("val")
                if isinstance(src, torch.Tensor) and src.dtype == self.param_dtype:
                    n.meta[META_NO_PARTIAL_PASS] = True



def mixed_precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) -> MixedPrecision:
    return MixedPrecision(param_dtype, reduce_dtype)


def split_param_casts(gm) -> None:
    """A parameter's cast (mixed precision's `_to_copy` to the compute dtype) used by the forward and by the
    backward (directly, through a view of it, or by a recomputed forward) is duplicated for the backward, as
    capture duplicates parameter views: a tiled parameter is then gathered, already cast, once per phase, and the
    gathered copy does not live from the forward to the backward (ZeRO-3's memory saving, kept under mixed
    precision and remat)."""
    nodes, fwd = traced_forward(gm)
    index = {n: i for i, n in enumerate(nodes)}
    changed = False
    for n in nodes:
        if n not in fwd or n.target is not aten._to_copy.default or n.args[0].op != "placeholder" \
                or n.args[0].meta.get(META_ROLE) != "param":
            continue
        changed |= split_for_backward(gm, n, fwd, index)
    if changed:
        gm.graph.lint()
        gm.recompile()


def hoist_gradient_casts(gm) -> None:
    """Autograd runs a parameter's ToCopyBackward (the up-cast of its compute-dtype gradient) last, after the
    whole backward, since the forward's cast was made first: every fp32 gradient, and so its reduction, would
    wait for the last backward matmul, and every compute-dtype gradient would live to the end of the step. Each
    such cast (a backward `_to_copy` to fp32 of one backward value) moves right after the value it casts, where
    FSDP's and DDP's hooks make it; the graph computes the same values. A step with its micro-batches unrolled
    (accumulate, pipeline) traces every micro-batch's backward before the loss they sum to: those backward nodes
    are not the forward, and the add that accumulates a cast gradient into the earlier micro-batches' sum follows
    its cast (`_follow_sum`), so the last micro-batch's gradient is final, and its reduction can start, where its
    backward makes it."""
    nodes, fwd = traced_forward(gm)
    fwd = {n for n in fwd if n.meta.get(META_PHASE) != Phase.BACKWARD}
    index = {n: float(i) for i, n in enumerate(nodes)}
    moved = False
    for n in nodes:
        if n in fwd or n.target is not aten._to_copy.default or n.kwargs.get("dtype") != torch.float32 \
                or len(n.args) != 1 or not isinstance(n.args[0], fx.Node) or n.args[0].op == "placeholder":
            continue
        src = n.args[0]
        if src in fwd:       # a saved activation's cast stays where the backward needs it (not alive from the forward)
            continue
        if src.next is not n:
            src.append(n)
            index[n] = index[src] + 1e-3
            moved = True
        moved |= _follow_sum(n, index)
    if moved:
        gm.graph.lint()
        gm.recompile()


def _follow_sum(cast, index) -> bool:
    """The backward add reading `cast` (its only reader: the micro-batch accumulation, gradient + earlier sum) moves
    right after it when its other operand is already made there; returns whether it moved."""
    users = list(cast.users)
    if len(users) != 1:
        return False
    u = users[0]
    if u.target is not aten.add.Tensor or u.kwargs or phase_of(u) != Phase.BACKWARD or cast.next is u:
        return False
    if any(a is not cast and index[a] > index[cast] for a in u.all_input_nodes):
        return False
    cast.append(u)
    index[u] = index[cast] + 1e-4
    return True


_RANDOM = tags.ops("random")


@dataclass(frozen=True)
class Remat:
    """Activation checkpointing of the modules whose FQN matches `selector` (a glob, e.g. "layers.*"; where a
    matched module contains other matched modules, the outermost one is the checkpointed region): each one's
    forward intermediates are recomputed in the backward, just before their first use, instead of being kept
    alive from forward to backward. The module's inputs and output are kept; random ops (dropout) are kept too,
    so the recomputation sees the same masks.

    policy "full" recomputes every other intermediate. "selective" is per-op checkpointing as torchtitan's "op"
    policy runs it: the outputs of the attention kernels and of every other matmul of a region are kept too, so
    the backward recomputes the remaining matmuls and the cheap ops between them (norms, activations, casts)."""

    selector: str
    policy: str = "full"
    name: str = "Remat"

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise PartitionError(f"remat: policy must be one of {', '.join(POLICIES)}, got {self.policy!r}.")
    in_eval: ClassVar[bool] = False    # an eval step has no backward to recompute for
    axis = ""

    def install(self, model) -> list:
        from ..capture.tags import tracing_graph

        matched = [(fqn, m) for fqn, m in model.named_modules() if fqn and fnmatch.fnmatchcase(fqn, self.selector)]
        if not matched:
            names = [fqn for fqn, _ in model.named_modules() if fqn][:8]
            raise PartitionError(f"remat: selector {self.selector!r} matches no module. Modules look like: "
                                 f"{', '.join(names)}.")
        handles = []
        for fqn, mod in matched:
            start: list = []

            def pre(mod, args, start=start):
                g = tracing_graph()
                start.append(None if g is None else len(g.nodes))

            def post(mod, args, out, fqn=fqn, start=start):
                g = tracing_graph()
                first = start.pop() if start else None
                if g is None or first is None:
                    return
                for n in list(g.nodes)[first:]:
                    if n.op == "call_function":   # hooks of enclosing modules run later: the outermost match wins
                        n.meta[META_REMAT] = fqn

            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
        return handles

    def transform_step(self, state, args):
        return state, args

    def rewrite(self, cap) -> None:
        gm = cap.gm
        nodes, fwd = traced_forward(gm)
        groups: dict = {}
        for n in nodes:
            fqn = n.meta.get(META_REMAT)
            if fqn and n in fwd:
                groups.setdefault(fqn, []).append(n)
        order = {n: i for i, n in enumerate(nodes)}
        for fqn, members in groups.items():
            inside = set(members)
            kept = {n for n in members if f"{fqn}:out" in n.meta.get(META_TAGS, ()) or n.target in _RANDOM
                    or any(u not in inside and u in fwd for u in n.users)}
            kept |= {u for n in members if n.target in _RANDOM for u in n.users if u in inside
                     and u.target is __import__("operator").getitem}
            if self.policy == "selective":
                saved = _saved_kernels(members, inside)
                for n in saved:
                    n.meta[META_SAVED] = fqn      # what torch.utils.checkpoint's cache would hold (sim/allocator.py)
                kept |= saved
            late = {n: [u for u in n.users if u not in fwd and u.op != "output"] for n in members if n not in kept}
            late = {n: us for n, us in late.items() if us}
            if not late:
                continue
            first_use = min((u for us in late.values() for u in us), key=order.get)
            need, stack = set(), list(late)
            while stack:
                n = stack.pop()
                if n in need or n in kept or n not in inside:
                    continue
                need.add(n)
                stack.extend(n.all_input_nodes)
            clones: dict = {}
            with gm.graph.inserting_before(first_use):
                for n in sorted(need, key=order.get):
                    c = gm.graph.node_copy(n, lambda a: clones.get(a, a))
                    c.meta.pop(META_TAGS, None)
                    c.meta.pop(META_TAG, None)
                    c.meta[META_RECOMPUTE] = fqn
                    c.meta[META_RECOMPUTE_OF] = n.name
                    c.meta[META_PHASE] = Phase.BACKWARD
                    clones[n] = c
            for n, us in late.items():
                for u in us:
                    u.replace_input_with(n, clones[n])
        split_param_casts(gm)   # the recomputed forward reads the backward's casts (mixed precision)
        gm.graph.lint()
        gm.recompile()



POLICIES = ("full", "selective")
_MATMULS = tags.ops("matmul")


def _saved_kernels(members: list, inside: set) -> set:
    """What selective checkpointing keeps in one region: attention kernels' outputs (and the getitems reading them)
    and every other matmul's output, in forward order (torchtitan's per-op policy)."""
    saved, mms = set(), 0
    for n in members:
        if n.op != "call_function":
            continue
        if "scaled_dot_product" in str(n.target):
            saved.add(n)
            saved |= {u for u in n.users if u in inside and u.target is operator.getitem}
        elif n.target in _MATMULS:
            if mms % 2 == 0:
                saved.add(n)
            mms += 1
    return saved


def remat(selector: str, policy: str = "full") -> Remat:
    """Activation checkpointing of the modules matching `selector`; policy "full" (recompute every intermediate)
    or "selective" (keep attention outputs and every other matmul's, recompute the rest)."""
    return Remat(selector, policy)
