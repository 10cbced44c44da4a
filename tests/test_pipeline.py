"""Pipeline parallelism as a tactic (issue 24): tactics/pipeline.py, lower/pipeline.py, the emulator's stages
(runtime/interpret.py), sim/pipeline.py.

Parity: every schedule trains like one device with the same global batch (tests/harness.py tolerances) on emulated
{pp: 2}, {pp: 2, dp: 2}, {pp: 2, dp: 2, tp: 2} (megatron on tp), {pp: 4}; so do clip_grad_norm (the stages' sums of
squares all-reduced on pp) and tied weights across stages (held by each stage reading them, their gradient
all-reduced on pp; lower/ppaxis.py); the simulated bubble of uniform stages is within 5% of the textbook
(p - 1) / (v m + p - 1)."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import partir_torch as pt
from partir_torch.contract import META_ACTION, META_COLLECTIVE, META_MODULE, META_STAGE, Phase, phase_of
from partir_torch.errors import PartitionError
from partir_torch.lower.pipeline import pp_transfer, rank_orders
from partir_torch.lower.ppschedules import SCHEDULES, schedule_of
from partir_torch.lower.ppspec import PipelineSpec
from examples.models import get
from tests.harness import LOSS_RTOL, PARAM_ATOL, PARAM_RTOL, adamw, assert_parameters_equal, train_next_to_eager

T = pt.tactics
LLAMA = get("llama", layers=4)


def _partition(mesh, schedule, spec=LLAMA, bs=8, **kw):
    model = spec.build()
    ref = copy.deepcopy(model)
    batch = spec.batch(bs)
    prog = pt.partition(model, pt.Mesh(mesh), schedule, example_inputs=batch, loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), **kw)
    return prog, ref, batch


def _parity(mesh, schedule, steps=2, **kw):
    prog, ref, batch = _partition(mesh, schedule, **kw)
    train_next_to_eager(prog, ref, [batch] * steps, LLAMA.loss_fn, adamw(1e-3), what=str(mesh))
    return prog


# -- parity --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_pp2_trains_like_one_device(schedule):
    prog = _parity({"pp": 2}, [T.pipeline("pp", 2, schedule, microbatches=4)])
    low = prog.plan.lowered()
    # MPMD: every op runs on one coordinate of the axis; 4 micro-batches x (activation forward + gradient backward)
    stages = {n.meta.get(META_STAGE) for n in low.gm.graph.nodes if n.op == "call_function"}
    assert stages == {0, 1}
    assert len(low.pipeline.transfers) == 8


def test_pp2_dp2_1f1b():
    _parity({"pp": 2, "dp": 2}, [T.pipeline("pp", 2, "1F1B", 4), T.data_parallel("dp")])


def test_pp2_dp2_tp2_megatron():
    with pytest.warns(UserWarning, match="output.weight"):
        prog = _parity({"pp": 2, "dp": 2, "tp": 2},
                       [T.pipeline("pp", 2, "GPipe", 4), T.data_parallel("dp"), T.megatron("tp")])
    kinds = {(r.kind, r.axis) for r in prog.plan.lowered().records}
    assert ("all_reduce", "tp") in kinds and not any(a == "pp" for _, a in kinds)


def test_pp4_1f1b():
    _parity({"pp": 4}, [T.pipeline("pp", 4, "1F1B", 4)], steps=1)


def test_interleaved_two_stages_per_rank():
    prog = _parity({"pp": 2}, [T.pipeline("pp", 4, "Interleaved1F1B", 4)], steps=1)
    low = prog.plan.lowered()
    assert {n.meta[META_ACTION][0] for n in low.gm.graph.nodes if META_ACTION in n.meta} == {0, 1, 2, 3}
    assert {n.meta[META_STAGE] for n in low.gm.graph.nodes if META_ACTION in n.meta} == {0, 1}


def test_zbv_pp2_trains_like_one_device_in_a_v():
    """ZBVZeroBubble: 4 stages on 2 ranks in a V (rank 0 runs stages 0 and 3, rank 1 stages 1 and 2), as summary()
    shows; trains like one device; eval_step runs the forwards on the same placement."""
    prog, ref, batch = _partition({"pp": 2}, [T.pipeline("pp", 4, "ZBVZeroBubble", 4)])
    train_next_to_eager(prog, ref, [batch] * 2, LLAMA.loss_fn, adamw(1e-3), what="zbv")
    spec, low = prog.plan.pipeline, prog.plan.lowered()
    assert [spec.rank_of(s) for s in range(4)] == [0, 1, 1, 0] and spec.stages_on(0) == (0, 3)
    assert {(a[0], n.meta[META_STAGE]) for n in low.gm.graph.nodes if (a := n.meta.get(META_ACTION))
            and a[0] is not None} == {(0, 0), (1, 1), (2, 1), (3, 0)}
    table = prog.summary().split("pipeline on axis 'pp': 4 stages, ZBVZeroBubble, 4 micro-batches")[1]
    assert re.findall(r"^\s+(\d)\s+(\d)\s", table, re.M) == [("0", "0"), ("1", "1"), ("2", "1"), ("3", "0")]
    # only the ranks' boundaries are transfers: stage 0 -> 1 and 2 -> 3 forward, 3 -> 2 and 1 -> 0 backward
    assert len(low.pipeline.transfers) == 4 * 4
    with torch.no_grad():
        want = LLAMA.loss_fn(ref.eval(), *batch)
    torch.testing.assert_close(prog.eval_step(*batch), want, rtol=1e-5, atol=0)


def test_zbv_pp2_dp2_tp2_megatron_zero():
    with pytest.warns(UserWarning, match="output.weight"):
        prog = _parity({"pp": 2, "dp": 2, "tp": 2}, [T.pipeline("pp", 4, "ZBVZeroBubble", 4), T.data_parallel("dp"),
                                                     T.megatron("tp"), T.zero(3, "dp")], steps=1)
    low = prog.plan.lowered()
    node = {n.name: n for n in low.gm.graph.nodes}
    kinds = {(r.kind, r.axis, node[r.node].meta[META_ACTION][1]) for r in low.records}
    # megatron's all_reduce of an input gradient is what the send needs (B); ZeRO's gradient reductions are W's
    assert ("all_reduce", "tp", "B") in kinds and ("reduce_scatter", "dp", "W") in kinds
    assert ("reduce_scatter", "dp", "B") not in kinds


def test_zbv_backward_split_into_input_and_weight_gradients():
    """Each backward of ZBVZeroBubble is two actions: B, the input-gradient matmuls the send to the previous stage
    needs (rows x d), and W, the weight-gradient matmuls (d x d) with their accumulation; the first stage sends
    nothing back, so its backward is all W. No transfer leaves a W action."""
    d, rows, m = 8, 6, 4
    model = _Stack(d, 8)
    ref = copy.deepcopy(model)
    x, y = torch.randn(m * rows, d), torch.randn(m * rows, d)
    loss_fn = lambda mod, x, y: F.mse_loss(mod(x), y)      # noqa: E731
    stages = [[f"blocks.{2 * s}", f"blocks.{2 * s + 1}"] for s in range(4)]
    prog = pt.partition(model, pt.Mesh({"pp": 2}), [T.pipeline("pp", stages, "ZBVZeroBubble", m)],
                        example_inputs=(x, y), loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    train_next_to_eager(prog, ref, [(x, y)] * 2, loss_fn, adamw(1e-3), what="zbv split")
    low = prog.plan.annotated_lowered()
    mms: dict = {}
    for n in low.gm.graph.nodes:
        a = n.meta.get(META_ACTION)
        if a is not None and a[1] in "BW" and n.target is torch.ops.aten.mm.default:
            mms.setdefault(a, []).append(tuple(n.meta["val"].shape))
    for s in range(4):
        for j in range(m):
            # the stage's two blocks' weight gradients; on the first stage, whose B is empty, the input gradients
            # too (what the gradient of the scale in front of block 0 reads)
            assert sorted(mms[(s, "W", j)]) == sorted([(d, d)] * 2 + ([] if s else [(rows, d)] * 2)), (s, j)
            assert mms.get((s, "B", j), []) == ([(rows, d)] * 2 if s else []), (s, j)
    sent = [n.meta[META_ACTION] for n in low.gm.graph.nodes if n.target is pp_transfer]
    assert sent and all(k in "FB" for _, k, _ in sent)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 2), (2, 1)])
def test_zbv_pp4_and_fewer_microbatches_than_the_v_fills(p, m):
    """ZB-V on {pp: 4} (8 stages), and with fewer micro-batches than the 2 p - 1 its warm-up holds (the order laid out
    for 2 p - 1 and cut to m): every order merges without a deadlock and trains like one device."""
    model = _Stack(8, 4 * p)
    ref = copy.deepcopy(model)
    x, y = torch.randn(3 * m, 8), torch.randn(3 * m, 8)
    loss_fn = lambda mod, x, y: F.mse_loss(mod(x), y)      # noqa: E731
    prog = pt.partition(model, pt.Mesh({"pp": p}), [T.pipeline("pp", 2 * p, "ZBVZeroBubble", m)],
                        example_inputs=(x, y), loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    train_next_to_eager(prog, ref, [(x, y)] * 2, loss_fn, adamw(1e-3), what=f"zbv p={p} m={m}")
    orders = prog.plan.lowered().pipeline.orders
    assert [sorted({a[0] for a in o if a[0] is not None}) for o in orders] == [[r, 2 * p - 1 - r] for r in range(p)]


def test_zero3_inside_stages_and_state_dict():
    prog = _parity({"pp": 2, "dp": 2}, [T.pipeline("pp", 2, "1F1B", 4), T.data_parallel("dp"), T.zero(3, "dp")])
    sd = prog.state_dict()
    full = prog.full_state_dict()
    assert set(full) >= {k for k, _ in LLAMA.build().named_parameters()}
    before = {k: v.clone() for k, v in prog.gather_parameters().items()}
    prog.train_step(*LLAMA.batch(8))
    prog.load_state_dict(sd)
    after = prog.gather_parameters()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0)


def test_dp_collectives_bucketed_per_stage_and_overlapped():
    """A stage's gradient reduce-scatters are bucketed within the stage (lower/pipeline.bucket_parts), issued in its
    last micro-batch's backward before that backward's compute ends, and waited for before its update; its ZeRO-3
    gathers (kept for every micro-batch) are bucketed in its first micro-batch's forward; no bucket mixes stages
    (each parameter reduced and gathered once, by its own stage); the step trains like one device."""
    prog = _parity({"pp": 2, "dp": 2}, [T.pipeline("pp", 2, "1F1B", 4), T.data_parallel("dp"),
                                        T.zero(3, "dp", reshard_after_forward=False)], options=pt.Options(bucket_bytes=2 ** 14))
    low, spec = prog.plan.lowered(), prog.plan.pipeline
    nodes = list(low.gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    node = {n.name: n for n in nodes}
    for s in range(2):
        last_b, first_f = (s, "B", 3), (s, "F", 0)
        mine = [r for r in low.records if r.axis == "dp" and node[r.node].meta[META_STAGE] == s]
        rs, ag = ([r for r in mine if r.kind == k] for k in ("reduce_scatter", "all_gather"))
        assert sum(len(r.parts()) for r in rs) == len(spec.params[s]) > len(rs) >= 2     # buckets, several per stage
        assert sorted(m.value for r in ag for m in r.parts()) == sorted(f"params.{p}" for p in spec.params[s])
        assert sum(len(r.parts()) > 1 for r in ag) >= 1 and {node[r.node].meta[META_ACTION] for r in ag} == {first_f}
        assert {node[r.node].meta[META_ACTION] for r in rs} == {last_b}
        compute = [n for n in nodes if n.meta.get(META_ACTION) == last_b and n.op == "call_function"
                   and META_COLLECTIVE not in n.meta and "wait" not in n.name]
        assert at[node[rs[0].node]] < at[compute[-1]]            # the first bucket overlaps the last backward
        update = min(at[n] for n in nodes if n.meta.get(META_ACTION) == (s, "U", 0))
        for r in rs:
            wait = next(iter(node[r.node].users))
            assert at[node[r.node]] < at[wait] < update
    # the simulator replays that order: a bucket runs on the dp stream while the backward computes, so not all of
    # the stage's reduce-scatter time is exposed
    sim = prog.simulate(pt.sim.hardware("h100", gpus_per_node=4), stages=False)
    for s in range(2):
        mine = [c for c in sim.collectives if c.kind == "reduce_scatter" and node[c.node].meta[META_STAGE] == s]
        assert mine and sum(c.exposed_s for c in mine) < sum(c.time_s for c in mine)


def test_mixed_precision_reductions_start_inside_the_last_backward():
    """Under mixed precision each gradient's up-cast and its micro-batch accumulation follow the gradient in the
    unrolled step (tactics/memory.hoist_gradient_casts; autograd put every up-cast after the backward), so a stage's
    first reduce-scatter bucket is issued before its last micro-batch's backward ends. Compute in float64 (the casts
    are the same ops as bf16's), so the step equals one device's fp32 training within the fp32 tolerances."""
    loss_fn = lambda m, *b: LLAMA.loss_fn(m, *b).float()      # noqa: E731 (the loss in fp32, as one device's)
    model = LLAMA.build()
    ref, batch = copy.deepcopy(model), LLAMA.batch(8)
    prog = pt.partition(model, pt.Mesh({"pp": 2, "dp": 2}),
                        [T.pipeline("pp", 2, "1F1B", 4), T.data_parallel("dp"), T.mixed_precision(torch.float64),
                         T.zero(3, "dp", reshard_after_forward=False)], example_inputs=batch, loss_fn=loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                        options=pt.Options(bucket_bytes=2 ** 14))
    train_next_to_eager(prog, ref, [batch] * 2, loss_fn, adamw(1e-3))
    low = prog.plan.lowered()
    nodes = list(low.gm.graph.nodes)
    at = {n.name: i for i, n in enumerate(nodes)}
    for s in range(2):
        rs = [at[r.node] for r in low.records if r.kind == "reduce_scatter" and r.axis == "dp"
              and nodes[at[r.node]].meta[META_STAGE] == s]
        mms = [at[n.name] for n in nodes if n.meta.get(META_ACTION) == (s, "B", 3)
               and n.target is torch.ops.aten.mm.default]
        assert len(rs) >= 2 and min(rs) < max(mms), (s, rs, max(mms))


def test_fqn_globs_and_automatic_after_pipeline():
    stages = [["tok_embeddings", "layers.[0-2]"], ["layers.3", "norm", "output"]]
    prog = _parity({"pp": 2, "dp": 2}, [T.pipeline("pp", stages, "1F1B", 4),
                                         T.automatic("dp", hardware=pt.sim.hardware("h100", gpus_per_node=4))],
                   steps=1)
    spec = prog.plan.pipeline
    assert spec.modules == (("tok_embeddings", "layers.[0-2]"), ("layers.3", "norm", "output"))
    assert "output.weight" in spec.params[1] and "layers.2.attention.wq.weight" in spec.params[0]


def test_new_batch_shape_and_eval_step():
    """A batch of another size is partitioned again with the pipeline (same state); eval_step runs the model on the
    live state (emulated: every stage's state is readable)."""
    prog, ref, batch = _partition({"pp": 2}, [T.pipeline("pp", 2, "1F1B", 4)])
    big = LLAMA.batch(16, seed=3)
    train_next_to_eager(prog, ref, [batch, big], LLAMA.loss_fn, adamw(1e-3))
    assert prog.plan.pipeline is not None and len(prog.shapes()) == 2
    with torch.no_grad():
        want = LLAMA.loss_fn(ref.eval(), *batch)
    torch.testing.assert_close(prog.eval_step(*batch), want, rtol=1e-5, atol=0)


# -- clip_grad_norm -------------------------------------------------------------------------------------------------
def _max_norm(model, batch, loss_fn) -> float:
    """A clip threshold at 1/4 of the first step's global gradient norm: clipping acts."""
    probe = copy.deepcopy(model)
    loss_fn(probe, *batch).backward()
    return 0.25 * torch.nn.utils.clip_grad_norm_(probe.parameters(), float("inf")).item()


def _train_clipped(prog, ref, batch, loss_fn, max_norm, steps=2, what="", make_opt=None):
    """`steps` AdamW steps (or make_opt's optimizer) next to one device's clip_grad_norm_: the losses, the norm
    before clipping (above max_norm: clipping acts) and the parameters agree."""
    opt = (make_opt or (lambda ps: torch.optim.AdamW(ps, lr=1e-3)))(ref.parameters())
    for step in range(steps):
        got = prog.train_step(*batch)
        opt.zero_grad()
        want = loss_fn(ref, *batch)
        want.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        opt.step()
        assert norm > max_norm
        torch.testing.assert_close(got, want.detach(), rtol=LOSS_RTOL, atol=0, msg=lambda m: f"step {step}: {m}")
        torch.testing.assert_close(prog.last_grad_norm, norm, rtol=LOSS_RTOL, atol=0)
    assert_parameters_equal(prog, ref, what=what)


def _clip_parity(mesh, schedule, steps=2):
    model = LLAMA.build()
    ref = copy.deepcopy(model)
    batch = LLAMA.batch(8)
    max_norm = _max_norm(model, batch, LLAMA.loss_fn)
    prog = pt.partition(model, pt.Mesh(mesh), schedule, example_inputs=batch, loss_fn=LLAMA.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                        step=pt.StepOptions(clip_grad_norm=max_norm))
    _train_clipped(prog, ref, batch, LLAMA.loss_fn, max_norm, steps, str(mesh))
    return prog


def test_clip_grad_norm_sums_every_stage():
    """The norm of one device's clip_grad_norm_: each rank's stages' squares, all-reduced on pp (ZeRO-3's shards:
    first reduced on dp)."""
    prog = _clip_parity({"pp": 2, "dp": 2}, [T.pipeline("pp", 2, "1F1B", 4), T.data_parallel("dp"), T.zero(3, "dp")])
    pp = [r for r in prog.collectives() if r.axis == "pp"]
    assert [(r.kind, r.why, r.value, r.nbytes) for r in pp] == [("all_reduce", "grad norm", "grad_norm", 4)]
    assert "grad norm 1 (4 B)" in prog.summary()
    sim = prog.simulate(pt.sim.hardware("h100", gpus_per_node=prog.plan.mesh.size), stages=False)
    assert any(c.axis == "pp" and c.kind == "all_reduce" and c.time_s > 0 for c in sim.collectives)


def test_clip_grad_norm_with_megatron():
    with pytest.warns(UserWarning, match="output.weight"):
        _clip_parity({"pp": 2, "dp": 2, "tp": 2}, [T.pipeline("pp", 2, "GPipe", 4), T.data_parallel("dp"),
                                                   T.megatron("tp")], steps=1)


# -- tied weights -------------------------------------------------------------------------------------------------
def test_tied_weights_held_by_every_stage_that_reads_them():
    """GPT's LM head reads the embedding's weight: stage 0 and stage 1 each hold wte.weight and its Adam moments
    (ZeRO-2: sharded on dp), sum their own gradient terms over the micro-batches, all-reduce them on pp ("tied
    weight") and apply the same update; no transfer carries the weight or its gradient. Clipping counts the weight
    once."""
    gpt = get("gpt")
    model = gpt.build()
    ref = copy.deepcopy(model)
    batch = gpt.batch(8)
    max_norm = _max_norm(model, batch, gpt.loss_fn)
    prog = pt.partition(model, pt.Mesh({"pp": 2, "dp": 2}), [T.pipeline("pp", 2, "1F1B", 4), T.data_parallel("dp"),
                                                             T.zero(2, "dp")],
                        example_inputs=batch, loss_fn=gpt.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                        step=pt.StepOptions(clip_grad_norm=max_norm))
    _train_clipped(prog, ref, batch, gpt.loss_fn, max_norm)
    spec = prog.plan.pipeline
    assert spec.tied["params.wte.weight"] == (0, 1) and spec.holders("opt.exp_avg.wte.weight") == (0, 1)
    pp = [r for r in prog.collectives() if r.axis == "pp"]
    wte = ref.wte.weight
    assert [(r.kind, r.why, r.value, r.nbytes) for r in pp] == [
        ("all_reduce", "tied weight", "params.wte.weight", wte.numel() * 4 // 2),     # its dp shard (ZeRO-2)
        ("all_reduce", "grad norm", "grad_norm", 4)]
    assert len(prog.plan.lowered().pipeline.transfers) == 8        # activations and their gradients only
    held = prog._executor.held().state        # each holder's own copy: ranks 0, 1 on stage 0 and 2, 3 on stage 1
    for k in ("params.wte.weight", "opt.exp_avg.wte.weight", "opt.exp_avg_sq.wte.weight"):
        ts = held[k].ts
        assert ts[2] is not ts[0] and torch.equal(ts[2], ts[0]) and torch.equal(ts[3], ts[1]), k
    assert "tied weight wte.weight: held by stages 0, 1" in prog.summary()
    assert "tied weight 1 (4.00 KiB)" in prog.summary()
    assert "tied weight, read by stages 0, 1: held by each of them" in prog.explain("params.wte.weight")
    sd = prog.state_dict()
    assert set(sd["model"]) == set(ref.state_dict()) and "wte.weight" in sd["optimizer"]["state"]
    fresh = gpt.build()
    prog.export_to(fresh, torch.optim.AdamW(fresh.parameters()))
    torch.testing.assert_close(fresh.wte.weight, wte, rtol=PARAM_RTOL, atol=PARAM_ATOL)
    rep = prog.simulate(pt.sim.hardware("h100", gpus_per_node=4), stages=False)
    costed = [(c.kind, c.nbytes) for c in rep.collectives if c.axis == "pp" and c.time_s > 0]
    assert costed.count(("all_reduce", wte.numel() * 2)) == 2 and costed.count(("all_reduce", 4)) == 2   # 2 ranks


def test_tied_weight_sharded_by_zero3_refused():
    gpt = get("gpt")
    prog, _, _ = _partition({"pp": 2, "dp": 2}, [T.pipeline("pp", 2, "1F1B", 4), T.data_parallel("dp"),
                                                  T.zero(3, "dp")], spec=gpt)
    with pytest.raises(PartitionError, match=r"params.wte.weight is a tied weight, read by stages 0, 1 .* tactic Z3 "
                                             r"shards it on axis 'dp' \(size 2\).*zero\(1\) or zero\(2\)"):
        prog.plan.lowered()


class _Reuse(nn.Module):
    """A linear with a weight of its own bias and another linear's weight (tied)."""

    def __init__(self, other: nn.Linear):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(other.out_features))
        self.other = [other]             # not a submodule: the weight stays the other module's

    def forward(self, x):
        return torch.tanh(F.linear(x, self.other[0].weight, self.bias))


class _TiedOnOneRank(nn.Module):
    """Four stages on two ranks (interleaved): stage 2 reads stage 0's weight, both on rank 0."""

    def __init__(self, d=8):
        super().__init__()
        first = nn.Linear(d, d)
        self.blocks = nn.Sequential(nn.Sequential(first, nn.Tanh()), nn.Sequential(nn.Linear(d, d), nn.Tanh()),
                                    _Reuse(first), nn.Linear(d, d))

    def forward(self, x):
        return self.blocks(x)


def _tied_trained(model, ranks: int, schedule: str, microbatches: int):
    """`model` (4 blocks, one stage each) on {pp: ranks} under `schedule` with clip_grad_norm, trained next to one
    device's clip_grad_norm_ (_train_clipped); returns the program."""
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    loss_fn = lambda m, x, y: F.mse_loss(m(x), y)      # noqa: E731
    max_norm = _max_norm(model, (x, y), loss_fn)
    prog = pt.partition(model, pt.Mesh({"pp": ranks}), [T.pipeline("pp", [[f"blocks.{i}"] for i in range(4)],
                                                                  schedule, microbatches)],
                        example_inputs=(x, y), loss_fn=loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                        step=pt.StepOptions(clip_grad_norm=max_norm))
    _train_clipped(prog, ref, (x, y), loss_fn, max_norm)
    return prog


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_tied_weight_clipped_under_sgd(schedule):
    """SGD reads the clipped gradient in its first update op, so the clipping's scaling is a backward op: it was
    left in the last backward, before the tied weight's sum on pp and the norm every rank waits for (the schedule
    deadlocked). The scaling now runs in the update, after both; GPT's tied wte on {pp: 2} trains like one device."""
    gpt = get("gpt", layers=4)
    model = gpt.build()
    ref = copy.deepcopy(model)
    batch = gpt.batch(8)
    max_norm = _max_norm(model, batch, gpt.loss_fn)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)      # noqa: E731
    prog = pt.partition(model, pt.Mesh({"pp": 2}), [T.pipeline("pp", 2, schedule, 4)], example_inputs=batch,
                        loss_fn=gpt.loss_fn, optimizer=sgd(model.parameters()),
                        step=pt.StepOptions(clip_grad_norm=max_norm))
    _train_clipped(prog, ref, batch, gpt.loss_fn, max_norm, make_opt=sgd)
    assert [r.why for r in prog.collectives() if r.axis == "pp"] == ["tied weight", "grad norm"]


def test_tied_weight_on_one_rank_needs_no_exchange_and_clipping_interleaved():
    """Interleaved: stages 0 and 2 on rank 0 read one weight (no exchange: the rank holds it once); clipping sums
    each rank's two stages' squares before the all_reduce on pp."""
    model = _TiedOnOneRank()
    prog = _tied_trained(model, 2, "Interleaved1F1B", 2)
    assert prog.plan.pipeline.tied["params.blocks.0.0.weight"] == (0, 2)
    assert prog.plan.pipeline.holders("params.blocks.0.0.weight") == (0,)
    assert [r.why for r in prog.collectives() if r.axis == "pp"] == ["grad norm"]


def test_tied_weight_on_first_and_last_of_four_ranks():
    """Stages 0 and 3 of {pp: 4} hold the tied weight; ranks 1 and 2, holding none of it, add zeros to its
    all_reduce on pp (and their squares to the norm's)."""
    model = _TiedOnOneRank()
    model.blocks = nn.Sequential(model.blocks[0], model.blocks[1], nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                                 _Reuse(model.blocks[0][0]))
    prog = _tied_trained(model, 4, "1F1B", 4)
    assert prog.plan.pipeline.holders("params.blocks.0.0.weight") == (0, 3)
    assert [r.why for r in prog.collectives() if r.axis == "pp"] == ["tied weight", "grad norm"]


@pytest.mark.parametrize("last, holders, pp", [(False, (0, 1), ["tied weight", "grad norm"]),
                                               (True, (0,), ["grad norm"])])
def test_zbv_tied_weights_and_clipping(last, holders, pp):
    """ZBVZeroBubble with a weight tied between stage 0 and stage 2 (ranks 0 and 1 in the V: its gradient terms,
    now in W actions, all-reduced on pp) or stage 3 (rank 0 too: no exchange), and clip_grad_norm (each rank's two
    stages' squares): trains like one device's clip_grad_norm_."""
    model = _TiedOnOneRank()
    if last:
        model.blocks = nn.Sequential(model.blocks[0], model.blocks[1], nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                                     _Reuse(model.blocks[0][0]))
    prog = _tied_trained(model, 2, "ZBVZeroBubble", 4)
    assert prog.plan.pipeline.holders("params.blocks.0.0.weight") == holders
    assert [r.why for r in prog.collectives() if r.axis == "pp"] == pp


# -- the cut -------------------------------------------------------------------------------------------------------
def test_backward_ops_follow_their_forward_module():
    prog, _, _ = _partition({"pp": 2}, [T.pipeline("pp", 2, "GPipe", 2)])
    cap, spec = prog.plan.captured, prog.plan.pipeline
    bwd = [n for n in cap.gm.graph.nodes if n.op == "call_function" and phase_of(n) == Phase.BACKWARD
           and (n.meta.get(META_MODULE) or "").startswith("layers.3.")]
    assert bwd and all(spec.stage_of[n.name] == 1 for n in bwd)
    first = [n for n in cap.gm.graph.nodes if (n.meta.get(META_MODULE) or "").startswith("layers.0.")]
    assert first and all(spec.stage_of[n.name] == 0 for n in first)


class _KwBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, hidden, extra):
        return torch.tanh(self.lin(hidden)) * extra + hidden


class _PerLayerInputs(nn.Module):
    """HF Gemma-4's per-layer inputs in small: the root makes one input per layer before the layers (a projection
    viewed per layer) and hands layer i its slice by keyword, as HF's layers take hidden_states."""

    def __init__(self, d=8, layers=2):
        super().__init__()
        self.emb, self.side = nn.Linear(d, d), nn.Linear(d, layers * d)
        self.layers = nn.ModuleList(_KwBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h, extra = self.emb(x), self.side(x).view(x.shape[0], len(self.layers), -1)
        for i, layer in enumerate(self.layers):
            h = layer(hidden=h, extra=extra[:, i])
        return self.head(h)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_an_input_made_before_the_layers_and_read_by_each_stage_trains_like_one_device(schedule):
    """Inputs given by keyword stop a module's claim on the backward (it differentiates only its own forward), and
    the root's own backward ops between the stages (the slices' backwards, the sum of both stages' gradients of the
    per-layer input) run on the earliest stage sending them a gradient: the 1F1B merge used to deadlock here, each
    stage's first backward waiting for the other's (HF gemma4_text under the sweep's pipeline column)."""
    torch.manual_seed(0)
    model = _PerLayerInputs()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    loss_fn = lambda mod, x, y: F.mse_loss(mod(x), y)      # noqa: E731
    prog = pt.partition(model, pt.Mesh({"pp": 2}),
                        [T.pipeline("pp", [["emb", "side", "layers.0"], ["layers.1", "head"]], schedule, 4)],
                        example_inputs=(x, y), loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    cap, spec = prog.plan.captured, prog.plan.pipeline
    bwd = [n for n in cap.gm.graph.nodes if n.op == "call_function" and phase_of(n) == Phase.BACKWARD]
    assert not [n.name for n in bwd if n.target is torch.ops.aten.select_backward.default
                and (n.meta.get(META_MODULE) or "").startswith("layers.")]       # the root's slices, no layer's
    train_next_to_eager(prog, ref, [(x, y)] * 2, loss_fn, adamw(1e-3), what=schedule)


class _HeadNamedFirst(nn.Module):
    """A tied embedding whose parameter is named after the LM head (registered first, as HF's Camembert lists
    lm_head before roberta): the embedding on the first stage reads a parameter the name puts on the last."""

    def __init__(self, vocab=16, d=8):
        super().__init__()
        self.head = nn.Linear(d, vocab, bias=False)
        self.emb = nn.Embedding(vocab, d)
        self.emb.weight = self.head.weight
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(2))

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_a_tied_weight_named_after_a_later_stage_is_held_by_both():
    torch.manual_seed(0)
    model = _HeadNamedFirst()
    assert next(iter(dict(model.named_parameters()))) == "head.weight"
    ref = copy.deepcopy(model)
    ids, y = torch.randint(0, 16, (8, 5)), torch.randint(0, 16, (8, 5))
    loss_fn = lambda m, ids, y: F.cross_entropy(m(ids).flatten(0, 1), y.flatten())      # noqa: E731
    prog = pt.partition(model, pt.Mesh({"pp": 2}), [T.pipeline("pp", [["emb", "blocks.0"], ["blocks.1", "head"]],
                                                              "1F1B", 4)],
                        example_inputs=(ids, y), loss_fn=loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert prog.plan.pipeline.tied["params.head.weight"] == (1, 0)
    train_next_to_eager(prog, ref, [(ids, y)] * 2, loss_fn, adamw(1e-3), what="head named first")


def test_state_the_step_never_reads_needs_no_stage_glob():
    """A module the call never runs, with a frozen table (an audio tower under a text-only call, HF
    moss_transcribe_diarize: its sinusoidal positions): its state
    has no op, and the automatic cut places it without asking for a glob; the step trains like one device."""
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
            self.tower = nn.Sequential(nn.Embedding(16, 8))           # never called; frozen (sinusoidal)
            self.tower[0].weight.requires_grad_(False)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

        def forward(self, x):
            return self.model(x)

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    loss_fn = lambda m, x, y: F.mse_loss(m(x), y)      # noqa: E731
    prog = pt.partition(model, pt.Mesh({"pp": 2}), [T.pipeline("pp", 2, "1F1B", 4)], example_inputs=(x, y),
                        loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert "model.tower.0.weight" in prog.plan.pipeline.params[-1]
    train_next_to_eager(prog, ref, [(x, y)] * 2, loss_fn, adamw(1e-3), what="unused tower")


class _SharedStateless(nn.Module):
    """One activation (or dropout) module called by every layer, as HF's openai-gpt shares its act and xlnet its
    dropout."""

    def __init__(self, shared: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.act = shared

    def forward(self, x):
        for lin in self.layers:
            x = self.act(lin(x))
        return x


def test_a_stateless_module_shared_by_the_stages_runs_where_each_call_is():
    torch.manual_seed(0)
    model = _SharedStateless(nn.GELU())
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    loss_fn = lambda m, x, y: F.mse_loss(m(x), y)      # noqa: E731
    stages = [["layers.0", "layers.1", "act"], ["layers.2", "layers.3"]]
    prog = pt.partition(model, pt.Mesh({"pp": 2}), [T.pipeline("pp", stages, "1F1B", 4)], example_inputs=(x, y),
                        loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    train_next_to_eager(prog, ref, [(x, y)] * 2, loss_fn, adamw(1e-3), what="shared act")
    with pytest.raises(PartitionError, match="module 'act' has no state but draws random numbers"):
        pt.partition(_SharedStateless(nn.Dropout(0.1)), pt.Mesh({"pp": 2}), [T.pipeline("pp", stages, "1F1B", 4)],
                     example_inputs=(x, y), loss_fn=loss_fn)


def test_balanced_cut_is_contiguous():
    prog, _, _ = _partition({"pp": 2}, [T.pipeline("pp", 2, "1F1B", 2)])
    assert prog.plan.pipeline.modules == (("tok_embeddings", "layers.0", "layers.1"),
                                          ("layers.2", "layers.3", "norm", "output"))


def test_schedule_orders():
    class S:
        ranks, microbatches, chunks, n_stages = 2, 4, 1, 2
        schedule = "1F1B"

        def rank_of(self, s):
            return s % 2

        def stages_on(self, r):
            return tuple(s for s in range(self.n_stages) if self.rank_of(s) == r)
    o = rank_orders(S())
    assert [(k, j) for _, k, j in o[0]] == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2),
                                            ("B", 3), ("U", 0)]
    assert [(k, j) for _, k, j in o[1]] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3),
                                            ("B", 3), ("U", 0)]
    S.schedule, S.chunks, S.n_stages = "Interleaved1F1B", 2, 4
    o = rank_orders(S())
    for r in range(2):       # every (stage, F/B, micro-batch) of the rank's two stages exactly once
        assert sorted(o[r]) == sorted([(s, k, j) for s in (r, r + 2) for k in "FB" for j in range(4)]
                                      + [(r, "U", 0), (r + 2, "U", 0)])
    S.schedule = "ZBVZeroBubble"
    S.rank_of = lambda self, s: s if s < 2 else 3 - s
    o = rank_orders(S())
    for r in range(2):       # the V: rank r runs stages r and 3 - r, each backward as B then W
        assert sorted(o[r]) == sorted([(s, k, j) for s in (r, 3 - r) for k in "FBW" for j in range(4)]
                                      + [(min(r, 3 - r), "U", 0), (max(r, 3 - r), "U", 0)])
    # rank 0: three forwards of stage 0 to warm up, the last stage's F, B, W right after its forward; the cool-down
    # ends with stage 0's backwards, its W's filling what would be the bubble
    assert o[0][:6] == [(0, "F", 0), (0, "F", 1), (0, "F", 2), (3, "F", 0), (3, "B", 0), (3, "W", 0)]
    assert o[0][-6:-2] == [(0, "B", 2), (0, "W", 2), (0, "B", 3), (0, "W", 3)]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_each_schedule_runs_every_action_of_the_stages_it_places(name):
    """Every schedule of the table (lower/ppschedules.py): for each stage count it accepts on p ranks, each rank's
    order runs every F and B (W: split backwards) of every micro-batch of exactly the stages rank_of puts on it,
    once each; PipelineSpec.stages_on and the eval step's schedule agree with the table; the textbook bubble is in
    [0, 1)."""
    sched = SCHEDULES[name]
    assert schedule_of(name) is sched and str(sched) == name and sched.eval_schedule in SCHEDULES.values()
    kinds = "FBW" if sched.split_backward else "FB"
    accepted = 0
    for p, n, m in [(2, 2, 4), (2, 4, 4), (4, 4, 8), (4, 8, 8), (2, 6, 4)]:
        try:
            sched.check_stages(n, p, m, "pp", "PP")
        except PartitionError:
            continue
        accepted += 1
        v = n // p
        spec = PipelineSpec("pp", sched, n, p, m, {}, ((),) * n, ((),) * n)
        for r in range(p):
            mine = [s for s in range(n) if sched.rank_of(s, p) == r]
            assert list(spec.stages_on(r)) == mine and mine, (p, n, r)
            assert sorted(sched.order(r, p, m, v)) == sorted((s, k, j) for s in mine for k in kinds
                                                             for j in range(m)), (p, n, r)
        assert sorted(sched.rank_of(s, p) for s in range(n)) == sorted(list(range(p)) * v)
        assert 0 <= sched.bubble(p, m, v) < 1
        assert m % sched.eval_group(p) == 0
    assert accepted >= 2, f"{name} accepted {accepted} of the stage counts tried"
    with pytest.raises(PartitionError, match="schedule must be one of"):
        schedule_of(name.lower() + "x")


# -- refusals ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule, kw, match", [
    ([T.pipeline("pp", 3, "1F1B", 4)], {}, "one stage per rank"),
    ([T.pipeline("pp", 2, "Interleaved1F1B", 4)], {}, "v >= 2 stages per rank"),
    ([T.pipeline("pp", 4, "Interleaved1F1B", 1)], {}, "groups of the axis size"),
    ([T.pipeline("pp", 2, "ZBVZeroBubble", 4)], {}, r"exactly 2 stages per rank.*\(size 2\). Use stages=4"),
    ([T.pipeline("pp", 6, "ZBVZeroBubble", 4)], {}, r"6 stages on axis 'pp' \(size 2\). Use stages=4"),
    ([T.pipeline("pp", [["layers.*"], ["norm", "output"]], "1F1B", 4)], {}, "tok_embeddings"),
    ([T.pipeline("pp", [["layers.[2-3]", "norm", "output"], ["tok_embeddings", "layers.[0-1]"]])], {},
     "later stage"),
    ([T.pipeline("pp", 2, "1F1B", 4), T.data_parallel("pp")], {}, "pipeline axis"),
    ([T.pipeline("pp", 2, "1F1B", 4)], {"options": pt.Options(compile=True)}, "compile=True"),
    ([T.pipeline("pp", 2, "1F1B", 4)], {"options": pt.Options(measure_memory=True)}, "measure_memory"),
    ([T.pipeline("pp", 2, "1F1B", 4)], {"step": pt.StepOptions(accumulate=2)}, "accumulate=2"),
])
def test_refused_with_the_cause(schedule, kw, match):
    with pytest.raises(PartitionError, match=match):
        _partition({"pp": 2}, schedule, **kw)


@pytest.mark.parametrize("stages, schedule, match", [(3, "1F1B", "one stage per rank"),
                                                     (2, "ZBVZeroBubble", "Use stages=4")])
def test_a_stage_count_the_mesh_cannot_run_is_refused_before_the_capture(stages, schedule, match, monkeypatch):
    import partir_torch.api as api

    monkeypatch.setattr(api, "capture_for", lambda *a, **k: pytest.fail("captured before refusing"))
    with pytest.raises(PartitionError, match=match):
        _partition({"pp": 2}, [T.pipeline("pp", stages, schedule, 4)])
    with pytest.raises(PartitionError, match="axis 'stage' is not an axis of the mesh"):
        _partition({"pp": 2}, [T.pipeline("stage", 2, "1F1B", 4)])


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_dropout_masks_are_one_devices_under_pipelining(schedule, recwarn):
    """Each dropout site draws one whole-batch mask, as one device does (capture/microdraws.py), each micro-batch
    reading its samples of it: a pipelined step with dropout trains like one device, with no warning. The (B*T, d)
    activation's mask is batch-major too (folded: r = T rows per sample)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3)) for _ in range(4))

        def forward(self, x):                      # x: (B, T, d); blocks 1 and 3 run on (B*T, d)
            for i, b in enumerate(self.blocks):
                x = b(x.flatten(0, 1)).view(x.shape) if i % 2 else b(x)
            return x
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 3, 8), torch.randn(8, 3, 8)
    loss_fn = lambda m, x, y: F.mse_loss(m(x), y)
    prog = pt.partition(model, pt.Mesh({"pp": 2}), [T.pipeline("pp", 2 if schedule == "1F1B" else 4, schedule)],
                        example_inputs=(x, y), loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters()))
    assert not [w for w in recwarn if "random" in str(w.message)], [str(w.message) for w in recwarn]
    train_next_to_eager(prog, ref, [(x, y)] * 2, loss_fn, adamw(1e-3), what=schedule)


def test_draws_of_another_kind_warn_that_they_differ_from_one_device():
    """A draw that is not a mask of a batch-major activation (here a factory, torch.randn) stays per micro-batch,
    and the pipeline says so."""
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            return self.blocks[1](self.blocks[0](x) + torch.randn(8))
    model, x = Noisy(), torch.randn(8, 8)
    with pytest.warns(UserWarning, match=r"draws random numbers per micro-batch \(aten.randn"):
        pt.partition(model, pt.Mesh({"pp": 2}), [T.pipeline("pp", 2, "1F1B", 4)],
                     example_inputs=(x, x), loss_fn=lambda m, x, y: F.mse_loss(m(x), y),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_automatic_cut_refusal_names_what_the_user_gave():
    """A module outside the blocks that runs between them (`mix`, after block 0) joins the last stage, and the
    balanced cut puts block 1 on stage 0 (blocks 2 and 3 are heavy), which would read stage 1: the message says the
    cut was automatic and proposes the stages it chose to start from, instead of asking to reorder globs the user
    never wrote."""
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            heavy = [nn.Sequential(nn.Linear(8, 256), nn.Linear(256, 8)) for _ in range(2)]
            self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)] + heavy)
            self.mix = nn.Linear(8, 8)

        def forward(self, x):
            x = self.mix(self.blocks[0](x))
            for b in self.blocks[1:]:
                x = b(x)
            return x
    model, x = Mixed(), torch.randn(8, 8)
    with pytest.raises(PartitionError, match=r"stage 0\) reads .* later stage 1.*stages=2 cut the model "
                                             r"automatically.*stages=\[\['blocks.0', 'blocks.1', 'blocks.2'\], "
                                             r"\['blocks.3', 'mix'\]\]") as e:
        pt.partition(model, pt.Mesh({"pp": 2}), [T.pipeline("pp", 2, "1F1B", 4)], example_inputs=(x, x),
                     loss_fn=lambda m, x, y: F.mse_loss(m(x), y), optimizer=torch.optim.SGD(model.parameters(), 0.1))
    assert "Reorder" not in str(e.value)


def test_unknown_schedule():
    with pytest.raises(PartitionError, match="GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble"):
        T.pipeline("pp", 2, "ZeroBubble")


# -- inspection and simulation -------------------------------------------------------------------------------------
def test_summary_has_the_stage_split():
    prog, _, _ = _partition({"pp": 2, "dp": 2}, [T.pipeline("pp", 2, "1F1B", 4), T.data_parallel("dp")])
    text = prog.summary()
    assert "pipeline on axis 'pp': 2 stages, 1F1B, 4 micro-batches" in text
    # per micro-batch and direction one activation of 8 / 4 micro-batches / 2 dp ranks = 1 row of 16 x 32 fp32 (2 KiB)
    low = prog.plan.annotated_lowered()
    sent = [n for n in low.gm.graph.nodes if n.target is pp_transfer]
    assert len(sent) == 8 and all(tuple(n.meta["val"].shape) == (1, 16, 32) for n in sent)
    assert "2.00 KiB" in text


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class _Stack(nn.Module):
    """Equal blocks; the scale in front makes the first block compute its input gradient as the others do."""

    def __init__(self, d, n):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))

    def forward(self, x):
        x = x * self.scale
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("p, m, v, schedule", [(4, 8, 1, "1F1B"), (4, 8, 1, "GPipe"), (2, 4, 2, "Interleaved1F1B"),
                                                (4, 8, 2, "Interleaved1F1B")])
def test_simulated_bubble_matches_the_textbook(p, m, v, schedule):
    """Equal stages whose transfers are small next to their compute (an interleaved bubble is small, so the transfers'
    latency weighs more in it: d = 8192)."""
    d, rows = (2048, 2048) if v == 1 else (8192, 512)
    with torch.device("meta"):
        model = _Stack(d, (4 if v == 1 else 2) * p * v)
        x, y = torch.randn(m * rows, d), torch.randn(m * rows, d)
    prog = pt.partition(model, pt.Mesh({"pp": p}), [T.pipeline("pp", p * v, schedule, m)], example_inputs=(x, y),
                        loss_fn=lambda mod, x, y: F.mse_loss(mod(x), y),
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    rep = prog.simulate(pt.sim.hardware("h100", gpus_per_node=p))
    sim = rep.pipeline
    assert sim.formula == pytest.approx((p - 1) / (v * m + p - 1))
    assert abs(sim.bubble / sim.formula - 1) < 0.05, (sim.bubble, sim.formula)
    assert sim.transfers == 2 * m * (p * v - 1)
    assert "bubble" in rep.table() and "slowest stage" in rep.table()
    # each rank's step split: no collective, so nothing exposed; its compute is its forward/backward busy time and its
    # update; the rest (the bubble) idle
    assert sim.exposed_s == [0.0] * p and "pipeline rank 0: step" in rep.table()
    for r in range(p):
        assert sim.busy_s[r] <= sim.compute_s[r] * (1 + 1e-9) and sim.compute_s[r] < sim.step_s[r]
    if schedule == "1F1B":   # the first stage holds p micro-batches' activations, the last one (GPipe: m on each)
        assert sim.peak_bytes[0] > 1.5 * sim.peak_bytes[-1]


def test_zbv_simulated_bubble_well_below_1f1b():
    """Uniform stages (each block's input- and weight-gradient matmuls cost the same: B = W) and transfers small next
    to their compute: ZB-V's W actions fill the bubble, so its simulated bubble at p = 2, m = 8 is under a quarter of
    1F1B's on the same model (benchmarks/pipeline_bubble.py: 1.6% against 11.4%); each rank does the same work (its
    W actions counted as backward)."""
    p, m, d, rows = 2, 8, 4096, 1024
    sims = {}
    for schedule, stages in (("1F1B", p), ("ZBVZeroBubble", 2 * p)):
        with torch.device("meta"):
            model = _Stack(d, 4 * p)
            x, y = torch.randn(m * rows, d), torch.randn(m * rows, d)
        prog = pt.partition(model, pt.Mesh({"pp": p}), [T.pipeline("pp", stages, schedule, m)],
                            example_inputs=(x, y), loss_fn=lambda mod, x, y: F.mse_loss(mod(x), y),
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        sims[schedule] = prog.simulate(pt.sim.hardware("h100", gpus_per_node=p)).pipeline
    zbv, f1b = sims["ZBVZeroBubble"], sims["1F1B"]
    assert zbv.formula == 0.0 and abs(f1b.bubble / f1b.formula - 1) < 0.05
    assert zbv.bubble < 0.25 * f1b.bubble, (zbv.bubble, f1b.bubble)
    assert sum(zbv.busy_s) == pytest.approx(sum(f1b.busy_s), rel=0.02)
    assert zbv.transfers == 2 * m * (2 * p - 1 - 1)        # stages 1 -> 2 (and back) stay on rank 1
