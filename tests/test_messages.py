"""The messages a new user meets first (issue 22, item 5): each names the real cause and the fix, and is a
pt.PartitionError. Programs built on the meta device report (collectives, summary, simulate) but do not run."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import partir_torch as pt
from examples.models import ZOO, get

T = pt.tactics


class Wide(nn.Module):
    """A 256-wide MLP block: fc1 (256 -> 1024), GELU, fc2 (1024 -> 256)."""

    def __init__(self, d: int = 256):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _sum_loss(m, x):
    return m(x).pow(2).mean()


# -- megatron ----------------------------------------------------------------------------------------------------
def test_megatron_axis_size_that_divides_no_dim_says_so():
    """3 does not divide 1024: the pair was found, the axis size is the cause, and 2 / 4 are sizes that fit."""
    with pytest.raises(pt.PartitionError) as e:
        pt.partition(Wide(), pt.Mesh({"model": 3}), [T.megatron("model")], example_inputs=(torch.randn(8, 256),),
                     loss_fn=_sum_loss)
    msg = str(e.value)
    assert "found column-parallel/row-parallel linear pairs" in msg
    assert "axis 'model' (size 3)" in msg and "3 does not divide" in msg
    assert "1024 output features in fc1.weight" in msg
    assert "(2 or 4 or 8 or 16 here)" in msg
    assert "found no" not in msg


def test_megatron_heads_the_axis_does_not_divide_are_named():
    spec = get("gpt_sdpa")     # 4 heads, MLP hidden 128
    with pytest.raises(pt.PartitionError) as e:
        pt.partition(spec.build(), pt.Mesh({"model": 3}), [T.megatron("model")], example_inputs=spec.batch(4),
                     loss_fn=spec.loss_fn)
    msg = str(e.value)
    assert "4 attention heads in layers.0.attn.wq.weight and 5 more" in msg
    assert "128 output features in layers.0.mlp.w1.weight and 1 more" in msg
    assert "(2 or 4 here)" in msg


def test_megatron_without_any_linear_pair_keeps_its_message():
    spec = ZOO["unet"]
    with pytest.raises(pt.PartitionError, match="found no column-parallel/row-parallel linear pair"):
        pt.partition(spec.build(), pt.Mesh({"model": 2}), [T.megatron("model")], example_inputs=spec.batch(2),
                     loss_fn=spec.loss_fn)


@pytest.mark.parametrize("glob, expect", [
    ("fc1", "it names the module fc1, and plan globs name parameters. Use 'fc1.weight'."),
    ("fc?", "it names the modules fc1, fc2, and plan globs name parameters. Use 'fc?.weight'."),
    ("fc1.weigth", "Did you mean 'fc1.weight'"),
])
def test_megatron_plan_glob_naming_a_module_suggests_its_weight(glob, expect):
    with pytest.raises(pt.PartitionError) as e:
        pt.partition(Wide(), pt.Mesh({"model": 2}), [T.megatron("model", plan={glob: "colwise"})],
                     example_inputs=(torch.randn(8, 256),), loss_fn=_sum_loss)
    assert f"plan entry {glob!r} matches no parameter weight" in str(e.value)
    assert expect in str(e.value)


def test_megatron_plan_without_colwise_says_what_is_missing():
    with pytest.raises(pt.PartitionError, match=r"names no 'colwise' weight.*'<fqn glob>.weight': 'colwise'"):
        pt.partition(Wide(), pt.Mesh({"model": 2}), [T.megatron("model", plan={"fc2.weight": "rowwise"})],
                     example_inputs=(torch.randn(8, 256),), loss_fn=_sum_loss)
