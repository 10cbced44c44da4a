"""Stock Hugging Face models (small random-init configs, no downloads) partitioned with data parallel + Megatron +
ZeRO-3 on a 2x2x2 mesh match the single-device loss and updated parameters (issue 4); an HF MoE (Mixtral) too."""
from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import partir_torch as pt
from partir_torch import tactics as T

from tests.harness import adamw, hf_gpt2 as gpt2, hf_llama as llama, train_next_to_eager





def loss_fn(m, x):
    """The documented call: the model shifts the labels and computes its own loss (default flags: KV cache on)."""
    return m(input_ids=x, labels=x).loss


@pytest.mark.parametrize("build", [gpt2, llama], ids=["GPT2LMHeadModel", "LlamaForCausalLM"])
def test_bp_mp_z3_on_2x2x2_matches_single_device(build):
    torch.manual_seed(0)
    model = build().train()
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (8, 16))
    mesh = pt.Mesh({"batch": 2, "fsdp": 2, "model": 2})
    schedule = [T.data_parallel("batch"), T.data_parallel("fsdp", name="BP-fsdp"), T.megatron("model"),
                T.zero(3, "fsdp")]
    # eps 1e-5: a key bias's gradient is zero in exact arithmetic, which eps 1e-8 would turn into +-lr steps
    prog = pt.partition(model, mesh, schedule, example_inputs=(tokens,), loss_fn=loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
    train_next_to_eager(prog, ref, [(tokens,)] * 3, loss_fn, make_opt=adamw(eps=1e-5))
    # Megatron found the projections by structure (fused c_attn with Conv1D weights in GPT-2; q/k/v/o and the
    # gated MLP in Llama): 2 all-reduces per layer forward and 2 backward, and no all-gather on "model"
    c = Counter((r.kind, r.axis) for r in prog.collectives())
    assert c[("all_reduce", "model")] == 4 * 2
    assert c[("all_gather", "model")] == 0
    # no conflicts: GPT-2's fused q/k/v bias, tiled strided by Megatron, stays whole on "fsdp" (explain says so)
    assert prog.conflicts == []


def test_megatron_vocab_tiles_an_untied_lm_head_and_the_loss_runs_vocabulary_parallel():
    """HF Llama with tie_word_embeddings=False: megatron(vocab=True) tiles lm_head on the vocabulary too, so no rank
    holds the whole logits, and training matches one device; without vocab=True the warning names the head."""
    torch.manual_seed(0)
    model = llama()                                  # LlamaConfig's default: tie_word_embeddings=False
    assert not model.config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight
    ref, tokens = copy.deepcopy(model), torch.randint(0, 64, (4, 16))
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}),
                        [T.data_parallel("batch"), T.megatron("model", vocab=True)], example_inputs=(tokens,),
                        loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
    train_next_to_eager(prog, ref, [(tokens,)] * 3, loss_fn, make_opt=adamw(eps=1e-5))
    assert prog.sharding("params.lm_head.weight").dims[0] == ("model",)
    assert prog.sharding("params.model.embed_tokens.weight").dims[0] == ("model",)
    with pytest.warns(UserWarning, match=r"lm_head.weight: the output head: every rank computes the whole "
                                         r"vocabulary's logits .* megatron\('model', vocab=True\)"):
        pt.partition(copy.deepcopy(ref), pt.Mesh({"model": 2}), [T.megatron("model")], example_inputs=(tokens,),
                     loss_fn=loss_fn)


def test_sequence_parallel_gathers_each_norm_output_once():
    """Data parallel + Megatron + sequence parallelism on HF Llama: q_proj, k_proj and v_proj each view the attention
    norm's output as (B*T, d), gate_proj and up_proj the MLP norm's, and with the batch and the sequence both tiled
    each view was gathered on its own: 5 gathers per layer in the forward, 2.5x the bytes of Megatron-SP's
    program. Equal views of one value are one node (capture/tidy.py share_views): one gather per norm output.
    Equal to one device."""
    torch.manual_seed(0)
    model = llama().train()
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (4, 16))
    schedule = [T.data_parallel("batch"), T.megatron("model"), T.sequence_parallel("model")]
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), schedule, example_inputs=(tokens,),
                        loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
    train_next_to_eager(prog, ref, [(tokens,)] * 2, loss_fn, make_opt=adamw(eps=1e-5))
    gathers = [r for r in prog.collectives()
               if r.kind == "all_gather" and r.axis == "model" and r.phase == "forward" and r.why == "tactic"]
    assert len(gathers) == 2 * model.config.num_hidden_layers, [(r.value, r.source) for r in gathers]
    # the norms' weight gradients, partial on both axes, are reduced on "model" first: the data-parallel gradient
    # reduction stays one bucket on this small model (lower/reshard.py), as without sequence parallelism
    grads = [r for r in prog.collectives() if r.axis == "batch" and r.why == "gradient"]
    assert len(grads) == 1, [r.value for r in grads]


def mixtral():
    """Stock Mixtral with its "batched_mm" experts: each token's expert weights are selected by index
    (gate_up_proj[expert_ids]), no data-dependent shapes."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=16, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "batched_mm"
    return MixtralForCausalLM(cfg)


def test_mixtral_bp_mp_z3_matches_single_device_and_refuses_expert_parallel():
    """An HF MoE: BP + MP + Z3 on 2x2 equals one device; expert_parallel is refused with the reason (per-token
    selection of expert weights would gather every expert on every rank)."""
    torch.manual_seed(0)
    model = mixtral().train()
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (8, 16))
    schedule = [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")]
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), schedule, example_inputs=(tokens,),
                        loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
    train_next_to_eager(prog, ref, [(tokens,)] * 2, loss_fn, make_opt=adamw(eps=1e-5))
    assert prog.conflicts == []
    # the per-token expert weights (tokens x 2I x D) are tiled with the tokens; their gradient is accumulated into
    # zeros (index_put), so each rank scatters its own tokens and the expert gradients are reduced like any other
    # (before that rule: 12.8 MB of all_gathers of per-token weights and their gradients per step)
    gathered = sum(r.nbytes for r in prog.collectives() if r.kind == "all_gather")
    params = sum(p.numel() * 4 for p in ref.parameters())
    assert gathered <= 2 * params, (gathered, params)
    with pytest.raises(pt.PartitionError, match=r"experts.gate_up_proj .* aten.index.Tensor"):
        pt.partition(mixtral(), pt.Mesh({"expert": 2}), [T.expert_parallel("expert")], example_inputs=(tokens,),
                     loss_fn=loss_fn)


def mistral():
    """Mistral with a sliding window shorter than the sequence: its cache layers (DynamicSlidingWindowLayer) keep
    the last window - 1 tokens, a cumulative length and a window tensor."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, sliding_window=4,
                        bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    return MistralForCausalLM(cfg)


def assert_same_cache(got, want):
    """The same cache class, layer classes and attributes: tensors equal (keys, values, a window tensor), the rest
    (lengths, flags, devices) identical."""
    assert type(got) is type(want) and len(got.layers) == len(want.layers)
    for a, b in zip(got.layers, want.layers):
        assert type(a) is type(b) and vars(a).keys() == vars(b).keys()
        for k, v in vars(b).items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(vars(a)[k], v, rtol=1e-5, atol=1e-6, msg=k)
            else:
                assert vars(a)[k] == v, (k, vars(a)[k], v)


@pytest.mark.parametrize("build", [gpt2, llama, mistral],
                         ids=["GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM"])
def test_forward_and_eval_step_with_the_default_kv_cache_equal_eager(build):
    """prog.forward(tokens) on a stock causal LM with its default use_cache=True, after a training step and at
    another batch size, returns what eager returns: the logits and the KV cache, gathered whole into a new cache of
    eager's class, which eager decoding continues from as from its own. eval_step with the documented loss_fn
    (cache on) too. BP + MP on 2x2."""
    torch.manual_seed(0)
    model = build().train()
    assert model.config.use_cache
    ref = copy.deepcopy(model)
    batch = torch.randint(0, 64, (8, 8))
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), [T.data_parallel("batch"), T.megatron("model")],
                        example_inputs=(batch,), loss_fn=loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
    train_next_to_eager(prog, ref, [(batch,)], loss_fn, make_opt=adamw(eps=1e-5))
    ref.eval()
    tokens = batch[:4]
    out = prog.forward(tokens)
    with torch.no_grad():
        want = ref(tokens)
        torch.testing.assert_close(prog.eval_step(tokens), loss_fn(ref, tokens), rtol=1e-5, atol=1e-6)
    assert type(out) is type(want) and list(out.keys()) == list(want.keys()) == ["logits", "cache"]
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-6)
    assert_same_cache(out.cache, want.cache)
    nxt = torch.randint(0, 64, (4, 1))
    with torch.no_grad():                       # decoding goes on from the program's cache as from eager's
        torch.testing.assert_close(ref(nxt, cache=out.cache).logits, ref(nxt, cache=want.cache).logits,
                                   rtol=1e-5, atol=1e-6)
    assert_same_cache(out.cache, want.cache)    # both grew by the same token
    assert prog.forward(tokens).cache is not out.cache      # a new cache per call


def test_forward_program_without_loss_fn_returns_the_cache_and_a_flag_or_cache_passed_in_is_refused():
    """partition(model, ..., example_inputs) without a loss_fn: prog(tokens) is model(tokens), cache included.
    A flag or a cache passed to forward is refused naming it and the fix (inputs are tensors)."""
    torch.manual_seed(0)
    model = llama().eval()
    tokens = torch.randint(0, 64, (4, 8))
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), [T.data_parallel("batch"), T.megatron("model")],
                        example_inputs=(tokens,))
    out = prog(tokens)
    with torch.no_grad():
        want = model(tokens)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-6)
    assert_same_cache(out.cache, want.cache)
    with pytest.raises(pt.PartitionError, match=r"forward: input\[0\]\['use_cache'\] is a bool \(False\); .*"
                                                r"model.config.use_cache = False"):
        prog.forward(input_ids=tokens, use_cache=False)
    with pytest.raises(pt.PartitionError, match=r"forward: input\[1\] is a DynamicCache .* continue decoding "
                                                r"eagerly from it"):
        prog.forward(tokens[:, -1:], out.cache)


@pytest.mark.parametrize("build", [gpt2, llama], ids=["GPT2LMHeadModel", "LlamaForCausalLM"])
def test_padding_mask_keeps_the_batch_split_under_data_parallel(build):
    """HF builds the attention mask as `padding_mask[batch_idx, kv_idx]` (an index by the batch's own positions):
    under data parallelism each rank indexes its own rows, no collective moves the mask (capture/tidy.py
    identity_indices), and the padded rows train as on one device."""
    torch.manual_seed(0)
    model = build().train()
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (4, 16))
    mask = torch.ones(4, 16, dtype=torch.int64)
    mask[1, 10:] = 0
    mask[3, 12:] = 0

    def masked_loss(m, x, am):
        return m(input_ids=x, attention_mask=am, labels=x).loss

    prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=(tokens, mask),
                        loss_fn=masked_loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert [r for r in prog.collectives() if r.why == "reshard"] == []
    assert {r.kind for r in prog.collectives()} == {"all_reduce"}
    train_next_to_eager(prog, ref, [(tokens, mask)] * 2, masked_loss,
                        make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1))


def mixtral_default():
    """Stock Mixtral with HF's default experts ("grouped_mm": tokens sorted by expert over the whole batch)."""
    mixtral_cfg = mixtral().config
    mixtral_cfg._experts_implementation = "grouped_mm"
    from transformers import MixtralForCausalLM

    return MixtralForCausalLM(mixtral_cfg)


@pytest.mark.parametrize("schedule", ["BP", "BP+Z3"])
def test_grouped_mm_experts_keep_tokens_on_their_rank(schedule):
    """HF's grouped-mm experts are one per-token op (rules/moe.py): under data parallelism no collective moves the
    MoE input (before: the sort over the global batch gathered it in every layer), and training equals one device."""
    torch.manual_seed(0)
    model = mixtral_default().train()
    assert model.config._experts_implementation == "grouped_mm"
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (8, 16))
    mesh = pt.Mesh({"batch": 2}) if schedule == "BP" else pt.Mesh({"batch": 2, "fsdp": 2})
    tactics = [T.data_parallel("batch")] if schedule == "BP" else [
        T.data_parallel("batch"), T.data_parallel("fsdp", name="BP-fsdp"), T.zero(3, "fsdp")]
    prog = pt.partition(model, mesh, tactics, example_inputs=(tokens,), loss_fn=loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
    ops = Counter(str(n.target) for n in prog.plan.captured.gm.graph.nodes)
    assert ops["partir.experts_grouped.default"] == 2 and ops["partir.experts_grouped_backward.default"] == 2
    assert [r for r in prog.collectives() if r.why == "reshard"] == []
    assert {r.kind for r in prog.collectives() if r.why != "state"} == {"all_reduce"} or schedule != "BP"
    train_next_to_eager(prog, ref, [(tokens,)] * 2, loss_fn, make_opt=adamw(eps=1e-5))
    assert prog.simulate(pt.sim.hardware("h100", gpus_per_node=mesh.size), stages=False).model_flops > 0
    if schedule == "BP":
        with pytest.raises(pt.PartitionError, match="grouped-mm experts"):
            pt.partition(mixtral_default(), pt.Mesh({"expert": 2}), [T.expert_parallel("expert")],
                         example_inputs=(tokens,), loss_fn=loss_fn)


def test_mfu_is_the_models_whatever_the_schedule():
    """Issue 23: MFU counts the model's FLOPs (the captured step's), so MFU x step time is one figure for every
    schedule of a stock model; a schedule with redundant work (megatron's replicated head) has the lower MFU."""
    tokens = torch.randint(0, 64, (8, 16))
    hw = pt.sim.hardware("h100", gpus_per_node=4)
    work = []
    for mesh, schedule in (({"batch": 4}, [T.data_parallel("batch")]),
                           ({"batch": 4}, [T.data_parallel("batch"), T.zero(3, "batch")]),
                           ({"batch": 2, "model": 2}, [T.data_parallel("batch"), T.megatron("model")])):
        torch.manual_seed(0)
        model = gpt2()
        prog = pt.partition(model, pt.Mesh(mesh), schedule, example_inputs=(tokens,), loss_fn=loss_fn,
                            optimizer=torch.optim.AdamW(model.parameters()))
        work += [r.mfu * r.step_time_s for r in prog.simulate(hw).stages]
    assert max(work) == pytest.approx(min(work), rel=1e-3)


def test_mixtral_eager_experts_loop_is_one_capture_for_every_routing():
    """Issue 26 item 2: HF's eager experts loop (`for expert_idx in expert_hit: top_k_pos, token_idx =
    torch.where(expert_mask[expert_idx])`, `index_add_`): each expert's selection is traced at a static size
    (capture/counts.py), so batches routing different token counts to each expert run one program, equal to one
    device, tokens kept on their rank. `expert_hit` (which experts got tokens) stays a guard: its rows are iterated
    in Python; every expert is hit by these batches, so that is one path."""
    from transformers import MixtralForCausalLM

    cfg = mixtral().config
    cfg.num_hidden_layers, cfg._experts_implementation = 1, "eager"
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 64, (4, 8), generator=g),) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=batches[0],
                            loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
        train_next_to_eager(prog, ref, batches, loss_fn, make_opt=adamw(eps=1e-5))
    cap = prog.captured
    assert len(cap.padded) == 4 and all("torch.where(expert_mask[expert_idx])" in w for w, _ in cap.padded)
    assert [w.split(": ", 1)[1] for w, _ in cap.unpadded] == [
        "expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()"]
    assert not any(g.count for g in cap.guards if "torch.where" in g.where)
    assert len(prog.shapes()) == 1 and prog.shapes()[0].calls == 3
    assert {(r.kind, r.why) for r in prog.collectives()} <= {("all_reduce", "tactic"), ("all_reduce", "gradient")}


def test_dynamic_padding_makes_the_sequence_length_one_symbol():
    """Stock HF Llama under data parallel + Megatron + sequence parallelism, each batch of its own length as a
    padding collator gives them: from the second length the program is one program in (batch, s) (runtime/dims.py),
    so 10, 14 and 6 are instantiated without capture; 3 leaves a sequence-parallel shard of 3/2 rows, so it is
    partitioned in full (uneven). Every step equals one device."""
    torch.manual_seed(0)
    model = llama().train()
    ref = copy.deepcopy(model)
    schedule = [T.data_parallel("batch"), T.megatron("model"), T.sequence_parallel("model")]
    batches = [(torch.randint(0, 64, (4, n)),) for n in (8, 12, 10, 14, 3, 6)]
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), schedule, example_inputs=batches[0],
                        loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        train_next_to_eager(prog, ref, batches, loss_fn, make_opt=adamw(eps=1e-5))
    instances = sorted(r.signature[0][0][1] for r in prog.shapes() if r.instance_of is not None)
    assert instances == [6, 10, 14], [str(r) for r in prog.shapes()]     # from the second length on (issue 40)
    full = [str(w.message) for w in record if "s=3) are partitioned in full" in str(w.message)]
    assert len(full) == 1 and "3/2 at s = (4, 3)" in full[0], full


def test_big_bird_switching_to_full_attention_on_its_first_call_trains_like_eager():
    """BigBird (block-sparse by default) on 16 tokens switches to full attention inside its first forward and
    builds new attention modules whose nn.Linear inits draw from the generator (capture/settle.py): the step is the
    switched model's, the first step makes those draws first, as eager does, and every step's dropout (on by
    default) is eager's. Before, the captured step made the init draws at every step and diverged from step 2."""
    from transformers import BigBirdConfig, BigBirdForCausalLM

    cfg = BigBirdConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, block_size=4, num_random_blocks=1)
    assert cfg.attention_type == "block_sparse" and cfg.hidden_dropout_prob > 0
    torch.manual_seed(0)
    model = BigBirdForCausalLM(cfg).train()
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (8, 16))
    with pytest.warns(UserWarning, match=r"changed the model \(2 module\(s\): bert\.encoder\.layer\.0\.attention\."
                                         r"self: BigBirdBlockSparseAttention -> BigBirdSelfAttention.*12 random"):
        prog = pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch")], example_inputs=(tokens,),
                            loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
    assert model.bert.attention_type == "original_full"
    # eps 1e-5 as above: with 1e-8 the elements whose gradient is rounding noise take +-lr steps (in float64 the
    # same three steps agree with eager to 3e-14)
    train_next_to_eager(prog, ref, [(tokens,)] * 3, loss_fn, make_opt=adamw(eps=1e-5))
