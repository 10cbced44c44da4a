"""Random ops inside the step (dropout): their rule keeps the draw whole, so every rank draws the whole mask from
the same generator state and keeps its slice. The partitioned step is then identical to the single-device step
(not merely distribution-equivalent) for any tiling, and a replicated value is the same on every rank. Real ranks
must be seeded alike; the start-up plan check compares their generator states."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import partir_torch as pt
from partir_torch.rules.tags import draws_random

from tests.harness import train_next_to_eager


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


class Sparse(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return self.proj(x).relu()


class Full(Sparse):
    def forward(self, x):
        return torch.tanh(self.proj(x))


class RebuildsOnFirstCall(nn.Module):
    """Like BigBird on a short batch: the first call replaces its attention by another module class, whose
    nn.Linear init draws from the generator before the trained projection is put back in; dropout after it.
    `late`: a dropout draws before the rebuild (BigBirdPegasus: the embeddings' dropout). With `new_weights`, the
    rebuilt module keeps its own fresh projection instead (new parameters)."""

    def __init__(self, d=16, new_weights=False, late=False):
        super().__init__()
        self.emb_drop = nn.Dropout(0.25)
        self.mix = Sparse(d)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(d, 4)
        self.settled, self.new_weights, self.late = False, new_weights, late

    def forward(self, x):
        if self.late:
            x = self.emb_drop(x)
        if not self.settled:
            self.settled = True
            full = Full(self.mix.proj.in_features)       # draws: kaiming_uniform_ of the weight, uniform_ of the bias
            if not self.new_weights:
                full.proj = self.mix.proj
            self.mix = full
        return self.head(self.drop(self.mix(x if self.late else self.emb_drop(x))))


def _rebuild_loss(m, x, y):
    return nn.functional.cross_entropy(m(x), y)


@pytest.mark.parametrize("late", [False, True], ids=["rebuild-first", "dropout-then-rebuild"])
@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                      lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)], ids=["AdamW", "SGD"])
def test_a_model_that_rebuilds_a_module_on_its_first_call_trains_like_eager(make_opt, late):
    """The trace is the model's first call: the steady step (the rebuilt model's) is traced again, and the first
    call's init draws are made once, before the first step, so every step's dropout masks are eager's; a dropout
    that eager draws before the rebuild is drawn before the step (with the init draws after it on the first
    call) and fed to it. Before, the captured step made the dead init draws at every step: the second step's
    masks differed."""
    torch.manual_seed(0)
    model = RebuildsOnFirstCall(late=late).train()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    fed = r" \(1 dropout draw\(s\) eager made before them are made before each step" if late else r"\."
    with pytest.warns(UserWarning, match=r"changed the model \(1 module\(s\): mix: Sparse -> Full\).*first step "
                                         r"makes the 2 random draw\(s\).*in eager's order" + fed):
        prog = pt.partition(model, pt.Mesh({"batch": 2}), [pt.tactics.data_parallel("batch")],
                            example_inputs=(x, y), loss_fn=_rebuild_loss, optimizer=make_opt(model.parameters()))
    assert type(model.mix) is Full     # partition's trace was the model's first call
    assert not any(draws_random(n) and n.target is torch.ops.aten.uniform.default
                   for n in prog.captured.gm.graph.nodes)      # the steady step makes no init draw
    assert [n for n, r in zip(prog.captured.input_names, prog.captured.input_roles) if r == "draw"] == \
        (["draws.bernoulli"] if late else [])
    train_next_to_eager(prog, ref, [(x, y)] * 4, _rebuild_loss, make_opt=make_opt)


def test_a_first_call_that_creates_parameters_is_refused_naming_them():
    model = RebuildsOnFirstCall(new_weights=True).train()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with pytest.raises(pt.PartitionError, match=r"mix: Sparse -> Full.*created 2 parameter\(s\).*mix\.proj\.weight, "
                                                r"mix\.proj\.bias.*Call the model once eagerly"):
        pt.partition(model, pt.Mesh({"batch": 2}), [pt.tactics.data_parallel("batch")], example_inputs=(x, y),
                     loss_fn=_rebuild_loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
