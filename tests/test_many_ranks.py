"""Emulation from 1 to 64 ranks (1-D and 2-D meshes): same numerics as one device."""
from __future__ import annotations

import copy

import pytest
import torch

import partir_torch as pt
from partir_torch import tactics as T
from examples.models import get
from tests.harness import adamw, train_next_to_eager


def train_like_single_device(spec, mesh, schedule, batch, eps=1e-8):
    """Two AdamW steps partitioned next to eager AdamW on a copy (tests/harness.py): losses and every parameter
    equal; returns prog."""
    model = spec.build()
    ref = copy.deepcopy(model)
    data = spec.batch(batch)
    prog = pt.partition(model, pt.Mesh(mesh), schedule, example_inputs=data, loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps))
    train_next_to_eager(prog, ref, [data] * 2, spec.loss_fn, adamw(eps=eps), what=f"{mesh}")
    return prog


@pytest.mark.parametrize("mesh", [{"batch": 1}, {"batch": 64}, {"batch": 8, "model": 8}],
                         ids=["1", "64", "8x8"])
def test_mlp_train_steps_match_single_device(mesh):
    schedule = [T.data_parallel("batch")] + ([T.megatron("model")] if "model" in mesh else [])
    train_like_single_device(get("mlp"), mesh, schedule, batch=64)


def test_expert_parallel_one_expert_per_rank_on_16_ranks():
    """GShard MoE with 8 experts, EP on 8 ranks (one expert each, token groups split 8 ways) x Megatron on 2."""
    prog = train_like_single_device(get("moe", dispatch="capacity", experts=8), {"data": 8, "model": 2},
                                    [T.expert_parallel("data"), T.megatron("model")], batch=8, eps=1e-5)
    assert sum(r.kind == "all_to_all" for r in prog.collectives()) == 8     # 2 layers x 2 exchanges x fwd + bwd
