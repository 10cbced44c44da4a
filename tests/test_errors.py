"""User mistakes: each is a PartitionError whose message names the value, the axis with its size, and the fix."""
from __future__ import annotations

import re

import pytest
import torch

import partir_torch as pt
from examples.models import get
from partir_torch.errors import MeshError, SelectorError, ShardingConflictError
from partir_torch.sharding import Sharding

SPEC = get("mlp")


def partition(schedule, mesh=None, batch_size=4, strict=False):
    return pt.partition(SPEC.build(), pt.Mesh(mesh or {"batch": 4}), schedule,
                        example_inputs=SPEC.batch(batch_size), loss_fn=SPEC.loss_fn, options=pt.Options(strict=strict))


def test_unknown_axis_suggests_the_closest():
    with pytest.raises(MeshError) as ei:
        partition([pt.ManualPartition({"inputs.*": 0}, axis="btach", name="BP")],
                  mesh={"batch": 4, "model": 2})
    msg = str(ei.value)
    assert isinstance(ei.value, pt.PartitionError)
    assert msg.startswith("BP: unknown mesh axis 'btach'")
    assert "'batch' (size 4), 'model' (size 2)" in msg and "Did you mean 'batch'?" in msg


def test_dim_not_divisible_by_axis_size_under_strict():
    """strict=True keeps the divisibility error (without it the dim is tiled unevenly: tests/test_uneven.py)."""
    with pytest.raises(ShardingConflictError) as ei:
        partition([pt.ManualPartition({"inputs.*": 0}, axis="batch", name="BP")], batch_size=6, strict=True)
    msg = str(ei.value)
    assert isinstance(ei.value, pt.PartitionError)
    assert "dim 0 of inputs.0 (size 6) cannot be tiled on axis 'batch' (size 4): 4 does not divide 6 " \
           "(strict=True asks for divisible dims)" in msg
    assert msg.startswith("BP:") and "Use a size divisible by 4, or tile another dim, or drop strict=True to " \
                                     "tile it unevenly." in msg


def test_dim_not_divisible_after_an_earlier_tiling_under_strict():
    # dim 0 of fc1.weight (64) is tiled 4 ways by A; B's axis of size 3 does not divide the local 16
    with pytest.raises(ShardingConflictError) as ei:
        partition([pt.ManualPartition({"params.fc1.weight": 0}, axis="a", name="A"),
                   pt.ManualPartition({"params.fc1.weight": 0}, axis="b", name="B")], mesh={"a": 4, "b": 3},
                  strict=True)
    msg = str(ei.value)
    assert "dim 0 of params.fc1.weight (size 16 after earlier tilings) cannot be tiled on axis 'b' (size 3)" in msg


def test_an_unevenly_tiled_dim_takes_no_further_axis():
    # dim 0 of fc1.weight (64) is tiled 3 ways unevenly by A (22, 22, 20); B cannot split it again
    with pytest.raises(ShardingConflictError) as ei:
        partition([pt.ManualPartition({"params.fc1.weight": 0}, axis="a", name="A"),
                   pt.ManualPartition({"params.fc1.weight": 0}, axis="b", name="B")], mesh={"a": 3, "b": 2})
    msg = str(ei.value)
    assert msg.startswith("B: dim 0 of params.fc1.weight (size 64) is tiled unevenly on axis 'a' (size 3), so it "
                          "cannot also be tiled on axis 'b' (size 2)") and "Tile another dim on 'b'." in msg


def test_selector_matching_nothing_lists_closest_names():
    with pytest.raises(SelectorError) as ei:
        partition([pt.ManualPartition({"params.fc9.weight": 0}, axis="batch", name="MP")])
    msg = str(ei.value)
    assert isinstance(ei.value, pt.PartitionError)
    assert msg.startswith("MP: selector 'params.fc9.weight' matches no value.")
    closest = re.search(r"Closest names: ([^.]+(?:\.[^ ,.]+)*(?:, [^ ,]+)*)\.", msg).group(0)
    assert "params.fc1.weight" in closest and "params.fc3.weight" in closest
    assert "inputs.0, params.<fqn>" in msg


def test_regex_selector_matching_nothing():
    pattern = r"params\.fc9.*"
    with pytest.raises(SelectorError, match=re.escape(f"selector {pattern!r} matches no value")):
        partition([pt.ManualPartition({re.compile(pattern): 0}, axis="batch")])


def test_contradicting_seeds_of_two_tactics_on_one_axis():
    with pytest.raises(ShardingConflictError) as ei:
        partition([pt.ManualPartition({"inputs.0": 0}, axis="batch", name="BP"),
                   pt.ManualPartition({"inputs.0": 1}, axis="batch", name="SP")])
    msg = str(ei.value)
    assert msg.startswith("SP: cannot make inputs.0 tiled(dim 1) on axis 'batch' (size 4)")
    assert "tactic BP already made it tiled(dim 0) on that axis" in msg
    assert "seed a different axis, or drop one of the two seeds" in msg


def test_seed_contradicting_what_propagation_decided():
    # BP tiles inputs.0 on dim 0, which propagates to the activations and makes the weight gradient partial;
    # replicating a propagated activation afterwards on the same axis contradicts it
    with pytest.raises(ShardingConflictError) as ei:
        partition([pt.ManualPartition({"inputs.0": 0}, axis="batch", name="BP"),
                   pt.ManualPartition({"fc1:out": pt.REPLICATED}, axis="batch", name="R")])
    assert "R: cannot make fc1:out replicated on axis 'batch'" in str(ei.value)
    assert "tactic BP already made it tiled(dim 0)" in str(ei.value)


def test_dim_out_of_range():
    with pytest.raises(pt.PartitionError) as ei:
        partition([pt.ManualPartition({"inputs.0": 2}, axis="batch", name="BP")])
    msg = str(ei.value)
    assert "BP: inputs.0 has shape (4, 16); dim 2 is out of range for axis 'batch'" in msg
    assert "Use a dim in 0..1 or REPLICATED." in msg
    # negative dims count from the end; -3 is out of range too
    with pytest.raises(pt.PartitionError, match="dim -3 is out of range"):
        partition([pt.ManualPartition({"inputs.0": -3}, axis="batch", name="BP")])
    assert partition([pt.ManualPartition({"inputs.0": -2}, axis="batch")]).sharding("inputs.0").dims == \
        (("batch",), ())


def test_callable_target_returning_a_bad_dim():
    with pytest.raises(pt.PartitionError, match=r"params.fc1.bias has shape \(64,\); dim 1 is out of range"):
        partition([pt.ManualPartition({"params.fc1.*": lambda name, shape: 1}, axis="batch")])


def test_sharding_axis_used_twice():
    with pytest.raises(pt.PartitionError, match="mesh axis 'x' tiles both dim 0 and dim 2"):
        Sharding(dims=(("x",), (), ("x",)))
    with pytest.raises(pt.PartitionError, match="mesh axis 'x' appears twice in dim 1"):
        Sharding(dims=((), ("x", "x")))
    with pytest.raises(pt.PartitionError, match="axis 'x' both tiles dim 0 and is partial"):
        Sharding(dims=(("x",),), partial=(("x", "sum"),))
    with pytest.raises(pt.PartitionError, match="partial reduce op 'mean' on axis 'y' must be one of"):
        Sharding(dims=((),), partial=(("y", "mean"),))
    with pytest.raises(pt.PartitionError, match="axis 'x' is explicitly replicated, so it cannot also tile dim 0"):
        Sharding(dims=(("x",),), replicated={"x"})
    with pytest.raises(MeshError, match="unknown mesh axis 'y'; this mesh has axes 'x' \\(size 2\\)"):
        Sharding(dims=(("y",),)).placements(pt.Mesh({"x": 2}))


@pytest.mark.parametrize("shape,needle", [
    ({}, "Mesh needs a non-empty dict of axis name -> size, got {}"),
    ([("batch", 2)], "Mesh needs a non-empty dict"),
    ({"batch": 0}, "Mesh axis 'batch' has size 0; sizes must be positive ints"),
    ({"batch": 2.0}, "Mesh axis 'batch' has size 2.0"),
    ({"batch": True}, "Mesh axis 'batch' has size True"),
    ({"my axis": 2}, "Mesh axis name 'my axis' must be an identifier string"),
])
def test_bad_mesh(shape, needle):
    with pytest.raises(MeshError) as ei:
        pt.Mesh(shape)
    assert needle in str(ei.value) and isinstance(ei.value, pt.PartitionError)


def test_partition_needs_a_mesh_and_a_loss_for_an_optimizer():
    model = SPEC.build()
    with pytest.raises(pt.PartitionError, match="mesh must be a pt.Mesh, got dict"):
        pt.partition(model, {"batch": 2}, [], example_inputs=SPEC.batch(4))
    with pytest.raises(pt.PartitionError, match="an optimizer needs a loss_fn"):
        pt.partition(model, pt.Mesh({"batch": 2}), [], example_inputs=SPEC.batch(4),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_non_tactic_in_schedule():
    with pytest.raises(pt.PartitionError) as ei:
        partition([pt.ManualPartition({"inputs.*": 0}, axis="batch"), "ZeRO"])
    assert "schedule entry 'ZeRO' is not a tactic" in str(ei.value)
    assert "pt.ManualPartition or a pt.tactics preset" in str(ei.value)


def test_duplicate_tactic_names():
    with pytest.raises(pt.PartitionError) as ei:
        partition([pt.ManualPartition({"inputs.*": 0}, axis="batch", name="T"),
                   [pt.ManualPartition({"params.fc1.weight": 1}, axis="batch", name="T")]])   # nested list
    msg = str(ei.value)
    assert "tactic names must be unique" in msg and "['T']" in msg and "Pass name=..." in msg


def test_bad_selector_and_empty_tactic():
    with pytest.raises(pt.PartitionError, match="selector 3 must be a glob string, a compiled regex or a callable"):
        pt.ManualPartition({3: 0}, axis="batch")
    with pytest.raises(pt.PartitionError, match="ManualPartition needs a non-empty dict selector -> dim"):
        pt.ManualPartition({}, axis="batch")


def test_unknown_value_name_in_queries():
    prog = partition([pt.ManualPartition({"inputs.*": 0}, axis="batch")])
    with pytest.raises(pt.PartitionError) as ei:
        prog.sharding("params.fc1.wieght")
    assert "no value named 'params.fc1.wieght'" in str(ei.value) and "params.fc1.weight" in str(ei.value)
