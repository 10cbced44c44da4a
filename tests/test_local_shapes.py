"""Local shapes of the per-device program (lower/fakeprop.py): the meta run's memo gives exactly what the meta
kernels give, and runs each repeated op once per signature; lowering and the meta run do not pay the collector;
lowering's node builder (reshard.call_function) builds what fx's Graph.call_function builds."""
from __future__ import annotations

import gc
from collections import Counter

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

import partir_torch as pt
from partir_torch import tactics as T
from partir_torch.lower import fakeprop
from partir_torch.lower.lower import Lowerer
from partir_torch.lower.reshard import call_function
from examples.models import get

aten = torch.ops.aten


class _Count(TorchDispatchMode):
    """The aten ops dispatched (a memo hit dispatches empty_strided, not the op)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def _facts(v):
    """Everything a meta value says: shape, strides, offset, dtype, flags (per tensor of a tuple)."""
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device, v.requires_grad, v.is_conj(),
                v.is_neg(), v._is_view())
    if isinstance(v, (list, tuple)):
        return type(v), [_facts(x) for x in v]
    return type(v), v


def _reference(gm, args) -> dict:
    """node name -> the meta kernels' own results (every op run, no memo)."""
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        interp.run(*args)
    return {n.name: _facts(v) for n, v in interp.env.items()}


def _scalars_graph():
    """Ops whose result depends on the Python type of a scalar (1, 1.0 and True promote differently) or on an
    operand's strides (a transposed operand lays out the result after it), each repeated."""
    g = fx.Graph()
    i, b, x = g.placeholder("i"), g.placeholder("b"), g.placeholder("x")
    xt = g.call_function(aten.t.default, (x,))
    outs = []
    for _ in range(3):
        outs += [g.call_function(aten.add.Tensor, (i, 1)), g.call_function(aten.add.Tensor, (i, 1.0)),
                 g.call_function(aten.add.Tensor, (b, True)), g.call_function(aten.add.Tensor, (b, 1)),
                 g.call_function(aten.mul.Tensor, (x, 2.0)), g.call_function(aten.mul.Tensor, (xt, 2.0)),
                 g.call_function(aten.sum.dim_IntList, (x, [0], True)),
                 g.call_function(aten.sum.dim_IntList, (x, [0], False))]
        outs.append(g.call_function(aten.t.default, (outs[-4],)))          # a view of a memoised result
        outs.append(g.call_function(torch.ops._c10d_functional.wait_tensor.default, (x,)))
    g.output(tuple(outs))
    args = [torch.empty(3, 4, dtype=torch.int64, device="meta"), torch.empty(3, 4, dtype=torch.bool, device="meta"),
            torch.empty(3, 4, device="meta")]
    return fx.GraphModule(torch.nn.Module(), g), args


def test_memo_gives_the_kernels_results_and_runs_each_signature_once():
    gm, args = _scalars_graph()
    want = _reference(gm, args)
    with _Count() as seen, torch.no_grad():
        fakeprop._MetaProp(gm).run(*[a.clone() for a in args])
    got = {n.name: _facts(n.meta["val"]) for n in gm.graph.nodes}
    assert got == want and len(want) == len(gm.graph.nodes)
    dtypes = [n.meta["val"].dtype for n in gm.graph.nodes if n.target == aten.add.Tensor][:4]
    assert dtypes == [torch.int64, torch.float32, torch.bool, torch.int64]
    assert [n.meta["val"].stride() for n in gm.graph.nodes if n.target == aten.mul.Tensor][:2] == [(4, 1), (1, 4)]
    assert seen.ops[aten.add.Tensor] == 4 and seen.ops[aten.mul.Tensor] == 2 and seen.ops[aten.sum.dim_IntList] == 2
    assert seen.ops[aten.t.default] == 4                                   # views run every time (they alias)
    views = [n for n in gm.graph.nodes if n.target == aten.t.default][1:]
    assert all(n.meta["val"]._base is n.args[0].meta["val"] for n in views)
    assert seen.ops[torch.ops._c10d_functional.wait_tensor.default] == 1


def test_lowered_program_local_shapes_equal_the_unmemoised_run():
    spec = get("gpt_sdpa", layers=3)
    model = spec.build(device="meta")
    prog = pt.partition(model, pt.Mesh({"batch": 4, "model": 2}),
                        [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")],
                        example_inputs=spec.batch(8, device="meta"), loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters()))
    low = prog.plan.lowered()
    with _Count() as seen:
        fakeprop.annotate_local_vals(low, prog.plan.captured)
    got = {n.name: _facts(n.meta.get("val")) for n in low.gm.graph.nodes}
    cap = [n.meta["val"] for n in prog.plan.captured.gm.graph.nodes if n.op == "placeholder"]
    args = [torch.empty(tuple(s) if s is not None else tuple(v.shape), dtype=v.dtype, device="meta")
            for v, s in zip(cap, low.local_shapes)] + [torch.zeros((), dtype=torch.int64, device="meta")] * 2
    want = _reference(low.gm, args)
    assert {k: got[k] for k in want} == want
    made = Counter(n.target for n in low.gm.graph.nodes if n.op == "call_function" and fakeprop._allocates(n.target))
    for op in (aten.mm.default, aten.add.Tensor):         # three identical layers: one run per signature
        assert made[op] >= 20 and 1 <= seen.ops[op] < made[op] / 2, (op, made[op], seen.ops[op])


def test_lowering_and_local_shapes_run_without_the_collector(monkeypatch):
    enabled = []
    run, annotate = Lowerer.run, fakeprop.annotate_local_vals
    monkeypatch.setattr(Lowerer, "run", lambda self: (enabled.append(gc.isenabled()), run(self))[1])
    monkeypatch.setattr(fakeprop, "annotate_local_vals",
                        lambda low, cap, memo=None: (enabled.append(gc.isenabled()), annotate(low, cap, memo))[1])
    spec = get("mlp")
    model = spec.build()
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=spec.batch(4),
                        loss_fn=spec.loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    was = gc.isenabled()
    gc.enable()
    try:
        prog.simulate(pt.sim.hardware("h100", gpus_per_node=2), stages=False)
        assert enabled == [False, False] and gc.isenabled()                # paused, then given back
    finally:
        if not was:
            gc.disable()


def test_call_function_builds_what_fx_builds():
    def build(make):
        g = fx.Graph()
        x, y = g.placeholder("x"), g.placeholder("y")
        a = make(g, aten.mm.default, (x, y), None)
        b = make(g, aten.cat.default, ([a, x, a], 0), None)
        c = make(g, aten.clone.default, (b,), {"memory_format": torch.contiguous_format})
        d = make(g, aten.add.Tensor, (c, x), {"alpha": 2})
        g.output((d, a))
        return g

    ours = build(call_function)
    theirs = build(lambda g, t, args, kwargs: g.call_function(t, args, kwargs))

    def facts(g):
        return [(n.name, n.op, n.target, repr(n.args), repr(n.kwargs), type(n.args), type(n.kwargs),
                 [u.name for u in n.all_input_nodes], [u.name for u in n.users]) for n in g.nodes]

    assert facts(ours) == facts(theirs) and ours.python_code("self").src == theirs.python_code("self").src
    ours.lint()
