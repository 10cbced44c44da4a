"""The simulator's knobs as fitted on the calibration half of the published measurements.

Written by ``benchmarks/sim_validation.py --write-confidence`` with the held-out errors of ``confidence.py``, from
the same fit, so that the presets a user simulates with (``hardware(name)``) are the model whose error the
confidence column reports. Each knob is a :class:`~partir_torch.sim.hardware.Hardware` field, set absolutely or as
a factor on the preset's value (``hardware.KNOBS``).
"""

# the fit on the calibration half (written by benchmarks/sim_validation.py --write-confidence)
FITTED = {
    "attn_efficiency": 1.0,
    "fp8_efficiency": 0.7,
    "hbm_efficiency": 0.8,
    "kernel_overhead_s": 4e-06,
    "mm_half_time_s": 1.0,
    "overlap_slowdown": 0.1,
    "roofline_p": 1.0,
    "sustained_clock": 0.9,
    "tpu_mm_efficiency": 0.95,
}  # end FITTED
