"""Tactics: ManualPartition and presets (each returns a tactic or a list of tactics)."""
from .manual import ManualPartition
from .presets import Megatron, Zero, data_parallel, find_linear_pairs, megatron, zero
from .schedule import flatten_schedule

__all__ = ["ManualPartition", "Megatron", "Zero", "data_parallel", "megatron", "zero", "find_linear_pairs",
           "flatten_schedule"]
