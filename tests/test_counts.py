"""Issue 26 item 2: a data-dependent count that only sizes a selection (`x[mask]`, `torch.where(mask)` in an MoE
routing loop) is traced at a static size (capture/counts.py), so batches whose counts differ run one program.
Emulated ranks; every step is compared with single-device eager torch through tests/harness.py (its fp32
tolerances)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import partir_torch as pt
from partir_torch.capture import counts
from partir_torch.capture.ctc import ctc_loss_static
from tests.branch_models import MoELoop, SelectedLoss, SplitExperts
from tests.harness import adamw, train_next_to_eager

T = pt.tactics
DP = (pt.Mesh({"batch": 2}), [T.data_parallel("batch")])
BP_MP_Z3 = (pt.Mesh({"batch": 2, "model": 2}), [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")])


def _batches(n, keep=0.7, seed=0):
    """n batches whose masks select a different number of positions each (asserted)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < n:
        mask = (torch.rand(4, 6, generator=g) < keep).long()
        if int(mask.sum()) in {int(b[2].sum()) for b in out}:
            continue
        out.append((torch.randn(4, 6, 4, generator=g), torch.randint(0, 6, (4, 6), generator=g), mask))
    return out


def _routed(model, batches) -> list:
    """Per batch, the number of (token, slot) pairs each expert of MoELoop is routed (eager)."""
    with torch.no_grad():
        return [tuple(torch.bincount(torch.topk(model.router(model.inp(x).flatten(0, 1)), model.top_k)[1].flatten(),
                                     minlength=model.n).tolist()) for x, _, _ in batches]


def _loss(m, x, y, k):
    return m(x, y, k)


def _train(model, mesh, schedule, batches, **kw):
    """partition on batches[0], train all of them next to eager; returns the program."""
    torch.manual_seed(0)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = pt.partition(model, mesh, schedule, example_inputs=batches[0], loss_fn=_loss,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), **kw)
        train_next_to_eager(prog, ref, batches, _loss, adamw(), what=str(schedule))
    return prog


def _no_activation_reshards(prog):
    """Data parallelism keeps the tokens on their rank: the only collectives are the loss's and the gradients'
    all_reduces (no gather, no all_to_all of activations)."""
    kinds = {(r.kind, r.why) for r in prog.collectives()}
    assert kinds <= {("all_reduce", "tactic"), ("all_reduce", "gradient")}, kinds


def test_a_selection_feeding_the_loss_is_one_program_under_data_parallel():
    """Qwen2-Audio's `cross_entropy(logits[mask != 0], labels[mask != 0])` and `x[mask].mean()` over 5 batches
    with 5 different counts: one capture (no guard), equal to eager at every step, no reshard of activations."""
    torch.manual_seed(0)
    prog = _train(SelectedLoss(), *DP, _batches(5))
    cap = prog.captured
    assert cap.guards == () and cap.unpadded == ()
    assert [n for _, n in cap.padded] == [20, 24], cap.padded          # (4, 5) shifted positions, (4, 6) positions
    assert len(prog.shapes()) == 1 and prog.shapes()[0].calls == 5
    _no_activation_reshards(prog)
    said = "2 data-dependent selection(s) traced at a static size: padded to all their candidate rows"
    assert said in prog.summary()
    assert any(said in n for n in prog.simulate(pt.sim.hardware("h100", gpus_per_node=2), stages=False).notes)


def test_a_selection_feeding_the_loss_under_megatron_and_zero3():
    torch.manual_seed(0)
    prog = _train(SelectedLoss(), *BP_MP_Z3, _batches(4))
    assert prog.captured.guards == () and len(prog.shapes()) == 1
    assert any(r.kind == "all_reduce" and r.axis == "model" for r in prog.collectives())   # Megatron did tile


def test_without_the_static_size_every_count_is_a_path():
    """The same steps with counts.py switched off: one path per count (what the static size saves)."""
    torch.manual_seed(0)
    with counts.disabled():
        prog = _train(SelectedLoss(), *DP, _batches(3))
    assert len(prog.shapes()) == 3 and all(g.count for g in prog.captured.guards)


def test_a_count_read_as_an_int_stays_a_guard():
    """`sel.shape[0]` reads the count as a Python int: that selection stays a count guard (named with its line
    and why), the loss's own selection is still padded, and every step equals eager."""
    torch.manual_seed(0)
    prog = _train(SelectedLoss(count_as_int=True), *DP, _batches(3))
    cap = prog.captured
    assert len(cap.unpadded) == 1 and "sel = torch.tanh(logits)[mask != 0]" in cap.unpadded[0][0]
    assert "reads its size (the count) as a Python int" in cap.unpadded[0][1]
    assert [n for _, n in cap.padded] == [20]
    assert [g.count for g in cap.guards] == [True] and len(prog.shapes()) == 3
    assert "selection kept as a count guard (one path per count): branch_models.py:" in prog.summary()


def test_moe_routing_loop_keeps_tokens_on_their_rank():
    """HF's eager MoE loop (`torch.where(expert_mask[e])`, `x[top_x]`, `index_add_`) under data parallelism:
    one program for every routing, tokens stay on their rank, equal to eager."""
    torch.manual_seed(0)
    model, batches = MoELoop(), _batches(4)
    routed = _routed(model, batches)
    assert len(set(routed)) == 4, routed                 # each batch routes differently
    prog = _train(model, *DP, batches)
    cap = prog.captured
    assert cap.guards == () and [n for _, n in cap.padded] == [48] * 4 and len(prog.shapes()) == 1
    _no_activation_reshards(prog)


def test_moe_routing_loop_under_megatron_and_zero3():
    """The experts' linear pairs tiled on "model" (Megatron inside each expert), ZeRO-3 and the batch on "batch"."""
    torch.manual_seed(0)
    mesh, _ = BP_MP_Z3
    schedule = [T.data_parallel("batch"),
                T.megatron("model", plan={"experts.*.0.weight": "colwise", "experts.*.2.weight": "rowwise"}),
                T.zero(3, "batch")]
    prog = _train(MoELoop(), mesh, schedule, _batches(3))
    assert prog.captured.guards == () and len(prog.shapes()) == 1
    assert prog.sharding("params.experts.1.0.weight").tiled_axes() == {"model": 0, "batch": 0}


def test_moe_loop_over_the_experts_hit():
    """The HF variant looping over `expert_hit = (expert_mask.sum(...) > 0).nonzero()`: which experts are hit
    stays a guard (the loop iterates it in Python), each expert's selection is padded; with every expert hit in
    every batch (24 tokens, 4 experts) that is one path."""
    torch.manual_seed(0)
    model, batches = MoELoop(hit=True), _batches(4)
    assert all(min(r) > 0 for r in _routed(model, batches))
    prog = _train(model, *DP, batches)
    cap = prog.captured
    assert len(cap.unpadded) == 1 and "hit = torch.greater" in cap.unpadded[0][0], cap.unpadded
    assert len(cap.padded) == 4 and cap.guards and len(prog.shapes()) == 1


_PADDED = {     # run padded: equal to eager, value and gradient
    "sum": lambda x, y, m: x[m].sum(),
    "mean": lambda x, y, m: x[m].mean(),
    "mean over rows": lambda x, y, m: (x[m].mean(0) * torch.arange(5.0)).sum(),
    "row-wise then sum": lambda x, y, m: torch.tanh(x[m] * 2 + 1).pow(2).sum(-1, keepdim=True).mean(),
    "softmax rows": lambda x, y, m: x[m].softmax(-1)[:, 1:3].mean(),
    "cross_entropy": lambda x, y, m: F.cross_entropy(x[m], y[m]),
    "cross_entropy none": lambda x, y, m: F.cross_entropy(x[m], y[m], reduction="none", label_smoothing=0.1).mean(),
    "masked_select": lambda x, y, m: torch.masked_select(x, m[..., None]).pow(2).mean(),
    "where + index_add": lambda x, y, m: _where_add(x, m).pow(2).sum(),
    "setitem": lambda x, y, m: _set(x, m).pow(2).sum(),
    "where rows mean": lambda x, y, m: x[torch.where(m.T)[1]].mean(),
    "moe loop": lambda x, y, m: _moe(x).pow(2).sum(),
}
_KEPT = {       # not padding-safe: Unpadded (capture then keeps the count as a guard)
    "cumsum": lambda x, y, m: x[m].cumsum(0).sum(),
    "cat": lambda x, y, m: torch.cat([x[m], x[m]]).sum(),
    "shape[0]": lambda x, y, m: x[m].sum() / x[m].shape[0],
    "size(0)": lambda x, y, m: x[m].sum() / x[m].size(0),
    "len": lambda x, y, m: x[m].sum() / len(x[m]),
    "max": lambda x, y, m: x[m].max(),
    "softmax over rows": lambda x, y, m: x[m].softmax(0).sum(),
    "first row": lambda x, y, m: x[m][0].sum(),
    "flatten": lambda x, y, m: x[m].flatten()[:3].sum(),
    "iterate": lambda x, y, m: sum(r.sum() for r in x[m]),
    "matmul over rows": lambda x, y, m: (x[m].T @ x[m]).sum(),
    "dropout": lambda x, y, m: F.dropout(x[m], 0.5).sum(),
    "coordinates shape[0]": lambda x, y, m: x.sum() * torch.where(m)[1].shape[0],
    "coordinates.tolist": lambda x, y, m: x.sum() * len(torch.where(m)[1].tolist()),
}


def _where_add(x, m):
    out = torch.zeros(x.shape[1], 5)
    idx, top_x = torch.where(m.T)                   # (T, B) mask: coordinates (t, b)
    out.index_add_(0, idx, x[top_x, idx] * 2)
    return out


def _moe(x):
    """HF's eager experts loop on 12 tokens, 5 experts, top-2 (expert e: a fixed matrix, tanh)."""
    h = x.reshape(12, 5)
    w, selected = torch.topk(h.softmax(-1), 2, dim=-1)
    expert_mask = F.one_hot(selected, 5).permute(2, 1, 0)                 # (E, k, tokens)
    out = torch.zeros_like(h)
    for e in range(5):
        idx, top_x = torch.where(expert_mask[e])
        out.index_add_(0, top_x, torch.tanh(h[top_x] @ torch.eye(5).roll(e, 0)) * w[top_x, idx, None])
    return out


def _set(x, m):
    x = x.clone()
    x[m] = torch.sigmoid(x[m])
    return x


def test_padding_rules_equal_eager_or_refuse():
    """Every consumer counts.py has a rule for gives eager's value and gradient on the padded rows; every other
    one raises Unpadded (never a wrong value). Eager, outside any trace: the rewrite itself."""
    g = torch.Generator().manual_seed(0)
    x0, y = torch.randn(3, 4, 5, generator=g), torch.randint(0, 5, (3, 4), generator=g)
    m = torch.rand(3, 4, generator=g) < 0.6
    for name, f in {**_PADDED, **_KEPT}.items():
        want_x, got_x = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        want = f(want_x, y, m)
        want.backward()
        pad = counts.Padding()
        try:
            with pad:
                got = f(got_x, y, m)
        except counts.Unpadded as u:
            assert name in _KEPT, f"{name}: {u}"
            continue
        assert name in _PADDED and pad.selections, name
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda s: f"{name}: {s}")
        torch.testing.assert_close(got_x.grad, want_x.grad, rtol=1e-6, atol=1e-6, msg=lambda s: f"{name}: {s}")


def _split_batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, 4, generator=g),) for _ in range(n)]


def _train_split(model, n):
    """SplitExperts-like `model` partitioned under DP and trained next to eager on n batches (warnings off)."""
    ref = copy.deepcopy(model)
    batches = _split_batches(n)
    loss = lambda m, x: m(x)   # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = pt.partition(model, *DP, example_inputs=batches[0], loss_fn=loss,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        train_next_to_eager(prog, ref, batches, loss, adamw())
    return prog


def test_a_split_by_counts_read_with_tolist_is_one_program():
    """JetMoE's experts (`x.split(counts.tolist())`, a linear per chunk, `torch.cat`): the counts change with every
    batch, and every batch runs the one program (each chunk padded to all rows), equal to eager step by step."""
    torch.manual_seed(0)
    prog = _train_split(SplitExperts(), 4)
    assert len(prog.shapes()) == 1 and not prog.captured.guards
    assert len(prog.captured.padded) == 4 and not prog.captured.unpadded


def test_a_count_of_a_split_read_as_an_int_stays_a_guard():
    """The same experts whose code also reads a count as a Python int: the counts are guards again (named in
    captured.unpadded), one path per set of counts, still equal to eager."""
    torch.manual_seed(0)
    prog = _train_split(SplitExperts(read_count=True), 3)
    assert len(prog.captured.guards) == 4 and "reads a count as a Python int" in prog.captured.unpadded[0][1]


def test_masked_select_kept_as_a_count_guard_is_traced_at_its_count():
    """With the static sizes off, `x.masked_select(mask)` (CTC losses flatten their targets so) is a count guard:
    fake tensors get the real count (it used to stop the trace), one path per count, equal to eager."""
    class Selects(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)

        def forward(self, x, mask):
            return self.a(x).masked_select(mask[..., None]).pow(2).mean()

    torch.manual_seed(0)
    model = Selects()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 6, 4, generator=g), torch.rand(4, 6, generator=g) < 0.5) for _ in range(3)]
    loss = lambda m, x, k: m(x, k)   # noqa: E731
    with warnings.catch_warnings(), counts.disabled():
        warnings.simplefilter("ignore")
        prog = pt.partition(model, *DP, example_inputs=batches[0], loss_fn=loss,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        train_next_to_eager(prog, ref, batches, loss, adamw())
    assert [g.count for g in prog.captured.guards] == [True]
    assert len(prog.shapes()) == len({int(k.sum()) for _, k in batches})


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_static_ctc_equals_torchs(reduction):
    """capture/ctc.py's recursion against F.ctc_loss: lengths that differ per sample (a frame count below the
    longest, an empty target, repeated labels that need a blank between them, an input too short for its target:
    inf, zeroed with zero_infinity), loss and the gradient of the log-probabilities."""
    g = torch.Generator().manual_seed(0)
    T_, B, C, S = 12, 5, 6, 4
    logits = torch.randn(T_, B, C, generator=g, dtype=torch.float64)
    targets = torch.randint(1, C, (B, S), generator=g)
    targets[1, :2] = 3                                    # a repeat
    input_lengths = torch.tensor([12, 9, 12, 3, 7])
    target_lengths = torch.tensor([4, 3, 0, 4, 2])        # sample 3: 3 frames, 4 labels (no alignment)
    for zero_infinity in (False, True):
        a = logits.clone().requires_grad_(True)
        b = logits.clone().requires_grad_(True)
        want = F.ctc_loss(a.log_softmax(-1), targets, input_lengths, target_lengths, reduction=reduction,
                          zero_infinity=zero_infinity)
        got = ctc_loss_static(b.log_softmax(-1), targets, input_lengths, target_lengths, reduction=reduction,
                              zero_infinity=zero_infinity)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
        if zero_infinity:
            want.sum().backward()
            got.sum().backward()
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12)


def test_stock_wav2vec2_ctc_with_layerdrop_runs_one_program_like_eager():
    """Wav2Vec2ForCTC as its documentation calls it (`model(input_values, labels=labels).loss`; labels padded with
    -100, so the CTC targets are a selection whose count changes with every batch), layerdrop 0.5: the labels'
    check is a guard, the layers are gated, the CTC loss is traced at static shapes: one program for 5 batches of
    different target lengths, equal to eager. SGD: the attention key bias has an exactly-zero gradient, which
    AdamW would turn into steps of size lr on both sides (rounding noise). mask_time_prob 0: HF draws SpecAugment's
    masks from NumPy's generator, which a trace fixes (capture warns)."""
    transformers = pytest.importorskip("transformers")
    from tests.test_gates import _train
    cfg = transformers.Wav2Vec2Config(vocab_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                      intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                      num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, layerdrop=0.5,
                                      mask_time_prob=0.0)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(cfg).train()
    g = torch.Generator().manual_seed(1)
    batches = []
    for n in (5, 3, 4, 2, 5):
        labels = torch.full((2, 5), -100)
        labels[0, :n] = torch.randint(1, 16, (n,), generator=g)
        labels[1, :5 - n // 2] = torch.randint(1, 16, (5 - n // 2,), generator=g)
        batches.append((torch.randn(2, 400, generator=g), labels))
    loss = lambda m, x, labels: m(x, labels=labels).loss   # noqa: E731
    prog, opt, ref, _ = _train(model, DP[0], DP[1], batches, loss=loss,
                               make_opt=lambda ps: torch.optim.SGD(ps, lr=1e-5))
    assert len(prog.shapes()) == 1 and len(prog.captured.gates.gates) == 3 and len(prog.captured.guards) == 1
    assert "aten.sort" not in prog.audit()        # the CTC rule's stable sort keeps each rank's rows (rules/nn.py)


def test_a_cat_of_some_chunks_of_a_split_by_counts_stays_a_guard():
    """`torch.cat(chunks[:2])` of a split by counts has fewer rows than the padded chunks: not the sum of the valid
    rows, so the counts are guards again (named), and the steps equal eager."""
    class FirstTwo(SplitExperts):
        def forward(self, x):
            h = self.inp(x).flatten(0, 1)
            expert = self.router(h).argmax(-1)
            counts = F.one_hot(expert, self.n).sum(0)
            order = expert.sort(0)[1]
            chunks = h[order].split(counts.tolist(), dim=0)
            return torch.cat(chunks[:2], 0).pow(2).sum() / h.shape[0]

    torch.manual_seed(0)
    prog = _train_split(FirstTwo(), 2)
    assert prog.captured.guards and prog.captured.unpadded, prog.captured.unpadded


class NonzeroIndex(torch.nn.Module):
    """The selected positions as an index vector: `idx = torch.nonzero(mask).squeeze(1)`, then `logits[idx]`."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 6)

    def forward(self, x, labels, mask):
        logits = self.lin(x).flatten(0, 1)                   # (B*T, V)
        idx = torch.nonzero(mask.flatten()).squeeze(1)       # (n,)
        return F.cross_entropy(logits[idx], labels.flatten()[idx])


def test_nonzero_squeezed_to_an_index_is_one_program():
    prog = _train(NonzeroIndex(), *DP, _batches(3))
    assert prog.captured.guards == () and [n for _, n in prog.captured.padded] == [24]
    assert len(prog.shapes()) == 1


def test_a_reshaped_nonzero_matrix_stays_a_guard():
    class Reshaped(NonzeroIndex):
        def forward(self, x, labels, mask):
            logits = self.lin(x).flatten(0, 1)
            idx = torch.nonzero(mask).flatten()              # (n * 2,): row and column interleaved
            return logits[idx].sum()

    prog = _train(Reshaped(), *DP, _batches(2))
    assert len(prog.captured.guards) == 1 and "reshapes the nonzero matrix" in prog.captured.unpadded[0][1]
