"""What the simulator returns: :class:`SimReport`, its table and its Chrome/Perfetto trace."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from tabulate import tabulate

ABBREV = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A",
          "collective_permute": "CP"}    # CP: one ring step of async_tp (lower/ring.py)


@dataclass
class CollectiveTiming:
    """One collective as simulated: the lowering record's facts plus the predicted time and schedule."""

    kind: str
    axis: str
    group_size: int
    nbytes: int
    dtype: str
    tactic: str          # the partitioning tactic that made it necessary (from the lowering record)
    value: str
    node: str
    time_s: float
    algorithm: str       # e.g. "ring/Simple", "nvls/Simple", "torus"
    start_s: float
    end_s: float
    exposed_s: float     # how long compute waited for it
    family: str = ""     # the tactic's declared family (from the lowering record)


@dataclass
class SimReport:
    """Predicted cost of one step of a per-device program on one hardware.

    Times are seconds, memory bytes per device, FLOPs per device per step. ``stages`` holds one report per tactic
    stage when the caller simulates each stage; ``table()`` then shows one row per stage.

    ``model_flops`` are the model's FLOPs per device: the unpartitioned step's FLOPs (recomputation excluded)
    divided by the number of devices, the same for every plan of one model, so ``mfu`` x ``step_time_s`` is a
    constant of the model and a plan that computes redundantly (a replicated head) shows a lower MFU.
    ``hardware_flops`` are what this device executes (redundant and recomputed FLOPs included) and ``hfu`` their
    utilisation. (simulate_graph on a bare program, with no unpartitioned step to count, uses the program's own
    FLOPs less recomputation as model FLOPs and says so in ``notes``.)
    """

    step_time_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    peak_memory_bytes: int = 0
    memory_breakdown: dict = field(default_factory=dict)
    model_flops: float = 0.0
    mfu: float = 0.0
    hardware_flops: float = 0.0
    hfu: float = 0.0
    hbm_bytes: float = 0.0               # the chip's memory per device: a peak above it is out of memory
    collectives: list = field(default_factory=list)
    stages: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    stage_name: str = ""
    hardware: str = ""
    peak_flops: float = 0.0              # FLOP/s the MFU is measured against
    trace: list = field(default_factory=list, repr=False)   # (track, name, start_s, dur_s)
    # held-out median |error| of the closest validated family (sim/confidence.py) and that family's name
    confidence: float | None = None
    confidence_family: str = ""
    pipeline: object = None              # sim/pipeline.PipelineSim of a pipelined program (bubble, stages, transfers)
    allocator: object = field(default=None, repr=False)   # GPU: the program's sim/memory.MemoryResult (reserved_memory_bytes)

    @property
    def reserved_memory_bytes(self) -> int | None:
        """On a GPU, what PyTorch's CUDA caching allocator reserves for this program in the steady state
        (sim/allocator.py): the figure torch.cuda.max_memory_reserved reports, where peak_memory_bytes is
        max_memory_allocated's (live tensor bytes). None on a TPU (XLA plans its buffers ahead) or for a report
        without the program's liveness (a pipelined program's stages)."""
        return self.allocator.reserved_bytes() if self.allocator is not None else None

    def collectives_by_kind(self) -> dict:
        """kind -> (count, bytes, seconds)."""
        out: dict = {}
        for c in self.collectives:
            n, b, t = out.get(c.kind, (0, 0, 0.0))
            out[c.kind] = (n + 1, b + c.nbytes, t + c.time_s)
        return out

    def collectives_by_axis(self) -> dict:
        """(kind, axis) -> (count, bytes, seconds)."""
        out: dict = {}
        for c in self.collectives:
            n, b, t = out.get((c.kind, c.axis), (0, 0, 0.0))
            out[(c.kind, c.axis)] = (n + 1, b + c.nbytes, t + c.time_s)
        return out

    @property
    def out_of_memory(self) -> bool:
        """The predicted peak exceeds the chip's HBM per device."""
        return bool(self.hbm_bytes) and self.peak_memory_bytes > self.hbm_bytes

    def _row(self) -> list:
        colls = ", ".join(f"{ABBREV.get(k, k)}x{n} {_bytes(b)}" for k, (n, b, _) in self.collectives_by_kind().items())
        conf = "-" if self.confidence is None else f"±{100 * self.confidence:.0f}% ({self.confidence_family})"
        peak = _bytes(self.peak_memory_bytes) + (" OOM" if self.out_of_memory else "")
        return [self.stage_name or "program", _ms(self.step_time_s), _ms(self.compute_s), _ms(self.comm_s),
                _ms(self.exposed_comm_s), peak, f"{100 * self.mfu:.1f}%", conf, colls or "-"]

    def table(self) -> str:
        """One row per stage (or one row for this program), then the memory breakdown of the last row and the
        notes (out of memory, what-if policies, communication never waited on). "OOM" after a peak: above the
        chip's HBM per device. MFU: the model's FLOPs (the same for every plan) per step time and peak FLOP/s.

        ``confidence``: how far the simulator was off, median |error| on published runs it was not fitted on, for
        the validated family (chip/strategy) closest to this one (benchmarks/sim_validation.py). The first line
        names the hardware, and how many of its devices the mesh runs on where it is smaller than the machine."""
        headers = ["stage", "step", "compute", "comm", "exposed comm", "peak mem/device", "MFU", "confidence",
                   "collectives"]
        rows = [s._row() for s in self.stages] if self.stages else [self._row()]
        text = f"simulated on {self.hardware or 'unnamed hardware'}\n" + tabulate(rows, headers=headers,
                                                                                  tablefmt="simple")
        last = self.stages[-1] if self.stages else self
        mem = ", ".join(f"{k} {_bytes(v)}" for k, v in last.memory_breakdown.items() if v)
        if mem:
            text += f"\npeak memory ({last.stage_name or 'program'}): {mem}"
        if last.allocator is not None:
            text += (f"\nreserved by PyTorch's CUDA caching allocator ({last.stage_name or 'program'}, estimated): "
                     f"{_bytes(last.reserved_memory_bytes)} (max_memory_reserved; the peak above is "
                     f"max_memory_allocated)")
        oom = [s.stage_name or "program" for s in (self.stages or [self]) if s.out_of_memory and s is not last]
        if oom:
            text += f"\nnote: out of memory (peak above the chip's HBM) after: {', '.join(oom)}"
        return text + "".join(f"\nnote: {n}" for n in last.notes)

    def __str__(self) -> str:
        return self.table()

    def to_chrome_trace(self, path: str) -> str:
        """Write Chrome trace-event JSON (open in Perfetto / chrome://tracing): track 0 compute, track 1 comm."""
        events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
                  for tid, name in ((0, "compute"), (1, "comm"))]
        events.append({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": self.hardware or "device"}})
        for track, name, start, dur in self.trace:
            events.append({"name": name, "ph": "X", "pid": 0, "tid": track, "ts": start * 1e6, "dur": dur * 1e6})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return path


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def _bytes(b: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{int(b)} B"
