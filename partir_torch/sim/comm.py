"""Collective cost: alpha-beta models of NCCL's algorithms on GPU meshes and of torus collectives on TPU pods.

Sizes follow the nccl-tests convention (NVIDIA nccl-tests PERFORMANCE.md): ``nbytes`` is the full array, i.e. the
all_reduce buffer, the all_gather output, the reduce_scatter input, the per-rank all_to_all buffer. Each rank moves
``bus = f * nbytes`` bytes, f = 2(n-1)/n for all_reduce and (n-1)/n for the others; busbw = bus / time.

>>> from partir_torch.mesh import Mesh
>>> from partir_torch.sim.hardware import hardware
>>> t = collective_time(hardware("a100-80g"), "all_reduce", 2**30, Mesh({"dp": 8}), "dp")
>>> round(2 * 7 / 8 * 2**30 / t / 1e9)   # bus bandwidth in GB/s (nccl-tests measure 228.1)
228
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from ..errors import PartitionError
from ..lower.records import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVE_PERMUTE, KINDS, REDUCE_SCATTER
from .hardware import Hardware

US = 1e-6
PROTOCOLS = ("LL", "LL128", "Simple")
# NCCL src/graph/tuning.cc (docs/hardware.md): latency = base + steps x per-hop latency, in microseconds.
BASE_LAT = {"ring": {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}, "tree": {"LL": 6.8, "LL128": 14.0, "Simple": 8.4}}
HOP_NET = {"LL": 2.7, "LL128": 4.0, "Simple": 14.0}
# NVLink per-hop: NCCL's tuner uses LL 0.6 / LL128 1.9 / Simple 3.4. Simple is refit to 11.5 us: nccl-tests on
# 8xA100 (Azure guide) shows ~170 us of fixed cost for 64 MiB-1 GiB all-reduces, 3x what the tuner assumes.
HOP_NVLINK = {"LL": 0.6, "LL128": 1.9, "Simple": 11.5}
# Fraction of the Simple protocol's bandwidth each protocol reaches. LL sends 4 B of flags per 4 B of data and
# LL128 8 B per 120 B (NCCL protocol design); both also run fewer threads. Values fit to 8xA100 nccl-tests at
# 1 MiB (LL) and 4-16 MiB (LL128).
PROTO_BW = {"LL": 0.22, "LL128": 0.535, "Simple": 1.0}
ALGORITHMS = ("ring", "tree", "nvls", "nvls_tree", "hierarchical", "direct", "torus")


@dataclass(frozen=True)
class CommEstimate:
    time_s: float
    algorithm: str      # ring | tree | nvls | nvls_tree | hierarchical | direct | torus
    protocol: str = ""  # LL | LL128 | Simple on GPUs; the torus/DCN layout on TPUs

    @property
    def tactic(self) -> str:
        return f"{self.algorithm}/{self.protocol}" if self.protocol else self.algorithm


def collective_time(hw: Hardware, kind: str, nbytes: float, mesh, axis: str, axis_map=None,
                    algorithm: str | None = None) -> float:
    """Seconds for one collective of ``nbytes`` (full array) over mesh axis ``axis`` of ``mesh`` laid on ``hw``."""
    return estimate(hw, kind, nbytes, mesh, axis, axis_map, algorithm).time_s


def estimate(hw: Hardware, kind: str, nbytes: float, mesh, axis: str, axis_map=None,
             algorithm: str | None = None) -> CommEstimate:
    """Like :func:`collective_time`, also naming the algorithm and protocol picked (the fastest, as NCCL's tuner
    does), or forcing one with ``algorithm=`` ("ring", "tree", "nvls", "nvls_tree", "hierarchical", "direct")."""
    if kind not in KINDS:
        raise PartitionError(f"collective_time: unknown collective kind {kind!r}; use one of {', '.join(KINDS)}.")
    hw = check_mesh(hw, mesh)
    mesh.check_axis(axis, "collective_time")
    amap = _freeze_map(axis_map)
    if hw.kind == "gpu":
        if amap:
            raise PartitionError(f"collective_time: axis_map applies to TPU torus dims; on {hw.describe()} mesh "
                                 f"axes map row-major onto nodes x GPUs (last axis inside a node). Reorder the "
                                 f"mesh axes to change which axis uses NVLink.")
        n, nodes, per_node = gpu_group(hw, mesh, axis)
        cands = _gpu_candidates(hw, kind, float(nbytes), n, nodes, per_node)
    else:
        cands = [_tpu_estimate(hw, kind, float(nbytes), torus_group(hw, mesh, axis, amap))]
    if nbytes <= 0 or mesh.axis_size(axis) == 1:
        return CommEstimate(0.0, cands[0].algorithm if cands else "none", "")
    if algorithm is not None:
        cands = [c for c in cands if c.algorithm == algorithm]
        if not cands:
            raise PartitionError(f"collective_time: algorithm {algorithm!r} does not apply to {kind} over axis "
                                 f"{axis!r} on {hw.describe()}; known algorithms: {', '.join(ALGORITHMS)}.")
    return min(cands, key=lambda c: c.time_s)


def check_mesh(hw: Hardware, mesh) -> Hardware:
    """The hardware ``mesh`` runs on: ``hw`` itself, or on GPUs, for a smaller mesh, its first ``mesh.size`` GPUs
    (filling nodes in order; ``describe()`` says how many of the machine's). A mesh the machine cannot hold, or one
    that does not fill a TPU slice, raises naming the ``hardware(...)`` argument that fits it."""
    n, have = mesh.size, hw.nodes * hw.gpus_per_node if hw.kind == "gpu" else hw.num_devices
    if n == hw.num_devices:
        return hw
    if hw.kind == "gpu" and n < have:
        return dataclasses.replace(hw, devices=n)
    if hw.kind == "gpu":
        nodes = -(-n // hw.gpus_per_node)
        fix = f"hardware({hw.name!r}, nodes={nodes})" + (f", which runs it on {n} of its {nodes * hw.gpus_per_node} "
                                                         f"GPUs" if n % hw.gpus_per_node else "")
    else:
        fix = _tpu_fix(hw, n)
    raise PartitionError(f"sim: the mesh {mesh} has {n} devices but the hardware {hw.describe()} has {have}. "
                         f"Simulate on {fix}.")


def _tpu_fix(hw: Hardware, n: int) -> str:
    """The hardware(...) call that holds ``n`` chips: one slice shaped for them (near-cubic), else more slices."""
    per_slice, shape = math.prod(hw.topology), [1] * len(hw.topology)
    for f in _prime_factors(n):                       # deal the factors to the smallest dim: a near-cube shape
        shape[shape.index(min(shape))] *= f
    if max(shape) <= (16 if hw.generation in ("v5e", "v6e") else 64):
        return f"hardware({hw.name!r}, topology={tuple(sorted(shape))})"
    if n % per_slice == 0:
        return f"hardware({hw.name!r}, topology={hw.topology}, slices={n // per_slice})"
    return f"a mesh of a multiple of {per_slice} chips on hardware({hw.name!r}, slices=...)"


def _prime_factors(n: int) -> list:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return sorted(out, reverse=True)


def _freeze_map(axis_map):
    if not axis_map:
        return None
    return tuple((a, (dims,) if isinstance(dims, str) else tuple(dims)) for a, dims in axis_map.items())


# ---------------------------------------------------------------------------------------------------- GPU
@lru_cache(maxsize=None)
def gpu_group(hw: Hardware, mesh, axis: str) -> tuple:
    """(ranks, nodes spanned, ranks per node) of the groups of ``axis``; ranks fill nodes row-major."""
    n, nodes, per_node = mesh.axis_size(axis), 1, 1
    for group in mesh.axis_groups(axis):
        counts: dict = {}
        for r in group:
            counts[r // hw.gpus_per_node] = counts.get(r // hw.gpus_per_node, 0) + 1
        nodes, per_node = max(nodes, len(counts)), max(per_node, max(counts.values()))
    return n, nodes, per_node


def _bus_factor(kind: str, n: int) -> float:
    return 2 * (n - 1) / n if kind == ALL_REDUCE else (n - 1) / n


def _ring(kind, S, n, nodes, intra_bw, net_bw):
    """Ring (NCCL tuning.cc): steps 2(n-1) for all_reduce, n-1 otherwise, of which 2(k-1) / k-1 cross nodes;
    bandwidth is the slower of NVLink and the node's NICs that carry the ring across the node boundary."""
    steps = 2 * (n - 1) if kind == ALL_REDUCE else n - 1
    inter = (2 * (nodes - 1) if kind == ALL_REDUCE else nodes - 1)
    bw = min(intra_bw if n > nodes else math.inf, net_bw if nodes > 1 else math.inf)
    bus = _bus_factor(kind, n) * S
    return [CommEstimate(US * (BASE_LAT["ring"][p] + (steps - inter) * HOP_NVLINK[p] + inter * HOP_NET[p])
                         + bus / (bw * PROTO_BW[p]), "ring", p) for p in PROTOCOLS]


def _best_ring(kind, S, n, nodes, intra_bw, net_bw) -> float:
    return 0.0 if n == 1 else min(c.time_s for c in _ring(kind, S, n, nodes, intra_bw, net_bw))


def _gpu_candidates(hw: Hardware, kind: str, S: float, n: int, nodes: int, per_node: int) -> list:
    intra = hw.nvlink_bw * hw.nvlink_efficiency               # NVSwitch: every GPU pair at full port speed
    nic = hw.nic_bw * hw.nic_efficiency                       # one NIC per GPU
    net = per_node * nic                                      # a node's NICs used by one group
    if n == 1:
        return [CommEstimate(0.0, "ring", "")]
    if kind == COLLECTIVE_PERMUTE:
        # One ring step: every rank sends S bytes to its neighbour (through its NIC where the ring leaves the node).
        bw, hop = (nic, HOP_NET) if nodes > 1 else (intra, HOP_NVLINK)
        return [CommEstimate(US * (BASE_LAT["ring"][p] + hop[p]) + S / (bw * PROTO_BW[p]), "direct", p)
                for p in PROTOCOLS]
    if kind == ALL_TO_ALL:
        # Direct p2p: each rank sends (n-1)/n of its buffer; the off-node part goes through its own NIC.
        t_nv = (per_node - 1) / n * S / intra
        t_net = (n - per_node) / n * S / nic if nodes > 1 else 0.0
        hop = HOP_NET if nodes > 1 else HOP_NVLINK
        return [CommEstimate(US * (BASE_LAT["ring"][p] + hop[p]) + max(t_nv, t_net) / PROTO_BW[p], "direct", p)
                for p in PROTOCOLS]
    cands = _ring(kind, S, n, nodes, intra, net)
    if kind == ALL_REDUCE and hw.nvls and nodes == 1:
        # NVLS (NCCL >= 2.17): multimem ld_reduce + st through the switch; each GPU sends and receives ~S once.
        cands.append(CommEstimate(hw.nvls_latency_s + S / (hw.nvls_efficiency * hw.nvlink_bw), "nvls", "Simple"))
        cands.append(CommEstimate(hw.nvls_small_latency_s + S / (hw.nvls_small_efficiency * hw.nvlink_bw), "nvls",
                                  "Simple/few-channels"))
    if nodes > 1 and kind == ALL_REDUCE:
        # Tree (NCCL tuning.cc): chain inside a node, double binary tree across nodes; each node's NICs carry
        # ~2S per direction (S reduced up + S broadcast down), spread over its per_node NICs.
        hops = math.ceil(math.log2(nodes))
        t_bw = max(2 * S / intra if per_node > 1 else 0.0, 2 * S / net)
        for p in PROTOCOLS:
            lat = BASE_LAT["tree"][p] + 2 * ((per_node - 1) * HOP_NVLINK[p] + hops * HOP_NET[p])
            cands.append(CommEstimate(US * lat + t_bw / PROTO_BW[p], "tree", p))
        if hw.nvls and per_node > 1:
            # NVLS-tree: NVLS inside the node pipelined with a tree (or IB SHARP) over the nodes' NICs.
            t_net = S / per_node / nic * (1 if hw.ib_sharp else 2)
            t = hw.nvls_latency_s + 2 * hops * HOP_NET["Simple"] * US \
                + max(S / (hw.nvls_efficiency * hw.nvlink_bw), t_net)
            cands.append(CommEstimate(t, "nvls_tree", "Simple"))
    if nodes > 1 and per_node > 1:
        # Hierarchical (ml-engineering "network" chapter): reduce-scatter inside the node over NVLink, the S/g
        # shard across nodes over each GPU's NIC, all-gather inside the node; phases run one after another.
        g, k, shard = per_node, nodes, S / per_node
        intra_rs = _best_ring(REDUCE_SCATTER, S, g, 1, intra, math.inf)
        intra_ag = _best_ring(ALL_GATHER, S, g, 1, intra, math.inf)
        inter = _best_ring(kind, shard, k, k, math.inf, nic)
        t = {ALL_REDUCE: intra_rs + inter + intra_ag, ALL_GATHER: inter + intra_ag,
             REDUCE_SCATTER: intra_rs + inter}[kind]
        cands.append(CommEstimate(t, "hierarchical", "mixed"))
    return cands


# ---------------------------------------------------------------------------------------------------- TPU
@dataclass(frozen=True)
class TorusGroup:
    dims: tuple        # per torus dim the group spans: (name, count, spacing, ring: bool)
    slices: int        # slices the group spans over DCN

    @property
    def ici_size(self) -> int:
        return math.prod(c for _, c, _, _ in self.dims)

    def label(self) -> str:
        parts = [f"{d}:{'ring' if r else 'line'}{c}" + (f"/{s}" if s > 1 else "") for d, c, s, r in self.dims]
        return ",".join(parts + ([f"dcn{self.slices}"] if self.slices > 1 else []))


@lru_cache(maxsize=None)
def torus_group(hw: Hardware, mesh, axis: str, amap=None) -> TorusGroup:
    """Where the groups of ``axis`` lie on the torus. Default: mesh axes fill (slice, x, y[, z]) row-major, the last
    mesh axis on the last torus dim; ``axis_map={"axis": ("x", "y")}`` pins an axis to whole dims ("slice" = DCN)."""
    dims = ([("slice", hw.slices)] if hw.slices > 1 else []) + list(zip(hw.torus_dims, hw.topology))
    names = [d for d, _ in dims]
    size = dict(dims)
    pinned = dict(amap or ())
    used: list = []
    for a, ds in pinned.items():
        mesh.check_axis(a, "axis_map")
        for d in ds:
            if d == "dcn":
                d = "slice"
            if d not in size or d in used:
                raise PartitionError(f"axis_map: axis {a!r} names torus dim {d!r}, which is unknown or already "
                                     f"used; {hw.describe()} has dims {', '.join(names)} (each usable once).")
            used.append(d)
        if math.prod(size["slice" if d == "dcn" else d] for d in ds) != mesh.axis_size(a):
            raise PartitionError(f"axis_map: axis {a!r} has size {mesh.axis_size(a)} but dims {ds} hold "
                                 f"{math.prod(size['slice' if d == 'dcn' else d] for d in ds)} chips.")
    if axis in pinned:
        spans = {("slice" if d == "dcn" else d): (size["slice" if d == "dcn" else d], 1) for d in pinned[axis]}
    else:
        free_dims = [(d, s) for d, s in dims if d not in used]
        free_axes = [a for a in mesh.axes if a not in pinned]
        stride = math.prod(mesh.axis_size(a) for a in free_axes[free_axes.index(axis) + 1:])
        spans = _spans(free_dims, stride, mesh.axis_size(axis))
    wrap = dict(zip(hw.torus_dims, hw.torus_wraparound))
    out = tuple((d, c, s, bool(wrap[d] and c * s == size[d])) for d, (c, s) in spans.items()
                if d != "slice" and c > 1)
    return TorusGroup(out, spans.get("slice", (1, 1))[0])


def _spans(dims, stride, n) -> dict:
    """Per dim: (distinct coordinates, spacing) of the ranks 0, stride, 2*stride, ... in a row-major grid."""
    place, p = {}, 1
    for d, s in reversed(dims):
        place[d], p = p, p * s
    out = {}
    for d, s in dims:
        coords = sorted({(i * stride // place[d]) % s for i in range(n)})
        out[d] = (len(coords), (coords[1] - coords[0]) if len(coords) > 1 else 1)
    return out


def _tpu_estimate(hw: Hardware, kind: str, S: float, g: TorusGroup) -> CommEstimate:
    """How to Scale Your Model (sharding chapter), V = full array bytes, W = link bandwidth per dim: all_gather /
    reduce_scatter ~ V/W (W bidirectional with wraparound, one-way without), all_reduce ~ 2V/W, all_to_all
    ~ V/(4W); dims used together add their bandwidth; ~1 us per hop."""
    link = hw.ici_link_bw * hw.ici_efficiency
    bw = sum((2 if ring else 1) * link / sp for _, _, sp, ring in g.dims)        # strided groups share links
    hops = sum((c // 2 if ring else c - 1) * sp for _, c, sp, ring in g.dims)
    n, k = g.ici_size, g.slices
    lat = hw.ici_base_latency_s + hops * hw.ici_hop_latency_s

    def ici(kind_, V):
        if n == 1:
            return 0.0
        if kind_ == ALL_TO_ALL:
            return lat + V * n / (4 * bw)                      # V is the per-rank buffer: the array is V*n
        t = lat + (n - 1) / n * V / bw
        return 2 * t if kind_ == ALL_REDUCE else t

    def dcn(kind_, V):
        # Ring over the slices through each chip's share of DCN (same alpha-beta form as NCCL's ring).
        if k == 1:
            return 0.0
        steps = 2 * (k - 1) if kind_ == ALL_REDUCE else k - 1
        return steps * hw.dcn_latency_s + _bus_factor(kind_, k) * V / (hw.dcn_bw * hw.dcn_efficiency)

    if kind == COLLECTIVE_PERMUTE:   # one ring step: S bytes to the next chip, one link one way (DCN across slices)
        t = (hw.dcn_latency_s + S / (hw.dcn_bw * hw.dcn_efficiency)) if k > 1 else \
            hw.ici_base_latency_s + hw.ici_hop_latency_s + S / link
        return CommEstimate(t, "torus" if k == 1 else "dcn", g.label())
    if kind == ALL_REDUCE:       # reduce-scatter on ICI, all-reduce of the shard over DCN, all-gather on ICI
        t = ici(ALL_REDUCE, S) + dcn(ALL_REDUCE, S / n)
    elif kind in (ALL_GATHER, REDUCE_SCATTER):
        t = ici(kind, S) + dcn(kind, S / n)
    else:
        t = ici(ALL_TO_ALL, S) + dcn(ALL_TO_ALL, S)
    return CommEstimate(t, "torus" if k == 1 else ("dcn" if n == 1 else "torus+dcn"), g.label())
