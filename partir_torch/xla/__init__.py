"""torch-xla SPMD backend: `prog.to_xla()` runs partir's plan through XLA's SPMD partitioner (issue 12).

Needs torch-xla (torch 2.9 + torch-xla 2.9: the `.venv-xla` environment of the Makefile). Imports only capture,
rules and propagate of partir_torch (no torch.distributed runtime); compare() reads partir's lowered program.
Importing this module turns XLA's SPMD mode and post-partitioning HLO dumps on (before XLA starts, see device.py).
"""
from . import device as _device
from .compare import Comparison
from .hlo import XlaCollective, parse_collectives
from .program import XlaBackend

_device.enable()

__all__ = ["XlaBackend", "XlaCollective", "Comparison", "parse_collectives"]
