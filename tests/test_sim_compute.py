"""Per-op compute costs: FLOP formulas, roofline, efficiency curve, free ops."""
import pytest
import torch

from functools import partial

from partir_torch.sim import hardware as _preset

# the cost model's formulas against the datasheet and kernel-benchmark anchors (docs/hardware.md): the presets
# without the fit they carry for users (sim/fitted.py)
hardware = partial(_preset, calibrated=False)
from partir_torch.sim.compute import COMPUTE, FREE, CostModel, elem_bytes, op_class, val_sig
from partir_torch.sim.synthetic import GraphBuilder

aten = torch.ops.aten


def _cost(hw, build):
    b = GraphBuilder()
    node = build(b)
    nodes = list(b.graph.nodes)
    sigs = {n: val_sig(n.meta.get("val")) for n in nodes}
    nbytes = {n: sum(elem_bytes(n.meta.get("val"))) for n in nodes}
    cls, formula = op_class(node.target)
    assert cls == COMPUTE
    return CostModel(hw).cost(node, node.target, formula, sigs, nbytes)


def _gemm(n, dtype):
    return lambda b: b.call(aten.mm.default, b.input("a", (n, n), dtype=dtype), b.input("w", (n, n), dtype=dtype))


def test_gemm_efficiency_curve_matches_reference_points():
    hw = hardware("a100-80g")
    flops, t, dtype = _cost(hw, _gemm(1024, torch.float16))
    assert flops == 2 * 1024 ** 3 and dtype == "float16"
    assert flops / t / hw.peak_bf16 == pytest.approx(0.38, abs=0.005)      # MAMF: 1024^3 fp16 on A100
    flops, t, _ = _cost(hw, _gemm(16384, torch.bfloat16))
    assert 0.85 < flops / t / hw.peak_bf16 <= 0.869                        # best shapes: 86.9%


def test_fp32_uses_non_tensor_peak_unless_tf32():
    t32 = _cost(hardware("a100-80g"), _gemm(4096, torch.float32))[1]
    ttf = _cost(hardware("a100-80g", tf32=True), _gemm(4096, torch.float32))[1]
    assert t32 / ttf == pytest.approx(156 / 19.5, rel=0.05)


def test_memory_bound_op_is_bytes_over_hbm():
    hw = hardware("h100")
    flops, t, _ = _cost(hw, lambda b: b.call(aten.add.Tensor, b.input("x", (1 << 26,)), b.input("y", (1 << 26,))))
    nbytes = 3 * 4 * (1 << 26)
    assert flops == 0
    assert t == pytest.approx(nbytes / (hw.hbm_efficiency * hw.hbm_bw) + hw.kernel_overhead_s)
    assert 0.79 <= nbytes / t / hw.hbm_bw <= 0.93                         # Azure guide: 79-93% of HBM


def test_attention_flops_cpu_flash_kernels():
    q = (2, 4, 128, 64)
    hw = hardware("h100")

    def fwd(b):
        qq, kk, vv = (b.input(n, q, dtype=torch.bfloat16) for n in "qkv")
        out = b.call(aten._scaled_dot_product_flash_attention_for_cpu.default, qq, kk, vv, 0.0, True)
        return out
    flops, _, _ = _cost(hw, fwd)
    assert flops == 4 * 2 * 4 * 128 * 128 * 64                               # QK^T and PV: 2 x 2bhs^2d

    def bwd(b):
        qq, kk, vv, go, o = (b.input(n, q, dtype=torch.bfloat16) for n in ("q", "k", "v", "go", "o"))
        lse = b.input("lse", (2, 4, 128), dtype=torch.float32)
        return b.call(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                      go, qq, kk, vv, o, lse, 0.0, True)
    assert _cost(hw, bwd)[0] == 2.5 * flops                                  # flop_counter's backward formula


def test_views_and_metadata_are_free():
    for op in (aten.view.default, aten.t.default, aten.expand.default, aten.permute.default, aten.split.Tensor,
               aten._unsafe_view.default, aten.sym_size.int, aten.detach.default):
        assert op_class(op)[0] == FREE, op
    for op in (aten.clone.default, aten.mm.default, aten.add_.Tensor, aten._to_copy.default):
        assert op_class(op)[0] == COMPUTE, op
    assert op_class(torch.ops._c10d_functional.all_reduce.default) == (2, "all_reduce")
    assert op_class(aten.empty.memory_format) == (FREE, "alloc")            # no kernel, but holds memory


def test_a_step_runs_flop_bound_kernels_at_the_sustained_clock():
    hw = hardware("h100", roofline_p=64)            # the compute leg alone (max() roofline)
    slow = hardware("h100", sustained_clock=0.8, roofline_p=64)
    flops, t, _ = _cost(hw, _gemm(8192, torch.bfloat16))
    t_slow = _cost(slow, _gemm(8192, torch.bfloat16))[1]
    assert t_slow - hw.mm_half_time_s == pytest.approx((t - hw.mm_half_time_s) / 0.8)
    add = lambda b: b.call(aten.add.Tensor, b.input("x", (1 << 26,)), b.input("y", (1 << 26,)))   # noqa: E731
    assert _cost(slow, add)[1] == _cost(hw, add)[1]                      # memory-bound kernels keep their time


def test_a_kernel_near_the_ridge_point_takes_longer_than_its_slower_leg():
    """The tall-skinny GEMM of the kernel table (802816x192x768, fp16 on A100: 157.8 TFLOP/s measured, Azure guide)
    streams its operands for about as long as it computes; the max() roofline put it at 250 TFLOP/s."""
    m, n, k = 802816, 192, 768
    tall = lambda b: b.call(aten.mm.default, b.input("a", (m, k), dtype=torch.float16),   # noqa: E731
                            b.input("w", (k, n), dtype=torch.float16))
    legs = hardware("a100-80g", roofline_p=64)
    flops, t_max, _ = _cost(legs, tall)
    t_p2 = _cost(hardware("a100-80g", roofline_p=2.0), tall)[1]
    t_mem = (m * k + k * n + m * n) * 2 / (legs.hbm_efficiency * legs.hbm_bw)
    t_flop = flops / (legs.mm_efficiency * legs.peak_bf16) + legs.mm_half_time_s
    assert t_max == pytest.approx(max(t_mem, t_flop))
    assert t_p2 == pytest.approx((t_mem ** 2 + t_flop ** 2) ** 0.5)
    assert flops / t_max / 1e12 > 240 and flops / t_p2 / 1e12 < 200      # measured 157.8 (the fit: 183)
    big = _gemm(16384, torch.bfloat16)                                   # far from the ridge: the compute leg
    assert _cost(hardware("a100-80g"), big)[1] == pytest.approx(_cost(legs, big)[1], rel=0.01)
    # the fixed cost is the half-time alone: a memory-bound kernel's launch overhead does not enter a GEMM's time
    assert _cost(hardware("a100-80g", kernel_overhead_s=50e-6, roofline_p=2.0), tall)[1] == pytest.approx(t_p2)


def test_a_gemm_fixed_cost_is_cycles_so_hopper_pays_less_of_it():
    a100, h100 = hardware("a100-80g"), hardware("h100")
    assert h100.mm_half_time_s == pytest.approx(a100.mm_half_time_s * 1410 / 1980)
    fp8 = lambda b: b.call(aten.mm.default, b.input("a", (1024, 1024), dtype=torch.float8_e4m3fn),   # noqa: E731
                           b.input("w", (1024, 1024), dtype=torch.float8_e4m3fn))
    flops, t, _ = _cost(h100, fp8)
    assert 230 < flops / t / 1e12 < 300          # Azure guide, 1024^3 fp8 on H100: 274 TFLOP/s (A100's cost: 190)
