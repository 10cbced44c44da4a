"""Tactics: ManualPartition and presets (each returns a tactic or a list of tactics)."""
from .manual import ManualPartition
from .presets import (DataParallel, EmbeddingSharding, Megatron, MultiQuery, embedding, multi_query, SequenceParallel,
                      Zero, data_parallel, megatron, sequence_parallel, zero)
from .experts import ExpertParallel, expert_parallel
from .structure import find_linear_pairs
from .memory import MixedPrecision, Remat, mixed_precision, remat
from .schedule import flatten_schedule
from .auto import AutomaticPartition, automatic
from .pipeline import Pipeline, pipeline
from .cp import ContextParallel, context_parallel

__all__ = ["ManualPartition", "Megatron", "Zero", "data_parallel", "megatron", "zero", "find_linear_pairs", "SequenceParallel", "sequence_parallel",
           "flatten_schedule", "DataParallel", "ExpertParallel", "expert_parallel", "MultiQuery", "multi_query", "EmbeddingSharding", "embedding", "MixedPrecision", "mixed_precision", "Remat", "remat",
           "AutomaticPartition", "automatic", "Pipeline", "pipeline", "ContextParallel", "context_parallel"]
