"""Issue 4 presets beyond BP/MP/Z3: each on the zoo models it applies to, against single-device numerics (3 AdamW
steps, emulated ranks), with its collectives counted against the textbook formula, and a clear error where it
does not apply."""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import partir_torch as pt
from partir_torch import tactics as T
from examples.models import get
from tests.harness import adamw, train_next_to_eager

STEPS = 3


def run(name, schedule, mesh, batch=4, steps=STEPS, eps=1e-8, **overrides):
    spec = get(name, **overrides)
    model = spec.build()
    ref = copy.deepcopy(model)
    data = spec.batch(batch, **overrides)
    # bucket_bytes=0: one collective per value, so the textbook counts below can be read off directly
    prog = pt.partition(model, pt.Mesh(mesh), schedule, example_inputs=data, loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps),
                        options=pt.Options(bucket_bytes=0))
    # AdamW divides by sqrt(v): for an entry whose gradient is ~0, a gradient summed in another order (1e-7
    # relative) can move its update by a few 1e-6 over 3 steps (lr 1e-3; measured 6.8e-6 on one element of
    # gpt_sdpa under SP); 1e-5 absolute is 1% of one step (the tolerance these tests always had)
    train_next_to_eager(prog, ref, [data] * steps, spec.loss_fn, adamw(eps=eps), param_atol=1e-5, what=name)
    return prog


def counts(prog):
    return Counter((r.kind, r.axis, r.phase) for r in prog.collectives())


def test_sequence_parallel_turns_all_reduces_into_reduce_scatter_and_all_gather():
    prog = run("gpt_sdpa", [T.megatron("model"), T.sequence_parallel("model")], {"model": 2})
    c = counts(prog)
    layers = 2
    # Megatron's 2 all-reduces per layer and direction become 2 reduce-scatters (row-parallel outputs into the
    # sequence-tiled residual stream) ...
    assert c[("reduce_scatter", "model", "forward")] == 2 * layers
    assert c[("reduce_scatter", "model", "backward")] == 2 * layers
    # ... and 2 all-gathers in front of the column-parallel linears (one per norm output, shared by q, k and v)
    assert c[("all_gather", "model", "forward")] == 2 * layers
    # backward: the row-parallel linears' input gradients are gathered from the sequence-tiled stream, plus the
    # positional-embedding gradient (its rows are sequence positions)
    assert c[("all_gather", "model", "backward")] == 2 * layers + 1
    assert c[("all_reduce", "model", "forward")] == 2                  # only the loss: numerator and count
    h = prog.sharding("layers.0.ln1:out")
    assert h.dims[1] == ("model",), h


def test_vocabulary_parallel_embedding_and_cross_entropy():
    prog = run("gpt_sdpa", [T.embedding("model")], {"model": 2})
    assert prog.sharding("params.wte.weight").dims[0] == ("model",)
    kinds = Counter((r.kind, r.reduce_op) for r in prog.collectives())
    # forward: the masked lookup's partial sum; the log-softmax max and sum over the vocabulary; the loss numerator
    # and the target count; backward: the log-softmax sum and the tied head's input gradient
    assert kinds == {("all_reduce", "sum"): 6, ("all_reduce", "max"): 1}


def test_megatron_with_vocabulary_parallel_head_on_llama():
    # llama's head is untied: vocab=True tiles it on its output features (the vocabulary) as well as the embedding
    prog = run("llama", [T.data_parallel("batch"), T.megatron("model", vocab=True)], {"batch": 2, "model": 2})
    assert prog.sharding("params.output.weight").dims[0] == ("model",)
    assert prog.sharding("params.tok_embeddings.weight").dims[0] == ("model",)
    # the log-softmax max runs over the tiled vocabulary: one all_reduce(max) in the forward
    assert Counter((r.kind, r.reduce_op, r.phase) for r in prog.collectives())[("all_reduce", "max", "forward")] == 1


def test_expert_parallel_tiles_experts_and_reduces_the_combine_once_per_layer():
    prog = run("moe", [T.data_parallel("batch"), T.expert_parallel("expert")], {"batch": 2, "expert": 2})
    assert prog.sharding("params.layers.0.moe.w1").dims[0] == ("expert",)
    c = counts(prog)
    layers = 2
    assert c[("all_reduce", "expert", "forward")] == layers          # combine over experts
    # backward: the MoE input gradient and the router probabilities' gradient, each a sum over experts
    assert c[("all_reduce", "expert", "backward")] == 2 * layers
    assert not any(k[0] == "all_gather" for k in c)


def test_expert_parallel_exchanges_token_buffers_by_all_to_all():
    """GShard dispatch, groups and experts tiled on one axis: per MoE layer one all_to_all moves the dispatched
    buffers (B, E, C, d) from tiled(groups) to tiled(experts) and one moves the expert outputs back; the backward
    does the same for their gradients. The experts' gradients need no reduction on that axis."""
    prog = run("moe_capacity", [T.expert_parallel("data")], {"data": 2}, eps=1e-5)
    layers, E, C, d, B, T_ = 2, 4, 10, 32, 4, 16        # C = ceil(1.25 * top_k 2 * T 16 / E 4)
    c = counts(prog)
    assert c[("all_to_all", "data", "forward")] == 2 * layers
    assert c[("all_to_all", "data", "backward")] == 2 * layers
    a2a = [r for r in prog.collectives() if r.kind == "all_to_all"]
    assert {r.nbytes for r in a2a} == {B // 2 * E * C * d * 4}       # the local buffer, sent once
    assert not any(r.kind == "all_gather" for r in prog.collectives())
    assert not any("moe.w" in r.value for r in prog.collectives())
    # the dense layers are data parallel on the same axis: one gradient all_reduce per non-expert parameter
    dense = [n for n, _ in prog.model.named_parameters() if ".moe.w" not in n]
    assert c[("all_reduce", "data", "backward")] == len(dense)
    assert prog.sharding("params.layers.0.moe.w1").dims[0] == ("data",)
    assert prog.sharding("inputs.0").dims[0] == ("data",)
    assert "all_to_all" in prog.explain("params.layers.0.moe.w1")


def test_expert_parallel_on_its_own_axis_tiles_tokens_on_both():
    prog = run("moe_capacity", [T.data_parallel("batch"), T.expert_parallel("expert"), T.zero(3, "batch")],
               {"batch": 2, "expert": 2}, eps=1e-5)
    assert prog.sharding("inputs.0").dims[0] == ("batch", "expert")
    assert prog.sharding("params.layers.0.moe.w1").dims[0] == ("expert", "batch")
    c = counts(prog)
    assert c[("all_to_all", "expert", "forward")] == c[("all_to_all", "expert", "backward")] == 4
    assert not any(k[0] == "all_to_all" and k[1] == "batch" for k in c)


def test_expert_parallel_after_data_parallel_on_the_same_axis_is_an_error():
    with pytest.raises(pt.PartitionError, match=r"put expert_parallel\('data'\) before BP"):
        run("moe_capacity", [T.data_parallel("data"), T.expert_parallel("data")], {"data": 2}, steps=0)


def test_expert_parallel_on_per_token_weight_selection_is_an_error():
    with pytest.raises(pt.PartitionError, match="index_select"):
        run("moe_index", [T.data_parallel("batch"), T.expert_parallel("expert")], {"batch": 2, "expert": 2},
            steps=0)


def test_expert_parallel_params_glob_names_the_experts():
    prog = run("moe_capacity", [T.expert_parallel("data", params="layers.*.moe.w1")], {"data": 2}, steps=1,
               eps=1e-5)
    assert prog.sharding("params.layers.0.moe.w1").dims[0] == ("data",)
    # w2 is not named, but the experts' second matmul shares E with w1's: propagation tiles it too
    assert prog.sharding("params.layers.0.moe.w2").dims[0] == ("data",)
    assert "seeded" not in prog.explain("params.layers.0.moe.w2")
    with pytest.raises(pt.PartitionError, match="matches no parameter"):
        run("moe_capacity", [T.expert_parallel("data", params="nope.*")], {"data": 2}, steps=0)
    with pytest.raises(pt.PartitionError, match="stack the experts on dim 0"):
        run("moe_capacity", [T.expert_parallel("data", params="*ln*")], {"data": 2}, steps=0)


def test_expert_parallel_on_a_dense_model_is_an_error():
    with pytest.raises(pt.PartitionError, match="dense model"):
        run("gpt_sdpa", [T.expert_parallel("expert")], {"expert": 2}, steps=0)


def test_multi_query_keeps_shared_kv_replicated():
    prog = run("llama", [T.multi_query("model")], {"model": 2})
    assert prog.sharding("params.layers.0.attention.wq.weight").dims[0] == ("model",)
    assert prog.sharding("params.layers.0.attention.wk.weight").replicated == {"model"}
    fwd = [r for r in prog.collectives() if r.phase == "forward"]
    assert [r.kind for r in fwd].count("all_reduce") == 2            # the row-parallel wo, once per layer


def test_mixed_precision_matches_unpartitioned_mixed_precision():
    spec = get("gpt_sdpa")
    data = spec.batch(4)
    losses = []
    for mesh, sched in (({"batch": 1}, []), ({"batch": 2}, [T.data_parallel("batch")])):
        model = spec.build()
        prog = pt.partition(model, pt.Mesh(mesh), [T.mixed_precision()] + sched, example_inputs=data,
                            loss_fn=spec.loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        losses.append([float(prog.train_step(*data)) for _ in range(STEPS)])
        params = prog.gather_parameters()
        assert params["wte.weight"].dtype == torch.float32            # fp32 master weights
    # bf16 compute: the data-parallel sum of two half-batch gradients differs from the whole-batch one by bf16
    # rounding, so compare to bf16 precision
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=2e-2, atol=0)
    grads = [r for r in prog.collectives() if r.phase != "forward" and r.nbytes > 8]
    assert grads and all(r.dtype == "float32" for r in grads)          # reduce_dtype=float32


def test_mixed_precision_reduce_dtype_bf16_halves_gradient_bytes():
    spec = get("gpt_sdpa")
    model = spec.build()
    sizes = {}
    for rd in (torch.float32, torch.bfloat16):
        prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.mixed_precision(reduce_dtype=rd),
                                                            T.data_parallel("batch")],
                            example_inputs=spec.batch(4), loss_fn=spec.loss_fn,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        sizes[rd] = sum(r.nbytes for r in prog.collectives() if r.nbytes > 8)
    assert sizes[torch.bfloat16] * 2 == sizes[torch.float32]


def test_remat_recomputes_and_saves_memory_with_equal_numerics():
    prog = run("gpt_sdpa", [T.data_parallel("batch"), T.remat("layers.?")], {"batch": 2})
    recomputed = [n for n in prog.captured.gm.graph.nodes if n.meta.get("partir_recompute")]
    assert recomputed
    spec = get("gpt_sdpa", d=256, heads=8, seq=256, vocab=256)
    reports = []
    for sched in ([T.data_parallel("batch")], [T.data_parallel("batch"), T.remat("layers.?")]):
        m = spec.build(device="meta")
        p = pt.partition(m, pt.Mesh({"batch": 2}), sched, example_inputs=spec.batch(32, device="meta"),
                         loss_fn=spec.loss_fn, optimizer=torch.optim.AdamW(m.parameters()))
        reports.append(p.simulate(pt.sim.hardware("h100", gpus_per_node=2)))
    plain, remat = reports
    assert remat.peak_memory_bytes < plain.peak_memory_bytes
    assert remat.compute_s > plain.compute_s
    assert remat.model_flops == plain.model_flops                    # recomputation is not model work


def test_selective_remat_keeps_attention_and_every_other_matmul():
    """policy="selective" (torchtitan's per-op checkpointing): the backward recomputes half of each region's
    matmuls and no attention kernel; equal to one device; memory and compute between no remat and full remat."""
    def recomputed(prog, kind):
        return [n for n in prog.captured.gm.graph.nodes if n.meta.get("partir_recompute") and kind(str(n.target))]
    mm = lambda t: t.startswith("aten.mm")                                       # noqa: E731
    attn = lambda t: "scaled_dot_product" in t                                   # noqa: E731
    full = run("gpt_sdpa", [T.data_parallel("batch"), T.remat("layers.?")], {"batch": 2}, steps=1)
    sel = run("gpt_sdpa", [T.data_parallel("batch"), T.remat("layers.?", policy="selective")], {"batch": 2})
    assert recomputed(full, attn) and not recomputed(sel, attn)
    assert 0 < len(recomputed(sel, mm)) <= (len(recomputed(full, mm)) + 1) // 2
    spec = get("gpt_sdpa", d=256, heads=8, seq=256, vocab=256)
    reports = []
    for extra in ([], [T.remat("layers.?", policy="selective")], [T.remat("layers.?")]):
        m = spec.build(device="meta")
        p = pt.partition(m, pt.Mesh({"batch": 2}), [T.data_parallel("batch")] + extra,
                         example_inputs=spec.batch(32, device="meta"), loss_fn=spec.loss_fn,
                         optimizer=torch.optim.AdamW(m.parameters()))
        reports.append(p.simulate(pt.sim.hardware("h100", gpus_per_node=2), stages=False))
    plain, selective, whole = reports
    assert plain.peak_memory_bytes > selective.peak_memory_bytes > whole.peak_memory_bytes
    assert plain.compute_s < selective.compute_s < whole.compute_s
    with pytest.raises(pt.PartitionError, match="policy must be one of full, selective"):
        T.remat("layers.?", policy="op")


def test_remat_selector_matching_nothing_is_an_error():
    with pytest.raises(pt.PartitionError, match="matches no module"):
        run("mlp", [T.remat("blocks.*")], {"batch": 1}, steps=0)


# -- every preset on every zoo model it applies to (parity only; the counts are asserted above) -------------------
TRANSFORMERS = ["gpt", "gpt_sdpa", "llama", "moe", "vit"]
MATRIX = (
    [(m, "SP", {"model": 2}, lambda: [T.megatron("model"), T.sequence_parallel("model")]) for m in
     ["gpt", "gpt_sdpa", "llama"]]
    + [(m, "EMB", {"model": 2}, lambda: [T.embedding("model")]) for m in ["gpt", "gpt_sdpa", "llama", "moe"]]
    + [(m, "EMB-feature", {"model": 2}, lambda: [T.embedding("model", dim="feature")]) for m in ["gpt", "llama"]]
    + [(m, "EP", {"batch": 2, "expert": 2}, lambda: [T.data_parallel("batch"), T.expert_parallel("expert")])
       for m in ["moe", "moe_capacity"]]
    + [("moe_capacity", "EP-shared", {"data": 2, "model": 2},
        lambda: [T.expert_parallel("data"), T.megatron("model"), T.zero(3, "data")])]
    + [(m, "MQ", {"model": 2}, lambda: [T.multi_query("model")]) for m in ["gpt", "gpt_sdpa", "llama", "vit"]]
    + [(m, "Z1", {"batch": 2}, lambda: [T.data_parallel("batch"), T.zero(1, "batch")]) for m in
       ["mlp", "gpt_sdpa", "unet"]]
    + [(m, "remat", {"batch": 2}, lambda: [T.data_parallel("batch"), T.remat("layers.*")]) for m in
       ["gpt", "llama", "moe", "vit"]]
)


@pytest.mark.parametrize("model,name,mesh,schedule", MATRIX, ids=[f"{m}-{n}" for m, n, _, _ in MATRIX])
def test_preset_matrix_matches_single_device(model, name, mesh, schedule):
    # eps=1e-5 as in test_parity.py: with AdamW's default 1e-8, an entry whose gradient is ~0 turns a summation-order
    # difference of 1e-7 into an update difference of up to ~3e-5 (seen on one element of gpt's mlp.w1 under MQ/SP)
    run(model, schedule(), mesh, steps=2, eps=1e-5)


@pytest.mark.parametrize("model,tactic,match", [
    ("vit", lambda: T.embedding("model"), "no embedding table"),
    ("unet", lambda: T.sequence_parallel("model"), "linear pairs"),
    ("mlp", lambda: T.multi_query("model"), "key/value projections"),
    # convolution kernels (ViT's patch embedding, UNet's convs) are rank >= 3 but not experts
    ("vit", lambda: T.expert_parallel("model"), "dense model"),
    ("unet", lambda: T.expert_parallel("model"), "dense model"),
])
def test_presets_that_do_not_apply_raise(model, tactic, match):
    with pytest.raises(pt.PartitionError, match=match):
        run(model, [tactic()], {"model": 2}, steps=0)


def test_strategies_example_moe_ep_runs_and_matches_single_device():
    """examples/strategies.py moe_ep (GShard MoE, EP + MP + Z3): its printed losses equal the single-device ones
    and its summary shows the token exchange."""
    import os
    import re
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "examples", "strategies.py")
    out = subprocess.run([sys.executable, script, "moe_ep"], capture_output=True, text=True, check=True,
                         timeout=300).stdout
    pairs = re.findall(r"loss ([0-9.]+)\s+single device ([0-9.]+)", out)
    assert len(pairs) == 3
    for got, want in pairs:
        assert float(got) == pytest.approx(float(want), abs=2e-6)
    assert "all_to_all[data] +8" in out


class _GroupedQKV(torch.nn.Module):
    """CodeGen's attention: one fused projection whose features are `groups` groups of (q | v | k), viewed as
    (..., groups, 3 * local) and split on that minor dim; the heads of a group are that group's q, k, v."""

    def __init__(self, dim=32, heads=4, groups=4, vocab=64):
        super().__init__()
        self.heads, self.groups = heads, groups
        self.emb = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        b, s, d = x.shape
        local = d // self.groups
        q, v, k = self.qkv(x).view(b, s, -1, 3 * local).split(local, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.out(a.transpose(1, 2).reshape(b, s, d)))


def _lm_loss(m, ids):
    return torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten())


def test_megatron_tiles_a_projection_fused_by_groups_without_resharding():
    # the split is on the minor dim of (groups, q|v|k): the tiled features are whole groups (heads), not the
    # q / v / k chunks of the whole feature dim (that strided layout is resharded back at the view)
    torch.manual_seed(0)
    model = _GroupedQKV()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 8))
    prog = pt.partition(model, pt.Mesh({"model": 2}), [T.megatron("model")], example_inputs=(ids,),
                        loss_fn=_lm_loss, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    train_next_to_eager(prog, ref, [(ids,)] * STEPS, _lm_loss, adamw(), param_atol=1e-5, what="grouped qkv")
    assert prog.sharding("params.qkv.weight").dims[0] == ("model",)
    assert prog.sharding("params.qkv.weight").stride("model") == 1       # contiguous: whole groups per rank
    assert [r for r in prog.collectives() if r.why == "reshard"] == []
