"""Issue 39 item 5: on one CUDA device, an 8B-shaped Llama block's training step run four ways (plain torch eager and
compiled, partir's per-device program eager and compiled), measured step time and max_memory_allocated against
partir's prog.simulate(hw), one table, and the first-step losses checked against plain eager's. The code lives in
examples/zoo/gpu_check.py (tests/test_gpu_check.py runs it in its CPU mode); notes: benchmarks/notes/gpu_check.md.

    python benchmarks/gpu_check.py                       # on a GPU: the 8B-shaped block, 2 layers, seq 2048
    python benchmarks/gpu_check.py --device cpu --tiny   # the same code on a tiny config on CPU (seconds)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from examples.zoo.gpu_check import main  # noqa: E402
from tests.harness import BF16_LOSS_RTOL, LOSS_RTOL  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:], {torch.float32: LOSS_RTOL, torch.bfloat16: BF16_LOSS_RTOL})
