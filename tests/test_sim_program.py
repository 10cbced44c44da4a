"""The simulator on partitioned programs: stage reports change exactly where a tactic changed the program."""
from __future__ import annotations

import json

import pytest
import torch

import partir_torch as pt
from partir_torch import tactics as T
from examples.models import get



def gpt_program(mesh, schedule, layers=2):
    spec = get("gpt_sdpa", layers=layers)
    model = spec.build(device="meta")
    return pt.partition(model, pt.Mesh(mesh), schedule, example_inputs=spec.batch(8, device="meta"),
                        loss_fn=spec.loss_fn, optimizer=torch.optim.AdamW(model.parameters()),
                        options=pt.Options(bucket_bytes=0))


def kinds(report):
    return {(c.kind, c.axis) for c in report.collectives}


def test_stage_reports_follow_the_schedule():
    prog = gpt_program({"batch": 2, "model": 2}, [T.data_parallel("batch"), T.megatron("model"),
                                                   T.zero(3, "batch")])
    # the datasheet preset: the fit's contention (compute slowed while collectives run) would blur the halving below
    r = prog.simulate(pt.sim.hardware("h100", calibrated=False, gpus_per_node=4))
    base, bp, mp, z3 = r.stages
    assert [s.stage_name for s in r.stages] == ["replicated", "BP", "MP", "Z3"]
    assert kinds(base) == set()
    assert kinds(bp) == {("all_reduce", "batch")}                          # gradients (and the loss)
    assert kinds(mp) == {("all_reduce", "batch"), ("all_reduce", "model")}  # + Megatron's per-layer all-reduces
    assert kinds(z3) == {("all_reduce", "model"), ("all_reduce", "batch"), ("all_gather", "batch"),
                         ("reduce_scatter", "batch")}
    # BP leaves parameters whole, MP halves the tiled ones, Z3 tiles everything again on "batch"
    param = [prog.reports._stage_stats(k)["param"] for k in (-1, 0, 1, 2)]
    assert param[1] == param[0] and param[2] < param[1] and param[3] < param[2]
    assert z3.peak_memory_bytes < mp.peak_memory_bytes < bp.peak_memory_bytes < base.peak_memory_bytes
    assert base.compute_s > bp.compute_s            # half the batch per device
    assert r.step_time_s == z3.step_time_s and r.peak_memory_bytes == z3.peak_memory_bytes   # the report is its last stage


def test_zero3_memory_never_grows_with_ranks():
    peaks, params = [], []
    for k in (1, 2, 4, 8):
        prog = gpt_program({"batch": k}, [T.data_parallel("batch"), T.zero(3, "batch")])
        r = prog.simulate(pt.sim.hardware("h100", gpus_per_node=k))
        peaks.append(r.peak_memory_bytes)
        params.append(prog.reports._stage_stats(1)["param"])
    assert peaks == sorted(peaks, reverse=True) and params == sorted(params, reverse=True)
    assert params[-1] <= params[0] / 8 * 1.1          # a few small tensors that do not divide stay whole


def test_partition_with_simulate_prints_one_row_per_stage(capsys):
    spec = get("mlp")
    model = spec.build()
    pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=spec.batch(4),
                 loss_fn=spec.loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 simulate=pt.sim.hardware("a100-80g", gpus_per_node=2))
    out = capsys.readouterr().out
    assert "replicated" in out and "BP" in out and "ARx" in out


def test_a_smaller_mesh_runs_on_that_many_gpus_of_one_node():
    prog = gpt_program({"batch": 2, "model": 2}, [T.data_parallel("batch"), T.megatron("model")])
    part = prog.simulate(pt.sim.hardware("h100"), stages=False)           # 4 GPUs of an 8-GPU node
    whole = prog.simulate(pt.sim.hardware("h100", gpus_per_node=4), stages=False)
    assert part.hardware == "h100 (4 of 1 node(s) x 8 GPUs; on 1 node(s))"
    assert part.table().startswith(f"simulated on {part.hardware}\n")
    assert part.step_time_s == whole.step_time_s and part.peak_memory_bytes == whole.peak_memory_bytes
    assert kinds(part) == {("all_reduce", "batch"), ("all_reduce", "model")}


def test_a_mesh_the_hardware_cannot_hold_names_the_fix():
    prog = gpt_program({"batch": 4, "model": 4}, [T.data_parallel("batch")])
    with pytest.raises(pt.PartitionError, match=r"16 devices .* has 8\. Simulate on hardware\('h100', nodes=2\)"):
        prog.simulate(pt.sim.hardware("h100"), stages=False)
    with pytest.raises(pt.PartitionError, match=r"Simulate on hardware\('tpu-v5e', topology=\(4, 4\)\)"):
        prog.simulate(pt.sim.hardware("tpu-v5e"), stages=False)


def test_chrome_trace_has_compute_and_comm_tracks(tmp_path):
    prog = gpt_program({"batch": 2}, [T.data_parallel("batch"), T.zero(3, "batch")])
    r = prog.simulate(pt.sim.hardware("h100", gpus_per_node=2))
    path = tmp_path / "trace.json"
    r.to_chrome_trace(str(path))
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e.get("args", {}).get("name") for e in events if e.get("ph") == "M"}
    assert any("comm" in str(n) for n in names) and any("compute" in str(n) for n in names)
    assert sum(1 for e in events if e.get("ph") == "X") > 100


def test_mfu_counts_the_models_flops_whatever_the_plan():
    """MFU x step time is the model's FLOPs per device over the peak: the same for every plan of one model (a plan
    that computes redundantly, the replicated head of BP + MP, shows a lower MFU, not a higher one); the executed
    FLOPs stay available as hardware FLOPs utilisation."""
    hw = pt.sim.hardware("h100", gpus_per_node=4)
    reports = []
    for mesh, schedule in (({"batch": 4}, [T.data_parallel("batch")]),
                           ({"batch": 4}, [T.data_parallel("batch"), T.zero(3, "batch")]),
                           ({"batch": 2, "model": 2}, [T.data_parallel("batch"), T.megatron("model")])):
        r = gpt_program(mesh, schedule).simulate(hw)
        reports += r.stages
    work = [r.mfu * r.step_time_s for r in reports]
    assert max(work) == pytest.approx(min(work), rel=1e-3)
    assert len({r.model_flops for r in reports}) == 1
    replicated, bp_mp = reports[0], reports[-1]
    assert replicated.hardware_flops == pytest.approx(4 * replicated.model_flops)   # every device runs it whole
    assert bp_mp.hardware_flops > bp_mp.model_flops                 # the head is computed on both model ranks
    assert bp_mp.hfu > bp_mp.mfu


def test_table_flags_out_of_memory_and_lists_the_notes():
    prog = gpt_program({"batch": 2}, [T.data_parallel("batch")])
    small = pt.sim.hardware("h100", gpus_per_node=2, hbm_bytes=1024)
    r = prog.simulate(small)
    assert r.out_of_memory
    table = r.table()
    assert " OOM" in table and "exceeds the" in table and str(r) == table
    ok = prog.simulate(pt.sim.hardware("h100", gpus_per_node=2))
    assert not ok.out_of_memory and "OOM" not in ok.table()


def test_simulate_without_stages_is_the_final_row():
    prog = gpt_program({"batch": 2, "model": 2}, [T.data_parallel("batch"), T.megatron("model")])
    hw = pt.sim.hardware("h100", gpus_per_node=4)
    one = prog.simulate(hw, stages=False)
    full = prog.simulate(hw)
    assert one.stages == [] and one.stage_name == "MP"
    assert one.step_time_s == full.step_time_s and one.mfu == full.mfu and one.model_flops == full.model_flops


def _figures(r) -> dict:
    """Every figure of a SimReport (its stages' too: the last stage is the report itself), the allocator's
    reservation included."""
    import dataclasses

    out = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name not in ("stages", "allocator")}
    out["reserved"] = r.reserved_memory_bytes
    out["stages"] = [_figures(s) if s is not r else "itself" for s in r.stages]
    return out


def test_simulating_again_equals_a_fresh_program():
    """prog.simulate keeps what does not change between calls (the lowerings, per-node facts and liveness, the
    model's FLOPs, per-op costs per hardware): a call after another on other hardware gives, to the float, what a
    freshly partitioned program gives with cold caches."""
    from partir_torch.sim.simulate import _cost_model

    sched = [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")]
    h100 = pt.sim.hardware("h100", gpus_per_node=4)
    a100 = pt.sim.hardware("a100", gpus_per_node=4, nic_bw=25e9)
    prog = gpt_program({"batch": 2, "model": 2}, sched, layers=1)
    first = _figures(prog.simulate(h100))
    other = _figures(prog.simulate(a100))
    again = _figures(prog.simulate(h100))
    assert other["step_time_s"] != first["step_time_s"] and len(first["stages"]) == 4
    for hw, seen in ((h100, again), (a100, other)):
        _cost_model.cache_clear()
        fresh = _figures(gpt_program({"batch": 2, "model": 2}, sched, layers=1).simulate(hw))
        assert seen == fresh
    assert again == first


def test_a_compiled_program_prices_its_elementwise_chains_as_fused_kernels():
    """simulate_graph(..., compiled=True) (prog.simulate of an Options(compile=True) program): the elementwise ops
    between two matmuls are one kernel reading what it takes from outside and writing what is read outside once
    (sim/fusion.py); the matmuls stay as they are; eager prices each op. The report says what it modelled."""
    from partir_torch.mesh import Mesh
    from partir_torch.sim import hardware, simulate_graph
    from partir_torch.sim.compute import memory_time
    from partir_torch.sim.synthetic import GraphBuilder

    aten = torch.ops.aten
    mesh, hw = Mesh({"dp": 1}), hardware("h100")
    b = GraphBuilder(mesh)
    x = b.input("x", (4096, 4096), "input", torch.bfloat16)
    w = b.input("w", (4096, 4096), "param", torch.bfloat16)
    h = b.call(aten.mm.default, x, w)
    a = b.call(aten.mul.Tensor, h, 2.0)                        # mul -> view -> tanh -> add(., x): one kernel
    v = b.call(aten.view.default, a, [4096, 4096])
    t = b.call(aten.tanh.default, v)
    s = b.call(aten.add.Tensor, t, x)
    out = b.call(aten.mm.default, s, w)
    b.output([out, t])                                       # t is read outside: written once
    gm = b.module()
    eager, compiled = simulate_graph(gm, mesh, hw), simulate_graph(gm, mesh, hw, compiled=True)
    nbytes = 4096 * 4096 * 2
    mms = [c for c in eager.trace if c[1].startswith("mm")]
    fused = memory_time(hw, 2 * nbytes + 2 * nbytes)        # reads h and x, writes t and s
    assert compiled.compute_s == pytest.approx(sum(c[3] for c in mms) + fused, rel=1e-9)
    elementwise = sum(c[3] for c in eager.trace if not c[1].startswith("mm"))
    assert elementwise > fused and eager.compute_s == pytest.approx(sum(c[3] for c in mms) + elementwise)
    assert any("fused elementwise kernels" in n for n in compiled.notes)
    assert not any("fused elementwise" in n for n in eager.notes)
