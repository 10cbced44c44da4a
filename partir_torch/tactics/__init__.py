"""Tactics: ManualPartition and presets (each returns a tactic or a list of tactics)."""
from .manual import ManualPartition
from .presets import (DataParallel, EmbeddingSharding, ExpertParallel, Megatron, MultiQuery, embedding, expert_parallel,
                      multi_query, SequenceParallel, Zero, data_parallel, find_linear_pairs, megatron,
                      sequence_parallel, zero)
from .memory import MixedPrecision, Remat, mixed_precision, remat
from .schedule import flatten_schedule

__all__ = ["ManualPartition", "Megatron", "Zero", "data_parallel", "megatron", "zero", "find_linear_pairs", "SequenceParallel", "sequence_parallel",
           "flatten_schedule", "DataParallel", "ExpertParallel", "expert_parallel", "MultiQuery", "multi_query", "EmbeddingSharding", "embedding", "MixedPrecision", "mixed_precision", "Remat", "remat"]
