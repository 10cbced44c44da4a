"""LoRA adapters under megatron and ZeRO-3 (issue 37, item 3), on stock HF models wrapped by the real `peft`
(get_peft_model + LoraConfig), called the documented way, an optimizer over the trainable parameters only.

- megatron: a LoRA wrapper takes its base linear's role (capture/lora.py): the frozen base weight is column- or
  row-parallel as its pair says; a column base's lora_B is tiled on its output features, lora_A whole; a row base's
  lora_A is tiled on its input features, lora_B whole. The activations' collectives are the base model's Megatron
  pair's; the adapters add one r-wide gradient all_reduce each on the tensor-parallel axis (dA of a column wrapper
  sums the ranks' output features; dB of a row wrapper reads x A^T summed over them), nothing else.
- zero(3) on top shards the frozen base too; lora_dropout > 0 trains as one device does.
"""
from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch
from peft import LoraConfig, get_peft_model

import partir_torch as pt
from partir_torch import tactics as T

from tests.harness import hf_gpt2 as gpt2, hf_llama as llama, train_next_to_eager

R = 4




# (builder, LoRA targets, {base weight: (role, its tiled dim)} of layer 0; GPT-2's Conv1D weights are (in, out))
MODELS = {
    "GPT2LMHeadModel": (gpt2, ["c_attn", "c_proj", "c_fc"], "transformer.h.0",
                        {"attn.c_attn": ("column", 1), "attn.c_proj": ("row", 0), "mlp.c_fc": ("column", 1),
                         "mlp.c_proj": ("row", 0)}),
    "LlamaForCausalLM": (llama, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                         "model.layers.0",
                         {"self_attn.q_proj": ("column", 0), "self_attn.o_proj": ("row", 1),
                          "mlp.up_proj": ("column", 0), "mlp.down_proj": ("row", 1)}),
}


def loss_fn(m, x, y):
    return m(input_ids=x, labels=y).loss


def sgd(params):
    return torch.optim.SGD([p for p in params if p.requires_grad], lr=0.1)


def _partition(model, schedule, tokens):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), schedule, example_inputs=(tokens, tokens),
                            loss_fn=loss_fn, optimizer=sgd(model.parameters()))
    return prog, [str(w.message) for w in caught if "left" in str(w.message)]


def _model_axis(prog, why):
    return [(r.kind, r.phase, r.nbytes) for r in prog.collectives() if r.axis == "model" and r.why == why]


@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_gives_lora_wrappers_their_base_linears_role(name):
    build, targets, layer, roles = MODELS[name]
    torch.manual_seed(0)
    plain = build().train()
    # init_lora_weights=False: lora_B starts non-zero, so every adapter's gradient is non-zero from the first step;
    # lora_dropout > 0: its masks must match one device's
    model = get_peft_model(copy.deepcopy(plain), LoraConfig(r=R, target_modules=targets, lora_dropout=0.1,
                                                            init_lora_weights=False)).train()
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (4, 16))
    schedule = [T.data_parallel("batch"), T.megatron("model")]
    prog, left = _partition(model, schedule, tokens)
    train_next_to_eager(prog, ref, [(tokens, tokens)] * 3, loss_fn, make_opt=sgd)

    # the base weights tiled as their pair says, the adapters split as their base
    pre = f"params.base_model.model.{layer}."
    for mod, (role, dim) in roles.items():
        base, a, b = (f"{pre}{mod}.{p}.weight" for p in ("base_layer", "lora_A.default", "lora_B.default"))
        assert prog.sharding(base).tiled_axes() == {"model": dim}, (base, prog.sharding(base))
        tiled, whole = (b, a) if role == "column" else (a, b)
        assert prog.sharding(tiled).tiled_axes() == {"model": 0 if role == "column" else 1}, tiled
        assert "model" not in prog.sharding(whole).tiled_axes(), whole
        text = prog.explain(base)
        assert f"{role}-parallel on axis 'model' as the base linear of the LoRA wrapper " \
               f"'base_model.model.{layer}.{mod}' (rank {R})" in text, text
        assert f"adapter of the LoRA wrapper 'base_model.model.{layer}.{mod}'" in prog.explain(a)
    assert not any("base_layer" in w or "lora_" in w for w in left), left

    # the activations' collectives are the plain model's Megatron pairs': the same all_reduces forward; backward
    # each pair's input gradient but the first block's (the embedding and the norms are frozen: nothing reads it)
    plain_prog, _ = _partition(plain, schedule, tokens)
    mine, base = _model_axis(prog, "tactic"), _model_axis(plain_prog, "tactic")
    assert [c for c in mine if c[1] == "forward"] == [c for c in base if c[1] == "forward"] != []
    bwd, base_bwd = ([c for c in cs if c[1] == "backward"] for cs in (mine, base))
    assert set(bwd) == set(base_bwd) and len(bwd) == len(base_bwd) - 1 == 2 * 2 - 1, (bwd, base_bwd)
    # and one r-wide gradient all_reduce per adapter (dA of a column wrapper, dB of a row wrapper: r x 32 floats)
    wrappers = sum(p.requires_grad for p in model.parameters()) // 2
    assert _model_axis(prog, "gradient") == [("all_reduce", "backward", R * 32 * 4)] * wrappers
    assert not [r for r in prog.collectives() if r.axis == "model" and r.kind != "all_reduce"]


def test_zero3_shards_the_lora_base_under_megatron():
    """BP + MP + Z3 on peft Llama: the frozen base weights are tiled on both axes (Megatron's dim, then ZeRO's),
    explain says both, and training equals one device."""
    build, targets, layer, _ = MODELS["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = get_peft_model(build(), LoraConfig(r=R, target_modules=targets, init_lora_weights=False)).train()
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (4, 16))
    prog, _ = _partition(model, [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")], tokens)
    train_next_to_eager(prog, ref, [(tokens, tokens)] * 2, loss_fn, make_opt=sgd)
    w = f"params.base_model.model.{layer}.mlp.down_proj.base_layer.weight"      # (32, 64), row-parallel
    assert tuple(prog.executor.state[w].ts[0].shape) == (32 // 2, 64 // 2)
    text = prog.explain(w)
    assert "row-parallel on axis 'model' as the base linear of the LoRA wrapper" in text
    assert "frozen (requires_grad=False): stored tiled" in text
    assert not any(n.startswith("opt.") and "base_layer" in n for n in prog.executor.state)


def test_megatron_plan_naming_a_wrapper_tiles_its_adapters_as_its_base():
    """A plan whose globs match a wrapper's adapters too ('*.q_proj.*weight'): the adapters follow their base."""
    build, targets, layer, _ = MODELS["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = get_peft_model(build(), LoraConfig(r=R, target_modules=targets))
    plan = {"*.q_proj.*weight": "colwise", "*.o_proj.*weight": "rowwise"}
    prog, _ = _partition(model, [T.data_parallel("batch"), T.megatron("model", plan=plan)], torch.randint(0, 64, (4, 16)))
    pre = f"params.base_model.model.{layer}.self_attn."
    want = {"q_proj.base_layer": {"model": 0}, "q_proj.lora_B.default": {"model": 0}, "q_proj.lora_A.default": {},
            "o_proj.base_layer": {"model": 1}, "o_proj.lora_A.default": {"model": 1}, "o_proj.lora_B.default": {}}
    assert {k: prog.sharding(f"{pre}{k}.weight").tiled_axes() for k in want} == want
