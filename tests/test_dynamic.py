"""Shapes declared dynamic up front, and the program cache bounded by memory (issue 40 item 3; runtime/symbols.py,
runtime/dims.py, runtime/shapes.py)."""
from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch

import partir_torch as pt
import partir_torch.plan as plan_module
from examples.models import get
from tests.harness import LOSS_RTOL, assert_parameters_equal
from tests.test_shapes import Eager, _sgd

T = pt.tactics
SEQ = {"inputs.0": {1: "seq"}, "inputs.1": {1: "seq"}}


def _gpt_prog(model, spec, options):
    return pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), [T.data_parallel("batch"), T.megatron("model")],
                        example_inputs=spec.batch(8, seq=32), loss_fn=spec.loss_fn, optimizer=_sgd(model),
                        options=options)


def test_declared_dims_train_like_eager_with_no_capture_after_partition(monkeypatch):
    """dynamic= declares the length (the batch is a symbol by default): partition() builds the one program in
    (batch, seq), so every later length and a smaller last batch is an instance: capture_for is never called again,
    and losses and parameters after the SGD steps equal eager's."""
    spec = get("gpt")
    model = spec.build(seq=64)
    ref = Eager(model, spec.loss_fn)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        prog = _gpt_prog(model, spec, pt.Options(dynamic=SEQ))
    on = [str(w.message) for w in record if "are symbolic from now on" in str(w.message)]
    assert len(on) == 1 and "batch: inputs.0 dim 0, inputs.1 dim 0; seq: inputs.0 dim 1" in on[0], on
    captures = []
    real = plan_module.capture_for
    monkeypatch.setattr(plan_module, "capture_for", lambda *a, **k: captures.append(1) or real(*a, **k))
    batches = [(8, 40), (8, 24), (8, 56), (8, 36), (8, 40), (4, 28)]      # the last batch smaller
    for i, (b, n) in enumerate(batches):
        got = prog.train_step(*spec.batch(b, seq=n, seed=i))
        torch.testing.assert_close(got, ref.step(spec.batch(b, seq=n, seed=i)), rtol=LOSS_RTOL, atol=0,
                                   msg=lambda m: f"step {i} ({b} x {n}): {m}")
    assert captures == []
    rows = {r.signature[0][0]: r for r in prog.shapes()}
    # (8, 36) is a corner of the fit's grid (partitioned at partition(): 32 + the mesh's size), the rest instances
    assert {rows[s].instance_of for s in set(batches) - {(8, 36)}} == set(batches) - {(8, 36)}
    assert rows[(8, 36)].capture_s > 0 and rows[(8, 36)].calls == 1
    assert_parameters_equal(prog, ref.m, what="after 6 steps, all instances")


def test_eval_step_and_forward_make_a_dim_symbolic_at_its_second_size_as_train_step_does():
    """eval_step and forward follow train_step's rule (runtime/dims.py): the second length makes the length a
    symbol, with the batch dim; the fit's grid programs are built then (on the call's batch resized), and every
    later length and a smaller batch is an instance, equal to eager in eval mode. Each kind is a family of its own."""
    spec = get("gpt")
    model = spec.build(seq=64)
    prog = _gpt_prog(model, spec, pt.Options())
    ref = copy.deepcopy(model).eval()
    calls = [(8, 32), (8, 48), (8, 40), (4, 56), (8, 28)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for i, (b, n) in enumerate(calls):
            x, y = spec.batch(b, seq=n, seed=i)
            with torch.no_grad():
                want_loss, want_out = spec.loss_fn(ref, x, y), ref(x)
            torch.testing.assert_close(prog.eval_step(x, y), want_loss, rtol=LOSS_RTOL, atol=0,
                                       msg=lambda m: f"eval_step {b} x {n}: {m}")
            torch.testing.assert_close(prog.forward(x), want_out, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"forward {b} x {n}: {m}")
    on = [str(w.message) for w in record if "are symbolic from now on" in str(w.message)]
    assert len(on) == 2 and all("(batch=12, s=48)" in w for w in on), on      # eval_step's and forward's
    for kind in ("eval", "eval forward"):
        rows = {r.signature[0][0]: r for r in prog.shapes() if r.kind == kind}
        assert {s for s, r in rows.items() if r.instance_of is not None} == {(8, 40), (4, 56), (8, 28)}, kind
        assert rows[(8, 48)].symbolic_s > 0 and rows[(8, 48)].calls == 1
        assert all(r.capture_s is None for s, r in rows.items() if r.instance_of is not None)


def test_a_dynamic_declaration_that_names_what_is_not_there_is_refused():
    spec = get("gpt")
    model = spec.build(seq=64)
    with pytest.raises(pt.PartitionError, match=r"names 'inputs.5'.*inputs.0 \(8, 32\)"):
        _gpt_prog(model, spec, pt.Options(dynamic={"inputs.5": {1: "seq"}}))
    with pytest.raises(pt.PartitionError, match=r"marks dim 2 of inputs.0, which has shape \(8, 32\)"):
        _gpt_prog(model, spec, pt.Options(dynamic={"inputs.0": {2: "seq"}}))
    with pytest.raises(pt.PartitionError, match="dynamic must map inputs to"):
        pt.Options(dynamic={"inputs.0": {1: 3}})


class _FixedLength(torch.nn.Module):
    """Reads its input through a (T, T) weight: the length is fixed by the model's parameters."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        return (x @ self.w).pow(2).mean()


def test_a_declared_dim_the_model_needs_static_is_refused_by_name():
    model = _FixedLength()
    with pytest.raises(pt.PartitionError, match=r"dims declared dynamic \(batch: inputs.0 dim 0; n: inputs.0 dim 1"
                                                r"\) cannot be one program: .*Eq\(n, 6\).*declare it static"):
        pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=(torch.randn(4, 6),),
                     loss_fn=lambda m, x: m(x), optimizer=_sgd(model),
                     options=pt.Options(dynamic={"inputs.0": {1: "n"}}))


def test_evictions_are_counted_in_the_summary_under_a_memory_bound():
    """shape_cache_bytes smaller than two programs: each new program drops the least recently used one (never the
    example inputs'), said once, counted in summary(); a dropped program is freed (the runtime's copy of it too, and
    the fit's programs are not kept by the family); the numerics stay eager's."""
    spec = get("mlp")
    model = spec.build()
    ref = Eager(model, spec.loss_fn)
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=spec.batch(4),
                        loss_fn=spec.loss_fn, optimizer=_sgd(model), options=pt.Options(shape_cache_bytes=1))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        graphs = []
        for i, b in enumerate([6, 8, 10, 6]):
            torch.testing.assert_close(prog.train_step(*spec.batch(b, seed=i)), ref.step(spec.batch(b, seed=i)),
                                       rtol=LOSS_RTOL, atol=0)
            graphs += [weakref.ref(e.lowered.gm) for e in prog.executor.shapes.entries.values() if e.lowered]
    said = [str(w.message) for w in record if "MiB of programs" in str(w.message)]
    assert len(said) == 1 and "shape_cache_bytes" in said[0], said
    cache = prog.executor.shapes
    assert len(cache) == 2 and cache.evicted >= 3       # 6, the fit's 8, the instances: all but the last
    assert f"; {cache.evicted} evicted" in prog.summary()
    gc.collect()
    kept = [e.lowered.gm for e in cache.entries.values() if e.lowered]
    assert all(any(g() is k for k in kept) for g in graphs if g() is not None)
    assert_parameters_equal(prog, ref.m, what="after 4 steps with evictions")


def test_a_multilinear_size_names_each_symbol_when_there_are_several():
    """lower/template.py: a size in one symbol of two prints that symbol (s0), not s; one symbol prints s."""
    from partir_torch.lower.template import Grid, Multilinear

    two = Grid((8, 32), (12, 48))           # corners (lo, lo), (hi, lo), (lo, hi), (hi, hi)
    assert str(Multilinear.through(two, [8, 12, 8, 12])) == "1*s0"
    assert str(Multilinear.through(two, [256, 384, 384, 576])) == "1*s0*s1"
    assert str(Multilinear.through(Grid((32,), (48,)), [64, 96])) == "2*s"
