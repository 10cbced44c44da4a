"""Stock Hugging Face / timm models partitioned and trained next to eager torch: the sweep's command line.
The code lives in examples/zoo/hf.py (tests/test_coverage.py runs a sample of it); see its docstring for the options.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hf_coverage.py --help
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from examples.zoo.hf import main  # noqa: E402

if __name__ == "__main__":
    main()
