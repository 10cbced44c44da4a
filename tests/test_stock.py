"""Models as users bring them (issue 9, items 1 and 5): stock Hugging Face models called the documented way
(`model(input_ids=x, labels=y).loss`, default config flags: KV cache on, dropout on), custom autograd.Functions
(old-style, without setup_context), checkpointed blocks, tensors created inside the forward; and the errors a user
can cause, each naming what went wrong."""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import partir_torch as pt
from partir_torch import tactics as T
from partir_torch.errors import TraceError

from tests.harness import adamw, train_next_to_eager


def hf_loss(m, x, y):
    return m(input_ids=x, labels=y).loss


def test_hf_gpt2_default_call_with_labels_bp_mp_z3():
    """GPT-2 with its defaults (use_cache=True builds a DynamicCache of empty tensors; dropout 0.1; the model's own
    shifted cross-entropy with padding by -100) under BP + MP + Z3 on 2x2x2: one device's numerics, no conflicts,
    Megatron's textbook all-reduces and no all-gather of activations or dropout masks."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).train()
    assert model.config.use_cache and model.config.resid_pdrop > 0
    ref = copy.deepcopy(model)
    x = torch.randint(0, 64, (8, 16))
    mesh = pt.Mesh({"batch": 2, "fsdp": 2, "model": 2})
    schedule = [T.data_parallel("batch"), T.data_parallel("fsdp", name="BP-fsdp"), T.megatron("model"),
                T.zero(3, "fsdp")]
    # eps 1e-5: the key bias's gradient is zero in exact arithmetic (softmax ignores a per-query constant), so
    # with eps 1e-8 Adam turns its rounding noise into full +-lr steps in either direction
    prog = pt.partition(model, mesh, schedule, example_inputs=(x, x), loss_fn=hf_loss,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
    assert any(n.startswith("consts.") for n in prog.captured.input_names)   # the cache's tensors, lifted
    train_next_to_eager(prog, ref, [(x, x)] * 2, hf_loss, make_opt=adamw(eps=1e-5))
    assert prog.conflicts == []
    c = Counter((r.kind, r.axis) for r in prog.collectives())
    assert c[("all_reduce", "model")] == 2 * 2 * 2
    assert c[("all_gather", "model")] == 0 and c[("all_gather", "batch")] == 0
    assert {r.tactic for r in prog.collectives() if r.kind == "all_gather"} == {"Z3"}     # parameters only


class OldStyleGelu(torch.autograd.Function):
    """Written the pre-2.0 way (forward takes ctx, no setup_context), as Bloom's GeLU is: functorch's transforms
    refuse it; eager autograd runs it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(1.702 * x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(1.702 * x)
        return g * (s + 1.702 * x * s * (1 - s))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(OldStyleGelu.apply(self.fc1(x)))


class Net(nn.Module):
    """An old-style autograd.Function, a checkpointed block, a tensor constant and a setitem on a fresh tensor in
    the forward."""

    def __init__(self, d=16, classes=8):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.blocks[0](x)
        x = checkpoint(self.blocks[1], x, use_reentrant=False)
        scale = torch.tensor([1.0, 0.5, 2.0, 1.0] * (x.shape[-1] // 4))   # a constant made in the forward
        mask = torch.ones_like(x)
        mask[:, 0] = 0.0                                                    # setitem on a fresh tensor
        return self.head(x * scale * mask)


def net_loss(m, x, y):
    return F.cross_entropy(m(x), y)


def test_custom_function_checkpoint_and_constants_match_one_device():
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 8, (8,))
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), [T.data_parallel("batch"), T.megatron("model")],
                        example_inputs=(x, y), loss_fn=net_loss,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    train_next_to_eager(prog, ref, [(x, y)] * 3, net_loss)
    assert prog.conflicts == []
    assert {r.kind for r in prog.collectives() if r.axis == "batch"} == {"all_reduce"}    # gradients only
    assert prog.sharding("params.blocks.0.fc1.weight").dims[0] == ("model",)


def test_buffers_written_by_the_forward_are_state():
    """A buffer updated in place (a step counter, running statistics) is a state output: it advances on every
    step, like the eager module's."""
    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))
            self.register_buffer("ema", torch.zeros(4))

        def forward(self, x):
            self.calls += 1
            self.ema.mul_(0.9).add_(0.1 * x.detach().mean(0))
            return self.fc(x)

    torch.manual_seed(0)
    model = Counted()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 4)
    lf = lambda m, x: m(x).square().mean()
    prog = pt.partition(model, pt.Mesh({"batch": 4}), [T.data_parallel("batch")], example_inputs=(x,), loss_fn=lf,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    train_next_to_eager(prog, ref, [(x,)] * 3, lf, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1))
    sd = prog.state_dict()["model"]
    assert int(sd["calls"]) == 3
    torch.testing.assert_close(sd["ema"], ref.ema, rtol=1e-6, atol=1e-7)


# -- errors a user can cause ------------------------------------------------------------------------------------------

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, x):
        return self.out(self.emb(x))


def tiny_loss(m, x):
    return F.cross_entropy(m(x).flatten(0, 1), x.flatten())


def _partition(model=None, **kw):
    m = model or Tiny()
    kw.setdefault("example_inputs", (torch.randint(0, 16, (4, 5)),))
    kw.setdefault("loss_fn", tiny_loss)
    return pt.partition(m, pt.Mesh({"b": 2}), [T.data_parallel("b")], **kw)


@pytest.mark.parametrize("kw, pattern", [
    (dict(example_inputs=(torch.rand(4, 5) * 16,)), r"(?s)indices.*float32.*inputs\.0 \(4, 5\) torch\.float32.*torch\.long"),
    (dict(loss_fn=lambda m, x, y: m(x).sum()), r"loss_fn is called as loss_fn\(model, \*example_inputs\).*1 input.*'y'"),
    (dict(loss_fn=lambda m, x: m(x)), r"shape \(4, 5, 16\); the loss must be a scalar"),
    (dict(loss_fn=lambda m, x: {"loss": m(x).sum()}), r"loss_fn returned a dict, not a tensor"),
    (dict(optimizer="Adagrad"), r"Adagrad is not supported\. Supported: .*SGD.*Adam.*AdamW.*To add one"),
])
def test_capture_errors_name_the_cause(kw, pattern):
    m = Tiny()
    if "optimizer" in kw:
        kw["optimizer"] = torch.optim.Adagrad(m.parameters())
    with pytest.raises(pt.PartitionError, match=pattern) as info:
        _partition(model=m, **kw)
    assert "branches on tensor values" not in str(info.value)   # that advice only where it is the cause


def test_data_dependent_branch_is_captured_for_its_path():
    """A branch on a tensor value is a guard of the captured path (issue 26; tests/test_branches.py)."""
    class Branchy(Tiny):
        def forward(self, x):
            y = self.out(self.emb(x))
            return y if y.sum() > 0 else -y

    prog = pt.partition(Branchy(), pt.Mesh({"b": 2}), [T.data_parallel("b")],
                        example_inputs=(torch.randint(0, 16, (4, 5)),), loss_fn=tiny_loss)
    assert [g.where.split(":")[0] for g in prog.captured.guards] == ["test_stock.py"]


def test_writing_a_parameter_in_place_is_refused():
    class Writes(Tiny):
        def forward(self, x):
            with torch.no_grad():
                self.out.bias.mul_(0.5)
            return super().forward(x)

    with pytest.raises(TraceError, match=r"writes into params\.out\.bias in place"):
        pt.partition(Writes(), pt.Mesh({"b": 2}), [T.data_parallel("b")],
                     example_inputs=(torch.randint(0, 16, (4, 5)),), loss_fn=tiny_loss)


@pytest.mark.parametrize("bad, pattern", [
    # a new dtype or shape is another program (runtime/shapes.py): captured again, where the model names the fault
    (lambda x: x.double(), r"(?s)'indices'.*float64.*Give the inputs the dtypes the model expects"),
    (lambda x: x.to("meta"), r"inputs\.0 is on meta"),
])
def test_inputs_are_checked_at_every_call(bad, pattern):
    x = torch.randint(0, 16, (4, 5))
    prog = _partition(example_inputs=(x,))
    prog.loss_and_grads(x)
    with pytest.raises(pt.PartitionError, match=pattern):
        prog.loss_and_grads(bad(x))


def test_a_ragged_batch_is_tiled_unevenly_or_refused_under_strict():
    """3 rows on 2 ranks (2 / 1, issue 22): the same loss and gradients as eager; strict=True refuses it with the
    drop_last fix."""
    x = torch.randint(0, 16, (4, 5))
    model = Tiny()
    eager = copy.deepcopy(model)
    prog = _partition(model, example_inputs=(x,))
    with pytest.warns(UserWarning, match="new input shape"):
        loss, grads = prog.loss_and_grads(x[:3])
    want = tiny_loss(eager, x[:3])
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=0)
    for k, p in eager.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-5, atol=1e-6)
    strict = _partition(example_inputs=(x,), options=pt.Options(strict=True))
    with pytest.raises(pt.PartitionError, match=r"inputs\.0 has shape \(3, 5\); the program tiles its dim 0 on 'b' "
                                                r"\(size 2\), and 2 does not divide 3 \(strict=True.*drop_last=True"):
        strict.loss_and_grads(x[:3])


def test_rules_for_ops_stock_models_reach_verify():
    """Ops that stock models reach and the zoo does not: padding labels by -100 (HF's shifted loss), setitem on a
    fresh tensor (select_scatter / slice_scatter after functionalization), fill, cat with an empty cache."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from partir_torch.verify import verify_graph

    aten = torch.ops.aten

    def f(x, y, labels, empty, none):
        return (F.pad(labels, (0, 1), value=-100), F.pad(x, (1, 2)), F.pad(x, (0, 0, 1, 0), value=0.5),
                aten.select_scatter(x, y[:, 0], 1, 2), aten.slice_scatter(x, y[:, :2], 1, 1, 3),
                aten.fill.Scalar(x, 3.0), torch.cat([empty, x], 1), none.squeeze(1), none.unsqueeze(0))

    gm = make_fx(f, tracing_mode="fake")(torch.randn(6, 4), torch.randn(6, 4), torch.randint(0, 9, (6, 5)),
                                         torch.randn(0), torch.randn(0, 1, 3))   # an empty expert slot
    report = verify_graph(gm)
    assert report.nodes >= 7 and report.factor_checks >= 10, str(report)
    assert not report.wrong and not report.missing and not report.errors, str(report)


def test_parameters_the_loss_does_not_reach_are_skipped_like_torch_optim():
    """A parameter without a gradient (a decoder's cross-attention norm in a decoder-only call) is skipped by
    torch.optim: no weight decay, no moments. The program leaves it alone too."""
    class Partly(Tiny):
        def __init__(self):
            super().__init__()
            self.unused = nn.Linear(8, 8)

    torch.manual_seed(0)
    model = Partly()
    ref = copy.deepcopy(model)
    x = torch.randint(0, 16, (4, 5))
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.5)
    prog = pt.partition(model, pt.Mesh({"b": 2}), [T.data_parallel("b"), T.zero(3, "b")], example_inputs=(x,),
                        loss_fn=tiny_loss, optimizer=make(model.parameters()))
    train_next_to_eager(prog, ref, [(x,)] * 2, tiny_loss, make_opt=make)
    assert torch.equal(prog.gather_parameters()["unused.weight"], model.unused.weight.detach())


def test_register_rule_refuses_duplicates_and_bad_specs():
    reg = pt.rules.RuleRegistry()
    reg.register(torch.ops.aten.mm.default, "mk,kn->mn")
    with pytest.raises(pt.PartitionError, match=r"aten\.mm\.default already has a rule; pass override=True"):
        reg.register(torch.ops.aten.mm.default, "mk,kn->mn")
    reg.register(torch.ops.aten.mm.default, "mk,kn->mn", override=True)
    with pytest.raises(pt.PartitionError, match=r"names 3 operand\(s\), but aten\.bmm\.default takes 2 tensor"):
        reg.register(torch.ops.aten.bmm.default, "bmk,bkn,b->bmn")
    with pytest.raises(pt.PartitionError, match=r"has no '->'"):
        reg.register(torch.ops.aten.bmm.default, "bmk,bkn")
    with pytest.raises(pt.PartitionError, match=r"einsum spec string .* or a callable"):
        reg.register(torch.ops.aten.bmm.default, 42)
    with pytest.raises(pt.PartitionError, match=r"already has a rule"):    # built-ins are protected too
        pt.register_rule(torch.ops.aten.mm.default, "mk,kn->mn")


def test_tensors_the_model_closes_over_are_constants():
    """A plain tensor attribute (not a buffer) and a tensor the loss closes over are lifted as constants."""
    class Scaled(Tiny):
        def __init__(self):
            super().__init__()
            self.scale = torch.linspace(0.5, 1.5, 16)         # a plain attribute, not registered

        def forward(self, x):
            return super().forward(x) * self.scale

    torch.manual_seed(0)
    model = Scaled()
    ref = copy.deepcopy(model)
    weights = torch.rand(16)
    lf = lambda m, x: F.cross_entropy(m(x).flatten(0, 1), x.flatten(), weight=weights)
    x = torch.randint(0, 16, (4, 5))
    prog = pt.partition(model, pt.Mesh({"b": 2}), [T.data_parallel("b")], example_inputs=(x,), loss_fn=lf,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert sum(n.startswith("consts.") for n in prog.captured.input_names) >= 2
    train_next_to_eager(prog, ref, [(x,)] * 2, lf)


def test_a_parameter_read_behind_the_steps_back_is_refused():
    class Cached(Tiny):
        def __init__(self):
            super().__init__()
            self.frozen_view = self.out.weight.data        # a cached alias of a parameter's storage

        def forward(self, x):
            return super().forward(x) + self.emb(x) @ self.frozen_view.t() * 0

    with pytest.raises(TraceError, match=r"reads params\.out\.weight outside the module's parameters"):
        pt.partition(Cached(), pt.Mesh({"b": 2}), [T.data_parallel("b")],
                     example_inputs=(torch.randint(0, 16, (4, 5)),), loss_fn=tiny_loss)


def test_float64_model_trains_in_float64():
    """A float64 model's step is float64 end to end, its loss included (eager returns a float64 loss): batch norm
    over the global batch, data parallelism and ZeRO-3 then equal one device to 1e-12, which is how the coverage
    sweep tells rounding from a wrong program on numerically chaotic tiny convnets. (No conv bias before the norm:
    its gradient is zero in exact arithmetic, and Adam turns the rounding residue into +-lr updates.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.Hardswish(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 6, 6, dtype=torch.float64), torch.randint(0, 5, (8,))
    lf = lambda m, x, y: F.cross_entropy(m(x), y)
    schedule = [T.data_parallel("dp"), T.data_parallel("zero", name="BP-zero"), T.zero(3, "zero")]
    prog = pt.partition(model, pt.Mesh({"dp": 2, "zero": 2}), schedule,
                        example_inputs=(x, y), loss_fn=lf, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = train_next_to_eager(prog, ref, [(x, y)] * 3, lf, adamw(), buffers=True, loss_rtol=1e-12,
                                 param_rtol=1e-12, param_atol=1e-12)
    assert all(got.dtype == torch.float64 for got, _ in losses)


def test_mixed_precision_gradient_upcasts_follow_their_gradients():
    """Autograd would up-cast every bf16 gradient after the whole backward (the forward's casts come first, so
    their backward runs last); mixed_precision moves each up-cast next to the gradient it casts, so a layer's
    gradient reduction can start while the backward goes on and no bf16 gradient lives to the end."""
    from partir_torch.capture import capture

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(4, 8)
    lf = lambda m, x: m(x).float().square().mean()
    cap = capture(model, (x,), lf, torch.optim.AdamW(model.parameters(), lr=1e-3), options=(T.mixed_precision(),))
    nodes = list(cap.gm.graph.nodes)
    ups = [n for n in nodes if n.target is torch.ops.aten._to_copy.default and n.kwargs.get("dtype") == torch.float32
           and n.args[0].meta["val"].dtype == torch.bfloat16 and n.args[0].op != "placeholder"]
    assert len(ups) >= 6, ups     # the six parameters' gradients at least
    assert all(n.prev is n.args[0] for n in ups), [(n.name, n.prev.name, n.args[0].name) for n in ups]
    first_up = min(nodes.index(n) for n in ups)
    last_mm = max(i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default)
    assert first_up < last_mm       # the last layer's gradients are up-cast before the backward ends
