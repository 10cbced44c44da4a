"""Rules are verified numerically (partir_torch/verify.py) on every zoo model's train step; the verifier is shown to catch
wrong rules; localize_args rewrites shape arguments for local shards."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import functools  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from examples.models import VARIANTS, ZOO, get  # noqa: E402
from partir_torch.capture import capture  # noqa: E402
from partir_torch.rules.localize import localize_args  # noqa: E402
from partir_torch.rules import PASS, REDUCE, OpRule, RuleBuilder, default_registry  # noqa: E402
from partir_torch.rules.pointwise import pointwise  # noqa: E402
from partir_torch.verify import MISSING, WRONG, factor_cases, verify_graph, verify_node  # noqa: E402

aten = torch.ops.aten
MODELS = sorted(set(ZOO) | set(VARIANTS))


@functools.lru_cache(maxsize=None)
def _train_graph(name):
    spec = get(name)
    model = spec.build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(model, spec.batch(4), spec.loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-3)).gm


def _trace(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _node(gm, target):
    return next(n for n in gm.graph.nodes if n.target == target)


# ---- (1) every rule the zoo uses is right ----------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_zoo_rules_verify(name):
    report = verify_graph(_train_graph(name))
    assert report.nodes > 30 and report.factor_checks > 40 and report.linear_checks > 40, str(report)
    assert not report.wrong, str(report)
    assert not report.missing, str(report)
    assert not report.errors, str(report)


def test_rules_beyond_the_zoo():
    """Ops the zoo does not reach: group norm backward, grouped / bias-free convolution, factories, pooling, casts."""
    def f(x, w, b, wg, wc, img, idx, mask):
        o, mean, rstd = aten.native_group_norm(img, w, b, 4, 8, 36, 4, 1e-5)
        gn = aten.native_group_norm_backward(o, img, mean, rstd, w, 4, 8, 36, 4, [True, True, True])
        conv = F.conv2d(img, wc)
        return (*gn, F.conv2d(img, wg, groups=2), conv, torch.dot(x[0], x[1]), F.one_hot(idx, 6),
                *aten.convolution_backward(conv, img, wc, None, [1, 1], [0, 0], [1, 1], False,
                                           [0, 0], 1, [True, True, False]),
                x.new_full((6, 4), 2.0) + torch.full((6, 4), 3.0), aten.empty_strided([6, 4], [4, 1]),
                F.max_pool2d(img, 2), aten.scatter.value(x, 1, idx.view(6, 1).remainder(4), 1.5),
                x.amax(1), x.amin(0), torch.where(mask, x, 2 * x), x[:, 1:3], torch.cat([x, x], 1),
                x.to(torch.int64), x.to(torch.bfloat16), mask.to(torch.float32))

    gm = _trace(f, torch.randn(6, 4), torch.randn(8), torch.randn(8), torch.randn(8, 4, 1, 1),
                torch.randn(8, 8, 1, 1), torch.randn(4, 8, 6, 6), torch.randint(0, 6, (6,)), torch.rand(6, 4) < 0.5)
    report = verify_graph(gm)
    assert report.nodes >= 15 and not report.wrong and not report.missing and not report.errors, str(report)


def test_patches_and_vector_norm_rules():
    """nn.Unfold / nn.Fold (im2col, col2im: ConvBERT) and linalg_vector_norm over some dims (ConvNeXt-V2's GRN)."""
    def f(img, x):
        cols = F.unfold(img, kernel_size=(3, 1), padding=(1, 0))
        return cols, F.fold(cols, (6, 5), kernel_size=(3, 1), padding=(1, 0)), torch.linalg.vector_norm(
            x, dim=(1, 2), keepdim=True), torch.linalg.vector_norm(x, ord=1, dim=1)

    gm = _trace(f, torch.randn(4, 6, 6, 5), torch.randn(4, 6, 5, 3))
    report = verify_graph(gm)
    ops = {str(n.target) for n in gm.graph.nodes}
    assert {"aten.im2col.default", "aten.col2im.default", "aten.linalg_vector_norm.default"} <= ops
    assert not report.wrong and not report.missing and not report.errors, str(report)


def test_bilinear_upsampling_rules():
    """MobileViT's bilinear upsampling and its backward: batch and channels pass, the image stays whole."""
    def f(img, g):
        return (F.interpolate(img, size=(8, 10), mode="bilinear", align_corners=False),
                aten.upsample_bilinear2d_backward(g, [8, 10], [4, 6, 6, 5], False))

    gm = _trace(f, torch.randn(4, 6, 6, 5), torch.randn(4, 6, 8, 10))
    ops = {str(n.target) for n in gm.graph.nodes}
    assert any(o.startswith("aten.upsample_bilinear2d") for o in ops), ops
    report = verify_graph(gm)
    assert not report.wrong and not report.missing and not report.errors, str(report)


def test_flip_and_scatter_reduce_rules():
    """flip over the sequence (Bamba's reversed scans) and scatter_reduce (TAPAS's segment means): the batch passes."""
    def f(x, idx):
        seg = torch.zeros(4, 3).scatter_reduce(1, idx, x[:, :, 0], reduce="amax", include_self=False)
        return x.flip(1), x.flip((1, 2)), seg, torch.zeros(4, 3).scatter_reduce(1, idx, x[:, :, 1], reduce="sum")

    gm = _trace(f, torch.randn(4, 6, 5), torch.randint(0, 3, (4, 6)))
    ops = {str(n.target) for n in gm.graph.nodes}
    assert {"aten.flip.default", "aten.scatter_reduce.two"} <= ops, ops
    report = verify_graph(gm)
    assert not report.wrong and not report.missing and not report.errors, str(report)


def test_triangular_solve_and_unfold_rules():
    """Chunked delta rules (Qwen3-Next: solve_triangular per (batch, head, chunk)) and sliding windows (unfold and
    its backward): the batch dims pass, the solved / windowed dims stay whole."""
    def f(a, b, x, g):
        tri = a.tril(-1) + 3.0                  # the upper triangle is not read (upper=False)
        return (torch.linalg.solve_triangular(tri, b, upper=False), torch.linalg.solve_triangular(
                    tri[0], b[0].transpose(-1, -2), upper=False, left=False),
                x.unfold(1, 3, 2), aten.unfold_backward(g, [4, 7, 6], 1, 3, 2))

    gm = _trace(f, torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 2), torch.randn(4, 7, 6), torch.randn(4, 3, 6, 3))
    ops = {str(n.target) for n in gm.graph.nodes}
    assert {"aten.linalg_solve_triangular.default", "aten.unfold.default", "aten.unfold_backward.default"} <= ops
    report = verify_graph(gm)
    assert not report.wrong and not report.missing and not report.errors, str(report)


def test_fft_rules():
    """FNet mixes tokens with FFTs over (seq, hidden): the batch passes, the transformed dims stay whole."""
    def f(x):
        return (torch.fft.fftn(x.to(torch.complex64), dim=(1, 2)).real, torch.fft.rfft(x, dim=1),
                torch.fft.irfft(torch.fft.rfft(x, dim=2), n=5, dim=2))

    gm = _trace(f, torch.randn(4, 6, 5))
    ops = {str(n.target) for n in gm.graph.nodes}
    assert {"aten._fft_c2c.default", "aten._fft_r2c.default", "aten._fft_c2r.default"} <= ops, ops
    report = verify_graph(gm)
    assert not report.wrong and not report.missing and not report.errors, str(report)


def test_complex_pairs_rules():
    """Rotary embeddings through complex numbers (DeepSeek-V2, Llama's original code): view_as_complex and
    view_as_real keep the leading dims split and the (real, imaginary) pair whole."""
    def f(x, freqs):
        z = torch.view_as_complex(x.reshape(4, 6, 3, 2)) * freqs
        return torch.view_as_real(z).flatten(2)

    gm = _trace(f, torch.randn(4, 6, 6), torch.randn(6, 3, dtype=torch.complex64))
    report = verify_graph(gm)
    ops = {str(n.target) for n in gm.graph.nodes}
    assert {"aten.view_as_complex.default", "aten.view_as_real.default"} <= ops
    assert not report.wrong and not report.missing and not report.errors, str(report)


# (x shape, w shape, bias, stride, padding, dilation, groups): grouped and depthwise convolutions (timm's
# efficientnet / mobilenet / convnext blocks), conv1d and conv2d, bias and none, groups 2, 3, 4 and depthwise
GROUPED_CONVS = {
    "groups2-bias": ((6, 8, 5, 5), (4, 4, 3, 3), True, 1, 0, 1, 2),
    "groups4-stride2-pad1": ((6, 8, 5, 5), (12, 2, 3, 3), False, 2, 1, 1, 4),
    "groups3-dilation2": ((6, 6, 7, 7), (9, 2, 3, 3), True, 1, 2, 2, 3),
    "depthwise-pad1": ((6, 6, 5, 5), (6, 1, 3, 3), True, 1, 1, 1, 6),
    "depthwise-x2-stride2": ((4, 6, 6, 6), (12, 1, 3, 3), False, 2, 1, 1, 6),
    "depthwise-1d": ((6, 12, 9), (12, 1, 5), True, 1, 2, 1, 12),
}


def _grouped_conv_graph(case, mask):
    xs, ws, bias, stride, padding, dilation, groups = GROUPED_CONVS[case]
    nd = len(xs) - 2

    def f(x, w, b):
        y = aten.convolution(x, w, b if bias else None, [stride] * nd, [padding] * nd, [dilation] * nd, False,
                             [0] * nd, groups)
        grads = aten.convolution_backward(y * y, x, w, [ws[0]] if mask[2] else None, [stride] * nd,
                                          [padding] * nd, [dilation] * nd, False, [0] * nd, groups, mask)
        return (y, *grads)

    return _trace(f, torch.randn(xs), torch.randn(ws), torch.randn(ws[0]))


@pytest.mark.parametrize("mask", [[True, True, True], [False, True, False]], ids=["all-grads", "weight-grad"])
@pytest.mark.parametrize("case", list(GROUPED_CONVS))
def test_grouped_convolution_rules(case, mask):
    """Grouped and depthwise convolution, forward and backward: the batch is PASS in the forward and in grad_input,
    a reduction (partial sum) in grad_weight and grad_bias; the groups factor is PASS (each rank convolves whole
    groups, with its local count of groups); the verifier checks every one of them, k = 2 and 3."""
    groups = GROUPED_CONVS[case][-1]
    gm = _grouped_conv_graph(case, mask)
    fwd, bwd = _node(gm, aten.convolution.default), _node(gm, aten.convolution_backward.default)
    for node, x_slot, batch_kind in ((fwd, 0, PASS), (bwd, 1, REDUCE)):
        rule = default_registry().build(node)
        assert rule is not None, node.format_node()
        (n,), channels = rule.operands[x_slot][:2]         # x: (N, (groups, Cin / groups), *spatial)
        g = channels[0]
        assert rule.factors[n].kind == batch_kind and rule.factors[n].size == GROUPED_CONVS[case][0][0], str(rule)
        assert rule.factors[g].kind == PASS and rule.factors[g].size == groups, str(rule)
        if node is bwd:
            assert (rule.results[0] is None) == (not mask[0]) and (rule.results[2] is None) == (not mask[2])
            if mask[0]:    # grad_input: (N, (groups, ...)) like x
                assert rule.results[0][0] == (n,) and rule.results[0][1][0] == g, str(rule)
            # grad_weight: ((groups, ...), ...) without the batch, which it sums over
            assert rule.results[1][0][0] == g and not any(n in fs for fs in rule.results[1]), str(rule)
        checked = {f for f, _ in factor_cases(rule)}
        assert {n, g} <= checked, str(rule)                 # both are checked numerically, k = 2 and/or 3
        assert not verify_node(node, rule), str(rule)
    report = verify_graph(gm)
    assert not report.wrong and not report.missing and not report.errors, str(report)


def test_grouped_convolution_needs_its_local_groups(monkeypatch):
    """Without the groups localisation, a rank holding half of the groups runs the global count: the verifier
    reports the groups factor wrong (on the forward and the backward)."""
    import partir_torch.rules.localize as localize

    gm = _grouped_conv_graph("groups4-stride2-pad1", [True, True, False])
    assert not verify_graph(gm).findings
    for op in (aten.convolution.default, aten.convolution_backward.default):
        monkeypatch.delitem(localize.ROWS, op)
    report = verify_graph(gm)
    assert report.wrong and {f.op for f in report.wrong} == {str(aten.convolution.default),
                                                              str(aten.convolution_backward.default)}, str(report)
    assert all("=4 pass" in f.check for f in report.wrong), str(report)


class _Separable(torch.nn.Module):
    """A depthwise-separable block as in MobileNet / EfficientNet: pointwise, depthwise, grouped, head."""

    def __init__(self):
        super().__init__()
        self.pw = torch.nn.Conv2d(3, 8, 1)
        self.dw = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.gc = torch.nn.Conv2d(8, 12, 3, stride=2, padding=1, groups=4, bias=False)
        self.head = torch.nn.Linear(12 * 9, 5)

    def forward(self, x):    # (B, 3, 6, 6) -> (B, 8, 6, 6) -> (B, 12, 3, 3) -> (B, 5)
        return self.head(self.gc(F.gelu(self.dw(F.relu(self.pw(x))))).flatten(1))


@pytest.mark.parametrize("how", ["data-parallel", "groups-tiled"])
def test_grouped_convolution_trains(how):
    """Data parallelism trains through depthwise and grouped convolutions (forward and backward) like one device,
    without an all_gather or all_to_all; tiling the depthwise weight's channels (its groups) does too: each rank
    convolves its own groups."""
    import copy

    import partir_torch as pt
    from partir_torch import tactics as T
    from tests.harness import adamw, train_next_to_eager

    torch.manual_seed(0)
    model = _Separable()
    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 5, (8,))

    def loss_fn(m, x, y):
        return F.cross_entropy(m(x), y)

    ref = copy.deepcopy(model)
    tactic = T.data_parallel("b") if how == "data-parallel" else pt.ManualPartition({"params.dw.weight": 0}, "b")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no sharding rule.*")
        prog = pt.partition(model, pt.Mesh({"b": 2}), [tactic], example_inputs=(x, y), loss_fn=loss_fn,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    if how == "data-parallel":
        assert not any(r.kind in ("all_gather", "all_to_all") for r in prog.collectives()), prog.collectives()
    else:    # the depthwise conv's input, output, weight and bias all hold 4 of the 8 channels on each rank
        for name in ("params.dw.weight", "params.dw.bias", "dw:out"):
            assert prog.sharding(name).dims[0 if name.startswith("params") else 1] == ("b",), prog.sharding(name)
    train_next_to_eager(prog, ref, [(x, y)] * 2, loss_fn, adamw(), what=how)


def _as_strided_graph():
    """ConvNeXt's pooled head, functionalized: a (B, C, 1, 1) read through odd strides of its size-1 dims, and its
    gradient built by as_strided_scatter into zeros and read back as views; plus two that are not whole views."""
    def f(p, g):
        v = aten.as_strided(p, [6, 8, 1, 1], [8, 1, 8, 8])
        s = aten.as_strided_scatter(g.new_zeros([48]), g * 2, [6, 8], [8, 1], 0)
        return (v * 3, aten.as_strided(s, [6, 8, 1, 1], [8, 1, 1, 1], 0) + 1, aten.as_strided(s, [6, 8], [8, 1]),
                aten.as_strided(p, [3, 8], [8, 1]), aten.as_strided(g.t(), [8, 6], [6, 1]))

    return _trace(f, torch.randn(6, 8, 1, 1), torch.randn(6, 8))


def test_as_strided_rules():
    """as_strided (and as_strided_scatter) that reads all of a contiguous tensor in its order is a reshape: its
    factors are verified (k = 2, 3 on the batch, k = 2 on the channels); a view of part of it, or of a transposed
    tensor, has no rule (a barrier)."""
    gm = _as_strided_graph()
    views = [n for n in gm.graph.nodes if n.target in (aten.as_strided.default, aten.as_strided_scatter.default)]
    rules = [default_registry().build(n) for n in views]
    assert [r is None for r in rules] == [False, False, False, False, True, True], [str(r) for r in rules]
    assert all(f.kind == PASS and f.size in (6, 8) for r in rules[:4] for f in r.factors)
    report = verify_graph(gm)
    assert report.factor_checks >= 4 * 3 and not report.wrong and not report.errors, str(report)
    assert report.missing and {f.node for f in report.missing} <= {views[4].name, views[5].name}, str(report)


def test_as_strided_needs_its_localisation(monkeypatch):
    """Tiled, the view's size, strides and offset are the local shard's (a rank's shard of the batch starts at
    offset 0 of its own buffer): without the rewrite, the verifier reports the tiled views wrong; a view left
    whole keeps its arguments."""
    import partir_torch.rules.localize as localize

    gm = _as_strided_graph()
    node = _node(gm, aten.as_strided_scatter.default)
    args, _ = localize_args(node, ("b", "s", [6, 8], [8, 1], 0), {}, [(24,), (3, 8)], [(24,)])
    assert args == ("b", "s", [3, 8], [8, 1], None)
    args, _ = localize_args(node, ("b", "s", [6, 8], [8, 1], 0), {}, [(48,), (6, 8)], [(48,)])
    assert args == ("b", "s", [6, 8], [8, 1], 0)
    partial = [n for n in gm.graph.nodes if n.target is aten.as_strided.default][-2]     # [3, 8] of 48: no rule
    assert localize_args(partial, ("p", [3, 8], [8, 1]), {}, [(6, 8, 1, 1)], [(3, 8)])[0] == ("p", [3, 8], [8, 1])
    for op in (aten.as_strided.default, aten.as_strided_scatter.default):
        monkeypatch.delitem(localize.ROWS, op)
    report = verify_graph(gm)
    assert len({f.node for f in report.wrong}) >= 3, str(report)


ACTIVATIONS = [torch.nn.Hardsigmoid(), torch.nn.Hardswish(), torch.nn.CELU(), torch.nn.GLU(), torch.nn.LogSigmoid(),
               torch.nn.PReLU(8), torch.nn.Softshrink(), torch.nn.Hardshrink(), torch.nn.Threshold(0.1, 0.0),
               torch.nn.Mish()]


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: type(a).__name__)
def test_activation_rules(act):
    """torch.nn's activations (MobileNetV3 / GhostNet use hardsigmoid and hardswish): each forward and backward op
    has a rule the verifier accepts, and data parallelism trains through them like one device without gathering."""
    import copy

    import partir_torch as pt
    from partir_torch import tactics as T
    from tests.harness import adamw, train_next_to_eager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1), act, torch.nn.Flatten(),
                                torch.nn.Linear((4 if isinstance(act, torch.nn.GLU) else 8) * 9, 5))
    if isinstance(act, torch.nn.GLU):
        model[1] = torch.nn.GLU(dim=1)
    x, y = torch.randn(8, 3, 3, 3), torch.randint(0, 5, (8,))

    def loss_fn(m, x, y):
        return F.cross_entropy(m(x), y)

    gm = capture(model, (x, y), loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-3)).gm
    report = verify_graph(gm)
    assert not report.wrong and not report.missing and not report.errors, str(report)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no sharding rule.*")
        prog = pt.partition(model, pt.Mesh({"b": 4}), [T.data_parallel("b")], example_inputs=(x, y),
                            loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert not any(r.kind == "all_gather" for r in prog.collectives()), prog.collectives()
    train_next_to_eager(prog, ref, [(x, y)] * 2, loss_fn, adamw(), what=type(act).__name__)


def test_advanced_indexing_rule():
    """aten.index.Tensor: adjacent and separated index tensors, broadcast index shapes (HF builds masks so);
    aten.index_put, plain and accumulating (the gradient of a per-token selection of expert weights)."""
    def f(a, i, j, k):
        v = torch.ones(4, 1, 3, 7)
        return (a[i, j], a[:, k], a[i, :, j.view(1, 3) % 7], a[i.view(-1)] * 2,
                a.index_put((i, j), v, accumulate=True), a.index_put((i, j), v), a.index_put((i.view(-1),),
                                                                                         torch.ones(4, 6, 7)),
                # the gradient of a[i, j]: accumulated into zeros, so the positions may be tiled (partial sum)
                a.new_zeros(5, 6, 7).index_put((i, j), a[i, j] * 3, accumulate=True))

    gm = _trace(f, torch.randn(5, 6, 7), torch.randint(0, 5, (4, 1, 1)), torch.randint(0, 6, (1, 3)),
                torch.randint(0, 6, (2, 5)))
    report = verify_graph(gm)
    assert {"aten.index.Tensor", "aten.index_put.default"} <= report.ops
    into_zeros = [n for n in gm.graph.nodes if n.target is aten.index_put.default and n.args[0].target is
                  aten.new_zeros.default]
    assert into_zeros and any(f.kind == "reduce" for f in default_registry().build(into_zeros[0]).factors)
    assert not report.wrong and not report.missing and not report.errors, str(report)


def test_boolean_mask_put_rule_is_elementwise_and_keeps_the_batch_split():
    """x[mask] = v with a mask over x's leading dims and one value (Gemma 3's `ids[ids == image_token_id] = 0`):
    every dim is PASS (the verifier runs it per rank on tiles of x and mask); under data parallelism the ids stay
    tiled on the batch (no all_gather), and training equals one device."""
    import copy

    import partir_torch as pt
    from partir_torch import tactics as T
    from tests.harness import adamw, train_next_to_eager

    def f(a, m, n):
        return (a.index_put((m,), torch.tensor(0.5)), a.index_put((n,), torch.ones(1)),
                a.index_put((m,), torch.tensor(2.0), accumulate=True))

    a = torch.randn(4, 6, 3)
    gm = _trace(f, a, a > 0, a[..., 0] > 0)
    report = verify_graph(gm)
    assert "aten.index_put.default" in report.ops
    assert not report.wrong and not report.missing and not report.errors, str(report)
    puts = [n for n in gm.graph.nodes if n.target is aten.index_put.default]
    assert default_registry().build(puts[0]) is not None and default_registry().build(puts[1]) is not None

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

        def forward(self, ids):
            ids = ids.clone()
            ids[ids == 15] = 0              # a special token read as padding
            return self.head(self.emb(ids))

    def loss_fn(m, ids):
        return torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten() % 15)

    torch.manual_seed(0)
    model = Masked()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 16, (8, 5))
    ids[0, 0] = 15
    prog = pt.partition(model, pt.Mesh({"b": 2}), [T.data_parallel("b")], example_inputs=(ids,),
                        loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert [r for r in prog.collectives() if r.why == "reshard"] == []
    train_next_to_eager(prog, ref, [(ids,)] * 2, loss_fn, adamw(), what="masked put")

# ---- (2) the verifier fails on wrong rules ---------------------------------------------------------------------
def _mm_with_k_pass(ctx):
    """mm with its contracted k marked PASS (wrong: each rank holds a partial sum, not the whole result)."""
    (m, k), (_, n) = ctx.in_shapes
    b = RuleBuilder()
    fm, fk, fn = b.new(m), b.new(k, PASS), b.new(n)
    return b.rule([[(fm,), (fk,)], [(fk,), (fn,)]], [[(fm,), (fn,)]])


def _amax_as_sum(ctx):
    """amax over dim 1 with the reduced dim REDUCE(sum) (wrong: the partials combine by max)."""
    (r, c) = ctx.in_shapes[0]
    b = RuleBuilder()
    fr, fc = b.new(r), b.new(c, REDUCE, "sum")
    return b.rule([[(fr,), (fc,)]], [[(fr,)]])


WRONG_RULES = {
    "softmax dim PASS": (aten._softmax.default, pointwise, lambda x, y: torch.softmax(x, -1)),
    "mm k PASS": (aten.mm.default, _mm_with_k_pass, lambda x, y: x @ y),
    "amax partial(sum)": (aten.amax.default, _amax_as_sum, lambda x, y: x.amax(1)),
    "gelu linear": (aten.gelu.default, lambda ctx: pointwise(ctx, [({0}, ("sum",))]), lambda x, y: F.gelu(x)),
}


@pytest.mark.parametrize("case", list(WRONG_RULES))
def test_wrong_rule_is_reported(case):
    op, rule, fn = WRONG_RULES[case]
    gm = _trace(fn, torch.randn(6, 12), torch.randn(12, 6))
    assert not verify_graph(gm).findings      # the built-in rule passes
    registry = default_registry().copy()
    registry.register(op, rule, override=True)
    report = verify_graph(gm, registry)
    assert report.wrong and all(f.kind == WRONG and f.op == str(op) for f in report.findings), str(report)
    assert all(f.error > 1e-3 for f in report.wrong)
    assert "WRONG" in str(report) and str(op) in str(report)


def test_missing_rule_is_reported():
    registry = default_registry().copy()
    registry._rules.pop(aten._softmax.default)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify_graph(_trace(lambda x: torch.softmax(x, -1), torch.randn(4, 6)), registry)
    assert [f.kind for f in report.findings] == [MISSING] and "no rule" in str(report)


def test_verify_node_checks_linear_modes():
    gm = _trace(lambda x, y: x + y, torch.randn(4, 6), torch.randn(6))
    node = _node(gm, aten.add.Tensor)
    rule = default_registry().build(node)
    assert rule.linear and not verify_node(node, rule)
    wrong = OpRule(rule.factors, rule.operands, rule.results, ((frozenset({0}), ("sum",)),))  # x partial, y whole
    assert [f.check.split()[0] for f in verify_node(node, wrong)] == ["linear", "linear"]    # k = 2 and 3


# ---- (3) localize_args -----------------------------------------------------------------------------------------
def test_localize_view_with_minus_one():
    gm = _trace(lambda x: x.view(-1, 3), torch.randn(8, 6))
    node = _node(gm, aten.view.default)
    assert node.args[1] == [-1, 3]
    args, kwargs = localize_args(node, ("x", [-1, 3]), {}, [(4, 6)], [(8, 3)])
    assert args == ("x", [8, 3]) and kwargs == {}


def test_localize_expand():
    gm = _trace(lambda x: x.expand(-1, 5, 6), torch.randn(4, 1, 6))
    node = _node(gm, aten.expand.default)
    args, _ = localize_args(node, ("x", [-1, 5, 6]), {}, [(4, 1, 3)], [(4, 5, 3)])
    assert args == ("x", [4, 5, 3])


def test_localize_new_zeros_and_empty_strided():
    gm = _trace(lambda x: (x.new_zeros(6, 4), aten.empty_strided([6, 4], [1, 6])), torch.randn(6, 4))
    args, _ = localize_args(_node(gm, aten.new_zeros.default), ("x", [6, 4]), {}, [(3, 4)], [(3, 4)])
    assert args == ("x", [3, 4])
    args, _ = localize_args(_node(gm, aten.empty_strided.default), ([6, 4], [1, 6]), {}, [], [(6, 2)])
    assert args == ([6, 2], [1, 6])      # column-major kept: strides of the local (6, 2)


def test_localize_group_norm_ints():
    gm = _trace(lambda x, w, b: aten.native_group_norm(x, w, b, 4, 8, 36, 4, 1e-5),
                torch.randn(4, 8, 6, 6), torch.randn(8), torch.randn(8))
    node = _node(gm, aten.native_group_norm.default)
    args, _ = localize_args(node, ("x", "w", "b", 4, 8, 36, 4, 1e-5), {}, [(2, 8, 6, 6), (8,), (8,)],
                            [(2, 8, 6, 6), (2, 4), (2, 4)])
    assert args == ("x", "w", "b", 2, 8, 36, 4, 1e-5)


def test_localize_leaves_split_sizes_and_dims():
    """split sizes that happen to equal a result shape are sizes along the (whole) split dim, not a shape."""
    gm = _trace(lambda x: (torch.split(x, [4, 4], 1), x.permute(1, 0)), torch.randn(4, 8))
    node = _node(gm, aten.split_with_sizes.default)
    args, _ = localize_args(node, ("x", [4, 4], 1), {}, [(2, 8)], [(2, 4), (2, 4)])
    assert args == ("x", [4, 4], 1)
    args, _ = localize_args(_node(gm, aten.permute.default), ("x", [1, 0]), {}, [(2, 8)], [(8, 2)])
    assert args == ("x", [1, 0])


def test_verifier_catches_a_missing_localisation(monkeypatch):
    """Without localize_args, view's global sizes do not fit the local shard: the factor check fails."""
    import partir_torch.verify as verify

    gm = _trace(lambda x: x.view(4, 2, 6), torch.randn(8, 6))
    assert not verify_graph(gm).findings
    monkeypatch.setattr(verify, "localize_args", lambda node, args, kwargs, i, o: (args, kwargs))
    report = verify_graph(gm)
    assert report.wrong and all("raised" in f.detail for f in report.wrong), str(report)
