"""Tactics: ManualPartition and presets (each returns a tactic or a list of tactics)."""
from .manual import ManualPartition
from .schedule import flatten_schedule

__all__ = ["ManualPartition", "flatten_schedule"]
