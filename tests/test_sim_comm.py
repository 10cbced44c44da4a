"""Collective cost formulas: alpha-beta terms, algorithm choice, topology effects, monotonicity."""
import math

import pytest

from partir_torch.errors import PartitionError
from partir_torch.lower.records import KINDS
from partir_torch.mesh import Mesh
from partir_torch.sim import collective_time, estimate, hardware
from partir_torch.sim.comm import BASE_LAT, HOP_NVLINK, gpu_group, torus_group
from partir_torch.sim.hardware import PRESETS

GiB = 2 ** 30


def _slope(hw, kind, mesh, axis, algorithm, s1=4 * GiB, s2=8 * GiB):
    t1 = collective_time(hw, kind, s1, mesh, axis, algorithm=algorithm)
    t2 = collective_time(hw, kind, s2, mesh, axis, algorithm=algorithm)
    return (t2 - t1) / (s2 - s1)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_reduce_moves_2_n_minus_1_over_n(n):
    hw = hardware("a100-80g", gpus_per_node=n, nvlink_efficiency=1.0)
    slope = _slope(hw, "all_reduce", Mesh({"dp": n}), "dp", "ring")
    assert slope == pytest.approx(2 * (n - 1) / n / hw.nvlink_bw, rel=1e-9)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_ring_all_gather_moves_n_minus_1_over_n(kind):
    hw = hardware("h100", nvlink_efficiency=1.0)
    assert _slope(hw, kind, Mesh({"tp": 8}), "tp", "ring") == pytest.approx(7 / 8 / hw.nvlink_bw, rel=1e-9)


def test_ring_latency_is_nccl_base_plus_hops():
    hw = hardware("h100")
    t = estimate(hw, "all_reduce", 8, Mesh({"tp": 8}), "tp", algorithm="ring")
    assert t.protocol == "LL"                                   # tiny messages use the low-latency protocol
    lat = (BASE_LAT["ring"]["LL"] + 2 * 7 * HOP_NVLINK["LL"]) * 1e-6
    assert t.time_s == pytest.approx(lat, rel=1e-3)


def test_protocol_switches_with_size():
    hw, m = hardware("a100-80g"), Mesh({"dp": 8})
    protos = [estimate(hw, "all_reduce", s, m, "dp").protocol for s in (2 ** 16, 4 * 2 ** 20, GiB)]
    assert protos == ["LL", "LL128", "Simple"]


def test_nvls_on_nvswitch_systems_only():
    m = Mesh({"dp": 8})
    assert estimate(hardware("h200"), "all_reduce", GiB, m, "dp").algorithm == "nvls"
    assert estimate(hardware("a100-80g"), "all_reduce", GiB, m, "dp").algorithm == "ring"
    assert estimate(hardware("h200"), "all_gather", GiB, m, "dp").algorithm == "ring"
    with pytest.raises(PartitionError, match="nvls"):
        estimate(hardware("a100-80g"), "all_reduce", GiB, m, "dp", algorithm="nvls")
    # NVLS all-reduce exceeds the ring's bus bandwidth (docs/hardware.md: 480 vs 370 GB/s on 8xH100).
    ring = collective_time(hardware("h100"), "all_reduce", 8 * GiB, m, "dp", algorithm="ring")
    assert collective_time(hardware("h100"), "all_reduce", 8 * GiB, m, "dp") < 0.8 * ring


def test_mesh_axes_map_row_major_last_axis_inside_node():
    hw = hardware("h100", nodes=2)
    m = Mesh({"dp": 2, "tp": 8})
    assert gpu_group(hw, m, "tp") == (8, 1, 8)                   # within a node
    assert gpu_group(hw, m, "dp") == (2, 2, 1)                   # one GPU per node
    one_node = collective_time(hardware("h100"), "all_reduce", GiB, Mesh({"tp": 8}), "tp")
    assert collective_time(hw, "all_reduce", GiB, m, "tp") == pytest.approx(one_node)
    # Across nodes the NIC (50 GB/s) is the bottleneck: far slower than NVLink for the same bytes.
    assert collective_time(hw, "all_reduce", GiB, m, "dp") > 5 * one_node


def test_multi_node_group_is_slower_than_single_node():
    single = collective_time(hardware("h100"), "all_reduce", GiB, Mesh({"dp": 8}), "dp")
    hw = hardware("h100", nodes=4)
    multi = estimate(hw, "all_reduce", GiB, Mesh({"dp": 32}), "dp")
    assert multi.time_s > single
    # Ring bus bandwidth across nodes is capped by the node's 8 NICs (~8 x 47 GB/s), not NVLink.
    busbw = 2 * 31 / 32 / _slope(hw, "all_reduce", Mesh({"dp": 32}), "dp", "ring")
    assert busbw == pytest.approx(min(450e9 * hw.nvlink_efficiency, 8 * 50e9 * hw.nic_efficiency), rel=0.01)
    algos = {estimate(hw, "all_reduce", s, Mesh({"dp": 32}), "dp").algorithm for s in (1024, 64 * 2 ** 20)}
    assert algos <= {"ring", "tree", "hierarchical", "nvls_tree"}
    # The hierarchical formula: intra RS + inter AR of S/g + intra AG.
    h = collective_time(hw, "all_reduce", 8 * GiB, Mesh({"dp": 32}), "dp", algorithm="hierarchical")
    nic = 50e9 * hw.nic_efficiency
    assert h > 2 * 3 / 4 * 8 * GiB / 8 / nic


def test_tpu_all_gather_with_and_without_wraparound():
    m = Mesh({"x": 16, "y": 16})
    wrap = hardware("tpu-v5e", topology=(16, 16))
    line = hardware("tpu-v5e", topology=(16, 16), wraparound=(False, False))
    tw = collective_time(wrap, "all_gather", GiB, m, "y")
    tl = collective_time(line, "all_gather", GiB, m, "y")
    assert tl / tw == pytest.approx(2.0, rel=0.02)               # one-way links: about twice the time
    W = wrap.ici_link_bw * wrap.ici_efficiency
    lat = wrap.ici_base_latency_s + 8 * wrap.ici_hop_latency_s   # 16-ring, bidirectional: 8 hops
    assert tw == pytest.approx(15 / 16 * GiB / (2 * W) + lat, rel=1e-9)
    assert collective_time(wrap, "all_reduce", GiB, m, "y") == pytest.approx(2 * tw)


def test_tpu_axis_map_multi_dim_and_dcn():
    hw = hardware("tpu-v4", topology=(4, 4, 4), slices=2)
    m = Mesh({"data": 32, "model": 4})
    g = torus_group(hw, m, "data")
    assert g.slices == 2 and [d for d, *_ in g.dims] == ["x", "y"]
    t_default = collective_time(hw, "all_gather", GiB, m, "model")
    t_xy = collective_time(hw, "all_gather", GiB, Mesh({"model": 16, "data": 8}), "model",
                           axis_map={"model": ("x", "y"), "data": ("slice", "z")})
    assert t_xy < t_default                                      # two torus dims add their bandwidth
    dcn = collective_time(hw, "all_reduce", GiB, Mesh({"dcn": 2, "ici": 64}), "dcn")
    assert dcn > collective_time(hw, "all_reduce", GiB, Mesh({"dcn": 2, "ici": 64}), "ici")
    with pytest.raises(PartitionError, match="axis_map"):
        collective_time(hw, "all_gather", GiB, m, "model", axis_map={"model": ("x", "y")})    # 16 chips != 4
    with pytest.raises(PartitionError, match="axis_map"):
        collective_time(hw, "all_gather", GiB, m, "model", axis_map={"model": ("w",)})
    with pytest.raises(PartitionError, match="axis_map"):
        collective_time(hardware("h100"), "all_gather", GiB, Mesh({"tp": 8}), "tp", axis_map={"tp": ("x",)})


def _systems():
    for name in PRESETS:
        hw = hardware(name)
        yield hardware(name, nodes=2) if hw.kind == "gpu" else hardware(name, slices=2)
        yield hw


@pytest.mark.parametrize("hw", list(_systems()), ids=lambda h: h.describe())
def test_more_bytes_is_never_faster(hw):
    n = hw.num_devices
    inner = 8 if n % 8 == 0 else n
    meshes = [(Mesh({"a": n // inner, "b": inner}) if n // inner > 1 else Mesh({"b": n}))]
    sizes = [0] + [2 ** k for k in range(0, 35)]
    for m in meshes:
        for axis in m.axes:
            for kind in KINDS:
                times = [collective_time(hw, kind, s, m, axis) for s in sizes]
                assert all(b >= a for a, b in zip(times, times[1:])), (kind, axis)
                assert times[0] == 0 and all(math.isfinite(t) and t > 0 for t in times[1:])


def test_unknown_kind_and_axis():
    with pytest.raises(PartitionError, match="all_reduce"):
        collective_time(hardware("h100"), "allreduce", 1, Mesh({"tp": 8}), "tp")
    with pytest.raises(PartitionError, match="tp"):
        collective_time(hardware("h100"), "all_reduce", 1, Mesh({"tp": 8}), "mp")


def test_nvls_small_messages_use_the_low_latency_regime():
    """8xH200 nccl-tests (Azure guide): 4 MiB reaches 138 GB/s bus bandwidth, 16 MiB 240 GB/s, 1 GiB 468 GB/s."""
    hw, m = hardware("h200"), Mesh({"dp": 8})
    busbw = {s: 2 * 7 / 8 * s / collective_time(hw, "all_reduce", s, m, "dp") / 1e9
             for s in (4 * 2 ** 20, 16 * 2 ** 20, GiB)}
    assert busbw[4 * 2 ** 20] == pytest.approx(138.4, rel=0.05)
    assert busbw[16 * 2 ** 20] == pytest.approx(240.4, rel=0.05)
    assert busbw[GiB] == pytest.approx(467.6, rel=0.05)
    assert estimate(hw, "all_reduce", 4 * 2 ** 20, m, "dp").protocol == "Simple/few-channels"
    assert estimate(hw, "all_reduce", GiB, m, "dp").protocol == "Simple"


def test_the_public_estimate_stays_the_function_once_every_sim_module_is_loaded():
    """sim.estimate is comm's function: no submodule of sim shares its name (importing one would replace the
    package's attribute: `from partir_torch.sim import estimate` then returned a module)."""
    import importlib
    import pkgutil

    import partir_torch.sim as sim

    for m in pkgutil.iter_modules(sim.__path__):
        importlib.import_module(f"partir_torch.sim.{m.name}")
    assert all(callable(getattr(sim, name)) or name == "PRESETS" for name in sim.__all__), sim.__all__
