"""Norms and recurrent layers under data parallelism (issue 9, items 2 and 4).

Batch norm in train mode keeps single-device semantics (statistics over the global batch, as SyncBatchNorm) from one
all_reduce of stacked per-channel sums per norm in the forward and one in the backward, never by gathering the
activations; its running statistics are state outputs. Instance, group and layer norm and LSTM / GRU / RNN shard the
batch with no collective but the gradients' and the loss's. Every rule these layers reach passes the verifier.
"""
from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import partir_torch as pt
from partir_torch.capture import capture
from partir_torch.rules import default_registry
from partir_torch.verify import verify_graph

from tests.harness import train_next_to_eager

RTOL, ATOL = 1e-5, 1e-6
DP = [pt.tactics.data_parallel("batch")]
LOSS_REDUCTIONS = 2          # cross_entropy(mean) = nll(sum) / total_weight: both partial, 4 bytes each


class BatchNorms(nn.Module):
    """BatchNorm1d on (N, C) and (N, C, L), BatchNorm2d, BatchNorm3d, with distinct channel counts (8, 4, 2, 6) so
    that each norm's (2, C) float32 statistics all_reduce has its own size (64, 32, 16, 48 bytes)."""

    def __init__(self, track_running_stats=True):
        super().__init__()
        kw = dict(track_running_stats=track_running_stats)
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4, momentum=0.3, **kw)
        self.bn3 = nn.BatchNorm3d(2, **kw)
        self.bn1_seq = nn.BatchNorm1d(8, **kw)
        self.fc = nn.Linear(64, 6)
        self.bn1 = nn.BatchNorm1d(6, affine=False, **kw)

    def forward(self, x):                                    # (N, 3, 4, 4)
        h = F.relu(self.bn2(self.conv(x)))                   # (N, 4, 4, 4)
        h = self.bn3(h.view(-1, 2, 2, 4, 4)).view(-1, 8, 8)  # (N, 2, 2, 4, 4) -> (N, 8, 8)
        h = self.bn1_seq(h).flatten(1)                       # (N, 64)
        return self.bn1(self.fc(h))                          # (N, 6)


BN_STATS_BYTES = {64, 32, 16, 48}      # backward: one (2, C) stack of per-channel sums per norm (C = 8, 4, 2, 6)
# forward: one (2, C) stack of the moments E[x], E[x^2] per norm, in float64 (the one-pass variance keeps eager's
# two-pass precision only in double)
BN_MOMENTS_BYTES = {128, 64, 32, 96}


def _ce(m, x, y):
    return F.cross_entropy(m(x), y)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _batches(steps, n, shape, classes, seed=0, shift=1.5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn((n, *shape), generator=g) + shift, torch.randint(0, classes, (n,), generator=g))
            for _ in range(steps)]


def _train_both(model, mesh, batches, loss_fn=_ce, tactics=DP):
    """prog.train_step next to eager SGD on a deepcopy (tests/harness.py): the losses at every step, then every
    parameter and buffer; no op may be a barrier (the "no sharding rule" warning is an error here)."""
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "partir_torch: no sharding rule")
        prog = pt.partition(model, mesh, tactics, example_inputs=batches[0], loss_fn=loss_fn, optimizer=_sgd(model),
                            options=pt.Options(bucket_bytes=0))
        train_next_to_eager(prog, ref, batches, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                            buffers=True, loss_rtol=RTOL, param_rtol=RTOL, param_atol=ATOL,
                            what=type(model).__name__)
    return prog, ref


def _assert_state_equal(prog, ref):
    """Parameters and buffers (running statistics, num_batches_tracked) of the program equal the eager module's."""
    sd = prog.state_dict()["model"]
    for k, want in ref.state_dict().items():
        got = sd[k]
        if want.is_floating_point():
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
        else:
            assert torch.equal(got, want), f"{k}: {got} != {want}"


def _by_phase(prog) -> Counter:
    return Counter((r.kind, r.phase, r.nbytes) for r in prog.collectives())


# ---- batch norm -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stats", [True, False], ids=["running_stats", "no_running_stats"])
def test_batch_norm_data_parallel_matches_one_device(stats):
    """4 ranks, 2 samples each; 3 SGD steps: losses, parameters and running statistics (unbiased running_var,
    num_batches_tracked) equal eager nn.BatchNorm on the whole batch. One all_reduce of (2, C) per norm forward (the
    moments E[x], E[x^2], summed in float64) and one of (2, C) backward; the norms' weight and bias gradients need none of their own; nothing is gathered."""
    torch.manual_seed(0)
    model = BatchNorms(track_running_stats=stats)
    prog, ref = _train_both(model, pt.Mesh({"batch": 4}), _batches(3, 8, (3, 4, 4), 6))
    _assert_state_equal(prog, ref)
    if stats:
        assert int(prog.state_dict()["model"]["bn2.num_batches_tracked"]) == 3
        assert float(ref.bn2.running_var.sub(1).abs().max()) > 0.1    # the statistics moved: a real comparison

    coll = _by_phase(prog)
    assert all(kind == "all_reduce" for kind, _, _ in coll), coll
    fwd = Counter({b: n for (_, ph, b), n in coll.items() if ph == "forward"})
    bwd = Counter({b: n for (_, ph, b), n in coll.items() if ph == "backward"})
    assert fwd == Counter({**{b: 1 for b in BN_MOMENTS_BYTES}, 4: LOSS_REDUCTIONS}), fwd
    # backward: one per norm, plus the gradients of conv.weight (432 B), fc.weight (1536 B) and fc.bias (24 B)
    assert bwd == Counter({**{b: 1 for b in BN_STATS_BYTES}, 432: 1, 1536: 1, 24: 1}), bwd


def test_batch_norm_zero3_keeps_running_statistics_with_their_parameter():
    """ZeRO-3 tiles a norm's weight on the data axis; its running statistics (same module, same shape) are
    tiled with it, and still equal eager after 3 steps."""
    torch.manual_seed(0)
    prog, ref = _train_both(BatchNorms(track_running_stats=True), pt.Mesh({"batch": 4}),
                            _batches(3, 8, (3, 4, 4), 6), tactics=DP + [pt.tactics.zero(3, "batch")])
    _assert_state_equal(prog, ref)
    for k in ("bn2.weight", "bn2.running_mean", "bn2.running_var"):
        kind = "params" if k.endswith("weight") else "buffers"
        assert prog.sharding(f"{kind}.{k}").dims == (("batch",),), k
    assert prog.sharding("buffers.bn2.num_batches_tracked").dims == ()


def test_instance_norm_running_statistics_are_never_partial():
    """Instance norm's running statistics average per-sample statistics over the batch: with the batch tiled the
    update is a sum over ranks, but a state value keeps one layout across steps, so it is reduced, never left
    partial (which gave running_var 1.83 instead of 0.93)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
                          nn.Flatten(), nn.Linear(64, 6))
    prog, ref = _train_both(model, pt.Mesh({"batch": 4}), _batches(3, 8, (3, 4, 4), 6))
    _assert_state_equal(prog, ref)
    assert float(ref[1].running_var.sub(1).abs().max()) > 0.05     # the statistics moved


def test_batch_norm_forward_only_and_eval():
    """Forward-only programs: train mode updates the running statistics like eager (one all_reduce per norm);
    eval mode normalises with them and needs no collective. Either returns the whole output: one all_gather."""
    torch.manual_seed(1)
    model = BatchNorms()
    ref = copy.deepcopy(model)
    (x, _), (x2, _) = _batches(2, 8, (3, 4, 4), 6, seed=1)
    mesh = pt.Mesh({"batch": 4})
    prog = pt.partition(model, mesh, DP, example_inputs=(x,))
    for batch in (x, x2):
        torch.testing.assert_close(prog(batch), ref(batch), rtol=RTOL, atol=ATOL)
    _assert_state_equal(prog, ref)
    out_gather = ("all_gather", 8 * 6 * 4)
    assert sorted((r.kind, r.nbytes) for r in prog.collectives()) == sorted(
        [("all_reduce", b) for b in BN_MOMENTS_BYTES] + [out_gather])

    model.load_state_dict(prog.state_dict()["model"])
    model.eval(), ref.eval()
    prog = pt.partition(model, mesh, DP, example_inputs=(x,))
    torch.testing.assert_close(prog(x2), ref(x2), rtol=RTOL, atol=ATOL)
    assert [(r.kind, r.nbytes, r.value) for r in prog.collectives()] == [(*out_gather, "bn1:out")]


# ---- instance, group and layer norm -----------------------------------------------------------------------------
class OtherNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.inorm1 = nn.InstanceNorm1d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.ln = nn.LayerNorm([4, 4, 4])          # over (C, H, W)
        self.ln_last = nn.LayerNorm(4)             # over W only
        self.rms = nn.RMSNorm([4, 4])              # over (H, W)
        self.fc = nn.Linear(64, 5)

    def forward(self, x):                          # (N, 3, 4, 4)
        h = self.inorm(self.conv(x))
        h = self.inorm1(h.flatten(2)).view_as(h)   # (N, 4, 16)
        h = self.rms(self.ln_last(self.ln(self.gn(h))))
        return self.fc(F.gelu(h).flatten(1))


def test_instance_group_layer_norm_data_parallel():
    """Per-sample norms shard the batch locally: the only collectives are the loss's and the gradients'."""
    torch.manual_seed(2)
    prog, ref = _train_both(OtherNorms(), pt.Mesh({"batch": 2}), _batches(3, 4, (3, 4, 4), 5, seed=2))
    _assert_state_equal(prog, ref)
    coll = _by_phase(prog)
    assert all(kind == "all_reduce" for kind, _, _ in coll), coll
    fwd = Counter({b: n for (_, ph, b), n in coll.items() if ph == "forward"})
    assert fwd == Counter({4: LOSS_REDUCTIONS}), fwd
    n_grads = sum(n for (_, ph, _), n in coll.items() if ph == "backward")
    assert n_grads == len(list(ref.parameters())), coll


class HandNorms(nn.Module):
    """Norms written with torch.var_mean / var / std over dims that include the batch (a hand-made batch norm,
    a feature standardisation) and over the features only."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(64, 5)

    def forward(self, x):                                                     # (N, 3, 4, 4)
        h = self.conv(x)
        var, mean = torch.var_mean(h, dim=(0, 2, 3), keepdim=True, correction=0)
        h = (h - mean) * torch.rsqrt(var + 1e-5)                              # batch statistics
        h = h / h.std(dim=(1, 2, 3), keepdim=True)                            # per sample
        h = F.relu(h).flatten(1)
        return self.fc(h / torch.sqrt(h.var(0, keepdim=True) + 1.0))          # over the batch, unbiased


def test_hand_written_variance_norms_data_parallel():
    """var / var_mean / std over a tiled batch: two all_reduces each (the mean, then the squared deviations) of the
    reduced shape; over untiled dims none; the activations are never gathered."""
    torch.manual_seed(4)
    prog, ref = _train_both(HandNorms(), pt.Mesh({"batch": 2}), _batches(3, 8, (3, 4, 4), 5, seed=4))
    _assert_state_equal(prog, ref)
    coll = _by_phase(prog)
    assert all(kind == "all_reduce" for kind, _, _ in coll), coll
    fwd = Counter({b: n for (_, ph, b), n in coll.items() if ph == "forward"})
    assert fwd == Counter({4: LOSS_REDUCTIONS, 16: 2, 256: 2}), fwd    # var_mean over (N, H, W): C = 4; var(0): 64


# ---- recurrent layers -------------------------------------------------------------------------------------------
class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lstm = nn.LSTM(4, 5, num_layers=2, batch_first=True)
        self.lstm_proj = nn.LSTM(5, 4, proj_size=3, batch_first=True)
        self.gru = nn.GRU(3, 3, bidirectional=True, batch_first=True)
        self.rnn = nn.RNN(6, 4, nonlinearity="relu")          # (T, N, .): time-major
        self.head = nn.Linear(4, 10)

    def forward(self, tokens):                               # (N, T)
        h, _ = self.lstm(self.emb(tokens))
        h, _ = self.lstm_proj(h)
        h, _ = self.gru(h)
        h, _ = self.rnn(h.transpose(0, 1))
        return self.head(h.transpose(0, 1))                  # (N, T, 10)


def test_recurrent_layers_data_parallel():
    """LSTM (stacked, projected), bidirectional GRU and a time-major RNN: the batch is split over 4 ranks with no
    gather; collectives are the loss's and one all_reduce per parameter gradient."""
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 10, (8, 5), generator=g), torch.randint(0, 10, (8, 5), generator=g))
               for _ in range(2)]
    loss_fn = lambda m, x, y: F.cross_entropy(m(x).flatten(0, 1), y.flatten())
    prog, ref = _train_both(Recurrent(), pt.Mesh({"batch": 4}), batches, loss_fn)
    _assert_state_equal(prog, ref)
    assert prog.sharding("inputs.0").dims[0] == ("batch",)
    coll = _by_phase(prog)
    assert all(kind == "all_reduce" for kind, _, _ in coll), coll
    assert sum(n for (_, ph, _), n in coll.items() if ph == "forward") == LOSS_REDUCTIONS, coll
    # one all_reduce per gradient; an mkldnn LSTM layer's bias_ih and bias_hh gradients are one value (2 layers)
    assert sum(n for (_, ph, _), n in coll.items() if ph == "backward") == len(list(ref.parameters())) - 2, coll


def test_recurrent_gradients_data_parallel():
    """The gradients of every recurrent weight (tiny next to the head's: a deep recurrent stack) equal eager
    autograd's relative to their own scale: |g - g_ref| <= 1e-5 * max|g_ref| per tensor, no model-wide floor."""
    torch.manual_seed(6)
    model = Recurrent()
    g = torch.Generator().manual_seed(6)
    batch = (torch.randint(0, 10, (8, 5), generator=g), torch.randint(0, 10, (8, 5), generator=g))
    loss_fn = lambda m, x, y: F.cross_entropy(m(x).flatten(0, 1), y.flatten())
    ref = copy.deepcopy(model)
    loss_fn(ref, *batch).backward()
    prog = pt.partition(model, pt.Mesh({"batch": 4}), DP, example_inputs=batch, loss_fn=loss_fn)
    _, grads = prog.loss_and_grads(*batch)
    for k, p in ref.named_parameters():
        scale = p.grad.abs().max().item()
        assert scale > 0 and (grads[k] - p.grad).abs().max().item() <= RTOL * scale, k


# ---- rules ------------------------------------------------------------------------------------------------------
def _train_graph(model, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(model, (x,), lambda m, x: m(x).square().mean(), _sgd(model)).gm


NORM_CASES = {
    "batch_norm": (lambda: BatchNorms(), (4, 3, 4, 4)),
    "batch_norm_no_stats": (lambda: BatchNorms(False), (4, 3, 4, 4)),
    "batch_norm_eval": (lambda: BatchNorms().eval(), (4, 3, 4, 4)),
    "other_norms": (lambda: OtherNorms(), (4, 3, 4, 4)),
    "recurrent": (lambda: Recurrent(), None),
}


@pytest.mark.parametrize("case", list(NORM_CASES))
def test_norm_and_recurrent_rules_verify(case):
    build, shape = NORM_CASES[case]
    x = torch.randint(0, 10, (6, 3)) if shape is None else torch.randn(shape)
    report = verify_graph(_train_graph(build(), x))
    assert report.nodes > 10 and report.factor_checks > 20, str(report)
    assert not report.wrong and not report.missing and not report.errors, str(report)


def test_stack_repeat_unsafe_split_rules():
    def f(x, v):
        return (torch.stack([x, 2 * x], 0), torch.stack([x, x], 1), torch.stack([x, x], -1), x.repeat(2, 1),
                x.repeat(1, 3), x.repeat(2, 1, 1), v.repeat(6), v.repeat(3, 2),
                *torch.ops.aten.unsafe_split.Tensor(x, 2, 1))

    gm = make_fx(f, tracing_mode="fake")(torch.randn(6, 4), torch.randn(4))
    report = verify_graph(gm)
    assert {"aten.stack.default", "aten.repeat.default", "aten.unsafe_split.Tensor"} <= report.ops
    assert report.factor_checks > 20 and report.linear_checks > 10, str(report)
    assert not report.wrong and not report.missing and not report.errors, str(report)


def test_group_norm_rule_tiles_whole_groups():
    """native_group_norm and its backward: N and whole groups tile (the int args N, C, HxW and group localised);
    the channels of one group stay together. Affine and plain, with and without spatial dims."""
    aten = torch.ops.aten

    def f(x, x2, w, b):
        out = []
        for img, wb in ((x, (w, b)), (x, (None, None)), (x2, (w, b))):
            o, mean, rstd = aten.native_group_norm(img, *wb, img.shape[0], 12, img[0, 0].numel(), 6, 1e-5)
            mask = [True] + [wb[0] is not None] * 2
            out += [o, mean, rstd, *aten.native_group_norm_backward(o.sin(), img, mean, rstd, wb[0], img.shape[0], 12,
                                                                  img[0, 0].numel(), 6, mask)]
        return [t for t in out if t is not None]

    gm = make_fx(f, tracing_mode="fake")(torch.randn(6, 12, 2, 3), torch.randn(6, 12), torch.randn(12), torch.randn(12))
    report = verify_graph(gm)
    assert {"aten.native_group_norm.default", "aten.native_group_norm_backward.default"} <= report.ops
    rule = default_registry().build(next(n for n in gm.graph.nodes if n.target is aten.native_group_norm.default))
    assert sorted((f.size, f.kind) for f in rule.factors) == [(2, "need_rep"), (6, "pass"), (6, "pass")]
    assert report.factor_checks >= 30, str(report)
    assert not report.wrong and not report.missing and not report.errors, str(report)


class ChannelGroups(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(4, 8)
        self.proj = nn.Conv2d(8, 4, 1)
        self.fc = nn.Linear(64, 5)

    def forward(self, x):                                        # (N, 3, 4, 4)
        return self.fc(self.proj(F.relu(self.gn(self.conv(x)))).flatten(1))


def test_group_norm_channel_parallel():
    """Batch on "batch", conv channels on "model" (column- then row-parallel 1x1 conv): the group norm between them
    works on the rank's whole groups, so "model" needs only the row-parallel conv's all_reduce forward."""
    torch.manual_seed(5)
    tactics = DP + [pt.ManualPartition({"params.conv.*": 0, "params.proj.weight": 1}, axis="model")]
    prog, ref = _train_both(ChannelGroups(), pt.Mesh({"batch": 2, "model": 2}), _batches(3, 4, (3, 4, 4), 5, seed=5),
                            tactics=tactics)
    _assert_state_equal(prog, ref)
    assert prog.sharding("params.gn.weight").dims == (("model",),) and not prog.conflicts
    model_axis = [(r.kind, r.phase, r.nbytes) for r in prog.collectives() if r.axis == "model"]
    assert model_axis == [("all_reduce", "forward", 2 * 4 * 4 * 4 * 4)], model_axis     # proj's (N/2, 4, 4, 4) out
    assert all(r.kind == "all_reduce" for r in prog.collectives())


def test_batch_norm_statistics_keep_their_precision_when_the_mean_dominates():
    """Activations with mean 60x their spread (a conv after ReLU6): the variance from E[x^2] - E[x]^2 in fp32 is
    6e-4 off; the two-pass statistics match eager to fp32 rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(16), nn.Flatten(), nn.Linear(16 * 16, 4))
    x = torch.randn(8, 16, 4, 4) * 0.05 + 3
    y = torch.randint(0, 4, (8,))
    prog, ref = _train_both(model, pt.Mesh({"batch": 4}), [(x, y)] * 2)
    _assert_state_equal(prog, ref)
