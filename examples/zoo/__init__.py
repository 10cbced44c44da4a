"""Code that benchmarks/ and tests/ share, so that no test imports a benchmark script.

hf.py: stock Hugging Face (and timm) models built from tiny configs, partitioned and trained next to eager torch
(benchmarks/hf_coverage.py runs the sweep; tests/test_coverage.py a sample). meta_capture.py: a capture on `meta` in a
fresh process (its peak RSS its own). sim_decoder.py, sim_reference.py, sim_validation.py: the simulator's reference
decoder, the published measurements it is judged on, and the fit and predictions (benchmarks/sim_validation.py).
gpu_check.py: benchmarks/gpu_check.py's four rows on one CUDA device (plain torch and partir, eager and compiled,
measured against prog.simulate), with a CPU mode that tests/test_gpu_check.py runs.
"""
