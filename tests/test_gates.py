"""Issue 26: layerdrop gated in one program (capture/gates.py). Every step is compared with single-device eager
torch, the generator seeded alike on both sides: the layers skipped, the parameters updated and each one's Adam
step count must be eager's, with one program for every combination of skipped layers."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import partir_torch as pt
from partir_torch.capture import gates
from partir_torch.lower import fuse
from tests.branch_models import LayerdropEncDec
from tests.harness import adamw, train_next_to_eager

T = pt.tactics


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, 4, generator=g), torch.randn(4, 5, 4, generator=g)) for _ in range(n)]


def _loss(m, x, y):
    return m(x, y)


def _train(model, mesh, schedule, batches, loss=_loss, seed=100, make_opt=adamw()):
    """partition + train_step next to eager, step by step (tests/harness.py): (prog, eager optimizer, eager model,
    warnings said); prog.nograd: per step, the parameters it left without a gradient."""
    ref = copy.deepcopy(model)
    nograd, opts = [], []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        prog = pt.partition(model, mesh, schedule, example_inputs=batches[0], loss_fn=loss,
                            optimizer=make_opt(model.parameters()))
        train_next_to_eager(prog, ref, batches, loss, make_opt, seed=seed,
                            on_step=lambda i, opt: (nograd.append(prog.executor.paths.nograd), opts.append(opt)))
    prog.nograd = nograd
    return prog, opts[0], ref, [str(w.message) for w in said]


def _eager_steps(opt, ref) -> dict:
    return {n: int(opt.state[p]["step"]) if p in opt.state else 0 for n, p in ref.named_parameters()}


@pytest.mark.parametrize("mesh,schedule", [
    ({"batch": 2}, [T.data_parallel("batch")]),
    ({"batch": 2, "model": 2}, [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")]),
], ids=["dp", "dp_mp_z3"])
def test_layerdrop_trains_like_eager_in_one_program(mesh, schedule):
    """Layerdrop 0.5 over an encoder and a decoder of 3 layers each, 8 steps: one program (no capture after
    partition), eager's losses and parameters, and each parameter's Adam step count eager's, including the steps
    where every decoder layer was skipped and the encoder had no gradient at all."""
    torch.manual_seed(0)
    prog, opt, ref, said = _train(LayerdropEncDec(), pt.Mesh(mesh), schedule, _batches(8), seed=300)
    assert len(prog.shapes()) == 1 and not [m for m in said if "new path" in m], said
    assert prog.captured.gates is not None and len(prog.captured.gates.gates) == 6
    assert prog.captured.guards == ()
    steps = _eager_steps(opt, ref)
    assert {k: v for k, v in prog.executor.paths.param_steps.items()} == steps
    # the cases the masks are for: a skipped layer, and an encoder left without a gradient (its embedding too)
    # because every decoder layer was skipped
    assert steps["enc.0.fc1.weight"] < 8 and steps["dec.0.fc1.weight"] < 8 and steps["head.weight"] == 8, steps
    assert any("emb.weight" in ng and "dec_emb.weight" not in ng for ng in prog.nograd), prog.nograd
    # the masked updates are fused (lower/fuse.py): one adam_update takes the flags, no where pass is left
    gm = prog.executor._first.lowered.gm
    fused = [n for n in gm.graph.nodes if n.target is fuse.adam_update and n.args[15] is not None]
    masked = [n for n in gm.graph.nodes if n.target is torch.ops.aten.where.self
              and "nograd" in str(n.args[0])]
    assert fused and not masked, (len(fused), len(masked))


def test_residual_outside_the_layer_is_traced_as_paths_and_said():
    """`h = h + layer(h)`: a skipped layer would not leave h as a gated where does, so the step is traced as paths
    (one per combination met), with one warning saying why, and still equals eager."""
    torch.manual_seed(0)
    prog, _, _, said = _train(LayerdropEncDec(layers=2, residual_outside=True), pt.Mesh({"batch": 2}),
                              [T.data_parallel("batch")], _batches(3))
    assert prog.captured.gates is None and len(prog.captured.guards) == 4
    why = [m for m in said if "not layerdrop's shape" in m]
    assert why and "do not pass the hidden states from one to the next unchanged" in why[0], said


def test_summary_says_the_layers_are_gated():
    torch.manual_seed(0)
    model = LayerdropEncDec(layers=2)
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=_batches(1)[0],
                        loss_fn=_loss, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    text = prog.summary()
    assert "Layerdrop in enc, dec: 4 layers gated in one program" in text
    assert "skipped layers save no time" in text


def test_gates_disabled_traces_paths():
    torch.manual_seed(0)
    with gates.disabled():
        prog, _, _, _ = _train(LayerdropEncDec(layers=2), pt.Mesh({"batch": 2}), [T.data_parallel("batch")],
                               _batches(3))
    assert prog.captured.gates is None and len(prog.captured.guards) == 4


def test_stock_m2m100_trains_like_eager_in_one_program():
    """Hugging Face's M2M100 as its documentation calls it (`model(input_ids=..., labels=...).loss`), layerdrop
    0.5 in the encoder and the decoder (the config's default is 0.05), dropout on: 6 steps on 2 emulated ranks in
    one program, equal to eager."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.M2M100Config(vocab_size=64, d_model=32, encoder_layers=3, decoder_layers=3,
                                    encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                    decoder_ffn_dim=64, max_position_embeddings=64, encoder_layerdrop=0.5,
                                    decoder_layerdrop=0.5)
    torch.manual_seed(0)
    model = transformers.M2M100ForConditionalGeneration(cfg).train()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(3, 64, (4, 8), generator=g), torch.randint(3, 64, (4, 8), generator=g))
               for _ in range(6)]
    loss = lambda m, ids, labels: m(input_ids=ids, labels=labels).loss   # noqa: E731
    prog, opt, ref, said = _train(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], batches, loss=loss)
    assert len(prog.shapes()) == 1 and len(prog.captured.gates.gates) == 6, said
    assert prog.executor.paths.param_steps == _eager_steps(opt, ref)
    assert any(prog.nograd), prog.nograd


def test_sgd_momentum_masked_like_eager():
    """SGD with momentum and weight decay (the fused sgd_update takes the nograd flags, lower/fuse.py): a skipped
    layer keeps its parameters and momentum buffers, and the first step of a layer skipped at step 1 starts its
    buffer as eager."""
    torch.manual_seed(0)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01)   # noqa: E731
    prog, opt, ref, _ = _train(LayerdropEncDec(), pt.Mesh({"batch": 2}), [T.data_parallel("batch")], _batches(6),
                               seed=300, make_opt=sgd)
    assert len(prog.shapes()) == 1 and any(prog.nograd)
    gm = prog.executor._first.lowered.gm
    assert [n for n in gm.graph.nodes if n.target is fuse.sgd_update and n.args[-2] is not None]



class _TokenBatchNorm(torch.nn.BatchNorm1d):
    def forward(self, h):
        return super().forward(h.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("kw,why", [
    (dict(aux=True), "is read outside the next layer"),
    (dict(norm=_TokenBatchNorm), "(running statistics): a skipped layer would write too"),
], ids=["aux_loss", "running_stats"])
def test_what_a_skipped_layer_would_change_is_traced_as_paths(kw, why):
    """A read of every layer's output beyond the next layer (DETR's auxiliary losses) or a gated layer that writes
    running statistics: a gated where would not leave them as a skipped layer does, so the step is traced as paths,
    said, and equals eager."""
    torch.manual_seed(0)
    prog, _, _, said = _train(LayerdropEncDec(layers=2, **kw), pt.Mesh({"batch": 2}), [T.data_parallel("batch")],
                              _batches(3))
    assert prog.captured.gates is None and len(prog.captured.guards) == 4
    assert any(why in m for m in said), said
