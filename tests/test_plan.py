"""The plan as a value (issue 21): one capture planned many times, programs built from a plan, the checks that a
plan fits its capture, and what the facade does not do (collectives() holds no state)."""
from __future__ import annotations

import copy

import pytest
import torch

import partir_torch as pt
from partir_torch.plan import capture_for, plan
from partir_torch.program import Program

from tests import harness
from tests.harness import train_next_to_eager
from examples.models import get

T = pt.tactics
LR, EPS = 1e-3, 1e-5


def test_one_capture_planned_on_two_meshes_trains_like_one_device():
    """A Captured is planned twice (BP+MP on 2x2, BP+Z3 on 4): each Program, over its own copy of the model and
    its own optimizer, trains equal to eager AdamW; the plans share the captured graph and nothing else."""
    spec = get("gpt")
    batch = spec.batch(4)
    base = spec.build()
    cap = capture_for(base, [], batch, spec.loss_fn, torch.optim.AdamW(base.parameters(), lr=LR, eps=EPS))
    schedules = {"BP+MP": (pt.Mesh({"batch": 2, "model": 2}), [T.data_parallel("batch"), T.megatron("model")]),
                 "BP+Z3": (pt.Mesh({"batch": 4}), [T.data_parallel("batch"), T.zero(3, "batch")])}
    plans = {k: plan(cap, mesh, sched) for k, (mesh, sched) in schedules.items()}
    assert plans["BP+MP"].captured is plans["BP+Z3"].captured is cap
    assert plans["BP+MP"].graph is not plans["BP+Z3"].graph
    for k, p in plans.items():
        model = copy.deepcopy(base)
        ref = copy.deepcopy(base)
        # another learning rate than the capture's optimizer: the program reads its own optimizer's param groups
        prog = Program(p, model, torch.optim.AdamW(model.parameters(), lr=2 * LR, eps=EPS), spec.loss_fn)
        train_next_to_eager(prog, ref, [batch] * 2, spec.loss_fn, make_opt=harness.adamw(lr=2 * LR, eps=EPS),
                            what=f"gpt {k} from a shared capture")


def test_plan_refuses_a_schedule_the_step_was_not_captured_for():
    spec = get("mlp")
    model = spec.build()
    cap = capture_for(model, [], spec.batch(4), spec.loss_fn, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(pt.PartitionError, match=r"capture rewrites \['Remat'\] differ .*capture_for"):
        plan(cap, pt.Mesh({"batch": 2}), [T.data_parallel("batch"), T.remat("*")])
    with pytest.raises(pt.PartitionError, match="mesh must be a pt.Mesh"):
        plan(cap, {"batch": 2}, [T.data_parallel("batch")])


def test_stages_are_frozen_decisions_and_collectives_hold_no_state():
    """Each stage holds its own Decisions (later tactics do not change an earlier stage's), the plan is lowered
    once, and listing collectives or printing the summary builds no runtime and no state."""
    spec = get("gpt")
    model = spec.build()
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), [T.data_parallel("batch"), T.megatron("model")],
                        example_inputs=spec.batch(4), loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters()))
    w = prog.graph.name_to_vid["params.blocks.0.mlp.fc.weight"] if "params.blocks.0.mlp.fc.weight" in \
        prog.graph.name_to_vid else next(v for n, v in prog.graph.name_to_vid.items() if n.endswith("weight") and
                                         prog.sharding(n).tiled_axes().get("model") is not None)
    first, last = prog.stages
    assert first.decisions is not last.decisions
    assert first.decisions.sharding(w).tiled_axes().get("model") is None
    assert last.decisions.sharding(w).tiled_axes().get("model") is not None
    assert prog.collectives() and prog.summary()
    assert prog.plan.lowered() is prog.plan.lowered()
    assert prog._executor is None                     # nothing ran: no backend, no state
    prog.train_step(*spec.batch(4))
    assert prog.executor.lowered.records is prog.plan.lowered().records     # run what was reported


def test_renamed_tactics_are_classified_by_what_they_declare():
    """The simulator's confidence classifies a program by the families its tactics declare, carried on every
    collective record: megatron renamed "TP" and data_parallel renamed "DP" are still a tensor-parallel program."""
    spec = get("gpt")
    hw = pt.sim.hardware("h100", gpus_per_node=4)
    reports = {}
    for names in (("BP", "MP"), ("DP", "TP")):
        model = spec.build()
        prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}),
                            [T.data_parallel("batch", name=names[0]), T.megatron("model", name=names[1])],
                            example_inputs=spec.batch(4), loss_fn=spec.loss_fn)
        fams = {(r.tactic, r.family) for r in prog.collectives()}
        assert (names[1], "megatron") in fams, fams
        reports[names] = prog.simulate(hw)
    assert reports[("DP", "TP")].confidence_family == reports[("BP", "MP")].confidence_family != ""
    assert reports[("DP", "TP")].confidence == reports[("BP", "MP")].confidence


def _rows(report) -> list:
    """A stage table's figures as text: step, compute, exposed communication, peak memory, MFU, collectives."""
    return [(s.stage_name, repr(s.step_time_s), repr(s.compute_s), repr(s.exposed_comm_s), s.peak_memory_bytes,
             repr(s.mfu), repr(s.collectives)) for s in report.stages]


def _program_text(low) -> tuple:
    """A lowered program as text: its code, every node's local shape, strides and dtype, its collective records."""
    shapes = [(n.name, tuple(v.shape), v.stride(), str(v.dtype)) for n in low.gm.graph.nodes
              if isinstance(v := n.meta.get("val"), torch.Tensor)]
    return low.gm.code, shapes, [repr(r) for r in low.records]


@pytest.mark.filterwarnings("ignore:partir_torch")     # gpt's attention reshards on batch 6 over 4 (said, not tested)
def test_stages_lowered_together_equal_each_lowered_alone():
    """prog.simulate(hw, stages=True) lowers every stage of a plan with what they share (lower.StageShare: the
    layouts of ops a stage did not change, the meta run's memo): each stage's program and row equal those of the
    stage lowered alone on a fresh plan, and two schedules planned from one capture and simulated one after the
    other give the rows each gives alone. The schedule has partial values (MP), a second tactic on one axis (Z3 after
    BP) and uneven tilings (batch 6 on 4)."""
    spec = get("gpt")
    hw = pt.sim.hardware("h100", gpus_per_node=8)
    model = spec.build()
    cap = capture_for(model, [], spec.batch(6), spec.loss_fn, torch.optim.AdamW(model.parameters(), lr=LR))
    schedules = [(pt.Mesh({"batch": 4, "model": 2}), [T.data_parallel("batch"), T.megatron("model"),
                                                      T.zero(3, "batch")]),
                 (pt.Mesh({"model": 2, "batch": 4}), [T.megatron("model"), T.data_parallel("batch")])]
    alone = []
    for mesh, sched in schedules:
        plans = [plan(cap, mesh, sched) for _ in range(len(sched) + 1)]      # one fresh plan per stage
        programs = [_program_text(p.annotated_lowered(k)) for k, p in zip(range(-1, len(sched)), plans)]
        alone.append((programs, _rows(Program(plan(cap, mesh, sched), model, None, spec.loss_fn).simulate(hw))))
    together = [plan(cap, mesh, sched) for mesh, sched in schedules]
    rows = [_rows(Program(p, model, None, spec.loss_fn).simulate(hw)) for p in together]
    for p, r, (programs, rows_alone) in zip(together, rows, alone):
        assert r == rows_alone and len(r) == len(p.stages) + 1
        assert [_program_text(p.annotated_lowered(k)) for k in range(-1, len(p.stages))] == programs
    assert rows[0] != rows[1]


def test_ops_differing_names_every_op_whose_layouts_differ():
    """Decisions.ops_differing (values_differing) between two stages (either way, and from the replicated stage)
    holds every op (value) whose op_layouts (Sharding) differ, so a stage reusing another's layouts for the rest
    lowers what it would alone."""
    from partir_torch.lower.lower import StageShare, op_layouts, stage_layouts, stage_value_layouts

    spec = get("gpt")
    model = spec.build()
    prog = pt.partition(model, pt.Mesh({"batch": 4, "model": 2}),
                        [T.data_parallel("batch"), T.megatron("model"), T.sequence_parallel("model"),
                         T.zero(3, "batch")], example_inputs=spec.batch(6), loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters()))
    p = prog.plan
    stages = [p.stage_decisions(k) for k in range(-1, len(p.stages))]
    fresh = [[op_layouts(d, i) for i in range(len(p.graph.ops))] for d in stages]
    for a in range(len(stages)):
        for b in range(len(stages)):
            changed = stages[b].ops_differing(stages[a])
            assert changed is not None
            assert {i for i, (x, y) in enumerate(zip(fresh[a], fresh[b])) if x != y} <= changed, (a, b)
    values = [[d.sharding(v) for v in range(len(p.graph.values))] for d in stages]
    for a in range(len(stages)):
        for b in range(len(stages)):
            changed = stages[b].values_differing(stages[a])
            assert {p.graph.canon[v] for v, (x, y) in enumerate(zip(values[a], values[b])) if x != y} <= changed
    share = StageShare()
    for k in [0, 2, 1, 4, 3, 0]:           # in any order: each reuses the layouts of the stage lowered before it
        assert stage_layouts(stages[k], share) == fresh[k]
        assert stage_value_layouts(stages[k], share) == values[k]
