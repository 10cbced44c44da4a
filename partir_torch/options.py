"""Options of a partitioned program, set once in partition() and passed to every stage that reads them."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import PartitionError


@dataclass(frozen=True)
class Options:
    """bucket_bytes: parameter gathers and gradient reduce-scatters / all-reduces are merged into buckets of up to
    this many bytes (one collective each, as DDP/FSDP do; the bytes are unchanged); 0 keeps one collective per
    value. timeout_s: on real ranks, how long the start-up check waits for every rank before naming the missing
    ones. compile: the per-device program runs compiled by TorchInductor (runtime/compiled.py; eager otherwise, with
    the optimizer update as fused kernels, lower/fuse.py). max_shapes: how many input signatures (shapes and dtypes)
    keep a partitioned program (runtime/shapes.py); beyond it the least recently used one is dropped (and
    partitioned again if its shape comes back)."""

    bucket_bytes: int = 64 * 2 ** 20
    timeout_s: float = 300.0
    compile: bool = False
    max_shapes: int = 8

    def __post_init__(self):
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 0:
            raise PartitionError(f"partition: bucket_bytes must be an int >= 0 (0: no buckets), got "
                                 f"{self.bucket_bytes!r}.")
        if not isinstance(self.compile, bool):
            raise PartitionError(f"partition: compile must be True or False, got {self.compile!r}.")
        if not isinstance(self.max_shapes, int) or self.max_shapes < 1:
            raise PartitionError(f"partition: max_shapes must be an int >= 1 (input shapes that keep a program), "
                                 f"got {self.max_shapes!r}.")
        if not self.timeout_s > 0:
            raise PartitionError(f"partition: timeout_s must be a positive number of seconds, got {self.timeout_s!r}.")
