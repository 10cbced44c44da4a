"""Context parallelism (CP): the sequence dim of every activation tiled on one mesh axis, attention exact.

    schedule = [T.context_parallel("cp"), T.data_parallel("batch")]

The tactic seeds the sequence dim (`seq_dim`) of every input that has the sequence length there (token ids,
labels, attention and padding masks, position ids) and propagates, with no rule that knows about CP:

- embeddings, norms, the MLP and the loss are per position: they stay local;
- positions (`arange`, and the rotary cos/sin tables indexed by them) are an indexed factor: each rank computes its
  own positions [off, off + T/n) (lower/indexed.py);
- attention tiles the query rows and gathers the keys and values (rules/attention.py: the all_gather of K/V in the
  forward, the reduce_scatter of dK/dV in the backward, both named CP's by explain and audit); SDPA's is_causal,
  which would align the rank's first query with the first key, is computed blockwise at the rank's offset
  (lower/cp.py), and the explicit softmax(q k^T / sqrt(d) + mask) v form needs nothing: its mask is built from the
  rank's positions;
- the causal-LM loss's one-token label shift (HF pads the labels and slices [1:]) gathers the labels, B x T
  integers, once per step: exact, and small next to any activation.

attention="allgather" (Llama 3's choice: K/V are small with grouped-query heads) gathers K/V per layer;
attention="ring" keeps them tiled and passes them around the axis (lower/cp.py: collective_permute steps, an
online-softmax merge; the backward rotates K/V and their gradients), for SDPA kernels (the explicit matmul form
is gathered, with a warning). Both compute a rank's rows blockwise in ring order, so no (T/n, T) causal mask is
ever built. load_balance=True (rank r holding chunks r and 2n-1-r, so causal work is equal on every rank and each
computes only the blocks it sees) is the zigzag layout as a permutation: tactics/cpbalance.py, lower/zigzag.py.
"""
from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, replace

import torch.fx as fx

from ..contract import META_ZIGZAG
from ..errors import PartitionError, source_location, warn
from ..rules import tags
from .base import TacticBase, declare


LONG_SEQUENCE = 2048      # the automatic search offers CP on an axis when a self-attention is at least this long


@declare("context_parallel", macro=True)
@dataclass(frozen=True)
class ContextParallel(TacticBase):
    """CP on `axis`: the sequence dim `seq_dim` of the inputs tiled (see the module docstring)."""

    axis: str = "cp"
    seq_dim: int = 1
    attention: str = "allgather"
    load_balance: bool = False
    name: str = "CP"

    def __post_init__(self):
        if self.attention not in ("allgather", "ring"):
            raise PartitionError(f"context_parallel(attention={self.attention!r}): attention is 'allgather' (keys "
                                 f"and values gathered, the query chunk local) or 'ring'.")
        if self.load_balance and not isinstance(self, BalancedContextParallel):
            raise PartitionError("ContextParallel(load_balance=True): causal load balancing rewrites the captured "
                                 "step (tactics/cpbalance.py); build it with T.context_parallel(axis, "
                                 "load_balance=True).")

    @classmethod
    def macro_actions(cls, ctx, axis: str, name: str) -> list:
        """The automatic search's CP (the "allgather" form: the ring and load balancing are lowering and capture
        choices, made in the schedule): offered when a self-attention kernel's sequence is long (LONG_SEQUENCE or
        more) and the axis divides it."""
        k = ctx.mesh.shape[axis]
        lengths = {n.args[0].meta["val"].shape[-2] for n in _attention_nodes(ctx.captured.gm)
                   if n.args[0].meta["val"].shape[-2] == n.args[1].meta["val"].shape[-2]}
        if not any(t >= LONG_SEQUENCE and t % k == 0 for t in lengths):
            return []
        return [("context_parallel", "preset", (cls(axis, name=name),))]

    def seeds(self, ctx) -> list:
        k = ctx.mesh.shape[self.axis]
        inputs = sorted((n for n in ctx.value_names() if n.startswith("inputs.")),
                        key=lambda n: int(n.split(".")[1]))
        shapes = {n: ctx.value_meta(n)["shape"] for n in inputs}
        lengths = Counter(s[self.seq_dim] for s in shapes.values() if len(s) > self.seq_dim)
        if not lengths:
            raise PartitionError(f"{self.name}: no input has a dim {self.seq_dim} (seq_dim) to tile on axis "
                                 f"'{self.axis}' (size {k}); inputs: "
                                 + ", ".join(f"{n} {tuple(s)}" for n, s in shapes.items()) + ". Pass seq_dim=.")
        length = lengths.most_common(1)[0][0]
        seq = [n for n, s in shapes.items() if len(s) > self.seq_dim and s[self.seq_dim] == length]
        if length % k:
            fit = -(-length // k) * k
            raise PartitionError(
                f"{self.name}: the sequence length {length} (dim {self.seq_dim} of {', '.join(seq)}) cannot be tiled "
                f"on axis '{self.axis}' (size {k}): {k} does not divide {length}. Use a sequence length divisible "
                f"by {k} (e.g. {fit}, padding with the model's pad token and ignore_index labels).")
        return [(n, self.seq_dim) for n in seq]

    def apply(self, ctx) -> None:
        ctx.mesh.check_axis(self.axis, self.name)
        vids, seeds = [], self.seeds(ctx)
        inner = sorted({a for name, dim in seeds for a in ctx.dim_axes(name, dim)})
        if inner:
            warn(f"{self.name}: the sequence dim of {', '.join(n for n, _ in seeds)} is already tiled on "
                 f"{', '.join(repr(a) for a in inner)} by an earlier tactic (e.g. sequence_parallel), so axis "
                 f"'{self.axis}' tiles inside it and every activation that tactic tiles is gathered on "
                 f"'{self.axis}' around attention. Put context_parallel before sequence_parallel in the schedule.")
        for name, dim in seeds:
            vids.append(ctx.graph.name_to_vid[name])
            ctx.prop.seed(self.axis, vids[-1], dim, self.name)
        for node in _key_gradients(ctx.captured.gm):   # dK, dV tiled like K, V: reduced where the kernel makes them
            if ctx.is_unknown(self.axis, node) and node.meta["val"].shape[2] % ctx.mesh.shape[self.axis] == 0:
                vids.append(ctx.graph.vid[node])
                ctx.prop.seed(self.axis, vids[-1], 2, self.name)
        ctx.prop.run(self.axis, self.name, vids)
        self._report(ctx)

    def _report(self, ctx) -> None:
        """Say what CP could not do as asked: a ring without SDPA kernels, attention left whole; and the labels'
        gather of the causal-LM shift (summary)."""
        kernels = _attention_nodes(ctx.captured.gm)
        if self.attention == "ring" and not kernels:
            warn(f"{self.name}: attention='ring' runs fused attention kernels (SDPA) as a ring; this step has none "
                 f"(attention written as softmax(q k^T) v with matmuls), so its keys and values are gathered on axis "
                 f"'{self.axis}' (the 'allgather' form). Use attn_implementation='sdpa' for the ring.")
        shifted = sorted({ctx.graph.name(ctx.graph.vid[n.args[0]]) for n in _label_shifts(ctx.captured.gm)})
        if shifted:
            ctx.remark(self.name, f"{self.name}: the one-token label shift of the causal-LM loss (pad + slice [1:] "
                                  f"of {', '.join(shifted)}) crosses the shards of axis '{self.axis}': the labels "
                                  f"are gathered there (B x T integers, once per step; exact).")
        whole = [n for n in kernels if ctx.op_tactic(self.axis, _op_index(ctx, n)) is None]
        if whole:
            lines = sorted({source_location(n) or n.name for n in whole})
            warn(f"{self.name}: {len(whole)} attention op(s) run on the whole sequence on every rank of axis "
                 f"'{self.axis}' (propagation did not reach their query rows): {'; '.join(lines)}. Their keys, "
                 f"queries and values are gathered there; prog.explain and prog.audit name the values.")


@dataclass(frozen=True)
class BalancedContextParallel(ContextParallel):
    """context_parallel(load_balance=True): CP on the zigzag layout (rank r holding sequence chunks r and 2n-1-r),
    both a tactic and a capture rewrite (tactics/cpbalance.py): the step is captured on the permuted sequence, the
    inputs are laid out in zigzag order by the runtime, and causal attention computes only the visible blocks."""

    load_balance: bool = True
    n: int = 0                  # the axis size, known at capture (bound(mesh))
    in_eval = True

    def bound(self, mesh) -> "BalancedContextParallel":
        return replace(self, n=mesh.shape[self.axis]) if self.axis in mesh.shape else self

    def install(self, model) -> list:
        return []

    def transform_step(self, state: dict, args: tuple):
        return state, args

    def rewrite(self, cap) -> None:
        from .cpbalance import rewrite

        if not self.n:
            raise PartitionError(f"{self.name}: load_balance=True lays the sequence out for the size of axis "
                                 f"'{self.axis}', unknown at capture: pass the mesh (plan.capture_for(..., "
                                 f"mesh=mesh)), or partition with pt.partition.")
        rewrite(cap, self.name, self.axis, self.seq_dim, self.n)

    def without_rewrite(self) -> ContextParallel:
        """The tactic of a program captured without the rewrite (prog.forward, whose sequence outputs would come out
        in zigzag order): plain CP on the same axis, said once."""
        warn(f"{self.name}: the forward-only program (prog.forward) runs context parallelism on axis '{self.axis}' "
             f"without load balancing (its outputs along the sequence stay in the caller's order); train_step and "
             f"eval_step are balanced.")
        return ContextParallel(self.axis, self.seq_dim, self.attention, False, self.name)

    def _report(self, ctx) -> None:
        super()._report(ctx)
        done = (ctx.captured.gm.meta.get(META_ZIGZAG) or {}).get("done", ())
        ctx.remark(self.name, f"{self.name}: load balancing on axis '{self.axis}': the sequence inputs are laid out "
                              f"in zigzag order (rank r holds chunks r and 2n-1-r); rewritten for it: "
                              f"{'; '.join(done) or 'nothing'}.")


def _attention_nodes(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and tags.has(n.target, "attention_kernel")]


def _label_shifts(gm) -> list:
    """constant_pad_nd of an integer input (HF's ForCausalLMLoss pads the labels, then slices [1:])."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and tags.has(n.target, "pads")
            and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder" and not n.args[0].meta["val"].is_floating_point()]


def _key_gradients(gm) -> list:
    """The dK and dV results (getitems 1 and 2) of the self-attention kernels' backwards (queries and keys of one
    length: the keys come from the tiled sequence)."""
    return [u for n in gm.graph.nodes if n.op == "call_function" and tags.has(n.target, "attention_backward")
            and n.args[1].meta["val"].shape[2] == n.args[2].meta["val"].shape[2]
            for u in n.users if u.target is operator.getitem and u.args[1] in (1, 2)]


def _op_index(ctx, node) -> int:
    return next(i for i, op in enumerate(ctx.graph.ops) if op.node is node)


def context_parallel(axis: str = "cp", seq_dim: int = 1, attention: str = "allgather", load_balance: bool = False,
                     name: str = "CP") -> ContextParallel:
    """Context parallelism on `axis` (see ContextParallel): the sequence dim of every input tiled, attention's
    keys and values gathered, the query rows local, causal masks at each rank's offset."""
    if load_balance:
        return BalancedContextParallel(axis, seq_dim, attention, True, name)
    return ContextParallel(axis, seq_dim, attention, load_balance, name)
