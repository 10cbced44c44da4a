"""Hand-built per-device programs in the lowered format, for tests, speed checks and examples.

:class:`GraphBuilder` appends aten calls to an ``fx.Graph``, computing each ``meta["val"]`` by running the op on
fake tensors (memoised by shapes), and adds collectives with their ``CollectiveRecord`` and ``wait_tensor``.
:func:`synthetic_train_step` builds a Megatron(+data parallel) MLP training step of any length.

>>> from partir_torch.mesh import Mesh
>>> gm = synthetic_train_step(Mesh({"batch": 2, "model": 4}), layers=2)
>>> sum(1 for n in gm.graph.nodes if "wait_tensor" in str(n.target))
8
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..contract import META_COLLECTIVE, META_NAME, META_ROLE
from ..lower.records import CollectiveRecord

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


class GraphBuilder:
    """Builds a per-device FX graph with fake ``meta["val"]`` on every node."""

    def __init__(self, mesh=None):
        self.graph = torch.fx.Graph()
        self.mesh = mesh
        self.mode = FakeTensorMode()
        self._memo: dict = {}

    def fake(self, shape, dtype=torch.float32):
        with self.mode:
            return torch.empty(shape, dtype=dtype)

    def input(self, name, shape, role="input", dtype=torch.float32, value_name=None):
        n = self.graph.placeholder(name)
        n.meta["val"] = self.fake(shape, dtype)
        n.meta[META_ROLE] = role
        n.meta[META_NAME] = value_name or name
        return n

    def call(self, target, *args, **kwargs):
        """Append ``target(*args, **kwargs)``; Node args stand for their values."""
        n = self.graph.call_function(target, args, kwargs)
        key = (target, _sig(args), _sig(tuple(sorted(kwargs.items()))))
        if key not in self._memo:
            vals = torch.fx.node.map_aggregate(args, lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a)
            kw = torch.fx.node.map_aggregate(kwargs, lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a)
            with self.mode:
                self._memo[key] = target(*vals, **kw)
        n.meta["val"] = self._memo[key]
        return n

    def getitem(self, node, i):
        n = self.graph.call_function(__import__("operator").getitem, (node, i))
        n.meta["val"] = node.meta["val"][i]
        return n

    def collective(self, kind, x, axis, tactic="", value="", dim=0, phase=""):
        """Append a functional collective on mesh axis ``axis`` and return the collective node (wait it later)."""
        g = self.mesh.axis_size(axis)
        v = x.meta["val"]
        shape = list(v.shape)
        if kind == "all_reduce":
            n = self.graph.call_function(c10d.all_reduce.default, (x, "sum", axis))
            full = v
        elif kind == "all_gather":
            n = self.graph.call_function(c10d.all_gather_into_tensor.default, (x, g, axis))
            shape[0] *= g
            full = None
        elif kind == "reduce_scatter":
            n = self.graph.call_function(c10d.reduce_scatter_tensor.default, (x, "sum", g, axis))
            shape[0] //= g
            full = v
        else:
            n = self.graph.call_function(c10d.all_to_all_single.default, (x, None, None, axis))
            full = v
        n.meta["val"] = self.fake(shape, v.dtype)
        nbytes = (full if full is not None else n.meta["val"]).numel() * v.element_size()
        n.meta[META_COLLECTIVE] = CollectiveRecord(kind, axis, g, nbytes, str(v.dtype).replace("torch.", ""),
                                                   tactic, value or x.name, n.name, dim=dim, phase=phase)
        return n

    def wait(self, coll):
        n = self.graph.call_function(c10d.wait_tensor.default, (coll,))
        n.meta["val"] = coll.meta["val"]
        return n

    def output(self, nodes, names=None):
        out = self.graph.output(tuple(nodes))
        if names is not None:
            out.meta[META_NAME] = list(names)
        return out

    def module(self) -> torch.fx.GraphModule:
        return torch.fx.GraphModule(torch.nn.Module(), self.graph)


def _sig(a):
    if isinstance(a, torch.fx.Node):
        v = a.meta["val"]
        return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("node", a.name)
    if isinstance(a, (tuple, list)):
        return tuple(_sig(x) for x in a)
    return a


def synthetic_train_step(mesh, layers=4, tokens=1024, d=512, dtype=torch.bfloat16, dp="batch", tp="model"):
    """A per-device SGD training step of a residual MLP stack: Megatron tensor parallelism on ``tp`` (an all_reduce
    of the activations per layer, forward and backward) and data parallelism on ``dp`` (an all_reduce per weight
    gradient, waited on by the optimizer). About 30 nodes per layer."""
    b = GraphBuilder(mesh)
    t = mesh.axis_size(tp)
    h = 4 * d // t
    x = b.input("x", (tokens, d), "input", dtype, "inputs.0")
    lr = b.input("lr", (), "lr", torch.float32)
    ws = [(b.input(f"w1_{i}", (d, h), "param", dtype, f"params.l{i}.w1"),
           b.input(f"w2_{i}", (h, d), "param", dtype, f"params.l{i}.w2")) for i in range(layers)]
    acts, y = [], x
    for w1, w2 in ws:                                                # forward
        a = b.call(aten.mm.default, y, w1)                           # (tokens, 4d/t)
        g = b.call(aten.gelu.default, a)
        p = b.call(aten.mm.default, g, w2)                           # (tokens, d) partial on tp
        r = b.wait(b.collective("all_reduce", p, tp, "MP", phase="forward"))
        acts.append((y, a, g))
        y = b.call(aten.add.Tensor, y, r)
    loss = b.call(aten.sum.default, b.call(aten.mul.Tensor, y, y))
    dy = b.call(aten.mul.Tensor, y, 2.0)
    pending = []
    for (w1, w2), (yi, a, g) in zip(reversed(ws), reversed(acts)):   # backward
        dw2 = b.call(aten.mm.default, b.call(aten.t.default, g), dy)
        pending.append((w2, b.collective("all_reduce", dw2, dp, "BP", phase="backward")))
        dg = b.call(aten.mm.default, dy, b.call(aten.t.default, w2))
        da = b.call(aten.gelu_backward.default, dg, a)
        dw1 = b.call(aten.mm.default, b.call(aten.t.default, yi), da)
        pending.append((w1, b.collective("all_reduce", dw1, dp, "BP", phase="backward")))
        dx = b.call(aten.mm.default, da, b.call(aten.t.default, w1))
        dx = b.wait(b.collective("all_reduce", dx, tp, "MP", phase="backward"))
        dy = b.call(aten.add.Tensor, dy, dx)
    outs, names = [], []
    for w, coll in pending:                                          # optimizer (SGD)
        grad = b.wait(coll)
        step = b.call(aten.mul.Tensor, grad, lr)
        outs.append(b.call(aten.sub.Tensor, w, step))
        names.append(w.meta[META_NAME])
    b.output(outs + [loss], names + ["loss"])
    return b.module()
