"""Runtimes: real ranks (torch.distributed) or all ranks emulated in one process."""
from .executor import Executor

__all__ = ["Executor"]
