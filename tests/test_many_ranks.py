"""Emulation from 1 to 64 ranks (1-D and 2-D meshes): same numerics as one device."""
from __future__ import annotations

import copy
import time

import pytest
import torch

import partir_torch as pt
from partir_torch import tactics as T
from examples.models import get


def train_like_single_device(spec, mesh, schedule, batch, eps=1e-8):
    """Two AdamW steps partitioned next to eager AdamW on a copy: losses and parameters equal; returns prog."""
    model = spec.build()
    ref = copy.deepcopy(model)
    data = spec.batch(batch)
    start = time.time()
    prog = pt.partition(model, pt.Mesh(mesh), schedule, example_inputs=data, loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=eps)
    for _ in range(2):
        loss = prog.train_step(*data)
        ref_opt.zero_grad()
        ref_loss = spec.loss_fn(ref, *data)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    got = prog.gather_parameters()
    for k, p in ref.named_parameters():
        torch.testing.assert_close(got[k], p.detach(), rtol=1e-5, atol=1e-5, msg=k)
    assert time.time() - start < 60
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
