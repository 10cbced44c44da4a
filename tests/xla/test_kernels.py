"""The XLA forms of CPU-only kernels (partir_torch/xla/kernels.py) equal the aten kernels they replace, on CPU
tensors: flash attention forward and backward (causal, grouped heads, an additive mask), layer norm forward and
backward, group norm forward and backward, nearest upsampling backward, nll_loss's total weight."""
from __future__ import annotations

import pytest
import torch

from partir_torch.xla import kernels

aten = torch.ops.aten


@pytest.mark.parametrize("causal,heads_kv,masked", [(True, 4, False), (False, 2, False), (False, 4, True)])
def test_attention_forms_equal_the_cpu_flash_kernels(causal, heads_kv, masked):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = (torch.randn(2, heads_kv, 6, 8, generator=g) for _ in range(2))
    mask = None
    if masked:       # an additive float mask (the CPU kernel takes the query's dtype): -inf where a key is hidden
        keep = (torch.rand(6, 6, generator=g) > 0.3).fill_diagonal_(True)
        mask = torch.zeros(6, 6).masked_fill(~keep, float("-inf"))
    kr, vr = (t.repeat_interleave(4 // heads_kv, dim=1) for t in (k, v))   # the aten kernel wants equal heads
    want_out, want_lse = aten._scaled_dot_product_flash_attention_for_cpu(q, kr, vr, 0.0, causal, attn_mask=mask)
    out, lse = kernels.sdpa_cpu(q, k, v, 0.0, causal, attn_mask=mask)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse.reshape(lse.shape), rtol=1e-5, atol=1e-6)
    dout = torch.randn(out.shape, generator=g)
    want = aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, kr, vr, want_out, want_lse, 0.0,
                                                                     causal, attn_mask=mask)
    dq, dk, dv = kernels.sdpa_cpu_backward(dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask)
    rep = 4 // heads_kv
    torch.testing.assert_close(dq, want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dk, want[1].unflatten(1, (heads_kv, rep)).sum(2), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dv, want[2].unflatten(1, (heads_kv, rep)).sum(2), rtol=1e-4, atol=1e-5)


def test_layer_norm_forms_equal_aten():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(3, 5, 8, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g)
    want = aten.native_layer_norm(x, [8], w, b, 1e-5)
    got = kernels.layer_norm(x, [8], w, b, 1e-5)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    dy = torch.randn(x.shape, generator=g)
    want_b = aten.native_layer_norm_backward(dy, x, [8], want[1], want[2], w, b, [True, True, True])
    got_b = kernels.layer_norm_backward(dy, x, [8], want[1], want[2], w, b, [True, True, True])
    for a, e in zip(got_b, want_b):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_group_norm_and_upsampling_forms_equal_aten():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(2, 8, 4, 4, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g)
    want_f = aten.native_group_norm(x, w, b, 2, 8, 16, 4, 1e-5)
    for a, e in zip(kernels.group_norm(x, w, b, 2, 8, 16, 4, 1e-5), want_f):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    _, mean, rstd = want_f
    dy = torch.randn(x.shape, generator=g)
    want = aten.native_group_norm_backward(dy, x, mean, rstd, w, 2, 8, 16, 4, [True, True, True])
    got = kernels.group_norm_backward(dy, x, mean, rstd, w, 2, 8, 16, 4, [True, True, True])
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    dup = torch.randn(2, 8, 8, 12, generator=g)
    torch.testing.assert_close(kernels.upsample_nearest2d_backward(dup, [8, 12], [2, 8, 4, 4], 2.0, 3.0),
                               aten.upsample_nearest2d_backward(dup, [8, 12], [2, 8, 4, 4], 2.0, 3.0))


def test_nll_loss_total_weight_counts_the_targets_not_ignored():
    logp = torch.randn(6, 5).log_softmax(-1)
    target = torch.tensor([0, 1, -100, 3, 4, -100])
    out, total = kernels.nll_loss_forward(logp, target, None, 2, -100)   # reduction sum
    assert float(total) == 4.0
    torch.testing.assert_close(out, aten.nll_loss_forward(logp, target, None, 2, -100)[0])


def test_fill_with_a_tensor_value_equals_aten_and_stays_on_the_devices():
    """fill.Tensor (T5's `_shift_right`: the decoder start id written into a column of the labels): torch-xla's own
    kernel reads the 0-d value on the host, a sync that split T5's step in two XLA programs (compare() could not
    see the whole step); the form is a broadcast, computed on the devices, equal to aten's."""
    import torch_xla
    import torch_xla.debug.metrics as met

    from partir_torch.xla.kernels import xla_target

    assert xla_target(aten.fill.Tensor) is kernels.fill_tensor
    labels, start = torch.randint(0, 9, (4, 6)), torch.tensor(7)
    want = aten.fill.Tensor(labels[:, 0], start)
    dev = torch_xla.device()
    before = met.counter_value("aten::_local_scalar_dense") or 0
    got = kernels.fill_tensor(labels.to(dev)[:, 0], start.to(dev))
    torch_xla.sync()
    assert (met.counter_value("aten::_local_scalar_dense") or 0) == before
    assert got.dtype == want.dtype and torch.equal(got.cpu(), want)


def test_the_registry_rows_say_how_torch_xla_runs_each_op():
    """kernels.OVERRIDES is what the rows link; an op declared "as is" has a torch-xla kernel (or a composite one
    that decomposes for XLA); the ops listed as lacking an XLA form have neither."""
    from partir_torch.rules import registry as R

    rows = [r for r in R.default_registry().rows() if r.family != R.USER]
    linked = {r.op for r in rows if (r.xla or "").startswith("xla.kernels.")}
    assert set(kernels.OVERRIDES) >= linked and all(
        kernels.OVERRIDES[r.op] is getattr(kernels, r.xla.rsplit(".", 1)[1]) for r in rows if r.op in linked)

    def runs_on_xla(op):
        keys = ("XLA", "CompositeImplicitAutograd", "CompositeExplicitAutograd",
                "CompositeExplicitAutogradNonFunctional")
        return any(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), k) for k in keys)

    assert [str(r.op) for r in rows if r.xla == R.AS_IS and not runs_on_xla(r.op)] == []
    lacking = [r.op for r in rows if r.xla is None]
    assert sorted(map(str, lacking)) == sorted([
        "aten.glu_backward.default", "aten.im2col.default", "aten.col2im.default",
        "aten.linalg_solve_triangular.default", "aten.unfold_backward.default", "aten._fft_c2c.default",
        "aten._fft_r2c.default", "aten._fft_c2r.default",
        # partir's own op: its composite kernel is HF's grouped-mm function, not run on XLA tensors here
        "partir.experts_grouped.default", "partir.experts_grouped_backward.default",
        # batchnorm="local"'s per-rank kernels (rules/group_bn.py): no XLA form yet (tests/test_registry.py KNOWN_GAPS)
        "partir.group_batch_norm.default", "partir.group_batch_norm_backward.default"])
    assert not any(runs_on_xla(op) for op in lacking if op.namespace == "aten")
