"""Propagation golden tests (DESIGN §4): Megatron from weight seeds only, BP then ZeRO-3 on one axis, a golden
annotated print, explain() strings, recorded conflicts, and linear cost."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import partir_torch as pt
from examples.models import get
from tests.harness import train_next_to_eager
from partir_torch.capture import capture

aten = torch.ops.aten
SHARED = pytest.mark.xdist_group("propagation_programs")   # under xdist: one worker builds the module's programs
B, T, D, H, LAYERS = 4, 16, 32, 4, 2          # the zoo GPT's defaults (batch 4)
HD = D // H


def megatron(axis="model", name="MP"):
    """Column-parallel wq/wk/wv/w1 (weight dim 0 and bias), row-parallel wo/w2 (weight dim 1): weights only."""
    return pt.ManualPartition({
        "params.layers.*.attn.w[qkv].weight": 0, "params.layers.*.attn.w[qkv].bias": 0,
        "params.layers.*.mlp.w1.weight": 0, "params.layers.*.mlp.w1.bias": 0,
        "params.layers.*.attn.wo.weight": 1, "params.layers.*.mlp.w2.weight": 1,
    }, axis=axis, name=name)


def bp(axis="batch", name="BP"):
    return pt.ManualPartition({"inputs.*": 0}, axis=axis, name=name)


def zero3(axis="batch", name="Z3"):
    def dim0(name, shape, k=2):
        return 0 if shape and shape[0] % k == 0 else None
    return pt.ManualPartition({"params.*": dim0, "opt.*": dim0}, axis=axis, name=name)


def gpt_program(attention, mesh, schedule, layers=LAYERS):
    spec = get("gpt", attention=attention, layers=layers)
    model = spec.build()
    return pt.partition(model, mesh, schedule, example_inputs=spec.batch(B), loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))


def node_sharding(prog, node):
    return prog.sharding_of_vid(prog.graph.vid[node])


def head_split(prog, tag):
    """The (B, H, T, hd) tensor that attention reads, reached from a projection's output tag through the head
    reshape and transpose."""
    frontier = [prog.captured.names[tag]]
    for _ in range(3):
        frontier = [u for n in frontier for u in n.users]
        for n in frontier:
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and tuple(v.shape) == (B, H, T, HD):
                return n
    raise AssertionError(f"no (B, H, T, hd) tensor after {tag}")


def row_product(prog, tag):
    """The matmul inside a Linear's output: tag -> view -> add(bias) -> mm."""
    n = prog.captured.names[tag]
    while n.target != aten.mm.default:
        n = n.args[0]
    return n


def nodes(prog, target):
    return [n for n in prog.graph.gm.graph.nodes if n.target == target]


def adam_grad(prog, fqn):
    """The gradient the AdamW update reads: exp_avg' = lerp(exp_avg, grad, 1 - beta1)."""
    ph = prog.captured.names[f"opt.exp_avg.{fqn}"]
    (lerp,) = [u for u in ph.users if u.target in (aten.lerp.Scalar, aten.lerp.Tensor)]
    return lerp.args[1]


def has_axis(sharding, axis):
    return any(axis in axes for axes in sharding.dims)


MESHES = {"model": ({"model": 2}, lambda: [megatron()]),
          "batch+model": ({"batch": 2, "model": 2}, lambda: [bp(), megatron()])}


@pytest.fixture(scope="module", params=[(a, m) for a in ("sdpa", "matmul") for m in MESHES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def megatron_prog(request):
    attention, mesh_name = request.param
    shape, schedule = MESHES[mesh_name]
    return attention, mesh_name, gpt_program(attention, pt.Mesh(shape), schedule())


# -- (a) Megatron from weight seeds only ------------------------------------------------------------------------
@SHARED
def test_megatron_weights_and_mlp(megatron_prog):
    attention, mesh_name, prog = megatron_prog
    batch = ("batch",) if mesh_name == "batch+model" else ()
    for i in range(LAYERS):
        biases = [f"params.layers.{i}.{w}.bias" for w in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1")]
        biases = [b for b in biases if b in prog.graph.name_to_vid]     # the zoo GPT has no key bias
        assert len(biases) >= 3
        for b in biases:
            assert prog.sharding(b).dims == (("model",),)
        for w in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1"):
            assert prog.sharding(f"params.layers.{i}.{w}.weight").dims == (("model",), ())
            assert prog.sharding(f"opt.exp_avg.layers.{i}.{w}.weight").dims == (("model",), ())   # tied state
        for w in ("attn.wo", "mlp.w2"):
            assert prog.sharding(f"params.layers.{i}.{w}.weight").dims == ((), ("model",))
            assert prog.sharding(f"params.layers.{i}.{w}.bias").dims == ((),)       # added after the reduction
        # MLP hidden activation: column-parallel output tiled on its last dim (and gelu keeps it)
        h = prog.sharding(f"layers.{i}.mlp.w1:out")
        assert h.dims == (batch, (), ("model",)) and not h.partial
        gelu = [u for u in prog.captured.names[f"layers.{i}.mlp.w1:out"].users if u.target == aten.gelu.default]
        assert node_sharding(prog, gelu[0]).dims == (batch, (), ("model",))
        # row-parallel products are pending sums on "model"; the bias is added once, after the reduction
        # (capture splits addmm into mm + add), so the module output itself is whole on "model"
        for w in ("attn.wo", "mlp.w2"):
            product = row_product(prog, f"layers.{i}.{w}:out")
            s = node_sharding(prog, product)
            assert s.partial == (("model", "sum"),) and s.dims == (batch, ()), (w, s)
            s = prog.sharding(f"layers.{i}.{w}:out")
            assert s.dims == (batch, (), ()) and s.partial_op("model") is None, (w, s)
        # layer norms see whole rows: never tiled on "model"
        for ln in ("ln1", "ln2"):
            s = prog.sharding(f"layers.{i}.{ln}:out")
            assert s.dims == (batch, (), ()) and not s.partial
    assert prog.sharding("ln_f:out").dims == (batch, (), ())
    assert not has_axis(prog.sharding("params.wte.weight"), "model")


@SHARED
def test_megatron_attention_heads(megatron_prog):
    attention, mesh_name, prog = megatron_prog
    batch = ("batch",) if mesh_name == "batch+model" else ()
    for i in range(LAYERS):
        for w in ("wq", "wk", "wv"):
            assert prog.sharding(f"layers.{i}.attn.{w}:out").dims == (batch, (), ("model",))
            # after the head reshape + transpose: (B, H, T, hd) with the head dim tiled
            assert node_sharding(prog, head_split(prog, f"layers.{i}.attn.{w}:out")).dims == \
                (batch, ("model",), (), ())
    if attention == "sdpa":
        fwd = nodes(prog, aten._scaled_dot_product_flash_attention_for_cpu.default)
        bwd = nodes(prog, aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
        assert len(fwd) == len(bwd) == LAYERS
        for n in fwd + bwd:
            for g in n.users:   # attention output, logsumexp; dq, dk, dv: heads tiled
                assert node_sharding(prog, g).dims[:2] == (batch, ("model",)), (n.name, g.name)
    else:
        # torch's 4-D matmul runs as bmm on (B*H, T, .): the merged dim holds H as its minor factor, so "model"
        # tiles it strided (split factor B: rows b*H + h with h in this rank's heads), and the scores, the mask
        # and the softmax (forward and backward) are tiled on heads like sdpa's
        bmms = nodes(prog, aten.bmm.default)
        assert len(bmms) == 6 * LAYERS                    # 2 forward, 4 backward per layer
        for n in bmms:
            sh = node_sharding(prog, n)
            assert sh.dims[0] == batch + ("model",) and sh.strides == (("model", B),), (n.name, sh)
            assert str(sh).startswith("[{" + "".join(a + ", " for a in batch) + f"model:s{B}}}")
        softmax = nodes(prog, aten._softmax.default) + nodes(prog, aten._softmax_backward_data.default)
        assert len(softmax) == 2 * LAYERS
        for n in softmax:
            assert node_sharding(prog, n).dims == (batch, ("model",), (), ()), n.name
    assert prog.conflicts == []
    # the attention output, back in (B, T, d) before wo: tiled on its last dim (heads x hd)
    for i in range(LAYERS):
        wo_in = row_product(prog, f"layers.{i}.attn.wo:out").args[0]
        assert node_sharding(prog, wo_in).dims == (batch, ("model",))   # (B*T, d) operand of wo's mm


@SHARED
def test_megatron_backward_mirrors_forward(megatron_prog):
    attention, mesh_name, prog = megatron_prog
    for i in range(LAYERS):
        for w in ("attn.wq", "mlp.w1"):
            g = node_sharding(prog, adam_grad(prog, f"layers.{i}.{w}.weight"))
            assert g.dims == (("model",), ()) and g.partial_op("model") is None
        for w in ("attn.wo", "mlp.w2"):
            g = node_sharding(prog, adam_grad(prog, f"layers.{i}.{w}.weight"))
            assert g.dims == ((), ("model",)) and g.partial_op("model") is None
        g = node_sharding(prog, adam_grad(prog, f"layers.{i}.ln1.weight"))
        assert not has_axis(g, "model") and g.partial_op("model") is None
    # dx of the column-parallel matmuls (q, k, v summed; w1) is a pending sum on "model" when it reaches the
    # layer norm's backward: two reductions backward per layer, none for ln_f (its gradient comes from the head)
    batch = ("batch",) if mesh_name == "batch+model" else ()
    ln_bwd = nodes(prog, aten.native_layer_norm_backward.default)
    assert len(ln_bwd) == 2 * LAYERS + 1
    grads_in = [node_sharding(prog, n.args[0]) for n in ln_bwd]
    assert [g.partial_op("model") for g in grads_in].count("sum") == 2 * LAYERS
    assert all(g.dims == (batch, (), ()) for g in grads_in)
    if mesh_name == "batch+model":
        # data parallel: weight gradients are pending sums over "batch"
        g = node_sharding(prog, adam_grad(prog, "layers.0.attn.wq.weight"))
        assert g.partial == (("batch", "sum"),)


def test_megatron_stages():
    prog = gpt_program("sdpa", pt.Mesh({"batch": 2, "model": 2}), [bp(), megatron()])
    assert [(s.tactic, s.axis) for s in prog.stages] == [("BP", "batch"), ("MP", "model")]
    assert prog.stages[0].shardings["layers.0.mlp.w1:out"].dims == (("batch",), (), ())
    assert prog.stages[1].shardings["layers.0.mlp.w1:out"].dims == (("batch",), (), ("model",))
    assert prog.stages[0].shardings["params.layers.0.mlp.w1.weight"].is_replicated()
    assert all(s.decided > 0 and s.conflicts == () for s in prog.stages)
    summary = prog.summary()
    assert "BP" in summary and "MP" in summary and "model" in summary


# -- (b) BP then ZeRO-3 on the same axis -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bp_z3():
    return gpt_program("sdpa", pt.Mesh({"batch": 2}), [bp(), zero3()])


@SHARED
def test_bp_then_zero3(bp_z3):
    prog = bp_z3
    before, after = prog.stages
    # parameters and optimizer state tiled on dim 0 where 2 divides it (every GPT parameter here)
    for name, s in after.shardings.items():
        if name.startswith(("params.", "opt.")):
            assert s.dims[0] == ("batch",), name
            assert before.shardings[name].is_replicated(), name
    # activations tiled on the batch dim, by BP
    for name in ("wte:out", "layers.0.attn.wq:out", "layers.1.mlp.w1:out", "ln_f:out"):
        assert after.shardings[name].dims[0] == ("batch",)
    # weight gradients: pending sums over "batch" before the update (lowering reduce-scatters them)
    for fqn in ("layers.0.attn.wq.weight", "layers.1.mlp.w2.weight", "wte.weight", "layers.0.ln1.bias"):
        assert node_sharding(prog, adam_grad(prog, fqn)).partial == (("batch", "sum"),), fqn
    # earlier decisions are frozen: everything BP decided is unchanged after Z3
    decided = [n for n, s in before.shardings.items() if not s.is_replicated()]
    assert len(decided) > 20
    assert all(after.shardings[n] == before.shardings[n] for n in decided)
    assert after.decided > 0 and before.decided > 0


@SHARED
def test_bp_then_zero3_update_runs_on_shards(bp_z3):
    # the update takes the tiled state and the partial gradient: Z3 decides it tiled (lowering reduce-scatters
    # the gradient into it), without touching the gradient BP made partial
    prog = bp_z3
    for fqn in ("layers.0.attn.wq.weight", "layers.1.mlp.w1.bias"):
        ph = prog.captured.names[f"opt.exp_avg.{fqn}"]
        (lerp,) = [u for u in ph.users if u.target in (aten.lerp.Scalar, aten.lerp.Tensor)]
        assert node_sharding(prog, lerp).dims[0] == ("batch",)
        assert node_sharding(prog, lerp.args[1]).partial == (("batch", "sum"),)
        i = prog.graph.vid[lerp]
        assert prog.decisions.provenance("batch", i).tactic == "Z3"
    assert not [c for c in prog.conflicts if c.op == "aten.lerp.Scalar"]


# -- (c) golden text ---------------------------------------------------------------------------------------------
class TwoLayerMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


GOLDEN = """\
# mesh Mesh(x=2); schedule: MP[x]
%arg0_1: [8, 4] = input params.fc1.weight  # [{x}, {}]
%arg1_1: [8] = input params.fc1.bias  # [{x}]
%arg2_1: [4, 8] = input params.fc2.weight  # [{}, {x}]
%arg3_1: [4] = input params.fc2.bias  # [{}]
%arg4_1: [2, 4] = input inputs.0  # [{}, {}]
%t: [4, 8] = aten.t.default(%arg0_1)  # [{}, {x}]
%mm: [2, 8] = aten.mm.default(%arg4_1, %t)  # [{}, {x}]
%add: [2, 8] = aten.add.Tensor(%mm, %arg1_1)  # [{}, {x}]  (fc1:out)
%relu: [2, 8] = aten.relu.default(%add)  # [{}, {x}]
%t_1: [8, 4] = aten.t.default(%arg2_1)  # [{x}, {}]
%mm_1: [2, 4] = aten.mm.default(%relu, %t_1)  # [{}, {}] partial(sum)={x}
%add_1: [2, 4] = aten.add.Tensor(%mm_1, %arg3_1)  # [{}, {}]  (fc2:out)
return [add_1]"""


DEVICE_GOLDEN = """\
# per-device program on mesh Mesh(x=2); schedule: MP[x]
%arg0_1: f32[4, 4] = input params.fc1.weight
%arg1_1: f32[4] = input params.fc1.bias
%arg2_1: f32[4, 4] = input params.fc2.weight
%arg3_1: f32[4] = input params.fc2.bias
%arg4_1: f32[2, 4] = input inputs.0
%coord_x: i64[] = input coord.x
%t_default: f32[4, 4] = t(%arg0_1)  # [{}, {x}]
%mm_default: f32[2, 4] = mm(%arg4_1, %t_default)  # [{}, {x}]
%add_tensor: f32[2, 4] = add.Tensor(%mm_default, %arg1_1)  # [{}, {x}]
%relu_default: f32[2, 4] = relu(%add_tensor)  # [{}, {x}]
%t_default_1: f32[4, 4] = t(%arg2_1)  # [{x}, {}]
%mm_default_1: f32[2, 4] = mm(%relu_default, %t_default_1)  # [{}, {}] partial(sum)={x}
%all_reduce_default: f32[2, 4] = all_reduce(%mm_default_1, 'sum', 'partir_x')  # all_reduce(sum) on 'x' (x2) 32 B <- MP, for mm_1
%wait_tensor_default: f32[2, 4] = wait_tensor(%all_reduce_default)
%add_tensor_1: f32[2, 4] = add.Tensor(%wait_tensor_default, %arg3_1)  # [{}, {}]
return (add_tensor_1,)"""


def test_golden_annotated_print():
    torch.manual_seed(0)
    prog = pt.partition(TwoLayerMLP(), pt.Mesh({"x": 2}),
                        [pt.ManualPartition({"params.fc1.*": 0, "params.fc2.weight": 1}, axis="x", name="MP")],
                        example_inputs=(torch.randn(2, 4),))
    assert prog.annotated() == GOLDEN          # the captured (global) graph with each value's sharding
    assert str(prog) == DEVICE_GOLDEN          # print(prog): the per-device program with its collectives


# -- (d) explain -------------------------------------------------------------------------------------------------
@SHARED
def test_explain_names_tactic_and_path(megatron_prog):
    attention, mesh_name, prog = megatron_prog
    seeded = prog.explain("params.layers.0.attn.wq.weight")
    assert seeded.splitlines()[0] == "params.layers.0.attn.wq.weight: [{model}, {}]  shape (32, 32)"
    assert "  axis 'model': tiled(dim 0) by tactic MP: seeded" in seeded.splitlines()
    h = prog.explain("layers.0.mlp.w1:out")
    line = next(x for x in h.splitlines() if x.startswith("  axis 'model'"))
    assert line.startswith("  axis 'model': tiled(dim 2) by MP via aten.view.default")
    assert "from params.layers.0.mlp.w1." in line and line.endswith("(seeded by MP)")
    if mesh_name == "batch+model":
        assert "  axis 'batch': replicated (no tactic decided it)" in seeded.splitlines()
        assert "axis 'batch': tiled(dim 0) by BP via" in h
    else:
        assert "axis 'batch'" not in h and len(h.splitlines()) == 2


def test_explain_partial_value():
    spec = get("mlp")
    prog = pt.partition(spec.build(), pt.Mesh({"batch": 2}), [bp()], example_inputs=spec.batch(4),
                        loss_fn=spec.loss_fn)
    text = prog.explain("grads.fc1.weight")
    assert text.splitlines()[0] == "grads.fc1.weight: [{}, {}] partial(sum)={batch}  shape (64, 16)"
    assert "axis 'batch': partial(sum) by BP via " in text and "aten.mm.default" in text
    assert text.endswith("from inputs.0 (seeded by BP)")
    with pytest.raises(pt.PartitionError, match="grads.fc1.weight"):
        prog.explain("grads.fc1.weigth")


# -- (e) conflicts -----------------------------------------------------------------------------------------------
def test_conflict_when_operands_demand_different_factors():
    model = nn.Linear(8, 8, bias=False)                  # y = x @ W.T: mm(x, t(W))
    prog = pt.partition(model, pt.Mesh({"x": 2}),
                        [pt.ManualPartition({"inputs.0": 1, "params.weight": 0}, axis="x", name="T")],
                        example_inputs=(torch.randn(4, 8),))
    (c,) = prog.conflicts
    mm = nodes(prog, aten.mm.default)[0]
    assert (c.node, c.op, c.axis, c.tactic) == (mm.name, "aten.mm.default", "x", "T")
    states = {v: (s, t) for v, s, t in c.states}
    assert states["inputs.0"] == ("tiled(dim 1)", "T")              # contracting factor k
    assert ("tiled(dim 1)", "T") in [states[v] for v in states if v != "inputs.0"]   # t(W): factor n
    assert "different factors" in c.reason
    assert f"at {mm.name}" in str(c) and "aten.mm.default" in str(c)
    # propagation stopped there: the result is left undecided (replicated)
    assert node_sharding(prog, mm).is_replicated()
    assert prog.stages[0].conflicts == (c,)


def test_conflict_on_need_replication_factor():
    class SoftmaxHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x).softmax(-1)

    prog = pt.partition(SoftmaxHead(), pt.Mesh({"x": 2}),
                        [pt.ManualPartition({"params.fc.weight": 0}, axis="x", name="col")],
                        example_inputs=(torch.randn(4, 8),))
    (c,) = prog.conflicts
    assert (c.op, c.tactic) == ("aten._softmax.default", "col") and "whole" in c.reason
    assert prog.sharding("fc:out").dims == ((), ("x",))


# -- (f) linear cost ---------------------------------------------------------------------------------------------
def test_propagation_cost_is_linear():
    """Everything pt.partition does after capture (plan(): rule graph, BP + MP + Z3, one stage each), for 4 and 16
    layers: best of 3 interleaved runs, in CPU seconds (robust to neighbours on a shared machine)."""
    from partir_torch.plan import plan
    mesh = pt.Mesh({"batch": 2, "model": 2})
    steps = {}
    for layers in (4, 16):
        spec = get("gpt", attention="sdpa", layers=layers)
        model = spec.build(device="meta")
        tokens = torch.zeros(B, T, dtype=torch.long, device="meta")
        opt = torch.optim.AdamW(model.parameters())
        steps[layers] = (model, (tokens, tokens), spec.loss_fn, opt, capture(model, (tokens, tokens), spec.loss_fn, opt))
    best = {4: float("inf"), 16: float("inf")}
    for _ in range(3):
        for layers, (model, batch, loss_fn, opt, cap) in steps.items():
            c0 = time.process_time()
            p = plan(cap, mesh, [bp(), megatron(), zero3()])
            best[layers] = min(best[layers], time.process_time() - c0)
            assert p.captured is cap and len(p.stages) == 3
    n4, n16 = (len(steps[k][4].gm.graph.nodes) for k in (4, 16))
    assert 3.5 < n16 / n4 < 4.5
    assert best[16] / best[4] < 6, f"4 layers: {best[4]:.3f} s, 16 layers: {best[16]:.3f} s"


class _Routed(nn.Module):
    """x (B, D) -> per-expert buffers (B, E, Dh) -> expert matmul with w (E, Dh, H) -> sum over experts, plus a
    skip path (as the residual stream of an MoE block)."""

    def __init__(self, d=8, e=4, dh=6, h=5):
        super().__init__()
        self.proj = nn.Linear(d, e * dh, bias=False)
        self.skip = nn.Linear(d, h)
        self.w = nn.Parameter(torch.randn(e, dh, h) * 0.1)
        self.e, self.dh = e, dh

    def forward(self, x):
        buf = self.proj(x).reshape(x.shape[0], self.e, self.dh)
        return self.skip(x) + torch.einsum("bed,edh->beh", buf, self.w).sum(1)


class _ClosedExperts:
    """Seeds w's expert dim on "a" and propagates closed (what expert_parallel does for buffer models)."""
    axis, name = "a", "C"

    def apply(self, ctx):
        self.changed = ctx.seed_and_propagate("a", [("params.w", 0)], self.name, closed=True)


def test_closed_region_is_sealed_and_lowered_with_all_to_all():
    """A closed run decides only ops whose every operand and result holds the seeded factor (the expert matmul,
    the views of its buffer, w's update) and seals the values it set; a later tactic on the same axis (BP) decides
    the projection and the expert sum around the sealed values, which lowering exchanges by all_to_all."""
    torch.manual_seed(0)
    model = _Routed()
    x = torch.randn(4, 8)
    closed = _ClosedExperts()
    ref = __import__("copy").deepcopy(model)
    loss_fn = lambda m, x: m(x).pow(2).mean()   # noqa: E731
    prog = pt.partition(model, pt.Mesh({"a": 2}), [closed, bp("a")], example_inputs=(x,), loss_fn=loss_fn,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), options=pt.Options(bucket_bytes=0))
    assert prog.conflicts == []
    d, g = prog.decisions, prog.graph
    decided_by_c = {g.ops[i].node.target for i in range(len(g.ops)) if d.op_tactic(i, "a") == "C"}
    assert aten.bmm.default in decided_by_c and aten.mm.default not in decided_by_c
    assert all(d.is_sealed(c, "a") for c in closed.changed)
    assert prog.sharding("params.w").dims[0] == ("a",) and prog.sharding("inputs.0").dims[0] == ("a",)
    kinds = [(r.kind, r.phase) for r in prog.collectives()]
    # forward: the buffer into the region, the expert output out of it; backward: their gradients
    assert kinds.count(("all_to_all", "forward")) == 2 and kinds.count(("all_to_all", "backward")) == 2
    assert not any(k == "all_gather" for k, _ in kinds)
    train_next_to_eager(prog, ref, [(x,)] * 2, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.1))
