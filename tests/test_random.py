"""Random ops inside the step (dropout): their rule keeps the draw whole, so every rank draws the whole mask from
the same generator state and keeps its slice. The partitioned step is then identical to the single-device step
(not merely distribution-equivalent) for any tiling, and a replicated value is the same on every rank. Real ranks
must be seeded alike; the start-up plan check compares their generator states."""
from __future__ import annotations

import torch
import torch.nn as nn

import partir_torch as pt


class Drop(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.lin(self.drop(x))


def test_dropout_is_identical_to_single_device_for_any_tiling():
    p = 0.25
    torch.manual_seed(0)
    model = Drop(p).train()
    x = torch.randn(64, 256)
    for seeds in ([("batch", 0)], [("batch", 1)], [("batch", 0), ("model", 1)]):
        prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}),
                            [pt.ManualPartition({"inputs.0": d}, axis=a, name=f"T{a}") for a, d in seeds],
                            example_inputs=(x,))
        torch.manual_seed(123)
        y = prog(x)
        torch.manual_seed(123)
        torch.testing.assert_close(y, model(x), rtol=1e-6, atol=1e-6)
    # and it is dropout (not a no-op): about a quarter of the inputs are zeroed
    torch.manual_seed(123)
    mask = model.drop(torch.ones(64, 256)) != 0
    assert abs(mask.float().mean().item() - (1 - p)) < 0.02
