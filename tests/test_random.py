"""Random ops inside the step (dropout). Emulated ranks draw each shard at its offset of the single-device stream
(LocalTensorMode's offset-based generator), so the partitioned step is identical to the single-device one, for
any tiling of the random tensor. Real ranks draw from per-rank generators (runtime/executor.py): the same
distribution, independent across ranks, not bit-identical."""
from __future__ import annotations

import torch
import torch.nn as nn

import partir_torch as pt
from partir_torch import tactics as T


class Drop(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(x)


def _program(model, x, seeds):
    return pt.partition(model, pt.Mesh({"batch": 2, "model": 2}),
                        [pt.ManualPartition({"inputs.0": d}, axis=a, name=f"T{a}") for a, d in seeds],
                        example_inputs=(x,))


def test_emulated_dropout_is_identical_to_single_device_for_any_tiling():
    p = 0.25
    model = Drop(p).train()
    x = torch.ones(64, 256)
    for seeds in ([("batch", 0)], [("batch", 1)], [("batch", 0), ("model", 1)]):
        prog = _program(model, x, seeds)
        torch.manual_seed(0)
        y = prog(x)
        torch.manual_seed(0)
        torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    kept = y != 0
    # and it is dropout: each element kept with probability 1 - p (8 sigma band), kept ones scaled by 1/(1-p)
    assert abs(kept.float().mean().item() - (1 - p)) < 8 * (p * (1 - p) / y.numel()) ** 0.5
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / (1 - p)))
    # the four shards are not one repeated mask
    shards = kept.reshape(2, 32, 2, 128).permute(0, 2, 1, 3).reshape(4, 32, 128)
    assert not any(torch.equal(shards[0], shards[r]) for r in range(1, 4))
