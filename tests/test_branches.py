"""Issue 26 items 1 and 3: steps that branch on tensor values (capture/branches.py, runtime/paths.py). Emulated
ranks; every step is compared with single-device eager torch through tests/harness.py (its fp32 tolerances), the
generator seeded alike on both sides, so layerdrop's draws agree."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import partir_torch as pt
from partir_torch.capture import counts
from partir_torch.errors import PartitionError, TraceError
from tests.branch_models import Asserting, Branchy, MaskedLoss, ParamBranch, PythonLayerdrop
from tests.harness import adamw, train_next_to_eager

T = pt.tactics


def _loss(m, x, mask):
    return m(x, mask)


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        mask = torch.zeros(4, 6, dtype=torch.bool)
        if i % 3:                                       # every third batch has no padding at all
            mask[i % 4, 6 - (i % 3) - 1:] = True
        out.append((torch.randn(4, 6, 4, generator=g), mask))
    return out


def _partition(model, mesh, schedule, batch, **kw):
    return pt.partition(model, mesh, schedule, example_inputs=batch, loss_fn=_loss,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), **kw)


def _paths(prog) -> list:
    return [r.path for r in prog.shapes()]


def _run_next_to_eager(mesh, schedule, steps=8, layers=3, seed=5, **kw):
    torch.manual_seed(0)
    model = Branchy(layers=layers)
    ref = copy.deepcopy(model)
    batches = _batches(steps)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.manual_seed(seed)       # the example inputs' path (partition's draws) runs the first layer
        prog = _partition(model, mesh, schedule, batches[0], **kw)
        assert prog.captured.guards[2].value is False
        train_next_to_eager(prog, ref, batches, _loss, adamw(), what=str(schedule))
    said = [str(w.message) for w in record]
    return prog, [m for m in said if "took a new path" in m], [m for m in said if "schedule refused the path" in m]


def test_branches_train_like_eager_under_data_parallel():
    """8 steps of padding/no padding and layerdrop 0.5 over 3 layers on 2 emulated ranks equal eager step by step;
    each path is captured once (one warning each), and prog.shapes() names the values of its guards."""
    prog, said, _ = _run_next_to_eager(pt.Mesh({"batch": 2}), [T.data_parallel("batch")])
    guards = prog.captured.guards
    lines = [g.where.split(": ", 1)[1].split("#")[0].strip() for g in guards]
    assert lines[:2] == ["if not mask.any():", "n = int(mask.sum(1).max().item())"]
    assert lines[2:] == ["if self.training and torch.rand([]) < self.layerdrop:"] * 3
    assert len(guards) == 5                              # 2 on the mask, one draw per layer
    paths = _paths(prog)
    assert len(paths) == len(set(paths)) >= 3, paths     # several paths taken, each program once
    assert len(said) == len(paths) - 1                   # the example inputs' path was captured by partition
    assert sum(r.calls for r in prog.shapes()) == 8
    assert {("-> True" in p.split(";")[0]) for p in paths} == {True, False}   # both sides of `if not mask.any()`
    assert not prog.captured.checks[0].expect and prog.captured.checks[0].output == "asserts.0"


def test_branches_train_like_eager_under_megatron_and_zero3():
    """The same model on {batch: 2, model: 2}: data parallel, Megatron on the layers' linear pairs, ZeRO-3; the
    guards read the global batch, so every rank takes the path one device takes."""
    prog, _, refused = _run_next_to_eager(pt.Mesh({"batch": 2, "model": 2}),
                                          [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")], steps=8)
    assert len(prog.shapes()) >= 2
    # a path where layerdrop skipped every layer has no linear pair for Megatron: it keeps the first program's
    # layouts (one warning), and still trains like eager
    assert not refused


def test_a_path_the_schedule_refuses_keeps_the_first_programs_layouts():
    """One layer under layerdrop: on a path that skips it Megatron finds no linear pair and refuses; that path is
    planned to keep the first program's state and input layouts (one warning per such path), and the steps still
    equal eager's."""
    prog, _, refused = _run_next_to_eager(pt.Mesh({"batch": 2, "model": 2}),
                                          [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")],
                                          steps=6, layers=1)
    skipped = [path for _, path in prog.executor.shapes.entries if path[2] is True]
    assert len(refused) == len(skipped) >= 1, (refused, skipped)
    assert "MP: found no column-parallel/row-parallel linear pair" in refused[0]
    assert any(r.kind == "all_reduce" and r.axis == "model" for r in prog.collectives())


def test_branch_on_a_sharded_parameter_reads_the_held_state():
    """The guard reads params.a.bias from the state the program holds (after its updates, not the module's stale
    copy); SGD moves the bias sum across 0.15, so both paths run, each like eager."""
    torch.manual_seed(1)
    model = ParamBranch()
    with torch.no_grad():
        model.a.bias.fill_(0.02)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 4, generator=g) + 2,) for _ in range(6)]
    loss = lambda m, x: m(x)   # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch"), T.zero(3, "batch")],
                            example_inputs=batches[0], loss_fn=loss, optimizer=torch.optim.SGD(model.parameters(),
                                                                                               lr=0.1))
        train_next_to_eager(prog, ref, batches, loss, lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert prog.captured.guards[0].reads == ("params.a.bias",)
    assert sorted(r.path.rsplit("-> ", 1)[1] for r in prog.shapes()) == ["False", "True"]


def test_an_assert_is_checked_after_the_step_not_a_path():
    """An assert on a tensor is no guard (one program, nothing evaluated before the step); its predicate is an
    output of the step, and a step where it fails raises AssertionError naming the user's line."""
    torch.manual_seed(0)
    model = Asserting()
    loss = lambda m, x: m(x)   # noqa: E731
    x = torch.randn(4, 4)
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=(x,),
                        loss_fn=loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert prog.captured.guards == () and [c.expect for c in prog.captured.checks] == [True]
    prog.train_step(x)
    bad = x.clone()
    bad[3, 1] = float("nan")                            # on rank 1's shard of the batch
    with pytest.raises(AssertionError, match=r"branch_models.py:\d+: assert torch.isfinite\(x\).all\(\)"):
        prog.train_step(bad)
    assert len(prog.shapes()) == 1


def test_paths_share_the_shape_cache_bound():
    """max_shapes bounds paths and shapes together: beyond it the least recently used path is dropped (said once)
    and captured again when it comes back, still like eager."""
    prog, said, _ = _run_next_to_eager(pt.Mesh({"batch": 2}), [T.data_parallel("batch")], steps=8, options=pt.Options(max_shapes=2))
    assert len(prog.shapes()) <= 2
    assert len(said) >= 2


def test_branches_refuse_per_rank_batches():
    torch.manual_seed(0)
    model = Branchy()
    batches = _batches(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = _partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], batches[0])
    x, mask = batches[0]
    with pytest.raises(PartitionError, match="branches on tensor values .* Call train_step with the global batch"):
        prog.train_step_local(x[:2], mask[:2])


def test_a_branch_without_real_values_is_refused_by_line():
    """A model on the meta device has no values to decide the branch with: a TraceError naming the line."""
    with torch.device("meta"):
        model = ParamBranch()
    with pytest.raises(TraceError, match=r"branches on a tensor value at branch_models.py:\d+: if self.a.bias"):
        pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")],
                     example_inputs=(torch.randn(8, 4),), loss_fn=lambda m, x: m(x))


def test_a_step_without_branches_has_no_guards():
    model = ParamBranch()
    plain = lambda m, x: m.b(m.a(x)).mean()   # noqa: E731
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")],
                        example_inputs=(torch.randn(8, 4),), loss_fn=plain)
    assert prog.captured.guards == () and prog.captured.checks == ()
    assert not prog.executor.paths and prog.executor.paths.tries == {}


def test_eval_step_follows_the_branches_of_each_batch():
    """eval_step of a step that branches: each batch's guards select its eval program (layerdrop is off in eval
    mode: only the mask's guards remain), on the live state, equal to the eager module in eval mode."""
    torch.manual_seed(0)
    model = Branchy()
    ref = copy.deepcopy(model)
    batches = _batches(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = _partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], batches[0])
        train_next_to_eager(prog, ref, batches[:2], _loss, adamw())
        ref.eval()
        with torch.no_grad():
            for x, mask in batches:
                torch.testing.assert_close(prog.eval_step(x, mask), ref(x, mask), rtol=1e-5, atol=0)
    rows = [r for r in prog.shapes() if r.kind == "eval"]
    assert len(rows) == 3 and all(r.path.count("->") == 2 for r in rows), rows   # (any, n): 3 distinct pairs


def test_summary_lists_the_paths():
    prog, _, _ = _run_next_to_eager(pt.Mesh({"batch": 2}), [T.data_parallel("batch")], steps=3)
    text = prog.summary()
    assert "The step branches on tensor values (5 read(s) on this path" in text
    assert text.count("  path ") == len(prog.shapes()) >= 2
    assert "1 assert(s) on tensor values, checked after each step: branch_models.py:" in text


def test_boolean_mask_indexing_is_a_guard_on_its_size():
    """`logits[mask != 0]` with the static-size selections switched off (capture/counts.py; tests/test_counts.py
    has them on): the number of selected rows is a guard, each count a batch brings is one path, and every step
    equals eager."""
    torch.manual_seed(0)
    model = MaskedLoss()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 5, 4, generator=g), torch.randint(0, 6, (4, 5), generator=g),
                (torch.rand(4, 5, generator=g) < 0.7).long()) for _ in range(3)]
    batches.append(batches[0])
    loss = lambda m, x, y, k: m(x, y, k)   # noqa: E731
    with warnings.catch_warnings(), counts.disabled():
        warnings.simplefilter("ignore")
        prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=batches[0],
                            loss_fn=loss, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        train_next_to_eager(prog, ref, batches, loss, adamw())
    sizes = {int((k != 0).sum()) for _, _, k in batches}
    assert [g.count for g in prog.captured.guards] == [True, True]
    assert {path[0] for _, path in prog.executor.shapes.entries} == sizes and len(prog.shapes()) == len(sizes)


def test_export_gives_each_parameter_its_own_step_count():
    """After layerdrop skipped layers, export_to writes each parameter's own "step" into torch.optim's state (the
    counts the parity steps ran with: a skipped layer's is behind the embedding's)."""
    prog, _, _ = _run_next_to_eager(pt.Mesh({"batch": 2}), [T.data_parallel("batch")], steps=4)
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prog.export_to(model, opt)
    steps = {n: int(opt.state[p]["step"]) for n, p in model.named_parameters() if p in opt.state}
    want = {k: v for k, v in prog.executor.paths.param_steps.items() if v}
    assert steps == want and len(set(steps.values())) > 1 and steps["emb.weight"] == 4, steps


def test_a_python_random_draw_is_said_not_hidden():
    """A draw from Python's generator cannot be a guard (the trace sees only its value): capture warns that the
    path it chose is fixed, naming the line."""
    with pytest.warns(UserWarning, match=r"random generator at branch_models.py:\d+: if self.training and "
                                         r"random.uniform"):
        pt.partition(PythonLayerdrop(), pt.Mesh({"batch": 2}), [T.data_parallel("batch")],
                     example_inputs=(torch.randn(4, 4),), loss_fn=lambda m, x: m(x))


_EXEC_SOURCE = '''
class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, mask):
        h = self.lin(x)
        if h.sum() > 0:
            h = h * 2
        return h.pow(2).mean()
'''


def test_a_branch_in_code_defined_through_exec_is_a_path_named_by_its_function():
    """Code compiled from a string has no source lines: its guard is named by file, line and function, and both
    sides of the branch train like eager."""
    ns = {"torch": torch}
    exec(compile(_EXEC_SOURCE, "<string>", "exec"), ns)
    torch.manual_seed(0)
    model = ns["Scaled"]()
    ref = copy.deepcopy(model)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    batches = [(torch.randn(4, 6, 4) + s, mask) for s in (3.0, -3.0, 3.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = _partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], batches[0])
        train_next_to_eager(prog, ref, batches, _loss, adamw())
    assert [g.where for g in prog.captured.guards] == ["<string>:9: in forward (no source: code defined through exec)"]
    assert len(_paths(prog)) == 2
