"""Uneven sharding (issue 22 item 3): a dim a mesh axis does not divide is split as DTensor's Shard splits it
(torch.chunk sizes), each rank holding the largest chunk with padding that no value sees. Every numerics test trains
next to eager torch with the harness's fp32 tolerances (3 AdamW steps, emulated ranks). Real ranks (DTensor local
shapes, DCP save and reshard to a divisible layout): tests/test_real_ranks.py, phase "uneven"."""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import partir_torch as pt
from examples.models import get
from tests.harness import LOSS_RTOL, PARAM_ATOL, PARAM_RTOL, adamw, assert_parameters_equal, train_next_to_eager
from partir_torch.errors import ShardingConflictError
from partir_torch.sharding import Sharding, chunk_extent, chunk_size

T = pt.tactics


def test_chunk_sizes_are_torch_chunk_sizes():
    for n, k in [(1001, 2), (1001, 3), (5, 4), (10, 4), (3, 4), (8, 4)]:
        c = chunk_size(n, [k])
        sizes = [chunk_extent(n, k, r) for r in range(k)]
        want = [len(t) for t in torch.arange(n).chunk(k)]
        assert sizes == want + [0] * (k - len(want)) and c == max(sizes), (n, k, sizes)
    sh = Sharding(((), ("a",)))
    assert sh.local_shape((4, 1001), pt.Mesh({"a": 2})) == (4, 501)
    assert sh.uneven_dims((4, 1001), pt.Mesh({"a": 2})) == {1: (1001, "a", 1)}
    assert sh.uneven_dims((4, 1000), pt.Mesh({"a": 2})) == {}
    # a ragged batch of 5 flattened with 16 positions: blocks of 16, 3 / 2 of them per rank
    blocked = Sharding((("a",), ()), blocks=(("a", 16),))
    assert blocked.local_shape((80, 8), pt.Mesh({"a": 2})) == (48, 8)
    assert blocked.uneven_dims((80, 8), pt.Mesh({"a": 2})) == {0: (80, "a", 16)}
    assert str(blocked) == "[{a:b16}, {}]"


def _gpt(vocab, schedule, mesh, **kw):
    spec = get("gpt_sdpa", vocab=vocab)
    model = spec.build()
    ref = copy.deepcopy(model)
    data = spec.batch(4)
    prog = pt.partition(model, pt.Mesh(mesh), schedule, example_inputs=data, loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), **kw)
    return prog, ref, data, spec


# -- (a) a vocabulary the axis does not divide -------------------------------------------------------------------
@pytest.mark.parametrize("vocab,k,schedule", [
    (1001, 2, lambda: [T.megatron("model", vocab=True)]),      # 501 / 500 rows
    (1001, 3, lambda: [T.embedding("model")]),                 # 334 / 334 / 333 (heads do not divide by 3)
    (5, 4, lambda: [T.embedding("model")]),                    # 2 / 2 / 1 / 0: one rank holds no row
], ids=["1001-on-2-megatron", "1001-on-3-embedding", "5-on-4-one-rank-empty"])
def test_vocabulary_tiled_unevenly_trains_like_one_device(vocab, k, schedule):
    prog, ref, data, spec = _gpt(vocab, schedule(), {"model": k}, options=pt.Options(bucket_bytes=0))
    assert prog.sharding("params.wte.weight").dims[0] == ("model",)
    assert not prog.conflicts
    sizes = [len(c) for c in torch.arange(vocab).chunk(k)]
    sizes += [0] * (k - len(sizes))         # torch.chunk gives fewer chunks; DTensor's Shard gives empty ones
    assert f"tiled(dim 0), uneven: {' | '.join(map(str, sizes))} positions" in prog.explain("params.wte.weight")
    # AdamW's atol as test_presets.py states it (a near-zero gradient summed in another order)
    train_next_to_eager(prog, ref, [data] * 3, spec.loss_fn, adamw(), param_atol=1e-5, what=f"vocab {vocab}")


def test_uneven_vocabulary_costs_the_collectives_of_an_even_one():
    """Padding adds no collective: vocabulary 1001 on 2 ranks has the collectives of vocabulary 1002 (both hold 501
    rows per rank), with the same bytes; the simulator costs the largest shard (the same executed FLOPs per device)
    plus the masks that keep the padding out of the reductions."""
    def records(vocab):
        prog, *_ = _gpt(vocab, [T.megatron("model", vocab=True)], {"model": 2}, options=pt.Options(bucket_bytes=0))
        return prog, Counter((r.kind, r.axis, r.phase, r.nbytes) for r in prog.collectives())

    odd, c_odd = records(1001)
    even, c_even = records(1002)
    assert c_odd == c_even
    hw = pt.sim.hardware("h100", gpus_per_node=2)
    r_odd, r_even = odd.simulate(hw), even.simulate(hw)
    assert r_odd.hardware_flops == r_even.hardware_flops > 0        # executed: the padded (largest) shard
    assert r_odd.model_flops < r_even.model_flops                      # the model's own: 1001 rows, not 1002
    assert r_even.compute_s < r_odd.compute_s < 1.2 * r_even.compute_s


def test_megatron_tiles_mlp_features_unevenly_and_keeps_indivisible_heads_whole():
    """gpt_sdpa on {model: 3}: the MLP's 128 hidden features split 43 / 43 / 42 (the row-parallel matmul's
    contraction reads no padding), the 4 attention heads stay whole (a view folds them with the head dim); Megatron's
    2 all-reduces per layer, one layer's MLP each way."""
    prog, ref, data, spec = _gpt(64, [T.megatron("model")], {"model": 3}, options=pt.Options(bucket_bytes=0))
    assert str(prog.sharding("params.layers.0.mlp.w1.weight")) == "[{model}, {}]"
    assert str(prog.sharding("params.layers.0.mlp.w2.weight")) == "[{}, {model}]"
    assert prog.sharding("params.layers.0.attn.wq.weight").replicated == {"model"}
    c = Counter((r.kind, r.phase) for r in prog.collectives())
    assert c == {("all_reduce", "forward"): 2, ("all_reduce", "backward"): 2}, c
    train_next_to_eager(prog, ref, [data] * 3, spec.loss_fn, adamw(), param_atol=1e-5)


# -- (b) ZeRO-3 of parameters no dim of which the axis divides ------------------------------------------------------
def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.LayerNorm(7), nn.Linear(7, 3))


def _mse(m, x, y):
    return F.mse_loss(m(x), y)


@pytest.mark.parametrize("k", [2, 4])
def test_zero3_shards_indivisible_parameters_unevenly_with_clipping(k):
    """Linear(5, 7) -> LayerNorm(7) -> Linear(7, 3) under BP + Z3 on {batch: k}: every parameter is tiled (a bias of
    3 on 4 ranks: 1 / 1 / 1 / 0), and the clipped AdamW steps equal eager clip_grad_norm_ + AdamW (the norm's sum
    of squares reads no padding)."""
    model = _tiny()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    prog = pt.partition(model, pt.Mesh({"batch": k}), [T.data_parallel("batch"), T.zero(3, "batch")],
                        example_inputs=(x, y), loss_fn=_mse,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                        step=pt.StepOptions(clip_grad_norm=0.05))
    for name in ("0.weight", "0.bias", "2.weight", "3.weight", "3.bias"):
        assert prog.sharding(f"params.{name}").tiled_axes() == {"batch": 1 if name == "3.weight" else 0}, name
    for step in range(3):
        got = prog.train_step(x, y)
        opt.zero_grad()
        want = _mse(ref, x, y)
        want.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        assert norm > 0.05, "the test must clip"
        torch.testing.assert_close(got, want.detach(), rtol=LOSS_RTOL, atol=0, msg=lambda m: f"step {step}: {m}")
        torch.testing.assert_close(prog.last_grad_norm, norm, rtol=LOSS_RTOL, atol=0)
    assert_parameters_equal(prog, ref, PARAM_RTOL, PARAM_ATOL)


def test_compiled_program_pads_and_masks_like_the_eager_one():
    """compile=True (Inductor on each run of local ops): a ragged batch of 5 on 2 ranks and the indivisible
    parameters of _tiny under BP + Z3 train like eager."""
    model = _tiny()
    ref = copy.deepcopy(model)
    x, y = torch.randn(5, 5), torch.randn(5, 3)
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch"), T.zero(3, "batch")],
                        example_inputs=(x, y), loss_fn=_mse,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), options=pt.Options(compile=True))
    assert str(prog.sharding("inputs.0")) == "[{batch}, {}]"
    train_next_to_eager(prog, ref, [(x, y)] * 2, _mse, adamw())


# -- (c) a ragged last batch ---------------------------------------------------------------------------------------
def test_ragged_last_batch_trains_unevenly_where_no_view_merges_the_batch():
    """mlp under BP + Z3 on {batch: 2}: batches of 8, then 5 (3 / 2 rows: a new shape, partitioned again; as the
    second batch size it also tries to make the batch dim a symbol, with a program at batch 2, and fails: the ragged
    program is another graph, and the batch dim stays a program per shape), then 8 again, equal eager."""
    spec = get("mlp")
    model = spec.build()
    ref = copy.deepcopy(model)
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch"), T.zero(3, "batch")],
                        example_inputs=spec.batch(8), loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.warns(UserWarning, match="new input shape"):
        train_next_to_eager(prog, ref, [spec.batch(8), spec.batch(5, seed=3), spec.batch(8, seed=4)],
                            spec.loss_fn, adamw())
    assert sorted(r.signature[0][0] for r in prog.shapes()) == [(2, 16), (5, 16), (8, 16)]
    assert [r.calls for r in prog.shapes() if r.signature[0][0] == (2, 16)] == [0]


def test_ragged_last_batch_of_a_transformer_trains_unevenly():
    """gpt under BP + MP + Z3 on {batch: 2, model: 2}: a batch of 5 (3 / 2 rows) after batches of 8. Its loss
    flattens (B, T) into B*T: that dim is tiled in blocks of T positions (Sharding.blocks), the padding whole
    blocks at its end; the step equals eager."""
    spec = get("gpt")
    model = spec.build()
    ref = copy.deepcopy(model)
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}),
                        [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")],
                        example_inputs=spec.batch(8), loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.warns(UserWarning, match="new input shape"):
        # param_atol as test_presets.py states it for gpt under AdamW (a near-zero gradient summed in another order)
        train_next_to_eager(prog, ref, [spec.batch(8), spec.batch(5, seed=3), spec.batch(8, seed=4)],
                            spec.loss_fn, adamw(), param_atol=1e-5)
    ragged = next(r for r in prog.shapes() if r.signature[0][0][0] == 5)
    assert ragged.calls == 1


class _SeqFirst(nn.Module):
    """Folds (B, T, D) into (T * B, D) sequence-first, as nn.MultiheadAttention(batch_first=False) does: the batch is
    the minor factor of that dim."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        t = x.transpose(0, 1).reshape(-1, 8)      # (T * B, D)
        return self.fc(t)


def test_ragged_batch_that_a_view_folds_as_a_minor_factor_stops_propagation_there():
    """Sequence-first (T*B): padding cannot stay at the end of that dim, so propagation stops at the fold as at any
    conflict (its reason names the fix), lowering gathers the batch there, and the step still equals eager."""
    model = _SeqFirst()
    ref = copy.deepcopy(model)
    loss = lambda m, x: m(x).square().mean()      # noqa: E731
    x = torch.randn(5, 4, 8)
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=(x,), loss_fn=loss,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    reasons = [c.reason for c in prog.conflicts]
    assert reasons and all(r.startswith("a factor of size 5 cannot be tiled unevenly on axis 'batch' (size 2): ")
                           and "merges it with other dims" in r and "drop_last=True in the DataLoader" in r
                           for r in reasons), reasons
    with pytest.warns(UserWarning, match="forces"):
        train_next_to_eager(prog, ref, [(x,)] * 2, loss, adamw())


# -- (d) stock Hugging Face GPT-2 with its real vocabulary -----------------------------------------------------------
def test_hf_gpt2_vocabulary_50257_bp_mp_vocab_z3_on_2x2_matches_single_device():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50257, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"
    model = GPT2LMHeadModel(cfg).train()
    ref = copy.deepcopy(model)
    loss_fn = lambda m, x: m(input_ids=x, labels=x).loss      # noqa: E731
    tokens = torch.randint(0, 50257, (4, 16))
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}),
                        [T.data_parallel("batch"), T.megatron("model", vocab=True), T.zero(3, "batch")],
                        example_inputs=(tokens,), loss_fn=loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
    # the tied embedding / head: vocabulary on "model" (25129 / 25128 rows), features on "batch" (ZeRO-3)
    assert str(prog.sharding("params.transformer.wte.weight")) == "[{model}, {batch}]"
    assert prog.conflicts == []
    train_next_to_eager(prog, ref, [(tokens,)] * 3, loss_fn, make_opt=adamw(eps=1e-5))


# -- (e) state round trip ----------------------------------------------------------------------------------------
def test_state_dict_of_an_uneven_layout_loads_into_a_divisible_one():
    """vocabulary 1001 tiled 501 / 500 on {model: 2}: its state_dict (full tensors in emulation) loads into a
    program on {batch: 4} (BP + Z3, where wte's features divide), and both continue alike."""
    prog, ref, data, spec = _gpt(1001, [T.megatron("model", vocab=True)], {"model": 2})
    train_next_to_eager(prog, ref, [data] * 2, spec.loss_fn, adamw(), param_atol=1e-5)
    sd = prog.state_dict()
    other = spec.build()
    b = pt.partition(other, pt.Mesh({"batch": 4}), [T.data_parallel("batch"), T.zero(3, "batch")],
                     example_inputs=data, loss_fn=spec.loss_fn,
                     optimizer=torch.optim.AdamW(other.parameters(), lr=1e-3))
    assert str(b.sharding("params.wte.weight")) == "[{}, {batch}]"
    b.load_state_dict(sd)
    for k, v in prog.gather_parameters().items():
        torch.testing.assert_close(b.gather_parameters()[k], v, rtol=0, atol=0)
    for _ in range(2):
        torch.testing.assert_close(b.train_step(*data), prog.train_step(*data), rtol=LOSS_RTOL, atol=0)
    # and back: the divisible layout's state loads into the uneven one
    prog.load_state_dict(b.state_dict())
    torch.testing.assert_close(prog.train_step(*data), b.train_step(*data), rtol=LOSS_RTOL, atol=0)


# -- (f) strict=True keeps the divisibility error ----------------------------------------------------------------
def test_strict_keeps_the_divisibility_error():
    with pytest.raises(ShardingConflictError, match=r"dim 0 of params\.wte\.weight \(size 1001\) cannot be tiled "
                                                    r"on axis 'model' \(size 2\): 2 does not divide 1001 "
                                                    r"\(strict=True asks for divisible dims\)"):
        _gpt(1001, [T.megatron("model", vocab=True)], {"model": 2}, options=pt.Options(strict=True))


def test_strict_refuses_a_ragged_batch_with_drop_last_and_keeps_the_program():
    spec = get("mlp")
    model = spec.build()
    ref = copy.deepcopy(model)
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=spec.batch(8),
                        loss_fn=spec.loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                        options=pt.Options(strict=True))
    with pytest.raises(pt.PartitionError, match=r"inputs\.0 has shape \(5, 16\); the program tiles its dim 0 on "
                                                r"'batch' \(size 2\), and 2 does not divide 5 \(strict=True.*"
                                                r"drop_last=True"):
        prog.train_step(*spec.batch(5))
    train_next_to_eager(prog, ref, [spec.batch(8)] * 2, spec.loss_fn, adamw())


def test_interpreter_equals_local_tensor_mode_on_an_uneven_program():
    """The padded program run by the interpreter and through LocalTensorMode (the cross-check emulator): the same
    losses and parameters, bitwise. SGD: LocalTensors refuse the fused Adam node's .item()."""
    from partir_torch.runtime import executor
    from partir_torch.runtime.emulate import EmulatedRuntime
    from partir_torch.runtime.interpret import InterpretedRuntime

    def train(make):
        spec = get("gpt_sdpa", vocab=1001)
        model = spec.build()
        old = executor.Executor.emulator
        executor.Executor.emulator = staticmethod(make)
        try:
            prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}),
                                [T.data_parallel("batch"), T.megatron("model", vocab=True), T.zero(3, "batch")],
                                example_inputs=spec.batch(4), loss_fn=spec.loss_fn,
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
            return [prog.train_step(*spec.batch(4)) for _ in range(2)], prog.gather_parameters()
        finally:
            executor.Executor.emulator = old

    got, p_got = train(lambda mesh, compile=False: InterpretedRuntime(mesh))
    want, p_want = train(lambda mesh, compile=False: EmulatedRuntime(mesh))
    assert got[0] != got[-1]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for k in p_want:
        torch.testing.assert_close(p_got[k], p_want[k], rtol=0, atol=0)


def test_zero3_buckets_the_gathers_of_uneven_bf16_shards():
    """Mixed precision casts each fp32 shard to bf16 right before its gather, and an uneven gather keeps its first
    positions with a narrow right after its wait: the gathers still merge into buckets (the narrows move after the
    bucket), as the even ones do; the same bytes, the same steps as the unbucketed program."""
    x, y = torch.randn(6, 5), torch.randn(6, 3)
    tactics = [T.mixed_precision(torch.bfloat16), T.data_parallel("batch"), T.zero(3, "batch")]

    def prog(bucket_bytes):
        model = _tiny()
        return pt.partition(model, pt.Mesh({"batch": 3}), tactics, example_inputs=(x, y), loss_fn=_mse,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                            options=pt.Options(bucket_bytes=bucket_bytes))

    plain, bucketed = prog(0), prog(64 * 2 ** 20)
    gathers = lambda p: [r for r in p.collectives() if r.kind == "all_gather" and r.phase == "forward"]  # noqa: E731
    assert sum(r.nbytes for r in gathers(bucketed)) == sum(r.nbytes for r in gathers(plain))
    assert len(gathers(plain)) == 6 and len(gathers(bucketed)) == 1
    for _ in range(3):
        torch.testing.assert_close(bucketed.train_step(x, y), plain.train_step(x, y), rtol=0, atol=0)
    got, want = bucketed.gather_parameters(), plain.gather_parameters()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
