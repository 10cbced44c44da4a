"""The runtime asks a backend what it can do (runtime/backend.py's declared capabilities), never what it is: a backend
that declares it runs only its plan's program (as the torch-xla one does) gets that behaviour from the one call
path (runtime/call.py), whatever its class; and the reports of a compiled program are refused by name elsewhere."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import partir_torch as pt
from partir_torch.program import Program
from partir_torch.runtime.backend import Backend
from partir_torch.runtime.emulate import EmulatedRuntime
from partir_torch.runtime.interpret import InterpretedRuntime


class PlanOnly(InterpretedRuntime):
    """The interpreted emulator, declaring what the torch-xla backend declares: no programs beyond its plan's."""

    new_programs = False


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _loss(m, x, y):
    return F.mse_loss(m(x), y)


def test_a_backend_that_runs_only_its_plans_program_is_asked_not_named():
    model = _model()
    ref = _model()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [pt.tactics.data_parallel("batch")], (x, y), loss_fn=_loss,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    rt = PlanOnly(prog.mesh)
    assert isinstance(rt, Backend) and rt.ranks is None and rt.stages is None and rt.measures_memory
    fixed = Program(prog.plan, model, prog.optimizer, _loss, backend=rt)
    loss = fixed.train_step(x, y)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = _loss(ref, x, y)
    want.backward()
    opt.step()
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(fixed.gather_parameters()["0.weight"], ref[0].weight.detach())
    assert fixed.backend is rt
    with pytest.raises(pt.PartitionError, match=r"train_step: inputs \[\(8, 8\) float32, \(8, 4\) float32\]; this "
                                                r"torch-xla program runs the shapes it was built for"):
        fixed.train_step(torch.randn(8, 8), torch.randn(8, 4))
    with pytest.raises(pt.PartitionError, match=r"eval_step: this program's backend \(PlanOnly\) runs only the "
                                                r"program it was built for"):
        fixed.eval_step(x, y)
    assert fixed.steps == 1                    # nothing ran


def test_forward_on_a_plan_only_backend_runs_the_forward_program_itself():
    model = _model()
    x = torch.randn(4, 8)
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [pt.tactics.data_parallel("batch")], (x,))
    fixed = Program(prog.plan, model, backend=PlanOnly(prog.mesh))
    torch.testing.assert_close(fixed.forward(x), model(x).detach())
    torch.testing.assert_close(fixed(x), model(x).detach())


def test_compiled_program_reports_and_peak_memory_are_refused_where_the_backend_has_none():
    model = _model()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [pt.tactics.data_parallel("batch")], (x, y), loss_fn=_loss, options=pt.Options(measure_memory=True))
    for call in (prog.hlo, prog.compare):
        with pytest.raises(pt.PartitionError, match=r"runs partir's own per-device program.*prog.to_xla\(\)"):
            call()
    assert {r.kind for r in prog.collectives()} == {"all_reduce"}     # partir's own program's
    lax = Program(prog.plan, model, None, _loss, backend=EmulatedRuntime(prog.mesh))
    lax.loss_and_grads(x, y)
    with pytest.raises(pt.PartitionError, match=r"the EmulatedRuntime backend does not measure memory"):
        lax.peak_memory()
