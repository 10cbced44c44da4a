"""Predictability (DESIGN §5.3, issue 3): the collectives of each strategy are the textbook ones, counted exactly.

Model: gpt_sdpa from the zoo (vocab V=64, seq T=16, width d=32, L=2 layers, tied embedding/head), global batch B=4,
fp32 (4 bytes). P is the set of trainable parameters (the tied wte counted once), |p| a tensor's bytes.
Every record's nbytes is the full array size the collective reduces or produces (records.py: nccl-tests convention).

    BP  (batch=2)        all_reduce(sum) of every gradient, |p| bytes each          -> |P| records
                         + 2 scalar all_reduces for the loss: mean cross-entropy is lowered as sum / count, and
                           both the sum and the count are partial over the batch axis
    MP  (model=2)        per layer 2 all_reduces in forward (after attn.wo and mlp.w2, the row-parallel linears) and
                         2 in backward (dx of the column-parallel wq/wk/wv and w1), each B*T*d*4 bytes -> 4L records;
                         none for the embedding or the loss: megatron tiles no vocabulary here
    BP+MP (2x2)          MP's records on "model" with the local batch B/2, and BP's gradient all_reduces on "batch"
                         with each gradient's model-local bytes (|p| / 2 for the tensors megatron tiles)
    BP+Z3 (batch=2)      forward: all_gather of every parameter (|p| bytes); backward: all_gather again of every
                         parameter the backward reads (re-gathered rather than kept alive); optimizer: every gradient
                         reduce_scattered once (|p| bytes, input size); the 2 loss scalars; nothing else
    BP+Z2 (batch=2)      every gradient reduce_scattered once; every updated parameter all_gathered once, after the
                         update; the 2 loss scalars; Z1 lowers to the same program (presets.Zero docstring)
"""
from __future__ import annotations

import copy
import re
from collections import Counter

import pytest
import torch

import partir_torch as pt
from examples.models import get

from partir_torch.lower.bucket import MIN_BUCKET, UNITS
from tests.harness import adamw, train_next_to_eager

T = pt.tactics
SPEC = get("gpt_sdpa")
B, SEQ, D, LAYERS, VOCAB = 4, 16, 32, 2, 64
F32 = 4
LOSS_SCALARS = 2          # sum and count of the mean cross-entropy


def partition(mesh: dict, tactics, optimizer=True, bucket_bytes=0):
    """bucket_bytes=0: one collective per parameter, so the textbook counts can be read off directly."""
    model = SPEC.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer else None
    prog = pt.partition(model, pt.Mesh(mesh), tactics, example_inputs=SPEC.batch(B), loss_fn=SPEC.loss_fn,
                        optimizer=opt, options=pt.Options(bucket_bytes=bucket_bytes))
    return model, prog


def param_bytes(model) -> dict:
    return {k: p.numel() * p.element_size() for k, p in model.named_parameters()}


def select(records, **attrs) -> list:
    return [r for r in records if all(getattr(r, k) == v for k, v in attrs.items())]


def used_in_backward(name: str) -> bool:
    """Parameters the backward reads: every matrix (dx = dy @ W; the tied wte is the LM head's matrix) and the
    LayerNorm affine parameters (aten.native_layer_norm_backward takes weight and bias as operands). Linear biases
    and the position table wpe are not read: their gradients are sums of the incoming gradient."""
    if name == "wpe.weight":
        return False
    if ".ln" in name or name.startswith("ln_f."):
        return True
    return name.endswith(".weight")


def test_model_shape_assumed_by_formulas():
    model = SPEC.build()
    cfg = model.cfg
    assert (cfg.vocab, cfg.seq, cfg.d, cfg.layers, cfg.attention) == (VOCAB, SEQ, D, LAYERS, "sdpa")
    assert model.wte.weight.shape == (VOCAB, D)


def test_bp_one_all_reduce_per_gradient():
    model, prog = partition({"batch": 2}, [T.data_parallel("batch")])
    recs = prog.collectives()
    pb = param_bytes(model)
    assert {r.kind for r in recs} == {"all_reduce"}
    assert {(r.axis, r.group_size, r.tactic, r.dtype, r.reduce_op) for r in recs} == {("batch", 2, "BP", "float32",
                                                                                       "sum")}
    # expected: |P| gradient all_reduces of |p| bytes + LOSS_SCALARS of 4 bytes
    assert len(recs) == len(pb) + LOSS_SCALARS
    loss = select(recs, phase="forward")
    assert [r.nbytes for r in loss] == [F32] * LOSS_SCALARS
    grads = [r for r in recs if r.phase != "forward"]
    assert Counter(r.nbytes for r in grads) == Counter(pb.values())
    assert sum(r.nbytes for r in recs) == sum(pb.values()) + LOSS_SCALARS * F32


def test_mp_two_all_reduces_per_layer_each_way():
    model, prog = partition({"model": 2}, [T.megatron("model")])
    recs = prog.collectives()
    act = B * SEQ * D * F32          # (B, T, d) fp32 activation = 8192 bytes
    assert {(r.kind, r.axis, r.tactic, r.nbytes) for r in recs} == {("all_reduce", "model", "MP", act)}
    assert len(select(recs, phase="forward")) == 2 * LAYERS
    assert len(select(recs, phase="backward")) == 2 * LAYERS
    assert len(recs) == 4 * LAYERS   # nothing for embedding, head or loss
    assert sum(r.nbytes for r in recs) == 4 * LAYERS * act


def test_bp_mp_compose():
    model, prog = partition({"batch": 2, "model": 2}, [T.data_parallel("batch"), T.megatron("model")])
    recs = prog.collectives()
    act_local = (B // 2) * SEQ * D * F32
    mp = select(recs, axis="model")
    assert {(r.kind, r.tactic, r.nbytes) for r in mp} == {("all_reduce", "MP", act_local)}
    assert len(select(mp, phase="forward")) == len(select(mp, phase="backward")) == 2 * LAYERS
    bp = select(recs, axis="batch")
    assert {(r.kind, r.tactic) for r in bp} == {("all_reduce", "BP")}
    model_tiled = {k for k in param_bytes(model) if prog.sharding(f"params.{k}").tiled_axes().get("model") is not None}
    # megatron tiles the column-parallel wq/wk/wv/w1 (weights and biases) and the row-parallel wo/w2 (weights)
    assert model_tiled == {k for k in param_bytes(model) if re.search(r"\.(attn\.w[qkv]|mlp\.w1)\.(weight|bias)$", k)
                           or re.search(r"\.(attn\.wo|mlp\.w2)\.weight$", k)}
    local = [b // 2 if k in model_tiled else b for k, b in param_bytes(model).items()]
    assert Counter(r.nbytes for r in bp if r.phase != "forward") == Counter(local)
    assert [r.nbytes for r in select(bp, phase="forward")] == [F32] * LOSS_SCALARS
    assert len(recs) == 4 * LAYERS + len(local) + LOSS_SCALARS


def test_zero3_gathers_in_forward_and_again_in_backward_but_the_last_and_reduce_scatters_gradients():
    model, prog = partition({"batch": 2}, [T.data_parallel("batch"), T.zero(3, "batch")])
    recs = prog.collectives()
    pb = param_bytes(model)
    fwd_gather = select(recs, kind="all_gather", phase="forward")
    assert {(r.tactic, r.axis, r.dim) for r in fwd_gather} == {("Z3", "batch", 0)}
    assert Counter(r.value for r in fwd_gather) == Counter(f"params.{k}" for k in pb)      # each exactly once
    assert all(r.nbytes == pb[r.value[len("params."):]] for r in fwd_gather)
    bwd_gather = select(recs, kind="all_gather", phase="backward")
    # the tied wte is the last parameter the forward reads (the LM head): its forward copy serves the backward,
    # as FSDP2 keeps its root gathered and torchtitan its last block; every other one is gathered again
    want_bwd = [k for k in pb if used_in_backward(k) and k != "wte.weight"]
    assert len(want_bwd) == LAYERS * (6 + 4) + 2      # per layer 6 matrices + 2 LayerNorms; ln_f
    assert Counter(r.value for r in bwd_gather) == Counter(f"params.{k}" for k in want_bwd)
    assert all(r.nbytes == pb[r.value[len("params."):]] for r in bwd_gather)
    rs = select(recs, kind="reduce_scatter")
    assert Counter(r.nbytes for r in rs) == Counter(pb.values())                          # each gradient once
    assert {(r.axis, r.reduce_op) for r in rs} == {("batch", "sum")}
    assert select(recs, kind="all_gather", phase="optimizer") == []                       # parameters stay sharded
    ar = select(recs, kind="all_reduce")
    assert [r.nbytes for r in ar] == [F32] * LOSS_SCALARS
    assert len(recs) == len(pb) + len(want_bwd) + len(pb) + LOSS_SCALARS


@pytest.mark.parametrize("stage", [2, 1])
def test_zero2_reduce_scatters_gradients_and_gathers_updated_parameters(stage):
    model, prog = partition({"batch": 2}, [T.data_parallel("batch"), T.zero(stage, "batch")])
    recs = prog.collectives()
    pb = param_bytes(model)
    rs = select(recs, kind="reduce_scatter")
    assert Counter(r.nbytes for r in rs) == Counter(pb.values())
    ag = select(recs, kind="all_gather")
    assert {(r.phase, r.tactic, r.axis) for r in ag} == {("optimizer", f"Z{stage}", "batch")}
    assert Counter(r.value for r in ag) == Counter(f"params.{k}" for k in pb)             # once each, after update
    assert all(r.nbytes == pb[r.value[len("params."):]] for r in ag)
    assert [r.nbytes for r in select(recs, kind="all_reduce")] == [F32] * LOSS_SCALARS
    assert len(recs) == 2 * len(pb) + LOSS_SCALARS
    # the i-th gather follows the i-th reduce_scatter: a parameter is gathered only after its shard was updated
    kinds = [r.kind for r in recs if r.kind != "all_reduce"]
    rs_seen = 0
    for i, k in enumerate(kinds):
        rs_seen += k == "reduce_scatter"
        if k == "all_gather":
            assert rs_seen >= kinds[:i + 1].count("all_gather"), kinds


def test_records_match_lowered_graph():
    """Every record names a collective node of the per-device program, in program order."""
    _, prog = partition({"batch": 2, "model": 2}, [T.data_parallel("batch"), T.megatron("model"),
                                                   T.zero(3, "batch")])
    low = prog.lowered
    recs = prog.collectives()
    nodes = [n for n in low.gm.graph.nodes if n.meta.get("partir_collective") is not None]
    assert [n.name for n in nodes] == [r.node for r in recs]
    kinds = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
             "reduce_scatter": "reduce_scatter_tensor"}
    for n, r in zip(nodes, recs):
        assert kinds[r.kind] in str(n.target), (n.format_node(), r)


@pytest.mark.parametrize("stage", [2, 3])
def test_bucketing_keeps_bytes_and_merges_collectives(stage):
    """Default lowering merges runs of parameter gathers and gradient reduce-scatters into buckets (as DDP and
    FSDP do): the same bytes in far fewer calls, and the same numerics."""
    tactics = [T.data_parallel("batch"), T.zero(stage, "batch")]
    _, plain = partition({"batch": 2}, tactics)
    _, bucketed = partition({"batch": 2}, tactics, bucket_bytes=64 * 2 ** 20)
    by = lambda p, kind: [r for r in p.collectives() if r.kind == kind]
    for kind in ("all_gather", "reduce_scatter"):
        assert sum(r.nbytes for r in by(bucketed, kind)) == sum(r.nbytes for r in by(plain, kind))
        assert len(by(bucketed, kind)) < len(by(plain, kind)) // 2
        # buckets scale with the model (lower/bucket.py): a merged one holds at most 1/UNITS of what its kind moves
        # in its phase (MIN_BUCKET at least), so this 0.1 MB model is not one 64 MiB bucket gathered (or held) at once
        for phase in {r.phase for r in by(bucketed, kind)}:
            total = sum(r.nbytes for r in by(bucketed, kind) if r.phase == phase)
            limit = max(total // UNITS, MIN_BUCKET)
            assert all(r.nbytes <= limit for r in by(bucketed, kind) if r.phase == phase and r.members)
    data = SPEC.batch(B)
    for _ in range(2):
        torch.testing.assert_close(bucketed.train_step(*data), plain.train_step(*data), rtol=1e-6, atol=1e-6)
    got, want = bucketed.gather_parameters(), plain.gather_parameters()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)


def test_bucket_collectives_are_recorded_and_simulated_as_the_collectives_they_are():
    """A bucket's gather and all_reduce run as partir's own ops (lower/bucketops.py: every member written into one
    buffer). prog.collectives() records each as one all_gather / all_reduce of its members' bytes (its whole
    output buffer), and the simulator prices it as that collective on its axis: the same kind, axis and bytes,
    the time comm.estimate gives them."""
    from partir_torch.lower.bucketops import ALL_GATHER_BUCKET, ALL_REDUCE_BUCKET
    from partir_torch.sim import estimate

    kinds = {ALL_GATHER_BUCKET: "all_gather", ALL_REDUCE_BUCKET: "all_reduce"}
    _, prog = partition({"batch": 2, "fsdp": 2, "model": 2},
                        [T.data_parallel("batch"), T.data_parallel("fsdp", name="BP-fsdp"), T.megatron("model"),
                         T.zero(3, "fsdp")], bucket_bytes=64 * 2 ** 20)
    buckets = [n for n in prog.lowered.gm.graph.nodes if n.target in kinds]
    assert {kinds[n.target] for n in buckets} == {"all_gather", "all_reduce"}
    recs = {r.node: r for r in prog.collectives()}
    hw = pt.sim.hardware("h100", calibrated=False)
    timings = {c.node: c for c in prog.simulate(hw).collectives}
    for n in buckets:
        r, t = recs[n.name], timings[n.name]
        assert r.kind == kinds[n.target] and len(r.members) == len(n.args[0]) > 1
        assert r.nbytes == sum(m.nbytes for m in r.members)
        assert r.nbytes == n.meta["val"].numel() * F32     # nccl-tests convention: the whole buffer (fp32)
        assert (t.kind, t.axis, t.nbytes) == (r.kind, r.axis, r.nbytes)
        assert t.time_s == pytest.approx(estimate(hw, r.kind, r.nbytes, prog.mesh, r.axis).time_s)


def test_zero3_does_not_gather_a_weight_the_backward_reads_only_the_shape_of():
    """The ViT's patch embedding convolves the input images, which need no gradient: its convolution_backward
    (output_mask [False, True, True]) computes grad_weight from dy and x, reading only the weight's shape. ZeRO-3
    gathers that weight once, for the forward (it gathered it again for the backward, for nothing: 98 KiB a step on
    HF ViT, which XLA's program drops). The step still equals one device's."""
    spec = get("vit")
    model = spec.build()
    ref = copy.deepcopy(model)
    batch = spec.batch(4)
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch"), T.zero(3, "batch")],
                        example_inputs=batch, loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5),
                        options=pt.Options(bucket_bytes=0))
    gathers = select(prog.collectives(), kind="all_gather", value="params.patch_embed.weight")
    assert [r.phase for r in gathers] == ["forward"], [str(r) for r in gathers]
    train_next_to_eager(prog, ref, [batch] * 2, spec.loss_fn, adamw(eps=1e-5))


class _PositionTable(torch.nn.Module):
    """Tokens plus a learned position table of 64 rows, of which a sequence of 8 reads the first 8 (BERT's and
    GPT-2's `position_ids[:, :T]`): the table's gradient is the batch-summed (1, T, d) gradient scattered."""

    def __init__(self, d=16):
        super().__init__()
        self.tok, self.pos, self.head = torch.nn.Embedding(32, d), torch.nn.Embedding(64, d), torch.nn.Linear(d, 32)

    def forward(self, x):
        return self.head(self.tok(x) + self.pos(torch.arange(x.shape[1]))[None])


def test_a_position_tables_gradient_is_reduced_before_the_scatter_not_as_the_table():
    """Under BP the position gradient is partial over the batch axis once summed over the batch: partir reduces
    those 8 x 16 values (512 B), not the 64 x 16 table they are scattered into (4,096 B, as XLA's program does
    too); the step still equals one device's."""
    torch.manual_seed(0)
    model = _PositionTable()
    ref = copy.deepcopy(model)
    x = torch.randint(0, 32, (4, 8))
    loss_fn = lambda m, x: torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())   # noqa: E731
    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=(x,),
                        loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5),
                        options=pt.Options(bucket_bytes=0))
    sizes = sorted(r.nbytes for r in select(prog.collectives(), kind="all_reduce"))
    assert 8 * 16 * F32 in sizes and 64 * 16 * F32 not in sizes, sizes
    train_next_to_eager(prog, ref, [(x,)] * 2, loss_fn, adamw(eps=1e-5))
