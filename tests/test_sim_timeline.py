"""sim/timeline.py: the "prefetch" issue policy (input preparation on the collective's stream, state gathers a
bounded number ahead of their use) and the slowdown of compute that overlaps a collective."""
import dataclasses

import pytest
import torch

from partir_torch.errors import PartitionError
from partir_torch.mesh import Mesh
from partir_torch.sim import collective_time, hardware, simulate_graph
from partir_torch.sim.synthetic import GraphBuilder
from partir_torch.sim.timeline import overlap_s

aten = torch.ops.aten
MESH = Mesh({"dp": 8})
HW = hardware("h100", calibrated=False)    # the timeline's mechanics, without the fit's contention
BF16 = dict(dtype=torch.bfloat16)


def _gather_of_cast_param(matmuls_before: int):
    """fp32 parameter shard -> cast to bf16 -> all_gather -> used by a GEMM after `matmuls_before` other GEMMs."""
    b = GraphBuilder(MESH)
    p = b.input("p", (512, 4096), "param", torch.float32)
    x = b.input("x", (4096, 4096), "input", torch.bfloat16)
    y = x
    for _ in range(matmuls_before):
        y = b.call(aten.mm.default, y, x)
    cast = b.call(aten._to_copy.default, p, **BF16)             # placed just before its use, as capture does
    w = b.wait(b.collective("all_gather", cast, "dp", tactic="Z3"))
    b.output([b.call(aten.mm.default, y, w)])
    return b.module()


def test_prefetch_moves_a_state_gather_and_its_cast_off_the_compute_stream():
    gm = _gather_of_cast_param(matmuls_before=4)
    ready = simulate_graph(gm, MESH, HW, issue="ready")
    pre = simulate_graph(gm, MESH, HW, issue="prefetch")
    t_ag = collective_time(HW, "all_gather", 4096 * 4096 * 2, MESH, "dp")
    # "ready": the cast runs in program order after the 4 GEMMs, so the gather starts there and is exposed
    assert ready.exposed_comm_s == pytest.approx(t_ag)
    # "prefetch": the cast runs on the gather's stream at t=0 and the gather is hidden behind the GEMMs
    assert pre.collectives[0].start_s == 0.0 and pre.exposed_comm_s == 0.0
    cast_s = ready.compute_s - pre.compute_s
    assert cast_s > 0 and pre.comm_s == pytest.approx(t_ag + cast_s)
    assert pre.step_time_s == pytest.approx(ready.step_time_s - cast_s - t_ag)


def test_prefetch_gathers_at_most_one_ahead_of_the_one_in_use():
    b = GraphBuilder(MESH)
    x = b.input("x", (4096, 4096), "input", torch.bfloat16)
    ps = [b.input(f"p{i}", (512, 4096), "param", torch.bfloat16) for i in range(3)]
    colls = [b.collective("all_gather", p, "dp", tactic="Z3") for p in ps]     # all issued up front
    y = x
    for c in colls:
        w = b.wait(c)
        for _ in range(3):
            y = b.call(aten.mm.default, y, w)
    b.output([y])
    gm = b.module()
    one = simulate_graph(gm, MESH, HW, issue="prefetch")
    ready = simulate_graph(gm, MESH, HW, issue="ready")
    starts = [c.start_s for c in one.collectives]
    t_ag = one.collectives[0].time_s
    t_mm3 = 3 * (one.compute_s / 9)
    # the second gather waits until compute starts using the first, the third until it uses the second
    assert starts == pytest.approx([0.0, t_ag, t_ag + t_mm3])
    assert [c.start_s for c in ready.collectives] == pytest.approx([0.0, t_ag, 2 * t_ag])
    two = simulate_graph(gm, MESH, HW, issue="prefetch", prefetch=2)
    assert [c.start_s for c in two.collectives] == pytest.approx([0.0, t_ag, 2 * t_ag])
    assert one.exposed_comm_s == pytest.approx(t_ag) == two.exposed_comm_s


def test_prefetch_reduces_a_gradient_when_it_is_produced_not_where_its_cast_sits():
    b = GraphBuilder(MESH)
    x = b.input("x", (4096, 4096), "input", torch.bfloat16)
    g = b.call(aten.mm.default, x, x)                              # the gradient, bf16
    y = x
    for _ in range(6):
        y = b.call(aten.mm.default, y, x)                          # more backward
    g32 = b.call(aten._to_copy.default, g, dtype=torch.float32)     # its up-cast, placed at the end
    r = b.wait(b.collective("all_reduce", g32, "dp", tactic="BP"))
    b.output([y, r])
    gm = b.module()
    ready = simulate_graph(gm, MESH, HW, issue="ready")
    pre = simulate_graph(gm, MESH, HW, issue="prefetch")
    t_mm = pre.compute_s / 7
    assert pre.collectives[0].start_s == pytest.approx(t_mm) and pre.exposed_comm_s == 0.0
    assert ready.collectives[0].start_s == pytest.approx(ready.compute_s) and ready.exposed_comm_s > 0


def test_overlapped_compute_is_slowed_by_the_collective():
    b = GraphBuilder(MESH)
    g = b.input("g", (4096, 4096), "input", torch.bfloat16)
    x = b.input("x", (4096, 4096), "input", torch.bfloat16)
    c = b.collective("all_reduce", g, "dp")
    y = x
    for _ in range(20):
        y = b.call(aten.mm.default, y, x)
    b.output([b.call(aten.add.Tensor, y, b.wait(c))])
    gm = b.module()
    base = simulate_graph(gm, MESH, HW)
    slow = simulate_graph(gm, MESH, dataclasses.replace(HW, overlap_slowdown=0.25))
    assert base.exposed_comm_s == 0.0 and base.comm_s < base.compute_s
    assert slow.step_time_s == pytest.approx(base.step_time_s + 0.25 * base.comm_s)
    assert slow.compute_s == pytest.approx(base.compute_s + 0.25 * base.comm_s)


def test_overlap_s_counts_time_both_streams_are_busy():
    trace = [(0, "a", 0.0, 2.0), (0, "b", 2.0, 3.0), (1, "x", 1.0, 2.0), (1, "y", 2.5, 1.0), (1, "z", 6.0, 1.0)]
    assert overlap_s(trace) == pytest.approx(2.5)      # [1, 3.5] against compute [0, 5]
    assert overlap_s([(1, "x", 0.0, 1.0)]) == 0.0


def test_issue_and_prefetch_are_checked():
    gm = _gather_of_cast_param(matmuls_before=1)
    with pytest.raises(PartitionError, match="issue must be one of"):
        simulate_graph(gm, MESH, HW, issue="eager")
    with pytest.raises(PartitionError, match="prefetch must be an int >= 1"):
        simulate_graph(gm, MESH, HW, issue="prefetch", prefetch=0)
