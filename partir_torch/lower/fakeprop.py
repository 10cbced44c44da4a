"""Local shapes on the per-device program: every node's meta["val"] gets a tensor with its local shape and dtype
(the simulator, the memory sweep and the reports read it).

The program is run once on `meta` tensors (shapes, dtypes and strides, no data, no memory): about 4x faster than
fake-tensor propagation (FakeTensorProp's dispatch cache and device bookkeeping), which matters because
`prog.simulate` lowers and annotates one program per tactic stage. Ops that create tensors on a device are run on
`meta` instead, constants are read as meta tensors; kernels of our own (lower/fuse.py's adam_update) take the shapes-only path on meta operands.

A program repeats itself (32 identical layers): an op that allocates its results (no view, no write) is run on
meta once per signature (the op, its tensors' shapes, strides, dtypes and offsets, its other arguments with their
types) and its results are made again with those shapes and strides (`torch.empty_strided`), which is what the
meta kernel makes: most elementwise meta kernels are Python (torch._refs, ~100 us a call), an empty tensor ~2 us.
The memo lives for one run (one program), or for the programs of one plan when the plan passes its own
(lower.StageShare: the stages of `prog.simulate(hw, stages=True)` share most signatures); an entry is a function of
its key alone, whichever program made it. A memoised result is a new tensor: where a kernel may hand back its
argument itself (wait_tensor does, for some tensors), the value is an equal tensor instead; nothing reads identity
(sim/memory.py aliases a wait, a view or an in-place result by the op, not by the tensor).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from ..contract import META_NAME

META = torch.device("meta")


def _makes_tensors(target) -> bool:
    """An aten factory (arange, zeros, full, ...): it takes a device, and would default to the CPU."""
    made = _FACTORIES.get(target)
    if made is None:
        schema = getattr(target, "_schema", None)
        made = _FACTORIES[target] = schema is not None and any(a.name == "device" and a.kwarg_only
                                                               for a in schema.arguments)
    return made


_FACTORIES: dict = {}


def _allocates(target) -> bool:
    """An aten (or functional collective) op whose results are new tensors: no result aliases an argument and no
    argument is written. Only these are memoised: a view's result must share its argument's storage."""
    made = _ALLOCATES.get(target)
    if made is None:
        schema = getattr(target, "_schema", None)
        made = _ALLOCATES[target] = isinstance(target, torch._ops.OpOverload) and not schema.is_mutable and all(
            r.alias_info is None for r in schema.returns) and all(a.alias_info is None for a in schema.arguments)
    return made


_ALLOCATES: dict = {}
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


class _Unkeyed(Exception):
    """An argument (or result) the memo cannot describe exactly: the op is run."""


def _sig(a):
    """A hashable stand-in for one argument that determines the meta kernel's results: a tensor's shape, strides,
    dtype and conj/neg bits (not its storage offset: only kernels that allocate their results are memoised, and where
    an operand starts in its storage does not shape them; a bucket's members are views at their offsets in one
    buffer); any other value with its type (1, 1.0 and True promote differently)."""
    if isinstance(a, torch.Tensor):
        if type(a) is not torch.Tensor or a.layout != torch.strided:
            raise _Unkeyed
        return a.shape, a.stride(), a.dtype, a.is_conj(), a.is_neg()
    if isinstance(a, (list, tuple)):
        return type(a), tuple(_sig(x) for x in a)
    if type(a) in _PLAIN:
        return type(a), a
    raise _Unkeyed


def _template(out):
    """How to make a meta kernel's results again (_make): ("t", shape, strides, dtype) per tensor, ("seq", list or
    tuple, items), ("v", value); raises _Unkeyed for a result empty_strided would not make as it is (an offset, a
    flag, a subclass)."""
    if isinstance(out, torch.Tensor):
        if (type(out) is not torch.Tensor or out.storage_offset() or out.requires_grad or out.is_conj()
                or out.is_neg() or out.layout != torch.strided):
            raise _Unkeyed
        return "t", tuple(out.shape), out.stride(), out.dtype
    if type(out) in (list, tuple):
        return "seq", type(out), [_template(x) for x in out]
    if type(out) in _PLAIN:
        return "v", out
    raise _Unkeyed


def _make(t):
    if t[0] == "t":
        _, shape, strides, dtype = t
        return torch.empty_strided(shape, strides, dtype=dtype, device=META)
    if t[0] == "seq":
        _, kind, items = t
        return kind(_make(x) for x in items)
    return t[1]


class _MetaProp(fx.Interpreter):
    def __init__(self, gm, memo: dict | None = None):
        super().__init__(gm)
        # (op, argument signatures) -> results' template, or None: run it each time
        self.memo: dict = {} if memo is None else memo

    def call_function(self, target, args, kwargs):
        if "device" in kwargs or _makes_tensors(target):
            kwargs = {**kwargs, "device": META}
        if not _allocates(target):
            return target(*args, **kwargs)
        try:
            key = (target, _sig(args), _sig(tuple(kwargs.items())))
        except _Unkeyed:
            return target(*args, **kwargs)
        t = self.memo.get(key, False)
        if t is False:
            out = target(*args, **kwargs)
            try:
                self.memo[key] = _template(out)
            except _Unkeyed:
                self.memo[key] = None
            return out
        return target(*args, **kwargs) if t is None else _make(t)

    def get_attr(self, target, args, kwargs):
        t = super().get_attr(target, args, kwargs)            # a constant the capture kept (cpu): its meta twin
        return t.to(META) if isinstance(t, torch.Tensor) else t

    def run(self, *args):
        """fx.Interpreter.run without its per-node bookkeeping (a progress bar, the current-node context, a debug
        log, freeing values after their last use): a program of meta tensors, each kept in its node's meta["val"].
        Placeholders take `args` in order; returns the output's value."""
        env: dict = {}
        it = iter(args)
        for n in self.graph.nodes:
            try:
                if n.op == "placeholder":
                    out = next(it)
                elif n.op == "get_attr":
                    out = self.get_attr(n.target, (), {})
                elif n.op in ("call_function", "output"):
                    a, k = map_arg(n.args, env.__getitem__), map_arg(n.kwargs, env.__getitem__)
                    out = a[0] if n.op == "output" else self.call_function(n.target, a, k)
                else:
                    raise RuntimeError(f"a per-device program has no {n.op} nodes")
            except Exception as e:
                e.add_note(f"While executing {n.format_node()}")
                raise
            env[n] = n.meta["val"] = out
            if n.op == "output":
                return out
        return None


def annotate_graph(graph: fx.Graph, args: list) -> None:
    """meta["val"] on every node of a per-device graph being built (lower/ring.py reads the shapes), from meta
    tensors for its placeholders."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    with torch.no_grad():
        _MetaProp(_LazyGraphModule(torch.nn.Module(), graph)).run(*args)


def annotate_local_vals(lowered, captured, memo: dict | None = None) -> None:
    """Give every node of lowered.gm a meta-device tensor in meta["val"] with its local shape (no memory). memo: the
    meta run's memo to use and extend (lower.StageShare.meta_memo), else one for this run."""
    gm = lowered.gm
    cap_vals = [n.meta["val"] for n in captured.gm.graph.nodes if n.op == "placeholder"]
    args = [torch.empty(tuple(shape) if shape is not None else tuple(val.shape), dtype=val.dtype, device=META)
            for val, shape in zip(cap_vals, lowered.local_shapes)]
    args += [torch.zeros((), dtype=torch.int64, device=META) for _ in lowered.coord_axes]
    with torch.no_grad():
        _MetaProp(gm, memo).run(*args)
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    out.meta[META_NAME] = list(captured.output_names)
    lowered.annotated = True
