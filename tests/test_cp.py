"""Context parallelism (issue 38): T.context_parallel tiles the sequence of a stock HF decoder; loss and every
gradient equal one device (emulated ranks), alone and with data parallelism or Megatron on another axis."""
from __future__ import annotations

import copy
import re
from collections import Counter

import pytest
import torch

import partir_torch as pt
from partir_torch import tactics as T

from harness import hf_llama

GRAD_RTOL = 1e-5


def loss_fn(m, x):
    """The documented call: the model shifts the labels and computes its own loss."""
    return m(input_ids=x, labels=x).loss


def llama(attn: str):
    torch.manual_seed(0)
    model = hf_llama()
    model.config._attn_implementation = attn        # "sdpa" (is_causal) or "eager" (explicit mask + softmax)
    return model


def assert_grads_match(prog, model, batch, what):
    """loss and each gradient g vs one device: |g - g_ref| <= 1e-5 * max|g_ref| (+ the same floor from the largest
    gradient, for tensors whose true gradient is ~0)."""
    ref = copy.deepcopy(model)
    ref_loss = loss_fn(ref, *batch)
    ref_loss.backward()
    loss, grads = prog.loss_and_grads(*batch)
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=0)
    want = {k: p.grad for k, p in ref.named_parameters()}
    assert set(grads) == set(want)
    floor = GRAD_RTOL * max(g.abs().max().item() for g in want.values())
    for k, w in want.items():
        err = (grads[k] - w).abs().max().item()
        assert err <= GRAD_RTOL * w.abs().max().item() + floor, f"{what}: grad of {k}: max error {err:.3e}"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("n", [2, 4])
def test_cp_llama_matches_one_device(attn, n):
    """CP alone: the keys and values are gathered per layer (CP's all_gathers, 2 per layer) and their gradients
    reduce-scattered back (2 per layer); the query rows, positions, norms, MLP and loss stay local; the only other
    movement is the labels' gather for the one-token shift (B x T integers)."""
    model, tokens = llama(attn), torch.randint(0, 64, (2, 16))
    prog = pt.partition(model, pt.Mesh({"cp": n}), [T.context_parallel("cp")], example_inputs=(tokens,),
                        loss_fn=loss_fn)
    assert_grads_match(prog, model, (tokens,), f"{attn} CP={n}")
    recs = prog.collectives()
    kv = [r for r in recs if r.why == "tactic" and r.kind in ("all_gather", "reduce_scatter")]
    layers = model.config.num_hidden_layers
    assert Counter(r.kind for r in kv) == {"all_gather": 2 * layers, "reduce_scatter": 2 * layers}
    assert all(r.tactic == "CP" and r.axis == "cp" for r in kv)
    reshards = [r for r in recs if r.why == "reshard"]
    assert [(r.kind, r.nbytes) for r in reshards] == [("all_gather", tokens.numel() * 8)]   # the labels, once
    assert prog.sharding("inputs.0").dims[1] == ("cp",)


def test_cp_gpt2_matches_one_device():
    """Stock GPT-2 (eager attention with heads folded into (B*H), learned position embeddings looked up at each
    rank's positions): exact. Its backward's dK = dS^T Q meets two sequence tilings and gathers (audit lists them)."""
    from harness import hf_gpt2

    torch.manual_seed(0)
    model, tokens = hf_gpt2(), torch.randint(0, 64, (2, 16))
    prog = pt.partition(model, pt.Mesh({"cp": 2}), [T.context_parallel("cp")], example_inputs=(tokens,),
                        loss_fn=loss_fn)
    assert_grads_match(prog, model, (tokens,), "GPT-2 CP=2")


@pytest.mark.parametrize("other,mesh", [(T.data_parallel("batch"), {"batch": 2, "cp": 2}),
                                        (T.megatron("model"), {"cp": 2, "model": 2})], ids=["CPxDP", "CPxMP"])
def test_cp_composes_on_a_2x2_mesh(other, mesh):
    """CP on one axis, data parallelism or Megatron on the other: equal to one device."""
    model, tokens = llama("sdpa"), torch.randint(0, 64, (4, 16))
    prog = pt.partition(model, pt.Mesh(mesh), [T.context_parallel("cp"), other], example_inputs=(tokens,),
                        loss_fn=loss_fn)
    assert_grads_match(prog, model, (tokens,), f"CP x {other.name}")
    kv = Counter(r.kind for r in prog.collectives() if r.tactic == "CP" and r.why == "tactic")
    assert kv["all_gather"] >= 4 and kv["reduce_scatter"] == 4


@pytest.mark.parametrize("attention", ["allgather", "ring"])
def test_cp_balanced_composes_with_megatron_vocab_and_sequence_parallel(attention):
    """NeMo's long-context layout: load-balanced CP on one axis, Megatron with the vocabulary tiled and sequence
    parallelism on the other: equal to one device."""
    model, tokens = llama("sdpa"), torch.randint(0, 64, (2, 16))
    sched = [T.context_parallel("cp", attention=attention, load_balance=True), T.megatron("tp", vocab=True),
             T.sequence_parallel("tp")]
    prog = pt.partition(model, pt.Mesh({"cp": 2, "tp": 2}), sched, example_inputs=(tokens,), loss_fn=loss_fn)
    assert_grads_match(prog, model, (tokens,), f"CP {attention} lb x MP(vocab) + SP")
    assert prog.sharding("inputs.0").dims[1] == ("cp", "tp")      # SP tiles each rank's sequence tile further


def test_cp_after_sequence_parallel_warns_and_gathers():
    """CP after sequence parallelism in the schedule tiles the sequence tp-major, inside SP's tiling, and CP then
    gathers SP's activations on its axis (9x the bytes of CP first, here): said by a warning with the fix."""
    tokens = torch.randint(0, 64, (1, 16))
    mp = [T.megatron("tp", vocab=True), T.sequence_parallel("tp")]
    mesh = pt.Mesh({"cp": 2, "tp": 2})
    first = pt.partition(llama("sdpa"), mesh, [T.context_parallel("cp")] + mp, example_inputs=(tokens,),
                         loss_fn=loss_fn)
    with pytest.warns(UserWarning, match=r"already tiled on 'tp'.*Put context_parallel before sequence_parallel"):
        after = pt.partition(llama("sdpa"), mesh, mp + [T.context_parallel("cp")], example_inputs=(tokens,),
                             loss_fn=loss_fn)
    assert first.sharding("inputs.0").dims[1] == ("cp", "tp") and after.sharding("inputs.0").dims[1] == ("tp", "cp")
    cp_bytes = lambda p: sum(r.nbytes for r in p.collectives() if r.tactic == "CP" and r.why == "tactic")  # noqa: E731
    assert cp_bytes(after) > 4 * cp_bytes(first)


def test_cp_refuses_a_length_the_axis_does_not_divide():
    model, tokens = llama("sdpa"), torch.randint(0, 64, (2, 14))
    with pytest.raises(pt.PartitionError, match=r"sequence length 14 .* axis 'cp' \(size 4\).*e\.g\. 16"):
        pt.partition(model, pt.Mesh({"cp": 4}), [T.context_parallel("cp")], example_inputs=(tokens,),
                     loss_fn=loss_fn)


@pytest.mark.parametrize("n", [2, 4])
def test_cp_ring_attention_matches_one_device(n):
    """attention="ring": the keys and values stay tiled and travel around the axis (collective_permute steps, online
    softmax); the backward rotates them again with their gradients: no all_gather or reduce_scatter of K/V. Per layer
    2 (n - 1) transfers forward, 2 (n - 1) + 2 n backward."""
    model, tokens = llama("sdpa"), torch.randint(0, 64, (2, 16))
    prog = pt.partition(model, pt.Mesh({"cp": n}), [T.context_parallel("cp", attention="ring")],
                        example_inputs=(tokens,), loss_fn=loss_fn)
    assert_grads_match(prog, model, (tokens,), f"ring CP={n}")
    recs = [r for r in prog.collectives() if r.why == "tactic" and r.tactic == "CP"]
    layers = model.config.num_hidden_layers
    assert Counter(r.kind for r in recs if r.kind != "all_reduce") == {
        "collective_permute": layers * (4 * (n - 1) + 2 * n)}


def test_cp_ring_composes_with_data_parallel():
    model, tokens = llama("sdpa"), torch.randint(0, 64, (4, 16))
    prog = pt.partition(model, pt.Mesh({"batch": 2, "cp": 2}),
                        [T.data_parallel("batch"), T.context_parallel("cp", attention="ring")],
                        example_inputs=(tokens,), loss_fn=loss_fn)
    assert_grads_match(prog, model, (tokens,), "ring CP x DP")
    assert not [r for r in prog.collectives() if r.tactic == "CP" and r.kind in ("all_gather", "reduce_scatter")
                and r.why == "tactic"]


@pytest.mark.parametrize("attn,n,attention", [("sdpa", 2, "allgather"), ("sdpa", 4, "allgather"), ("eager", 2, "allgather"),
                                              ("eager", 4, "allgather"), ("sdpa", 2, "ring"), ("sdpa", 4, "ring")])
def test_cp_load_balanced_matches_one_device(attn, n, attention):
    """load_balance=True: rank r holds chunks r and 2n-1-r (the inputs laid out in zigzag order by the runtime, the
    positions and the label shift rewritten to the original order at capture): loss and every gradient equal one
    device. The user's call is unchanged (global tokens in their order)."""
    model, tokens = llama(attn), torch.randint(0, 64, (2, 16))
    prog = pt.partition(model, pt.Mesh({"cp": n}), [T.context_parallel("cp", attention=attention, load_balance=True)],
                        example_inputs=(tokens,), loss_fn=loss_fn)
    assert_grads_match(prog, model, (tokens,), f"{attn} {attention} CP={n} balanced")
    assert prog.sharding("inputs.0").dims[1] == ("cp",)


def test_cp_load_balanced_eval_step_and_forward():
    """eval_step is balanced too (its capture takes the rewrite) and equals the model's loss; prog.forward runs plain
    CP (its logits come back in order), said by a warning."""
    model, tokens = llama("sdpa"), torch.randint(0, 64, (2, 16))
    prog = pt.partition(model, pt.Mesh({"cp": 2}), [T.context_parallel("cp", load_balance=True)],
                        example_inputs=(tokens,), loss_fn=loss_fn)
    with torch.no_grad():
        ref = model(input_ids=tokens, labels=tokens)
    torch.testing.assert_close(prog.eval_step(tokens).detach(), ref.loss, rtol=1e-5, atol=0)
    with pytest.warns(UserWarning, match="without load balancing"):
        out = prog.forward(tokens)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)


def attention_flops(prog) -> float:
    """Causal attention FLOPs of one rank's lowered program (forward kernels): 4 B H Lq Lk E per call, half of it
    for a call with is_causal (the kernel skips the masked half of its diagonal block)."""
    from partir_torch.lower.fakeprop import annotate_local_vals

    annotate_local_vals(prog.lowered, prog.captured)      # each node's local shape (meta tensors)
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    total = 0.0
    for node in prog.lowered.gm.graph.nodes:
        if node.target is fwd:
            (b, h, lq, e), lk = node.args[0].meta["val"].shape, node.args[1].meta["val"].shape[2]
            total += 4 * b * h * lq * lk * e * (0.5 if node.args[4] else 1.0)
    return total


@pytest.mark.parametrize("attention", ["allgather", "ring"])
def test_cp_load_balancing_halves_causal_attention_work(attention):
    """CP=4 at sequence 32: without balancing a rank computes its 8 rows against all 4 key blocks of 8 (the hidden
    ones discarded: 3.5 blocks of 64 pairs); with it, 2 diagonal and 7 whole blocks of 4 x 4 (8 blocks of 16 pairs;
    allgather runs 4 of them as one call), every one visible to the rank: 128 / 224 = 4/7 of the work, each rank's
    causal minimum. One SPMD program: every rank runs the same kernel calls."""
    tokens = torch.randint(0, 64, (1, 32))
    flops = {}
    for lb in (False, True):
        prog = pt.partition(llama("sdpa"), pt.Mesh({"cp": 4}), [T.context_parallel("cp", attention=attention,
                                                                                 load_balance=lb)],
                            example_inputs=(tokens,), loss_fn=loss_fn)
        flops[lb] = attention_flops(prog)
    assert flops[True] / flops[False] == pytest.approx(4 / 7)


def test_cp_load_balancing_refuses_a_shift_it_cannot_rewrite():
    """A loss that shifts by slicing the logits and the tokens itself depends on the order of positions: refused by
    name (the zigzag program would pair each logit with the wrong token)."""
    def manual_shift(m, x):
        logits = m(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))

    with pytest.raises(pt.PartitionError, match=r"depends on the order of dim 1 \(size 16, the sequence\)"):
        pt.partition(llama("sdpa"), pt.Mesh({"cp": 2}), [T.context_parallel("cp", load_balance=True)],
                     example_inputs=(torch.randint(0, 64, (2, 16)),), loss_fn=manual_shift)


def test_cp_load_balancing_refuses_a_length_of_odd_chunks():
    from partir_torch.tactics.cp import ContextParallel

    with pytest.raises(pt.PartitionError, match=r"T\.context_parallel\(axis, load_balance=True\)"):
        ContextParallel("cp", load_balance=True)          # the rewrite comes with T.context_parallel's object
    model, tokens = llama("sdpa"), torch.randint(0, 64, (2, 12))
    with pytest.raises(pt.PartitionError, match=r"sequence length 12 into 2 x 4 chunks .*e\.g\. 16"):
        pt.partition(model, pt.Mesh({"cp": 4}), [T.context_parallel("cp", load_balance=True)],
                     example_inputs=(tokens,), loss_fn=loss_fn)


@pytest.mark.parametrize("attn,lb", [("sdpa", False), ("eager", False), ("sdpa", True), ("eager", True)])
def test_cp_padded_batch_matches_one_device(attn, lb):
    """A padding mask (HF builds a (B, 1, T, T) mask from it: no is_causal) tiled with the sequence; labels -100 on
    the padding. Equal to one device. Load-balanced, HF looks attention_mask up at the key positions: the rewrite
    maps those original positions to where they are stored."""
    model, tokens = llama(attn), torch.randint(1, 64, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0                                    # right padding in the second row
    labels = tokens.masked_fill(mask == 0, -100)

    def padded_loss(m, x, am, y):
        return m(input_ids=x, attention_mask=am, labels=y).loss

    batch = (tokens, mask, labels)
    prog = pt.partition(model, pt.Mesh({"cp": 2}), [T.context_parallel("cp", load_balance=lb)], example_inputs=batch,
                        loss_fn=padded_loss)
    ref = copy.deepcopy(model)
    ref_loss = padded_loss(ref, *batch)
    ref_loss.backward()
    loss, grads = prog.loss_and_grads(*batch)
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=0)
    floor = GRAD_RTOL * max(p.grad.abs().max().item() for p in ref.parameters())
    for k, p in ref.named_parameters():
        assert (grads[k] - p.grad).abs().max().item() <= GRAD_RTOL * p.grad.abs().max().item() + floor, k
    assert all(prog.sharding(f"inputs.{i}").dims[1] == ("cp",) for i in range(3))


@pytest.mark.parametrize("lb", [False, True], ids=["contiguous", "balanced"])
def test_cp_dp_megatron_zero3_on_2x2x2_trains_like_one_device(lb):
    """CP x DP x TP x ZeRO-3 (issue 38's composition goal): three steps of AdamW equal one device's."""
    from harness import adamw, train_next_to_eager

    model, tokens = llama("sdpa").train(), torch.randint(0, 64, (4, 16))
    ref = copy.deepcopy(model)
    schedule = [T.data_parallel("batch"), T.context_parallel("cp", load_balance=lb), T.megatron("model"),
                T.zero(3, "batch")]
    prog = pt.partition(model, pt.Mesh({"batch": 2, "cp": 2, "model": 2}), schedule, example_inputs=(tokens,),
                        loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
    train_next_to_eager(prog, ref, [(tokens,)] * 3, loss_fn, make_opt=adamw(eps=1e-5))


@pytest.mark.parametrize("causal", [True, False])
def test_attention_rules_and_blockwise_kernels_verify(causal):
    """The verifier (partir_torch/verify.py) tiles every factor of the CPU flash attention and its backward 2 and 4
    ways, runs each rank (the causal kernels of lower/cp.py at each rank's offset) and compares with the whole op;
    grouped-query heads (4 query heads, 2 key/value heads)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from partir_torch.verify import verify_graph

    def step(q, k, v):
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return torch.autograd.grad(out.square().sum(), (q, k, v))

    gm = make_fx(step, tracing_mode="fake")(torch.randn(2, 4, 8, 4), torch.randn(2, 2, 8, 4), torch.randn(2, 2, 8, 4))
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default in targets
    report = verify_graph(gm)
    assert report.factor_checks > 10 and not report.wrong and not report.missing and not report.errors, str(report)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("form", ["gathered", "ring"])
def test_zigzag_blockwise_attention_matches_causal_attention(form, n):
    """lower/zigzag.py on each rank of a zigzag layout (rank r holds chunks r and 2n-1-r): the rank's rows of the
    causal attention and their dq equal the whole kernel's; dk, dv summed over the ranks equal the whole kernel's;
    grouped-query heads. Each rank computes 2 diagonal and 2n-1 whole c x c blocks, every one of them visible
    (gathered: slot 1 against the first half, chunks 0..n-1, in one call)."""
    from partir_torch.lower.zigzag import Zigzag, zigzag_order
    from partir_torch.verify import _Eager

    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    torch.manual_seed(0)
    S, c = 16, 16 // (2 * n)
    q, k, v, g = torch.randn(2, 4, S, 8), torch.randn(2, 2, S, 8), torch.randn(2, 2, S, 8), torch.randn(2, 4, S, 8)
    out, lse = fwd(q, k, v, 0.0, True)[:2]
    want = [x.index_select(2, zigzag_order(S, n)) for x in (out, lse, *bwd(g, q, k, v, out, lse, 0.0, True))]
    qz, kz, vz, gz = (x.index_select(2, zigzag_order(S, n)) for x in (q, k, v, g))
    rank = lambda x, r: x[:, :, 2 * c * r:2 * c * (r + 1)]    # noqa: E731 - rank r's contiguous tile of the layout
    dk, dv, calls = torch.zeros_like(kz), torch.zeros_like(vz), []
    for r in range(n):
        zz, qr = Zigzag(_Eager(), torch.tensor(r), n, c, {}), rank(qz, r)
        if form == "gathered":
            steps = zz.gathered(qr, kz, vz)
            o, l = zz.forward(qr, steps)
            dq, dk_r, dv_r = zz.gathered_backward(rank(gz, r), qr, kz, vz, o, l)
            dk, dv = dk + dk_r, dv + dv_r
            calls.append([(s if isinstance(s, int) else int(s), k.shape[2] // c, causal) for s, k, _, causal in steps])
        else:
            block = lambda s, r=r: (rank(kz, (r - s) % n), rank(vz, (r - s) % n))     # noqa: E731

            def collect(s, a, b, r=r):
                rank(dk, (r - s) % n).add_(a)
                rank(dv, (r - s) % n).add_(b)
            o, l = zz.ring_forward(qr, block)
            dq = zz.ring_backward(rank(gz, r), qr, o, l, block, collect)
        for got, w in zip((o, l, dq), (want[0], want[1], want[2])):
            torch.testing.assert_close(got, rank(w, r), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dk, want[3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dv, want[4], rtol=1e-5, atol=1e-5)
    if form == "gathered":            # slot 0 (chunk r): r whole blocks; slot 1 (chunk 2n-1-r): 2n-1-r whole blocks
        for r, steps in enumerate(calls):
            assert steps[:3] == [(0, 1, True), (1, 1, True), (1, n, False)] and len(steps) == n + 2
            assert Counter(steps[3:]) == {k: m for k, m in {(0, 1, False): r, (1, 1, False): n - 1 - r}.items() if m}


def _balanced_ring_worker(rank, port, ckpt, queue):
    """One of 4 gloo ranks: load-balanced ring CP on the whole axis; the loss and the largest gradient error
    against one device (computed on every rank) as plain floats."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    out = {"rank": rank}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timedelta(seconds=60))
        model, tokens = llama("sdpa"), torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        ref = copy.deepcopy(model)
        ref_loss = loss_fn(ref, tokens)
        ref_loss.backward()
        prog = pt.partition(model, pt.Mesh({"cp": 4}), [T.context_parallel("cp", attention="ring", load_balance=True)],
                            example_inputs=(tokens,), loss_fn=loss_fn)
        loss, grads = prog.loss_and_grads(tokens)
        out["loss"], out["ref_loss"] = float(loss), float(ref_loss)
        floor = max(p.grad.abs().max().item() for p in ref.parameters())
        out["grad_err"] = max((grads[k] - p.grad).abs().max().item() / (p.grad.abs().max().item() + floor)
                              for k, p in ref.named_parameters())
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent
        import traceback
        out["fatal"] = traceback.format_exc()
    queue.put(out)


def test_cp_load_balanced_ring_on_real_ranks():
    """4 gloo ranks (the ring's transfers are real point-to-point sends): each rank's input tile is its two zigzag
    chunks of the global batch; loss and gradients equal one device."""
    from spawn import spawn_ranks

    res = spawn_ranks(_balanced_ring_worker, 4, 300, prefix="partir_cp_lb_")
    for rank, r in sorted(res.items()):
        assert "fatal" not in r, f"rank {rank}:\n{r['fatal']}"
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["grad_err"] <= 1e-5, f"rank {rank}: gradient error {r['grad_err']:.3e}"


# -- composition with the capture tactics and the pipeline (issue 38 item 2) ---------------------------------------
def _cp_records(prog) -> list:
    """CP's collectives; each is CP's by its record and by prog.explain of the value it moves."""
    recs = [r for r in prog.collectives() if r.axis == "cp" and r.why == "tactic"]
    for r in recs:
        if r.kind != "all_reduce":
            why = prog.explain(r.value)
            assert r.tactic == "CP" and re.search(r"axis 'cp': tiled\(dim 2\) by (tactic )?CP", why), (r, why)
    assert "axis 'cp': tiled(dim 1) by tactic CP: seeded" in prog.explain("inputs.0")
    return recs


@pytest.mark.parametrize("attention,lb", [("allgather", False), ("ring", False), ("ring", True)])
def test_cp_composes_with_remat(attention, lb):
    """remat of whole decoder layers: the backward recomputes each layer's attention, so the recomputed kernels run
    as CP runs them (gathered or ring, balanced) and their transfers are CP's, in the backward; loss and every
    gradient equal one device. The ring's per-layer count grows by the recomputed forward's 2 (n - 1) permutes."""
    model, tokens = llama("sdpa"), torch.randint(0, 64, (2, 16))
    n, layers = 2, model.config.num_hidden_layers
    sched = [T.context_parallel("cp", attention=attention, load_balance=lb), T.remat("model.layers.*")]
    prog = pt.partition(model, pt.Mesh({"cp": n}), sched, example_inputs=(tokens,), loss_fn=loss_fn)
    assert_grads_match(prog, model, (tokens,), f"CP {attention} lb={lb} x remat")
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    recomputed = [x for x in prog.captured.gm.graph.nodes if x.target is fwd and x.meta.get("partir_recompute_of")]
    assert len(recomputed) == layers
    recs = _cp_records(prog)
    assert all(r.tactic == "CP" for r in recs)
    if attention == "ring":
        kinds = Counter((r.kind, r.phase) for r in recs if r.kind == "collective_permute")
        assert kinds == {("collective_permute", "forward"): layers * 2 * (n - 1),
                         ("collective_permute", "backward"): layers * (4 * (n - 1) + 2 * n)}
    else:
        assert Counter((r.kind, r.phase) for r in recs if r.kind != "all_reduce") == {
            ("all_gather", "forward"): 2 * layers, ("all_gather", "backward"): 2 * layers,
            ("reduce_scatter", "backward"): 2 * layers}


def _bf16_steps(model, batch, steps, lr=0.1):
    """Mixed precision on one device as DESIGN's MixedPrecision does it (tests/test_compose.py's _eager): an fp32
    master copy, forward and backward on a bf16 copy, fp32 gradients into SGD."""
    master, losses = copy.deepcopy(model), []
    opt = torch.optim.SGD(master.parameters(), lr=lr)
    for _ in range(steps):
        work = copy.deepcopy(master).to(torch.bfloat16)
        loss = loss_fn(work, *batch).float()
        loss.backward()
        for p, w in zip(master.parameters(), work.parameters()):
            p.grad = w.grad.float()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: p.detach() for k, p in master.named_parameters()}


@pytest.mark.parametrize("attention,lb", [("allgather", False), ("ring", False), ("allgather", True)])
def test_cp_composes_with_mixed_precision(attention, lb):
    """bf16 compute under CP: the keys and values travel in bf16 (half the fp32 bytes), named CP's; two SGD steps
    equal one device's bf16 steps to bf16 precision (tests/test_compose.py's tolerances: 2% on the loss, each
    parameter within a quarter of how far the steps moved it; a lost or doubled reduction is 50% or more)."""
    model, tokens = llama("sdpa"), torch.randint(0, 64, (2, 16))
    init = {k: p.detach().clone() for k, p in model.named_parameters()}
    want_losses, want = _bf16_steps(model, (tokens,), 2)
    sched = [T.mixed_precision(), T.context_parallel("cp", attention=attention, load_balance=lb)]
    prog = pt.partition(model, pt.Mesh({"cp": 2}), sched, example_inputs=(tokens,), loss_fn=loss_fn,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    got_losses = [float(prog.train_step(tokens)) for _ in range(2)]
    got = prog.gather_parameters()
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=2e-2, atol=0)
    for k in want:
        assert got[k].dtype == torch.float32, k
        moved, err = (want[k] - init[k]).abs().max(), (got[k] - want[k]).abs().max()
        assert err <= 0.25 * moved + 1e-6, f"{k}: off by {err:.3g}, moved {moved:.3g}"
    kv = [r for r in _cp_records(prog) if r.kind in ("all_gather", "reduce_scatter", "collective_permute")]
    assert kv and all(r.tactic == "CP" and r.dtype == "bfloat16" for r in kv)


@pytest.mark.parametrize("attention,lb", [("allgather", False), ("ring", False), ("allgather", True)])
def test_cp_composes_with_pipeline(attention, lb):
    """CP x PP on {pp: 2, cp: 2} (1F1B, 2 micro-batches): each stage's layers run CP on their micro-batch; two AdamW
    steps equal one device's. Load balancing finds HF's label shift in each micro-batch (the pipeline's capture
    views the batch as (micro-batches, B / m, S) and selects one: cpbalance._labels_of looks through it)."""
    from harness import adamw, train_next_to_eager

    model, tokens = llama("sdpa"), torch.randint(0, 64, (4, 16))
    ref = copy.deepcopy(model)
    sched = [T.pipeline("pp", 2, "1F1B", 2), T.context_parallel("cp", attention=attention, load_balance=lb)]
    prog = pt.partition(model, pt.Mesh({"pp": 2, "cp": 2}), sched, example_inputs=(tokens,), loss_fn=loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    train_next_to_eager(prog, ref, [(tokens,)] * 2, loss_fn, adamw(1e-3), what=f"PP x CP {attention} lb={lb}")
    kinds = Counter(r.kind for r in _cp_records(prog) if r.tactic == "CP")
    layers, micro = model.config.num_hidden_layers, 2
    if attention == "ring":
        assert kinds["collective_permute"] == layers * micro * (4 * 1 + 2 * 2)
    else:
        assert kinds["all_gather"] == kinds["reduce_scatter"] == 2 * layers * micro


# -- attention forms beyond causal and padding (issue 38 item 1's "anything else") ---------------------------------
def _tiny(kind: str, attn: str, window: int | None = 5):
    """A stock HF decoder from a tiny config: Mistral (sliding_window on every layer), Qwen2 (use_sliding_window),
    Gemma-2 (sliding and full layers alternating; eager attention, as its docs say: SDPA has no softcap)."""
    import transformers

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    if kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=window, **common))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            use_sliding_window=window is not None, sliding_window=window, max_window_layers=0, **common))
    else:
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            sliding_window=window or 4096, head_dim=8, query_pre_attn_scalar=8, **common))
    model.config._attn_implementation = attn
    return model


@pytest.mark.parametrize("kind,attn,attention,lb", [("mistral", "sdpa", "ring", False),
                                                    ("mistral", "sdpa", "ring", True),
                                                    ("qwen2", "sdpa", "allgather", True),
                                                    ("gemma2", "eager", "allgather", True)])
def test_cp_sliding_window_matches_one_device(kind, attn, attention, lb):
    """Sliding-window attention (HF builds a (B, 1, T, T) mask from the query and key positions, no is_causal): the
    mask's rows are built at each rank's positions (load-balanced: the original positions in zigzag order), its
    columns address the gathered or ring-passed key blocks: exact. The window must be live (the model's loss
    differs from the same weights without it). HF's sliding KV cache keeps the last window of keys (a slice of the
    sequence no loss reads): load balancing does not refuse it."""
    tokens = torch.randint(1, 64, (2, 16))
    model = _tiny(kind, attn)
    whole = _tiny(kind, attn, window=None)
    with torch.no_grad():
        assert abs(loss_fn(model, tokens).item() - loss_fn(whole, tokens).item()) > 1e-3, "the window is not live"
    prog = pt.partition(model, pt.Mesh({"cp": 2}), [T.context_parallel("cp", attention=attention, load_balance=lb)],
                        example_inputs=(tokens,), loss_fn=loss_fn)
    assert_grads_match(prog, model, (tokens,), f"{kind} window CP {attention} lb={lb}")


def packed_loss(m, x, pos):
    """Packed sequences the way HF's masking_utils finds them: position_ids restarting, no attention_mask, no cache
    (use_cache=False, as in training): a block-diagonal causal mask."""
    return m(input_ids=x, position_ids=pos, labels=x, use_cache=False).loss


@pytest.mark.parametrize("attn,attention", [("sdpa", "allgather"), ("sdpa", "ring"), ("eager", "allgather")])
def test_cp_packed_sequences_match_one_device(attn, attention):
    """A document mask (two sequences packed per row, position_ids restarting at 0): HF finds the documents with a
    diff and a cumsum along the sequence, which CP gathers (B x T integers); the mask's rows are local: exact. The
    reference is block-diagonal: the second document's logits equal those of the document alone."""
    model, tokens = llama(attn), torch.randint(1, 64, (2, 16))
    pos = torch.stack([torch.cat([torch.arange(6), torch.arange(10)]), torch.cat([torch.arange(11), torch.arange(5)])])
    with torch.no_grad():
        packed = model(input_ids=tokens, position_ids=pos, use_cache=False).logits
        alone = model(input_ids=tokens[:1, 6:], use_cache=False).logits
    torch.testing.assert_close(packed[:1, 6:], alone, rtol=1e-5, atol=1e-5)
    prog = pt.partition(model, pt.Mesh({"cp": 2}), [T.context_parallel("cp", attention=attention)],
                        example_inputs=(tokens, pos), loss_fn=packed_loss)
    ref = copy.deepcopy(model)
    ref_loss = packed_loss(ref, tokens, pos)
    ref_loss.backward()
    loss, grads = prog.loss_and_grads(tokens, pos)
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=0)
    floor = GRAD_RTOL * max(p.grad.abs().max().item() for p in ref.parameters())
    for k, p in ref.named_parameters():
        assert (grads[k] - p.grad).abs().max().item() <= GRAD_RTOL * p.grad.abs().max().item() + floor, k


def test_cp_load_balancing_refuses_packed_sequences():
    """Load balancing lays the sequence out in zigzag order; HF's document search (diff of position_ids) depends on
    their order: refused by name, with the fix (plain CP is exact, the test above)."""
    tokens = torch.randint(1, 64, (2, 16))
    pos = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16).clone()
    with pytest.raises(pt.PartitionError, match=r"depends on the order of dim 1 .*document mask found from "
                                                r"position_ids.*Use load_balance=False"):
        pt.partition(llama("sdpa"), pt.Mesh({"cp": 2}), [T.context_parallel("cp", load_balance=True)],
                     example_inputs=(tokens, pos), loss_fn=packed_loss)


# -- the automatic tactic (issue 38 item 2: "the automatic tactic may choose a CP axis when the sequence is long") --
def _long_llama(seq: int):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                                   bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _auto(model, tokens, limit):
    hw = pt.sim.hardware("h100", nodes=1, gpus_per_node=4)
    return pt.partition(model, pt.Mesh({"cp": 4}), [T.automatic("cp", hardware=hw, memory_limit=limit, budget_s=3,
                                                                progress=False)],
                        example_inputs=(tokens,), loss_fn=loss_fn)


def test_automatic_search_offers_and_chooses_context_parallel_for_a_long_sequence():
    """Sequence 2048, batch 1 (no batch to split): the search offers context_parallel as a preset (lowered and
    simulated with the pure preset combinations); under a memory limit only CP meets (activations dominate: CP
    3.5 MB, Megatron + SP 4.8 MB, replicated 11.6 MB per device as simulated), it chooses it, and the program
    equals one device. A short sequence is not offered CP."""
    model, tokens = _long_llama(2048), torch.randint(0, 64, (1, 2048))
    prog = _auto(model, tokens, 4e6)
    rep = prog.search_reports[-1]
    assert rep.within_limit and rep.chosen.label() == "cp: context_parallel", prog.search_report()
    assert any(c.label() == "cp: context_parallel" and c.preset_only for c in rep.lowered)
    assert prog.sharding("inputs.0").dims[1] == ("cp",)
    assert "action 'context_parallel'" in prog.explain("inputs.0")
    assert_grads_match(prog, model, (tokens,), "automatic CP")
    short = _auto(_long_llama(256), torch.randint(0, 64, (1, 256)), None).search_reports[-1]
    assert not any("context_parallel" in a.label for a in short.chosen.actions) and "context_parallel" not in \
        {c.label().split(": ")[-1] for c in short.lowered}
