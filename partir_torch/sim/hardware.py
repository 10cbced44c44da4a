"""Hardware descriptions: chips, links and how they are wired.

``hardware("h100", nodes=2)`` returns a frozen :class:`Hardware`; every field can be overridden by keyword. A preset
is a :class:`Chip` (``CHIPS``) joined by a :class:`Network` (``NETWORKS``), both with named fields. Every figure is
in docs/hardware.md with its source; the comments here say its kind ("spec" = datasheet, "meas" = published
measurement, "fit" = calibrated by benchmarks/sim_validation.py, "assumed" = no public number found).

>>> hw = hardware("h100", nodes=2)
>>> hw.num_devices, hw.nvlink_bw
(16, 450000000000.0)
>>> hardware("tpu-v5e", topology=(16, 16)).torus_wraparound
(True, True)
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import PartitionError, closest
from .fitted import FITTED

GB = 1e9
GiB = 2 ** 30
TFLOPS = 1e12

# Small-GEMM fall-off as a Hockney curve (Hockney 1991, "r_inf and n_1/2"): t = F / (eff_max * peak) + t_half.
# Fit to MAMF (ml-engineering): a 1024^3 fp16 GEMM on A100 reaches 38% of 312 TFLOP/s, best shapes 86.9%.
# The 38% is the whole kernel's time, whose memory leg (6 MiB of operands at 90% of 2,039 GB/s) combines with the
# compute leg as sim/compute.py's p-norm (Hardware.roofline_p).
ROOFLINE_P = 1.5                   # fit on the kernel rows of the calibration half (benchmarks/sim_validation.py)
_T_PEAK_1024 = 2 * 1024 ** 3 / (312 * TFLOPS)
_T_MEM_1024 = 3 * 2 * 1024 ** 2 / (0.90 * 2039 * GB)
GEMM_HALF_TIME_S = ((_T_PEAK_1024 / 0.38) ** ROOFLINE_P - _T_MEM_1024 ** ROOFLINE_P) ** (1 / ROOFLINE_P) \
    - _T_PEAK_1024 / 0.869                                                                # ~9.2 us
# The half-time is a GEMM kernel's fixed cost (launch, prologue, epilogue, the last wave's tail): a number of cycles,
# so it shrinks with the clock. Hopper's boost clock is 1,980 MHz against A100's 1,410 (datasheets); B200's is
# assumed Hopper's. The 1024^3 fp8 GEMMs of the kernel table (7.8 us on H100) are what this predicts (7.4 us), and
# A100's half-time was 38% too slow for them.
_HOPPER_HALF_TIME_S = GEMM_HALF_TIME_S * 1410 / 1980


@dataclass(frozen=True)
class Hardware:
    """One machine: a chip type, how many, and the links between them.

    GPU systems: ``nodes`` x ``gpus_per_node``, NVLink/NVSwitch inside a node, one NIC per GPU between nodes.
    TPU systems: ``slices`` x prod(``topology``) chips, an ICI torus inside a slice, DCN between slices.
    Bandwidths are bytes/s in one direction per device (GPU) or per link (TPU ICI); FLOP/s are dense.
    """

    name: str
    kind: str                          # "gpu" | "tpu"
    # --- chip ---------------------------------------------------------------------------------------------------
    peak_bf16: float                   # tensor-core / MXU FLOP/s for bf16 and fp16
    peak_fp32: float                   # non-tensor fp32 FLOP/s (used for fp32 matmuls unless tf32=True)
    peak_tf32: float                   # tensor-core tf32 FLOP/s
    peak_fp8: float
    hbm_bytes: float
    hbm_bw: float                      # bytes/s
    tf32: bool = False                 # fp32 matmuls run on tensor cores (torch.backends.cuda.matmul.allow_tf32)
    mm_efficiency: float = 0.85        # best-shape fraction of peak for matmul-like ops
    mm_half_time_s: float = GEMM_HALF_TIME_S   # Hockney t_1/2 of a matmul kernel
    # fp8 GEMMs reach a smaller fraction of their (2x) peak than bf16 ones: cuBLASLt fp8 on H100/H200 tops out at
    # ~1,380 of 1,979 TFLOP/s (Azure AI-benchmarking-guide); 0 = same as mm_efficiency
    fp8_efficiency: float = 0.0
    # fused attention kernels (FlashAttention-2) reach a smaller fraction of peak than GEMMs: ~50-73% on A100
    # (Dao 2023, FlashAttention-2, fig. 5-7), ~35-40% on H100 (Shah et al. 2024, FlashAttention-3, fig. 6; 33% in the
    # 8xH200 calibration row)
    attn_efficiency: float = 0.6
    hbm_efficiency: float = 0.90       # large-copy fraction of HBM bandwidth (meas 79-93%, Azure guide)
    kernel_overhead_s: float = 2e-6    # per memory-bound kernel (launch + tail); assumed
    # how a FLOP-carrying kernel's compute and memory legs combine: time = (t_c^p + t_m^p)^(1/p) (sim/compute.py);
    # p = 1 is their sum, 64 and above the max() roofline. Near the ridge point the two overlap only in part: the
    # tall-skinny GEMMs of the kernel table (802816x192x768) run 30-40% slower than the slower leg; fit
    # (benchmarks/sim_validation.py)
    roofline_p: float = ROOFLINE_P
    # compute time lost per second of compute that runs while a collective is in flight: NCCL kernels occupy SMs
    # and both sides stream through HBM (Rashidi et al., ISCA'21; arXiv 2512.10236 measures the contention
    # slowdown of overlapped GEMMs); fit (benchmarks/sim_validation.py)
    overlap_slowdown: float = 0.0
    # FLOP rate a chip sustains through a training step, relative to the short kernel benchmarks its efficiencies
    # come from (a step holds the chip at its power limit, which lowers the tensor-core clock; torchtitan's H100s
    # at 500 W are a documented case); fit (benchmarks/sim_validation.py)
    sustained_clock: float = 1.0
    # --- GPU system ---------------------------------------------------------------------------------------------
    nodes: int = 1
    gpus_per_node: int = 8
    nvlink_bw: float = 0.0             # per GPU, one direction, through NVSwitch
    nvlink_efficiency: float = 0.80    # NCCL ring/Simple bus bandwidth / nvlink_bw at large sizes (fit)
    nvls: bool = False                 # NVLink SHARP (NVSwitch in-switch reduction), H100 and later
    nvls_efficiency: float = 0.61      # NVLS all-reduce algbw / nvlink_bw (fit: 480 GB/s busbw on 8xH100/H200)
    nvls_latency_s: float = 60e-6      # NVLS all-reduce fixed cost (fit to 8xH200 nccl-tests, 16 MiB-8 GiB)
    # small messages: NCCL runs NVLS on fewer channels (its tuner scales channels with the size): a lower fixed cost
    # and a lower bandwidth; fit to 8xH200 nccl-tests at 4-16 MiB
    nvls_small_latency_s: float = 30e-6
    nvls_small_efficiency: float = 0.405
    nic_bw: float = 0.0                # per GPU (one NIC per GPU), one direction
    nic_efficiency: float = 0.94       # NCCL reaches ~46-48 of 50 GB/s per NDR NIC (nccl-tests #290)
    ib_sharp: bool = False             # in-network reduction on the IB fabric (SHARP), used by NVLS-tree
    # the GPUs a smaller mesh runs on: the first `devices` of the machine, filling nodes in order (0 = all of them;
    # set by sim.comm.check_mesh, which the simulator calls)
    devices: int = 0
    # --- TPU system ---------------------------------------------------------------------------------------------
    topology: tuple = ()               # torus dims (x, y[, z]) of one slice
    slices: int = 1                    # slices joined by DCN
    wraparound: tuple | None = None    # per torus dim; None = the generation's rule (see torus_wraparound)
    ici_link_bw: float = 0.0           # per link, one direction
    ici_efficiency: float = 0.90       # assumed (no public calibration)
    ici_hop_latency_s: float = 1e-6    # "about 1 us per hop" (How to Scale Your Model)
    ici_base_latency_s: float = 2e-6   # assumed
    dcn_bw: float = 0.0                # per chip, one direction
    dcn_efficiency: float = 0.90       # assumed
    dcn_latency_s: float = 10e-6       # per ring step over DCN; assumed
    generation: str = ""               # "v4" | "v5e" | "v5p" | "v6e": selects the wraparound rule

    def __post_init__(self):
        if self.kind not in ("gpu", "tpu"):
            raise PartitionError(f"hardware {self.name!r}: kind must be 'gpu' or 'tpu', got {self.kind!r}.")
        for f in ("nodes", "gpus_per_node", "slices"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise PartitionError(f"hardware {self.name!r}: {f} must be a positive int, got {v!r}.")
        whole = self.nodes * self.gpus_per_node
        if not isinstance(self.devices, int) or not 0 <= self.devices <= whole or (self.devices and self.kind != "gpu"):
            raise PartitionError(f"hardware {self.name!r}: devices (the GPUs a smaller mesh uses) must be an int in "
                                 f"0..{whole} on a GPU machine, got {self.devices!r}.")
        if self.kind == "tpu":
            object.__setattr__(self, "topology", tuple(self.topology))
            ranks = (2, 3) if self.generation in ("v4", "v5p") else (2,)     # 3D tori may be given as (x, y)
            if len(self.topology) not in ranks or not all(isinstance(d, int) and d >= 1 for d in self.topology):
                raise PartitionError(f"hardware {self.name!r}: topology must be {max(ranks)} positive ints "
                                     f"(x, y{', z' if max(ranks) == 3 else ''}), got {self.topology!r}.")
            if self.generation in ("v5e", "v6e") and max(self.topology) > 16:
                raise PartitionError(f"hardware {self.name!r}: {self.generation} slices are at most 16x16 "
                                     f"(256 chips), got topology {self.topology!r}; use slices= for more.")
            if self.wraparound is not None:
                object.__setattr__(self, "wraparound", tuple(bool(w) for w in self.wraparound))
                if len(self.wraparound) != len(self.topology):
                    raise PartitionError(f"hardware {self.name!r}: wraparound {self.wraparound!r} needs one "
                                         f"flag per torus dim of topology {self.topology!r}.")

    @property
    def num_devices(self) -> int:
        if self.kind == "gpu":
            return self.devices or self.nodes * self.gpus_per_node
        return math.prod(self.topology) * self.slices

    @property
    def torus_dims(self) -> tuple:
        """Names of the torus dims: ('x', 'y') or ('x', 'y', 'z')."""
        return ("x", "y", "z")[:len(self.topology)]

    @property
    def torus_wraparound(self) -> tuple:
        """Which torus dims have wraparound links.

        v4 / v5p: all dims, when the slice is made of full 4x4x4 cubes (every dim a multiple of 4).
        v5e / v6e: only dims of size 16 (a full pod side). (Google Cloud TPU docs; How to Scale Your Model.)
        """
        if self.wraparound is not None:
            return self.wraparound
        if self.generation in ("v4", "v5p"):
            cube = all(d % 4 == 0 for d in self.topology)
            return tuple(cube and d > 1 for d in self.topology)
        return tuple(d == 16 for d in self.topology)

    def peak_flops(self, dtype) -> float:
        """Dense matmul FLOP/s for a dtype (torch.dtype or its name)."""
        name = str(dtype).replace("torch.", "")
        if name in ("bfloat16", "float16", "half"):
            return self.peak_bf16
        if name.startswith("float8"):
            return self.peak_fp8
        if name in ("float32", "float"):
            return self.peak_tf32 if self.tf32 else self.peak_fp32
        if name in ("float64", "double"):
            return self.peak_fp32 / 2          # FP64 is at most half of FP32 on these chips (spec sheets)
        return self.peak_fp32

    def describe(self) -> str:
        if self.kind == "gpu":
            whole = f"{self.nodes} node(s) x {self.gpus_per_node} GPUs"
            if self.devices and self.devices < self.nodes * self.gpus_per_node:
                used = -(-self.devices // self.gpus_per_node)
                return f"{self.name} ({self.devices} of {whole}; on {used} node(s))"
            return f"{self.name} ({whole} = {self.num_devices})"
        topo = "x".join(map(str, self.topology))
        return f"{self.name} ({self.slices} slice(s) x {topo} = {self.num_devices} chips)"


_FIELDS = tuple(f.name for f in dataclasses.fields(Hardware))


@dataclass(frozen=True)
class Chip:
    """One accelerator as its vendor ships it: peak rates, HBM, and how close kernels get to them. Fields are named
    as in :class:`Hardware` (FLOP/s dense, bytes, bytes/s). ``confidence`` is the chip class of the simulator's
    validated error families (sim/confidence.py), ``nearest`` the classes to fall back on, closest first."""

    name: str
    kind: str                          # "gpu" | "tpu"
    peak_bf16: float
    peak_fp32: float
    peak_tf32: float
    peak_fp8: float
    hbm_bytes: float
    hbm_bw: float
    mm_efficiency: float
    confidence: str
    nearest: tuple
    attn_efficiency: float = 0.6
    fp8_efficiency: float = 0.0
    mm_half_time_s: float = GEMM_HALF_TIME_S
    generation: str = ""               # TPU generation: selects the torus wraparound rule
    source: str = ""                   # where each figure comes from (docs/hardware.md has them all)


@dataclass(frozen=True)
class Network:
    """How the chips of a system are joined, with :class:`Hardware`'s field names (bytes/s, one direction).
    GPU: NVLink/NVSwitch inside a node, one NIC per GPU between nodes. TPU: ICI torus links inside a slice (and
    the preset's default slice shape), DCN between slices."""

    name: str
    nvlink_bw: float = 0.0
    nvlink_efficiency: float = 0.80
    nvls: bool = False
    nic_bw: float = 0.0
    ici_link_bw: float = 0.0
    dcn_bw: float = 0.0
    topology: tuple = ()
    source: str = ""


def _nvidia(name, bf16, fp32, tf32, fp8, hbm_gb, hbm_gbs, mm, confidence, nearest, **more) -> Chip:
    """An NVIDIA GPU from its datasheet units: TFLOP/s, GB, GB/s."""
    return Chip(name, "gpu", peak_bf16=bf16 * TFLOPS, peak_fp32=fp32 * TFLOPS, peak_tf32=tf32 * TFLOPS,
                peak_fp8=fp8 * TFLOPS, hbm_bytes=hbm_gb * GB, hbm_bw=hbm_gbs * GB, mm_efficiency=mm,
                confidence=confidence, nearest=nearest, **more)


def _tpu(name, gen, bf16, hbm_bytes, hbm_gbs, nearest) -> Chip:
    """A TPU from Google's units (TFLOP/s, GB/s). Assumed: fp32 matmuls run as 3 bf16 passes (XLA precision HIGH),
    fp8 at the bf16 rate, 85% of peak for the best matmul shapes (no MAMF-style TPU measurement)."""
    return Chip(name, "tpu", peak_bf16=bf16 * TFLOPS, peak_fp32=bf16 * TFLOPS / 3, peak_tf32=bf16 * TFLOPS / 3,
                peak_fp8=bf16 * TFLOPS, hbm_bytes=hbm_bytes, hbm_bw=hbm_gbs * GB, mm_efficiency=0.85,
                confidence=gen, nearest=nearest, generation=gen, source=_TPU)


# Every figure is in docs/hardware.md; `source` says where each comes from and of which kind it is: "spec" =
# datasheet, "meas" = published measurement, "fit" = calibrated by benchmarks/sim_validation.py, "assumed".
_A100 = "spec: NVIDIA A100 datasheet (SXM); mm 86.9% meas: MAMF (ml-engineering)"
_H100 = ("spec: NVIDIA {} datasheet; mm 80.3% meas: MAMF; fp8 70% meas: Azure AI-benchmarking-guide (cuBLASLt "
         "~1,380 of 1,979 TFLOP/s); attention 34% meas: FlashAttention-3 fig. 6 (35-40%), 8xH200 row (33%)")
_TPU = "spec: Google Cloud TPU docs (bf16 TFLOP/s, HBM size and GB/s); fp32, fp8, mm 85% assumed"
CHIPS = {
    "a100-40g": _nvidia("a100-40g", bf16=312, fp32=19.5, tf32=156, fp8=312, hbm_gb=40, hbm_gbs=1555, mm=0.869,
                        confidence="a100", nearest=("h100", "h200", "b200"), source=_A100),
    "a100-80g": _nvidia("a100-80g", bf16=312, fp32=19.5, tf32=156, fp8=312, hbm_gb=80, hbm_gbs=2039, mm=0.869,
                        confidence="a100", nearest=("h100", "h200", "b200"), source=_A100),
    "h100": _nvidia("h100", bf16=989, fp32=66.9, tf32=494.5, fp8=1979, hbm_gb=80, hbm_gbs=3350, mm=0.803,
                    confidence="h100", nearest=("h200", "b200", "a100"), attn_efficiency=0.34, fp8_efficiency=0.70,
                    mm_half_time_s=_HOPPER_HALF_TIME_S,
                    source=_H100.format("H100 SXM5")),
    "h200": _nvidia("h200", bf16=989, fp32=67, tf32=494.5, fp8=1979, hbm_gb=141, hbm_gbs=4800, mm=0.803,
                    confidence="h200", nearest=("h100", "b200", "a100"), attn_efficiency=0.34, fp8_efficiency=0.70,
                    mm_half_time_s=_HOPPER_HALF_TIME_S,
                    source=_H100.format("H200 SXM")),
    "b200": _nvidia("b200", bf16=2250, fp32=80, tf32=1125, fp8=4500, hbm_gb=180, hbm_gbs=8000, mm=0.776,
                    confidence="b200", nearest=("h200", "h100", "a100"), attn_efficiency=0.4,
                    mm_half_time_s=_HOPPER_HALF_TIME_S,
                    source="spec: NVIDIA DGX B200 (180 GB usable); mm 77.6% meas: MAMF; attention 40% assumed "
                           "(H100's FlashAttention-3 range)"),
    "tpu-v4": _tpu("tpu-v4", "v4", bf16=275, hbm_bytes=32 * GiB, hbm_gbs=1200, nearest=("v5p", "v5e", "v6e")),
    "tpu-v5e": _tpu("tpu-v5e", "v5e", bf16=197, hbm_bytes=16 * GB, hbm_gbs=819, nearest=("v6e", "v5p", "v4")),
    "tpu-v5p": _tpu("tpu-v5p", "v5p", bf16=459, hbm_bytes=95 * GiB, hbm_gbs=2765, nearest=("v4", "v6e", "v5e")),
    "tpu-v6e": _tpu("tpu-v6e", "v6e", bf16=918, hbm_bytes=32 * GB, hbm_gbs=1640, nearest=("v5e", "v5p", "v4")),
}

_ICI = "spec: Google Cloud TPU docs, How to Scale Your Model (ICI per link one-way, DCN per chip)"
NETWORKS = {
    "dgx-a100": Network("dgx-a100", nvlink_bw=300 * GB, nvlink_efficiency=0.775, nvls=False, nic_bw=25 * GB,
                        source="spec: NVLink3 300 GB/s via NVSwitch, HDR IB 200 Gb/s per GPU; ring 77.5% meas: "
                               "nccl-tests busbw 232 of 300 GB/s on 8xA100 (NVIDIA GTC'25 S72583)"),
    "dgx-h100": Network("dgx-h100", nvlink_bw=450 * GB, nvlink_efficiency=0.822, nvls=True, nic_bw=50 * GB,
                        source="spec: NVLink4 450 GB/s with NVLink SHARP, NDR IB 400 Gb/s per GPU; ring 82.2% fit "
                               "(370 of 450 GB/s meas, GTC'25 S72583)"),
    "dgx-b200": Network("dgx-b200", nvlink_bw=900 * GB, nvlink_efficiency=0.822, nvls=True, nic_bw=50 * GB,
                        source="spec: NVLink5 900 GB/s, 400 Gb/s per GPU; ring efficiency assumed as H100's"),
    "v4-pod": Network("v4-pod", ici_link_bw=45 * GB, dcn_bw=25 / 4 * GB, topology=(2, 2, 1),
                      source=_ICI + "; DCN ~25 GB/s per 4-chip host"),
    "v5e-pod": Network("v5e-pod", ici_link_bw=45 * GB, dcn_bw=3 * GB, topology=(2, 4), source=_ICI),
    "v5p-pod": Network("v5p-pod", ici_link_bw=90 * GB, dcn_bw=6 * GB, topology=(2, 2, 1), source=_ICI),
    "v6e-pod": Network("v6e-pod", ici_link_bw=90 * GB, dcn_bw=12.5 * GB, topology=(2, 4), source=_ICI),
}


def system(chip: Chip, net: Network) -> Hardware:
    """The Hardware of `chip` joined by `net` (one node, or one slice of the network's default shape)."""
    fields = {f.name: getattr(chip, f.name) for f in dataclasses.fields(Chip) if f.name in _FIELDS}
    fields.update({f.name: getattr(net, f.name) for f in dataclasses.fields(Network) if f.name in _FIELDS[1:]})
    if chip.kind == "tpu":     # XLA fuses elementwise ops: short kernels, small launch cost; assumed
        fields.update(mm_half_time_s=2e-6, kernel_overhead_s=0.5e-6)
    return Hardware(**fields)


# preset -> its chip in its network
PRESETS = {name: system(CHIPS[name], NETWORKS[net]) for name, net in (
    ("a100-40g", "dgx-a100"), ("a100-80g", "dgx-a100"), ("h100", "dgx-h100"), ("h200", "dgx-h100"),
    ("b200", "dgx-b200"), ("tpu-v4", "v4-pod"), ("tpu-v5e", "v5e-pod"), ("tpu-v5p", "v5p-pod"),
    ("tpu-v6e", "v6e-pod"))}

_ALIASES = {"a100": "a100-80g", "h100-80g": "h100", "v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p",
            "v6e": "tpu-v6e"}


# The knobs benchmarks/sim_validation.py fits: knob -> (Hardware field, "abs" or "scale" (a factor on the preset's
# value), the kind of chip it acts on or None for every kind). sim/fitted.py holds the fit the presets carry.
KNOBS = {"attn_efficiency": ("attn_efficiency", "scale", None), "hbm_efficiency": ("hbm_efficiency", "abs", None),
         "mm_half_time_s": ("mm_half_time_s", "scale", None), "fp8_efficiency": ("fp8_efficiency", "abs", None),
         "roofline_p": ("roofline_p", "abs", None), "sustained_clock": ("sustained_clock", "abs", "gpu"),
         "overlap_slowdown": ("overlap_slowdown", "abs", None), "kernel_overhead_s": ("kernel_overhead_s", "abs", None),
         "tpu_mm_efficiency": ("mm_efficiency", "abs", "tpu")}


def with_knobs(hw: Hardware, knobs: dict) -> Hardware:
    """``hw`` with fitted knobs applied (``KNOBS``): absolute values, or factors on ``hw``'s own; a knob scoped to one
    kind of chip leaves the other alone. Fused attention never runs above the GEMM efficiency."""
    over = {}
    for k, v in knobs.items():
        field, mode, kind = KNOBS[k]
        if kind in (None, hw.kind):
            over[field] = getattr(hw, field) * v if mode == "scale" else v
    if "attn_efficiency" in over:
        over["attn_efficiency"] = min(over["attn_efficiency"], over.get("mm_efficiency", hw.mm_efficiency))
    return dataclasses.replace(hw, **over)


def hardware(name: str, calibrated: bool = True, **overrides) -> Hardware:
    """A preset machine with any field overridden.

    GPU presets ("a100-40g", "a100-80g", "h100", "h200", "b200") take ``nodes=``, ``gpus_per_node=``,
    ``nic_bw=`` ...; TPU presets ("tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e") take ``topology=(x, y[, z])`` and
    ``slices=``. ``calibrated``: the preset carries the knobs fitted on published measurements (sim/fitted.py:
    the sustained clock, contention, launch overhead, HBM and roofline constants), the model whose held-out error
    the report's confidence column gives; False: the datasheet and kernel-benchmark figures alone (docs/hardware.md).
    """
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key not in PRESETS:
        hint = closest(key, PRESETS)
        raise PartitionError(f"hardware: unknown preset {name!r}."
                             + (f" Did you mean {hint[0]!r}?" if hint else "")
                             + f" Presets: {', '.join(PRESETS)}.")
    bad = [k for k in overrides if k not in _FIELDS]
    if bad:
        hints = {b: closest(b, _FIELDS, 1) for b in bad}
        did = "; ".join(f"{b!r} -> did you mean {h[0]!r}?" for b, h in hints.items() if h)
        raise PartitionError(f"hardware({name!r}): unknown field(s) {', '.join(map(repr, bad))}."
                             + (f" {did}." if did else "")
                             + f" Valid fields: {', '.join(_FIELDS)}.")
    base = PRESETS[key]
    if base.kind == "gpu" and any(k in overrides for k in ("topology", "slices")):
        raise PartitionError(f"hardware({name!r}): topology/slices describe TPU pods; for GPUs use "
                             f"nodes= and gpus_per_node=.")
    if base.kind == "tpu" and any(k in overrides for k in ("nodes", "gpus_per_node")):
        raise PartitionError(f"hardware({name!r}): nodes/gpus_per_node describe GPU clusters; for TPUs use "
                             f"topology=(x, y[, z]) and slices=.")
    if calibrated:
        base = with_knobs(base, FITTED)
    return dataclasses.replace(base, **overrides)
