"""Core types: Mesh, Sharding (printing, round trips, DTensor placements), and rules for user ops."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard

import partir_torch as pt
from partir_torch.rules.registry import RuleRegistry, default_registry
from partir_torch.sharding import Sharding


# -- Mesh --------------------------------------------------------------------------------------------------------
def test_mesh_coordinates_round_trip_row_major():
    m = pt.Mesh({"pod": 2, "batch": 3, "model": 4})
    assert (m.size, m.axes, m.axis_size("batch")) == (24, ("pod", "batch", "model"), 3)
    assert m.coordinate(0) == {"pod": 0, "batch": 0, "model": 0}
    assert m.coordinate(1) == {"pod": 0, "batch": 0, "model": 1}       # the last axis varies fastest
    assert m.coordinate(4) == {"pod": 0, "batch": 1, "model": 0}
    assert m.coordinate(23) == {"pod": 1, "batch": 2, "model": 3}
    assert [m.rank_of(m.coordinate(r)) for r in range(m.size)] == list(range(24))
    assert len({tuple(m.coordinate(r).values()) for r in range(m.size)}) == 24


def test_mesh_axis_groups():
    m = pt.Mesh({"batch": 2, "model": 4})
    assert m.axis_groups("model") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.axis_groups("batch") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    m3 = pt.Mesh({"a": 2, "b": 3, "c": 2})
    for axis in m3.axes:
        groups = m3.axis_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(12))       # a partition of the ranks
        assert all(len(g) == m3.shape[axis] for g in groups)
        for g in groups:   # members differ exactly in `axis`, and are ordered by it
            coords = [m3.coordinate(r) for r in g]
            assert [c[axis] for c in coords] == list(range(m3.shape[axis]))
            assert all({k: v for k, v in c.items() if k != axis} ==
                       {k: v for k, v in coords[0].items() if k != axis} for c in coords)


def test_mesh_repr_round_trips_and_str():
    m = pt.Mesh({"batch": 2, "model": 4})
    assert repr(m) == "Mesh({'batch': 2, 'model': 4})"
    assert eval(repr(m), {"Mesh": pt.Mesh}) == m
    assert hash(eval(repr(m), {"Mesh": pt.Mesh})) == hash(m)
    assert str(m) == "Mesh(batch=2 x model=4)"
    assert pt.Mesh({"model": 4, "batch": 2}) != m                  # axis order matters


# -- Sharding ----------------------------------------------------------------------------------------------------
def test_sharding_str():
    assert str(Sharding(dims=(("batch",), (), ("model",)))) == "[{batch}, {}, {model}]"
    s = Sharding(dims=(("batch", "model"), ()), partial=(("x", "sum"), ("y", "max"), ("z", "sum")),
                 replicated={"r", "q"})
    assert str(s) == "[{batch, model}, {}] partial(sum)={x, z} partial(max)={y} replicated={q, r}"
    assert str(Sharding.replicate(2)) == "[{}, {}]" and Sharding.replicate(2).is_replicated()
    assert str(Sharding(dims=())) == "[]"


@pytest.mark.parametrize("s", [
    Sharding(dims=(("batch",), (), ("model",))),
    Sharding(dims=((), ()), partial=(("model", "sum"),)),
    Sharding(dims=(("a", "b"),), partial=(("c", "min"),), replicated=frozenset({"d", "e"})),
    Sharding(dims=()),
], ids=str)
def test_sharding_repr_round_trips(s):
    back = eval(repr(s), {"Sharding": Sharding})
    assert back == s and repr(back) == repr(s) and hash(back) == hash(s)


def test_sharding_placements():
    mesh = pt.Mesh({"batch": 2, "model": 2, "zero": 2})
    s = Sharding(dims=((), ("batch",), ("model",)))
    assert s.placements(mesh) == (Shard(1), Shard(2), Replicate())
    p = Sharding(dims=(("zero",), ()), partial=(("batch", "max"), ("model", "sum")))
    assert p.placements(mesh) == (Partial("max"), Partial("sum"), Shard(0))
    assert Sharding.replicate(3).placements(mesh) == (Replicate(),) * 3
    assert Sharding(dims=((),), replicated={"model"}).placements(mesh) == (Replicate(),) * 3
    assert s.local_shape((8, 6, 4), mesh) == (8, 3, 2)
    assert Sharding(dims=(("batch", "model"),)).local_shape((8,), mesh) == (2,)


def test_placements_build_a_dtensor():
    """DTensor accepts the placements (a 1-rank gloo group; torn down again so later tests see no group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    s = Sharding(dims=(("model",), ()), partial=(("batch", "sum"),))
    mesh = pt.Mesh({"batch": 1, "model": 1})
    full = torch.arange(8.0).reshape(4, 2)
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dm = init_device_mesh("cpu", (1, 1), mesh_dim_names=mesh.axes)
        d = DTensor.from_local(full, dm, s.placements(mesh))
        assert d.placements == (Partial("sum"), Shard(0))
        torch.testing.assert_close(d.full_tensor(), full)
    finally:
        if own:
            dist.destroy_process_group()
    assert dist.is_initialized() is not own


# -- rules for user ops ------------------------------------------------------------------------------------------
@torch.library.custom_op("partir_test::scale_cols", mutates_args=())
def scale_cols(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


@scale_cols.register_fake
def _(x, w):
    return torch.empty_like(x)


@torch.library.custom_op("partir_test::no_rule", mutates_args=())
def no_rule(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@no_rule.register_fake
def _(x):
    return torch.empty_like(x)


class UserOps(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.ones(8))
        self.op = op

    def forward(self, x):
        h = self.fc(x)                                   # (B, 8)
        y = scale_cols(h, self.w) if self.op == "scale_cols" else no_rule(h)
        return torch.relu(y)


def test_register_rule_for_a_user_op():
    pt.register_rule(torch.ops.partir_test.scale_cols.default, "mn,n->mn")
    assert torch.ops.partir_test.scale_cols.default in default_registry()
    x = torch.randn(4, 8)
    prog = pt.partition(UserOps("scale_cols"), pt.Mesh({"batch": 2, "model": 2}),
                        [pt.ManualPartition({"inputs.0": 0}, axis="batch", name="BP"),
                         pt.ManualPartition({"params.w": 0}, axis="model", name="MP")], example_inputs=(x,))
    (node,) = [n for n in prog.graph.gm.graph.nodes if n.target == torch.ops.partir_test.scale_cols.default]
    relu = next(iter(node.users))
    # batch flows through the user op's m factor, model from its w operand into the result's n factor
    assert prog.sharding_of_vid(prog.graph.vid[node]).dims == (("batch",), ("model",))
    assert prog.sharding_of_vid(prog.graph.vid[relu]).dims == (("batch",), ("model",))
    # and backwards from it: fc's output is tiled on n, so fc.weight is tiled on its output dim
    assert prog.sharding("fc:out").dims == (("batch",), ("model",))
    assert prog.sharding("params.fc.weight").dims == (("model",), ())
    assert "partir_test.scale_cols.default" in prog.explain("params.fc.weight")


def test_user_op_without_rule_is_a_barrier_with_one_warning():
    reg = RuleRegistry(dict((op, default_registry()._rules[op]) for op in default_registry().ops()))
    x = torch.randn(4, 8)
    sched = [pt.ManualPartition({"inputs.0": 0}, axis="batch", name="BP")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):   # two partitions with the same registry: still one warning
            prog = pt.partition(UserOps("no_rule"), pt.Mesh({"batch": 2}), sched, example_inputs=(x,),
                                registry=reg)
    msgs = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert len(msgs) == 1 and "partir_test.no_rule.default" in msgs[0]
    (node,) = [n for n in prog.graph.gm.graph.nodes if n.target == torch.ops.partir_test.no_rule.default]
    assert prog.sharding("fc:out").dims == (("batch",), ())                        # up to the barrier
    assert prog.sharding_of_vid(prog.graph.vid[node]).is_replicated()              # stays whole after it
    assert prog.sharding_of_vid(prog.graph.vid[next(iter(node.users))]).is_replicated()


def test_injected_registry_overrides_default():
    """A registry built for a test decides propagation: with mm as a barrier, nothing passes the matmul."""
    table = {op: default_registry()._rules[op] for op in default_registry().ops()
             if op != torch.ops.aten.mm.default}
    reg = RuleRegistry(table)
    model = nn.Linear(8, 8)
    sched = [pt.ManualPartition({"inputs.0": 0}, axis="batch", name="BP")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        barrier = pt.partition(model, pt.Mesh({"batch": 2}), sched, example_inputs=(torch.randn(4, 8),),
                               registry=reg)
    normal = pt.partition(model, pt.Mesh({"batch": 2}), sched, example_inputs=(torch.randn(4, 8),))
    assert barrier.sharding("inputs.0").dims == (("batch",), ())
    assert barrier.sharding("outputs.0").is_replicated()
    assert normal.sharding("outputs.0").dims == (("batch",), ())
