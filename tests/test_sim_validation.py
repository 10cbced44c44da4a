"""The simulator's reference table, its split, the confidence column and the per-axis comm streams."""
import pytest
import torch

from examples.zoo import sim_reference as R
from examples.zoo import sim_validation as V
from partir_torch.mesh import Mesh
from partir_torch.sim import collective_time, hardware, simulate_graph
from partir_torch.sim import confidence as C
from partir_torch.sim.synthetic import GraphBuilder, synthetic_train_step


def test_reference_rows_have_sources_and_the_split_is_disjoint():
    R.check()
    assert len(R.ROWS) >= 40 and all(r.source and r.measured > 0 for r in R.ROWS)
    cal = {r.name for r in R.ROWS if R.split_of(r) == "cal"}
    val = {r.name for r in R.ROWS if R.split_of(r) == "val"}
    assert cal and val and not cal & val and cal | val == {r.name for r in R.ROWS}
    # split by family: no family has rows in both halves
    fam_halves = {}
    for r in R.ROWS:
        fam_halves.setdefault(r.family, set()).add(R.split_of(r))
    assert all(len(h) == 1 for h in fam_halves.values())


def test_fit_sees_only_the_calibration_half(monkeypatch):
    seen = []
    real = V.predict
    monkeypatch.setattr(V, "predict", lambda r, knobs=None: seen.append(r.name) or real(r, knobs))
    rows = [r for r in R.ROWS if r.kind != "training"]
    cal = [r for r in rows if R.split_of(r) == "cal"]
    V.fit(cal, {}, passes=1)
    assert seen and {R.split_of(next(r for r in rows if r.name == n)) for n in seen} == {"cal"}


def test_kernel_rows_fit_kernel_knobs_only():
    """Kernel and collective rows move the kernel knobs; the training knobs (sustained clock, contention, TPU MXU
    efficiency, launch overhead) keep their starting values until training rows are in the fit."""
    rows = [r for r in R.ROWS if r.kind != "training" and R.split_of(r) == "cal"]
    knobs = V.fit(rows, {}, passes=1)
    start = V.fit([], {}, passes=1)
    assert set(knobs) == set(V.KNOBS)
    assert all(knobs[k] == start[k] for k, (_, by) in V.KNOBS.items() if by == "training")
    assert V._hw({"preset": "tpu-v5e"}, {"tpu_mm_efficiency": 0.9}).mm_efficiency == 0.9
    assert V._hw({"preset": "h100"}, {"tpu_mm_efficiency": 0.9}).mm_efficiency == hardware("h100").mm_efficiency


def test_known_collective_row_within_its_family_error():
    row = next(r for r in R.ROWS if r.name == "h100 8x all_reduce ring 8 GiB (GTC)")
    e = abs(V.err(V.predict(row), row.measured))
    assert e <= C.FAMILY_ERROR[row.family] and e < 0.02


def test_kendall_tau():
    assert V.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert V.kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert V.kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)


def test_strategy_from_tactics():
    assert C.strategy_of(["BP", "Z3"]) == "fsdp"
    assert C.strategy_of(["BP", "MP"]) == "tp"
    assert C.strategy_of(["MP", "Z3", "BP"]) == "fsdp+tp"
    assert C.strategy_of(["BP-dcn", "BP"]) == "dp"
    assert C.strategy_of([]) == "single"


def test_a_pipelined_program_is_judged_by_the_pipelined_runs():
    """The confidence of a pipelined program comes from the validated pipelined family (Megatron-Core's TP x PP
    rows), not from the SPMD family of its stages."""
    assert C.pipelined("tp") == C.pipelined("fsdp+tp") == "tp+pp"
    assert C.closest_family("h100", C.pipelined("tp")) == ("h100/tp+pp", C.FAMILY_ERROR["h100/tp+pp"])
    assert C.closest_family("h100", C.pipelined("dp"))[0] == "h100/tp+pp"
    assert C.closest_family("h100", "tp")[0] == "h100/tp"


def test_strategy_comes_from_the_families_tactic_classes_declare(monkeypatch):
    """A tactic class of the user's, declared tensor parallel under its own name, makes a tensor-parallel program;
    the same name undeclared counts as data parallel."""
    from dataclasses import dataclass

    from partir_torch.contract import TACTIC_FAMILY
    from partir_torch.tactics import base

    assert C.strategy_of(["BP", "TP"]) == "dp"
    monkeypatch.setattr(base, "MACRO_TACTICS", list(base.MACRO_TACTICS))
    monkeypatch.setitem(TACTIC_FAMILY, "TP", "")            # removed again after the test

    @base.declare("megatron")
    @dataclass(frozen=True)
    class TensorParallel(base.TacticBase):
        axis: str = "model"
        name: str = "TP"

        def apply(self, ctx) -> None: ...

    assert TensorParallel.family == "megatron" and not TensorParallel.macro
    with pytest.raises(TypeError, match="deriving from tactics.base.TacticBase"):    # else its family goes unread
        base.declare("megatron")(dataclass(frozen=True)(type("Loose", (), {"__annotations__": {"axis": str}})))
    assert C.strategy_of(["BP", "TP"]) == "tp" and C.strategy_of(["TP-inner", "Z3"]) == "fsdp+tp"
    assert base.MACRO_TACTICS == [t for t in base.MACRO_TACTICS if t.macro]


def test_the_presets_declare_their_families_and_macro_actions():
    from partir_torch import tactics as T
    from partir_torch.tactics.base import MACRO_TACTICS

    assert [T.data_parallel().family, T.megatron().family, T.zero(2).family, T.expert_parallel().family,
            T.sequence_parallel().family, T.ManualPartition({"inputs.*": 0}, axis="batch").family] == \
        ["data_parallel", "megatron", "zero2", "expert", "sequence", "manual"]
    # context parallelism: the automatic search's preset for a long self-attention (tactics/cp.py)
    assert MACRO_TACTICS == [T.DataParallel, T.Megatron, T.Zero, T.ExpertParallel, T.ContextParallel]
    assert T.context_parallel("cp", seq_dim=1).family == "context_parallel"
    assert not T.SequenceParallel.macro and not T.MultiQuery.macro and not T.EmbeddingSharding.macro


def test_closest_family_falls_back_to_the_nearest_chip(monkeypatch):
    monkeypatch.setattr(C, "FAMILY_ERROR", {"h100/fsdp": 0.11, "a100/fsdp": 0.05, "h100/tp": 0.3})
    assert C.closest_family("h200", "fsdp") == ("h100/fsdp", 0.11)      # same strategy, nearest chip
    assert C.closest_family("a100-40g", "fsdp") == ("a100/fsdp", 0.05)   # exact family
    assert C.closest_family("h100", "fsdp+tp") == ("h100/tp", 0.3)       # neighbouring strategy, same chip
    monkeypatch.setattr(C, "FAMILY_ERROR", {})
    assert C.closest_family("h100", "fsdp") == ("", None)


def test_table_shows_the_closest_family_error():
    mesh = Mesh({"batch": 2, "model": 4})
    rep = simulate_graph(synthetic_train_step(mesh, layers=2), mesh, hardware("h100"))
    fam, e = C.closest_family("h100", "tp")                 # MP on "model" and BP on "batch": tensor parallel
    assert fam and rep.confidence_family == fam and rep.confidence == e == C.FAMILY_ERROR[fam]
    head, row = rep.table().splitlines()[1], rep.table().splitlines()[3]
    assert "confidence" in head and f"±{100 * e:.0f}% ({fam})" in row


def test_collectives_on_different_axes_overlap():
    """Each mesh axis has its own comm stream: a tensor-parallel and a data-parallel collective issued together
    take the longer of the two, not their sum."""
    mesh = Mesh({"dp": 2, "tp": 4})
    hw = hardware("h100")
    b = GraphBuilder(mesh)
    x = b.input("x", (4096, 4096), "input", torch.bfloat16)
    g = b.input("g", (4096, 4096), "input", torch.bfloat16)
    c1, c2 = b.collective("all_reduce", x, "tp"), b.collective("all_reduce", g, "dp")
    b.output([b.call(torch.ops.aten.add.Tensor, b.wait(c1), b.wait(c2))])
    rep = simulate_graph(b.module(), mesh, hw)
    t_tp = collective_time(hw, "all_reduce", 4096 * 4096 * 2, mesh, "tp")
    t_dp = collective_time(hw, "all_reduce", 4096 * 4096 * 2, mesh, "dp")
    assert rep.collectives[0].start_s == rep.collectives[1].start_s == 0.0
    assert rep.exposed_comm_s == pytest.approx(max(t_tp, t_dp)) and rep.comm_s == pytest.approx(t_tp + t_dp)


def test_the_flash_attention_forward_backward_rows_are_predicted_never_fitted(monkeypatch):
    """The FlashAttention-2 forward + backward kernel rows (flash-attention README) count 3.5x the forward's FLOPs
    (the flash-attention benchmark's count, halved when causal) over the time the simulator's own cost model gives
    the attention nodes of a training program (forward and backward, is_causal as the row); no fit (the halves' or
    leave-one-family-out's) sees them."""
    row = next(r for r in R.ROWS if r.name == "a100 flash-attention-2 fwd+bwd hd128 s8k")
    assert row.setup["mode"] == "fwd+bwd" and not row.setup["causal"] and row.measured == 201
    assert row.family in V.HELD_OUT_ONLY and len([r for r in R.ROWS if r.family in V.HELD_OUT_ONLY]) >= 24
    legs = {"roofline_p": 64.0}          # the compute leg alone: this checks the FLOP count and its split
    hw = V._hw(row.setup, legs)
    flops = 4 * 2 * 8192 ** 2 * 16 * 128
    t = (flops / (hw.attn_efficiency * hw.peak_bf16) + 2.5 * flops / (hw.attn_efficiency * hw.peak_bf16)
         + 2 * hw.mm_half_time_s)
    assert V.predict(row, legs) == pytest.approx(3.5 * flops / t / 1e12, rel=1e-9)
    # the simulator charges a causal kernel the full square (benchmarks/notes/sim_validation.md, "FlashAttention-2
    # forward + backward rows"):
    # its causal twin, counted at half the FLOPs, is predicted at half the rate; the row's error says so
    causal = next(r for r in R.ROWS if r.name == row.name + " causal")
    assert V.predict(causal, legs) == pytest.approx(V.predict(row, legs) / 2, rel=1e-9)
    # a kernel row runs at the clock its benchmark ran at, not at a training step's sustained clock
    assert V.predict(row, {**legs, "sustained_clock": 0.8}) == pytest.approx(V.predict(row, legs), rel=1e-9)
    seen = []
    real = V.predict
    monkeypatch.setattr(V, "predict", lambda r, knobs=None: seen.append(r.family) or real(r, knobs))
    V.fit([r for r in R.ROWS if r.kind == "attention"], {}, passes=1)
    assert seen and not set(seen) & V.HELD_OUT_ONLY


def _adam_numel(gm) -> int:
    import math
    node = next(n for n in gm.graph.nodes if "adam" in str(n.target))
    return sum(math.prod(p.meta["val"].shape) for p in node.args[0])


@pytest.mark.parametrize("name", ["GPT-1.7B h100 TP1", "GPT-7.1B h100 TP2", "GPT-32B h100 TP8"])
def test_the_megatron_rows_update_a_48th_of_each_shard(name):
    """Megatron-Core ran its table with the distributed optimizer: each of the 48 data-parallel ranks updates
    1/48 of its (tensor-parallel) shard. The rows' programs do too, the dims 48 does not divide tiled unevenly."""
    row = next(r for r in R.ROWS if r.name.startswith(name))
    gm = V.program(row.setup, 2)[0]
    cfg = V.M.DecoderConfig(**{**row.setup["model"], "layers": 2})
    with torch.device("meta"):
        params = {k: p.numel() for k, p in V.M.Decoder(cfg).named_parameters()}
    tp = row.setup["mesh"].get("tp", 1)
    shard = sum(n if "norm" in k else n // tp for k, n in params.items())
    assert shard / 48 <= _adam_numel(gm) <= 1.01 * shard / 48
