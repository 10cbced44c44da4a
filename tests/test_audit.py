"""Issue 20, items 1 and 2: every collective says why it is there (lower/records.py states the rule), prog.audit()
lists the "reshard" ones, and an op that forces them is named once in a warning (rank 0 only under
torch.distributed, like every warning of the library)."""
from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import partir_torch as pt
from partir_torch.errors import warn
from partir_torch.lower.copies import layout_copies, one_device_copies
from partir_torch.lower.records import WHYS
from partir_torch.plan import capture_for, plan
from examples.models import get

T = pt.tactics
AUDIT = pytest.mark.xdist_group("audit")     # the zoo captures are shared by the tests of this file


def bp_dims(spec) -> dict:
    return {i: d for i, d in enumerate(spec.batch_dims) if d != 0}


SCHEDULES = {
    "BP": ({"batch": 2}, lambda s: [T.data_parallel("batch", dims=bp_dims(s))]),
    "BP+MP+Z3": ({"batch": 2, "fsdp": 2, "model": 2},
                 lambda s: [T.data_parallel("batch", dims=bp_dims(s)), T.megatron("model"),
                            T.data_parallel("fsdp", dims=bp_dims(s), name="BP_fsdp"), T.zero(3, "fsdp")]),
    "MP": ({"model": 2}, lambda s: [T.megatron("model")]),
    "SP": ({"model": 2}, lambda s: [T.megatron("model"), T.sequence_parallel("model")]),
    "EP": ({"batch": 2, "expert": 2}, lambda s: [T.data_parallel("batch"), T.expert_parallel("expert")]),
}
_CAPTURES: dict = {}


def records(name, sched):
    """The collective records of zoo model `name` under schedule `sched` (one capture per model, batch 4)."""
    return planned(name, sched).lowered().records


def planned(name, sched):
    """The plan of zoo model `name` under schedule `sched` (one capture per model, batch 4)."""
    spec = get(name)
    mesh, tactics = SCHEDULES[sched]
    if name not in _CAPTURES:
        model = spec.build()
        _CAPTURES[name] = capture_for(model, [], spec.batch(4), spec.loss_fn, torch.optim.AdamW(model.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # megatron's note on the weights it leaves replicated
        return plan(_CAPTURES[name], pt.Mesh(mesh), tactics(spec))


def members(recs) -> list:
    return [m for r in recs for m in r.parts()]


def whys(recs) -> Counter:
    return Counter(m.why for m in members(recs))


@AUDIT
@pytest.mark.parametrize("name", ["mlp", "gpt", "gpt_sdpa", "llama", "unet", "moe", "vit"])
def test_data_parallel_has_gradient_reductions_and_the_loss(name):
    recs = members(records(name, "BP"))
    assert {m.why for m in recs} <= {"gradient", "tactic"}, whys(recs)
    for m in recs:
        assert m.kind == "all_reduce" and m.axis == "batch"
        if m.phase == "backward":        # the weight gradients, partial over the batch
            assert m.why == "gradient", m
    tactic = [m for m in recs if m.why == "tactic"]
    # the loss: a scalar (cross-entropy's sum and count of targets: two)
    assert 1 <= len(tactic) <= 2 and all(m.phase == "forward" and m.nbytes in (4, 8) for m in tactic), tactic
    assert sum(m.why == "gradient" for m in recs) >= 2


@AUDIT
@pytest.mark.parametrize("name", ["mlp", "gpt", "llama", "moe", "vit"])
def test_hsdp_times_megatron_has_state_gradient_and_tactic_collectives(name):
    recs = members(records(name, "BP+MP+Z3"))
    c = whys(recs)
    assert "reshard" not in c and c["state"] > 0 and c["gradient"] > 0 and c["tactic"] > 0, c
    for m in recs:
        assert m.why in WHYS
        if m.axis == "fsdp" and m.kind == "all_gather":      # ZeRO-3: parameters gathered for each use
            assert m.why == "state" and m.value.startswith("params."), m
        if m.kind == "reduce_scatter":                       # ZeRO: gradients reduced into their shards
            assert m.why == "gradient", m
        if m.axis == "model" and m.phase == "forward" and m.nbytes > 4:   # Megatron's activation all_reduces
            assert m.kind == "all_reduce" and m.why == "tactic", m
            assert m.source.startswith("examples/models/"), m    # the user's line of the op it serves
    if name != "mlp":     # the input gradient of each layer's column-parallel linear (the MLP's first has none)
        assert any(m.axis == "model" and m.why == "tactic" and m.phase == "backward" for m in recs)


@AUDIT
@pytest.mark.parametrize("name", ["gpt_sdpa", "llama"])
def test_sequence_parallel_gathers_and_scatters_are_the_tactic(name):
    recs = members(records(name, "SP"))
    c = whys(recs)
    assert "reshard" not in c, [m for m in recs if m.why == "reshard"]
    gathers = [m for m in recs if m.kind == "all_gather" and m.phase == "forward"]
    scatters = [m for m in recs if m.kind == "reduce_scatter"]
    assert gathers and scatters
    assert all(m.why == "tactic" for m in gathers + scatters)


@AUDIT
def test_sequence_parallel_position_embedding_gradient_is_a_gradient_gather():
    """gpt's wpe[:T] under SP: its gradient is tiled by sequence position and gathered into the replicated wpe at
    a recorded conflict: a gradient collective, not a reshard."""
    recs = members(records("gpt", "SP"))
    assert "reshard" not in whys(recs)
    (g,) = [m for m in recs if m.kind == "all_gather" and m.phase == "backward" and m.op.endswith("slice_backward.default")]
    assert g.why == "gradient"


@AUDIT
@pytest.mark.parametrize("name", ["moe", "moe_capacity"])
def test_expert_parallel_exchanges_are_the_tactic(name):
    recs = members(records(name, "EP"))
    c = whys(recs)
    assert "reshard" not in c and c["tactic"] > 0, c
    a2a = [m for m in recs if m.kind == "all_to_all"]
    if name == "moe_capacity":
        assert a2a
    assert all(m.why == "tactic" for m in a2a)
    assert all(m.why in ("tactic", "gradient") for m in recs if m.axis == "expert")


@AUDIT
def test_gns_under_data_parallelism_reshards_at_its_edge_gathers():
    """The GNS edge list indexes the whole node set: data parallelism over nodes gathers the node features for
    each message-passing step (conflicts on 'batch'); those are the only reshard collectives."""
    recs = members(records("gns", "BP"))
    reshard = [m for m in recs if m.why == "reshard"]
    assert reshard and all(m.kind == "all_gather" for m in reshard)
    assert {m.op for m in reshard} <= {"aten.index_select.default", "aten.gather.default"}
    assert any(m.source.startswith("examples/models/gns.py:") for m in reshard)


# -- an op without a rule -----------------------------------------------------------------------------------------
class Rolled(nn.Module):
    """aten.roll has no rule: under data parallelism it is a barrier (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.roll(h, 1, dims=1)  # ROLL_LINE
        return self.fc2(h)


def _roll_line() -> int:
    import inspect

    src, first = inspect.getsourcelines(Rolled.forward)
    return first + next(i for i, line in enumerate(src) if "ROLL_LINE" in line)


def _partition_rolled():
    torch.manual_seed(0)
    model = Rolled()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    assert torch.ops.aten.roll.default not in pt.rules.registry.default_registry()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=(x, y),
                            loss_fn=lambda m, x, y: F.mse_loss(m(x), y),
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        prog.collectives()                  # the first lowering warns (the first step or report does)
        prog.collectives()                  # once
    return prog, [w for w in caught if "reshard collective" in str(w.message)]


def test_op_without_rule_reshards_warns_once_and_audit_names_it():
    prog, warned = _partition_rolled()
    where = f"tests/test_audit.py:{_roll_line()}"
    recs = prog.collectives()
    reshard = [m for m in members(recs) if m.why == "reshard"]
    # the roll's operand gathered in the forward, its gradient's in the backward: (B, 16) fp32 each
    assert [(m.kind, m.phase, m.nbytes, m.op) for m in reshard] == [
        ("all_gather", "forward", 4 * 16 * 4, "aten.roll.default"),
        ("all_gather", "backward", 4 * 16 * 4, "aten.roll.default")]
    assert reshard[0].source == where
    assert whys(recs) == Counter({"gradient": 4, "reshard": 2, "tactic": 1})
    # one warning for the op type, though two collectives: the op, the line, the bytes, the fix
    assert len(warned) == 1, [str(w.message) for w in warned]
    text = str(warned[0].message)
    assert "aten.roll.default forces 2 reshard collectives (512 B per step)" in text and where in text
    assert "pt.register_rule" in text
    assert warned[0].filename == __file__                 # attributed to the caller of partition
    audit = prog.audit()
    assert "aten.roll.default: 512 B per step (all_gather[batch] x2)" in audit
    assert f"{where}: 256 B  (relu)" in audit
    assert "collectives by why: gradient 4 (848 B), state 0, tactic 1 (4 B), reshard 2 (512 B)" in prog.summary()


def test_audit_without_reshards_says_so():
    spec = get("mlp")
    model = spec.build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=spec.batch(2),
                            loss_fn=spec.loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        prog.collectives()
    assert not [w for w in caught if "reshard" in str(w.message)]
    assert prog.audit().startswith("no reshard collectives")
    assert "reshard 0" in prog.summary()


# -- rank 0 only ---------------------------------------------------------------------------------------------------
def _ranks(monkeypatch, rank):
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: rank)


@pytest.mark.parametrize("rank,expected", [(0, 1), (1, 0), (3, 0)])
def test_warn_on_rank_zero_only(monkeypatch, rank, expected):
    _ranks(monkeypatch, rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn("partir_torch: a test warning", stacklevel=1)     # 1: this line (2, the default: its caller)
    assert len(caught) == expected
    if expected:
        assert caught[0].filename == __file__


def test_warn_in_one_process_without_torch_distributed(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 1 / 0)    # not asked
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn("partir_torch: a test warning")
    assert len(caught) == 1


def test_reshard_warning_is_silent_on_other_ranks(monkeypatch):
    _ranks(monkeypatch, 1)
    prog, warned = _partition_rolled()
    assert not warned
    assert [m.why for m in members(prog.collectives())].count("reshard") == 2


# -- layout copies (issue 39 item 1): the per-device program copies no more than the one-device step --------------
def extra_copies(p) -> list:
    return [c for c in layout_copies(p.annotated_lowered(), p.captured) if c.extra]


@AUDIT
@pytest.mark.parametrize("sched", ["BP", "MP", "BP+MP+Z3"])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_zoo_programs_make_no_layout_copy_the_one_device_step_does_not(name, sched):
    """Buckets gather and all_reduce into one buffer, member after member (lower/bucketops.py), so unpacking them
    is views; a cat to pack a bucket or a clone to unpack it would be counted here. The program's copies are the
    model's own (the same ops as the one-device step's, on local shapes), and audit() says so."""
    p = planned(name, sched)
    assert extra_copies(p) == []
    copies = layout_copies(p.annotated_lowered(), p.captured)
    one = one_device_copies(p.captured)
    assert Counter(c.op for c in copies) == Counter(c.op for c in one)
    from partir_torch.reporting import copies_text
    assert copies_text(copies, one).endswith("extra: none")


@AUDIT
def test_audit_names_the_extra_copies_sequence_parallel_makes():
    """The detector itself: sequence parallelism gathers the (B, T, d) activations on T (dim 1), which lowering
    moves to the front and back with a clone each (reshard.py), copies no one-device step makes: counted, with
    their bytes, and printed by audit() next to the collectives."""
    p = planned("gpt", "SP")
    extra = extra_copies(p)
    assert extra and {c.op for c in extra} >= {"clone"} and all(c.nbytes > 0 for c in extra)
    moved = {m.value for r in p.lowered().records for m in r.parts() if m.kind in ("all_gather", "reduce_scatter")}
    assert {c.value for c in extra if c.op == "clone"} <= moved      # each next to the collective it serves
    from partir_torch.reporting import copies_text
    text = copies_text(layout_copies(p.annotated_lowered(), p.captured), one_device_copies(p.captured))
    assert f"extra: {len(extra)}," in text and "clone:" in text


@pytest.mark.parametrize("build", ["gpt2", "llama"])
def test_stock_hf_decoders_make_no_extra_layout_copy(build):
    """Stock HF GPT-2 and Llama (tiny configs) under BP, MP and BP+MP+Z3 on a 2x2x2 mesh: no extra copy, except, on
    GPT-2 under ZeRO-3, the one local slice of the position embedding's gradient (whole on 'fsdp': the positions
    are not batched) at the rank's coordinate (index_select: the program is the same for every rank)."""
    from tests.harness import hf_gpt2, hf_llama

    torch.manual_seed(0)
    model = {"gpt2": hf_gpt2, "llama": hf_llama}[build]().train()
    tokens = torch.randint(0, 64, (8, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture_for(model, [], (tokens,), lambda m, x: m(input_ids=x, labels=x).loss,
                          torch.optim.AdamW(model.parameters()))
        for mesh, tactics in [({"batch": 2}, [T.data_parallel("batch")]), ({"model": 2}, [T.megatron("model")]),
                              ({"batch": 2, "fsdp": 2, "model": 2},
                               [T.data_parallel("batch"), T.data_parallel("fsdp", name="BP-fsdp"),
                                T.megatron("model"), T.zero(3, "fsdp")])]:
            extra = extra_copies(plan(cap, pt.Mesh(mesh), tactics))
            if build == "gpt2" and "fsdp" in mesh:
                assert [(c.op, c.nbytes) for c in extra] == [("index_select", 16 * 32 * 4 // 2)], extra
            else:
                assert extra == [], (mesh, extra)
