"""Peak memory per device from buffer liveness over the program order.

A storage is allocated by the node that produces it and freed after its last use. Views (and getitem of view
lists, and wait_tensor) alias their base, so a storage is counted once; so do the results of an in-place kernel
(the fused optimizer update with donate=True writes its parameters and moments). Placeholders (params, buffers,
optimizer state, inputs) live for the whole step; whatever the output node returns lives to the end. A collective's inputs
stay alive until its wait_tensor (the communication reads them asynchronously). A node's own temporaries (tensors
it creates and frees before it returns) count at that node only: partir's fused optimizer update (lower/fuse.py)
holds its square-root denominators and, with maximize or L2 weight decay, the modified gradients (`_transient`).

This is the figure the runtime measures (partition(..., measure_memory=True), prog.peak_memory(); what is counted:
runtime/memtrack.py): live tensor bytes, each storage once, torch.cuda.max_memory_allocated's figure. It does not
depend on the chip. What PyTorch's caching allocator reserves on a GPU for the same storages (rounding, segments,
fragmentation: max_memory_reserved's figure) is `MemoryResult.reserved_bytes()`, replayed in sim/allocator.py;
library workspaces and the CUDA context are in neither.

Breakdown at the peak:
- parameters / optimizer_state / buffers / inputs: placeholders by ``partir_role`` (and the updated values the
  output returns under ``params.*`` / ``opt.*`` / ``buffers.*`` names);
- gradients: values produced in backward that are still alive when the optimizer update starts (its first node
  that reads optimizer state or the learning rate);
- activations: values produced in forward (up to the loss) and used in backward;
- temporaries: everything else.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from ..contract import META_NAME, META_ROLE, Role
from ..errors import PartitionError
from ..rules import tags
from .compute import FREE, WAIT, elem_bytes, op_class

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "buffers", "inputs")
_ROLE_CATEGORY = {Role.PARAM: "parameters", Role.OPT_STATE: "optimizer_state", Role.BUFFER: "buffers",
                  Role.INPUT: "inputs", Role.LR: "inputs", Role.COORD: "inputs"}
_NAME_CATEGORY = (("params.", "parameters"), ("opt.", "optimizer_state"), ("buffers.", "buffers"))


@dataclass
class MemoryResult:
    peak_bytes: int
    peak_node: str                      # node at which the peak occurs
    breakdown: dict                     # category -> bytes live at the peak
    categories: dict = field(default_factory=dict, repr=False)   # producing node name -> category
    curve: list = field(default_factory=list, repr=False)   # live bytes at each node, program order
    events: tuple = field(default=(), repr=False)    # reserved_bytes' arguments: the storages' liveness
    owners: tuple = field(default=(), repr=False)    # per storage of events, the node that allocates it
    _reserved: dict = field(default_factory=dict, repr=False)

    def reserved_bytes(self, runtime: str = "partir", held: tuple = ()) -> int:
        """What PyTorch's CUDA caching allocator reserves for these storages in the steady state (two steps;
        sim/allocator.py): the figure torch.cuda.max_memory_reserved reports, where peak_bytes is
        max_memory_allocated's. ``runtime``: "partir" (partir's runtime: every buffer on the default stream,
        freed after its last use) or "eager" (the step as eager PyTorch runs it: FSDP2's collective buffers on their
        streams, selective checkpointing's cache: allocator.eager_buffers; ``held``: the parameters FSDP2 does not
        reshard after the forward, globs). Computed on first use."""
        if runtime not in ("partir", "eager"):
            raise PartitionError(f"reserved_bytes: runtime {runtime!r} is not modelled: 'partir' (partir's runtime) "
                                 f"or 'eager' (eager PyTorch's: FSDP2, torch.utils.checkpoint).")
        if held and runtime != "eager":
            raise PartitionError(f"reserved_bytes: held={held!r} names parameters FSDP2 keeps gathered; it applies "
                                 f"to runtime 'eager', not {runtime!r}.")
        key = (runtime, tuple(held))
        if key not in self._reserved:
            from .allocator import eager_buffers, reserved_bytes

            if not self.events:
                self._reserved[key] = self.peak_bytes
            elif runtime == "eager":
                *args, streams = eager_buffers(self.events, self.owners, held)
                self._reserved[key] = reserved_bytes(*args, streams=streams)
            else:
                self._reserved[key] = reserved_bytes(*self.events)
        return self._reserved[key]


_WRITES: dict = {}


def _writes_self(target) -> bool:
    """In-place / out= ops return their (mutated) first argument."""
    hit = _WRITES.get(id(target))
    if hit is None:
        rets = getattr(getattr(target, "_schema", None), "returns", ())
        writes = bool(rets) and rets[0].alias_info is not None and rets[0].alias_info.is_write
        hit = _WRITES[id(target)] = (writes, target)              # keep target alive so its id stays unique
    return hit[0]


def analyze_memory(nodes: list, elems: dict | None = None, inputs: dict | None = None,
                   classes: dict | None = None) -> MemoryResult:
    """Liveness sweep over ``nodes`` (program order). ``elems``: node -> per-tensor bytes of its val; ``inputs``:
    node -> its input nodes; ``classes``: call_function node -> op_class(). Computed here when not given; the
    simulator passes its own to share one pass over the graph."""
    end = len(nodes)
    if elems is None:
        elems = {n: elem_bytes(n.meta.get("val")) for n in nodes}
    if inputs is None:
        inputs = {n: n.all_input_nodes for n in nodes}
    if classes is None:
        classes = {n: op_class(n.target) for n in nodes if n.op == "call_function"}
    sid_of: dict = {}
    donated: dict = {}                  # in-place kernel node -> per result list, the storages it writes
    first: dict = {}                    # a placeholder's storage -> the first node that reads it
    size, born, last, owner = [], [], [], []

    def new(node, nbytes, i):
        size.append(nbytes)
        born.append(i)
        last.append(i)
        owner.append(node)
        return len(size) - 1

    for i, node in enumerate(nodes):
        op = node.op
        if op == "placeholder":                                    # pinned to the end after the loop
            sid_of[node] = [new(node, b, 0) for b in elems[node]]
            continue
        if op == "output":
            for a in inputs[node]:
                for s in sid_of.get(a, ()):
                    last[s] = end
            continue
        if op != "call_function":
            sid_of[node] = [new(node, b, i) for b in elems[node]]
            continue
        cls, info = classes[node]
        sid_of[node] = _storages(node, cls, info, sid_of, donated, elems, lambda b: new(node, b, i))
        for a in inputs[node]:
            for s in sid_of[a]:
                last[s] = i
                if a.op == "placeholder":
                    first.setdefault(s, i)
        if cls == WAIT and node.args and isinstance(node.args[0], torch.fx.Node):
            for a in inputs[node.args[0]]:                 # collective inputs live until the wait
                for s in sid_of.get(a, ()):
                    last[s] = i

    for s, node in enumerate(owner):
        if node.op == "placeholder":
            last[s] = end

    temps = {i: t for i, node in enumerate(nodes) if node.op == "call_function" and (t := _transient(node, elems))}
    curve = _sweep(nodes, temps, size, born, last)
    peak = max(curve, default=0)
    at = curve.index(peak) if curve else 0
    category = _categorize(nodes, inputs, sid_of, born, last, owner)
    breakdown = dict.fromkeys(CATEGORIES, 0)
    for s in range(len(size)):
        if born[s] <= at <= last[s]:
            breakdown[category[s]] += size[s]
    names = {owner[s].name: category[s] for s in range(len(size))}
    for i, t in temps.items():                  # a node's own temporaries: allocated and freed at it
        new(nodes[i], t, i)
    persistent = [s for s, node in enumerate(owner) if node.op == "placeholder"]
    # eager torch.optim creates its state in the first step's update, among the activations' freed blocks
    lazy = {s: first[s] for s in persistent if s in first and owner[s].meta.get(META_ROLE) == Role.OPT_STATE}
    return MemoryResult(peak, nodes[at].name if nodes else "", breakdown, names, curve,
                        (size, born, last, end, persistent, lazy), tuple(owner))


def _storages(node, cls, info, sid_of, donated, elems, new) -> list:
    """The storage ids a call_function node's results use: its input's (views, waits, in-place ops, an in-place
    kernel's results), none (metadata), or new ones (`new(nbytes)`)."""
    target = node.target
    if target is operator.getitem:
        src, idx = node.args[0], node.args[1]
        srcs = sid_of.get(src, ())
        if src in donated:                                         # a list of in-place results
            return donated[src][idx]
        return [srcs[idx]] if isinstance(idx, int) and idx < len(srcs) else []
    if tags.donated_args(target) and node.args[-1] is True:
        # an in-place kernel (lower/fuse.py's adam_update, sgd_update, donate=True): its results are its state arguments
        donated[node] = [[sid_of[x][0] for x in node.args[k] if sid_of.get(x)] for k in tags.donated_args(target)]
        return [s for col in donated[node] for s in col]
    if info == "view" or cls == WAIT or (cls != FREE and _writes_self(target)):
        base = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        bs = sid_of.get(base, ()) if base is not None else ()
        val = node.meta.get("val")
        n = len(val) if isinstance(val, (tuple, list)) else 1
        return [bs[0]] * n if bs else [new(b) for b in elems[node]]
    if cls == FREE and info != "alloc":
        return []
    return [new(b) for b in elems[node]]


def _sweep(nodes, temps, size, born, last) -> list:
    """Live bytes at each node: a sweep over allocation/free events, plus each node's own temporaries there
    (temps: node index -> bytes)."""
    end = len(nodes)
    delta = [0] * (end + 2)
    for i, t in temps.items():
        delta[i] += t
        delta[i + 1] -= t
    for s in range(len(size)):
        delta[born[s]] += size[s]
        delta[last[s] + 1] -= size[s]
    return list(accumulate(delta[:end]))


def _transient(node, elems) -> int:
    """Bytes a node allocates and frees inside itself: 0 for aten ops (their scratch is not tensors); a partir
    kernel's own count (lower/fuse.py's adam_update and sgd_update declare theirs, rules/tags.py TRANSIENT)."""
    size = lambda ts: sum(sum(elems.get(t) or [0]) for t in ts)  # noqa: E731
    return tags.transient_bytes(node.target, node.args, size)


def _categorize(nodes, inputs, sid_of, born, last, owner) -> list:
    out_node = next((n for n in reversed(nodes) if n.op == "output"), None)
    flat_out = _flatten(out_node.args[0]) if out_node is not None and out_node.args else []
    names = out_node.meta.get(META_NAME) if out_node is not None else None
    named: dict = {}
    if isinstance(names, (list, tuple)) and len(names) == len(flat_out):
        for a, nm in zip(flat_out, names):
            if isinstance(a, torch.fx.Node):
                cat = next((c for p, c in _NAME_CATEGORY if str(nm).startswith(p)), None)
                for s in sid_of.get(a, ()):
                    if cat:
                        named[s] = cat
    fwd_end = _loss_index(flat_out, names, len(nodes), sid_of, born)
    opt_start = _optimizer_start(nodes, inputs)
    cats = []
    for s, node in enumerate(owner):
        if node.op == "placeholder":
            cats.append(_ROLE_CATEGORY.get(node.meta.get(META_ROLE), "inputs"))
        elif s in named:
            cats.append(named[s])
        elif born[s] <= fwd_end < last[s]:
            cats.append("activations")
        elif fwd_end < born[s] < opt_start <= last[s]:
            cats.append("gradients")
        else:
            cats.append("temporaries")
    return cats


def _flatten(x) -> list:
    if isinstance(x, (list, tuple)):
        return [y for e in x for y in _flatten(e)]
    if isinstance(x, dict):
        return [y for e in x.values() for y in _flatten(e)]
    return [x]


def _loss_index(flat_out, names, end, sid_of, born) -> int:
    """Program index where forward ends: the loss's producer. Found by output name ("loss"), else the last 0-dim
    floating output. Without one the whole program is forward (no activations)."""
    cand = None
    if isinstance(names, (list, tuple)) and len(names) == len(flat_out):
        cand = next((a for a, nm in zip(flat_out, names) if str(nm).split(".")[-1] == "loss"), None)
    if cand is None:
        for a in reversed(flat_out):
            v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
            if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point() and a.op != "placeholder":
                cand = a
                break
    if cand is None or not sid_of.get(cand):
        return end + 1
    return born[sid_of[cand][0]]


def _optimizer_start(nodes, inputs) -> int:
    """First non-placeholder node that depends on optimizer state or the learning rate (len(nodes) if none)."""
    state = {n for n in nodes if n.op == "placeholder" and n.meta.get(META_ROLE) in (Role.OPT_STATE, Role.LR)}
    for i, n in enumerate(nodes):
        if n.op == "call_function" and any(a in state for a in inputs[n]):
            return i
    return len(nodes)
