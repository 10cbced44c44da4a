"""Emulation from 1 to 64 ranks (1-D and 2-D meshes): same numerics as one device."""
from __future__ import annotations

import copy
import time

import pytest
import torch

import partir_torch as pt
from partir_torch import tactics as T
from examples.models import get


@pytest.mark.parametrize("mesh", [{"batch": 1}, {"batch": 64}, {"batch": 8, "model": 8}],
                         ids=["1", "64", "8x8"])
def test_mlp_train_steps_match_single_device(mesh):
    spec = get("mlp")
    model = spec.build()
    ref = copy.deepcopy(model)
    data = spec.batch(64)
    schedule = [T.data_parallel("batch")] + ([T.megatron("model")] if "model" in mesh else [])
    start = time.time()
    prog = pt.partition(model, pt.Mesh(mesh), schedule, example_inputs=data, loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
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
