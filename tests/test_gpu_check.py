"""benchmarks/gpu_check.py (issue 39 item 5) in its CPU mode: the script's code (examples/zoo/gpu_check.py, no test
imports a benchmark script) on the tiny config, every row run, the table printed, the loss check passed; the
refusals without CUDA; the loss check and the GPU-name -> hardware preset map on values given here. The CPU mode's
two Inductor compiles dominate its cost: 14 s with Inductor's cache warm, 58 s cold (load 3.6-4.2, 2 cores)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import partir_torch as pt
from examples.zoo import gpu_check
from examples.zoo.gpu_check import ROWS, Row
from tests.harness import BF16_LOSS_RTOL, LOSS_RTOL

RTOL = {torch.float32: LOSS_RTOL, torch.bfloat16: BF16_LOSS_RTOL}


def test_cpu_tiny_mode_runs_the_four_rows_and_passes_the_loss_check(capsys):
    pytest.importorskip("torch._inductor")
    from partir_torch.runtime.emulate import _ensure_world

    _ensure_world(4)      # what an emulated program left behind in this process (a "fake" group): not refused
    res = gpu_check.main(["--device", "cpu", "--tiny", "--hw", "h100", "--warmup", "1", "--steps", "2"], RTOL)
    out = capsys.readouterr().out
    assert res.table in out and res.loss_ok and res.loss_rtol == BF16_LOSS_RTOL
    assert [r.name for r in res.rows] == list(ROWS)
    lines = {name: [ln for ln in out.splitlines() if ln.startswith(name + " ")] for name in ROWS}
    for r in res.rows:
        assert r.error is None, r.error
        assert len(lines[r.name]) == 1, lines
        assert lines[r.name][0].count("n/a (cpu)") == 3, lines[r.name]   # memory and both ratios: not measured
        assert r.peak_bytes is None and r.step_s > 0 and math.isfinite(r.loss0)
    plain, partir = res.rows[0], res.rows[2]
    assert abs(partir.loss0 - plain.loss0) <= BF16_LOSS_RTOL * abs(plain.loss0)
    assert abs(partir.loss_last - plain.loss_last) <= BF16_LOSS_RTOL * abs(plain.loss_last)  # after 2 updates
    for r in res.rows[2:]:                       # partir's programs, simulated on the preset asked for
        assert r.sim is not None and r.sim.step_time_s > 0 and r.sim.peak_memory_bytes > 0
        assert f"{1e3 * r.sim.step_time_s:.2f}" in lines[r.name][0]
    assert not dist.is_initialized()             # the 1-rank group is torn down


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda_unless_cpu_tiny():
    with pytest.raises(SystemExit, match="no CUDA device"):
        gpu_check.main([], RTOL)
    with pytest.raises(SystemExit, match="--device cpu runs only with --tiny"):
        gpu_check.main(["--device", "cpu"], RTOL)


def test_loss_check_names_failed_rows_and_partir_losses_beyond_the_tolerance():
    rows = [Row(ROWS[0], "", loss0=2.0), Row(ROWS[1], "", loss0=2.5), Row(ROWS[2], "", loss0=2.001),
            Row(ROWS[3], "", error="RuntimeError: no kernel")]
    bad = gpu_check.loss_check(rows, 1e-5)
    assert len(bad) == 2 and "partir compiled failed (RuntimeError: no kernel)" in bad[0]
    assert "partir eager's first-step loss 2.001 is 5.00e-04" in bad[1]       # plain compiled is not partir's
    assert gpu_check.loss_check(rows, 1e-3) == bad[:1]
    rows[3] = Row(ROWS[3], "", loss0=float("nan"))
    assert len(gpu_check.loss_check(rows, 1e-3)) == 1                         # a NaN loss fails too


@pytest.mark.parametrize("name, preset", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA B200", "b200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80g"), ("NVIDIA A100-SXM4-40GB", "a100-40g"),
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA GH200 480GB", None),
    ("NVIDIA A100 80GB PCIe", None), ("NVIDIA GeForce RTX 4090", None)])
def test_gpu_names_map_to_hardware_presets(name, preset):
    assert gpu_check.hardware_preset(name) == preset
    if preset is not None:
        assert pt.sim.hardware(preset).kind == "gpu"
