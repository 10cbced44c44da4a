"""The simulator against published measurements it was not fitted on: the command line.
The code lives in examples/zoo/sim_validation.py (tests/test_sim_validation.py checks parts of it); see its docstring.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sim_validation.py [--quick] [--write-confidence]
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from examples.zoo.sim_validation import main  # noqa: E402

if __name__ == "__main__":
    main()
