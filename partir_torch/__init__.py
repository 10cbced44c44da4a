"""partir_torch: composable SPMD partitioning of PyTorch training steps (PartIR for PyTorch)."""
from . import sim, tactics
from .api import partition
from .errors import PartitionError
from .mesh import Mesh
from .options import Options, StepOptions
from .rules.registry import register_rule
from .sharding import REPLICATED, Sharding
from .tactics.manual import ManualPartition
from .runtime import restart as _restart

_restart.install()      # torchrun --max-restarts: every attempt's store keys of its own (runtime/restart.py)

__all__ = ["Mesh", "Sharding", "REPLICATED", "ManualPartition", "partition", "tactics", "register_rule",
           "PartitionError", "sim", "Options", "StepOptions"]
