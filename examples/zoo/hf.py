"""Coverage sweep (issue 9, item 6): stock models called the stock way, partitioned, compared with one device.

Hugging Face: every architecture of transformers' causal-LM, masked-LM, seq2seq-LM and image-classification auto
mappings, built from a tiny random config (AutoConfig.for_model + every size field shrunk, recursively into
sub-configs; no weights are ever downloaded), in train mode with the config's own flags and dropout, called as the
HF Trainer does: `model(**batch).loss` with `labels` in the batch. Schedule on an emulated 2x2x2 mesh
{dp, tp, zero}: data_parallel(dp) + data_parallel(zero) + megatron(tp) + zero(3, zero) (HSDP-style, as
tests/test_hf.py); where megatron reports no linear pair (or none that its axis divides) the row falls back to
data_parallel + zero(3) (column "sched" says BP+Z3). 2 AdamW steps against a deepcopy trained eagerly, torch.manual_seed(step) before each step on
both sides (so dropout draws agree).

timm (`--suite timm`, run in .venv-timm: torchvision there is a CPU build): >= 10 families with
data_parallel(dp) + data_parallel(zero) + zero(3, zero) on the same mesh, images 8 x 3 x 32 x 32 (or the smallest
size the family accepts), cross-entropy on the logits (timm's train script).

Each architecture runs in a worker process with an alarm; the parent restarts the worker when it hangs or dies
and records a timeout. Rows are appended to a JSON-lines file as they finish (a partial run is still useful).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/hf_coverage.py            # all HF
    .venv/bin/python benchmarks/hf_coverage.py --mapping causal --limit 20                               # quick
    .venv/bin/python benchmarks/hf_coverage.py --only gpt2,llama,bert
    .venv/bin/python benchmarks/hf_coverage.py --schedule dp --out benchmarks/results/hf_dp.jsonl  # reshard bytes, DP
    .venv/bin/python benchmarks/hf_coverage.py --schedule pp --mapping causal --out benchmarks/results/hf_pp.jsonl
    .venv-timm/bin/python benchmarks/hf_coverage.py --suite timm
    .venv/bin/python benchmarks/hf_coverage.py --report benchmarks/results/hf_coverage.jsonl             # table
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
if ROOT not in sys.path:      # run as a worker script (python examples/zoo/hf.py --worker ...)
    sys.path.insert(0, ROOT)
MAPPINGS = {   # short name -> transformers.models.auto.modeling_auto mapping
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
BATCH, SEQ, IMAGE = 8, 16, 32
STEPS = 2
RTOL, ATOL = 1e-5, 1e-5          # loss and parameters (fp32; DESIGN §5.2's rtol 1e-5)
MESH = {"dp": 2, "tp": 2, "zero": 2}
SCHEDULE_ENV = "PARTIR_SWEEP_SCHEDULE"      # "dp": data_parallel alone on 2 ranks (--schedule dp); "pp": PP_MESH
PP_MESH = {"pp": 2, "dp": 2}                # --schedule pp: pipeline("pp", stages=2) + data_parallel("dp")

# Architectures that cannot run here (CPU eager, no downloads), each with its reason. Everything else is attempted;
# an eager failure of the tiny model is recorded as "skip" with the exception, so nothing is dropped silently.
SKIP = {}

# Harness-side config fixes for architectures whose fields the generic shrink cannot infer.
OVERRIDES: dict = {
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},   # the stock default lacks them
    "mamba2": {"head_dim": 16},                              # hidden_size * expand == num_heads * head_dim
    "efficientnet": {"hidden_dim": 2560},                    # the head width is round_filters(1280) at width 2.0
    "bit": {"num_groups": 4},                                # group norm over 8-channel stages
    "mobilevitv2": {"image_size": 64},                       # 32 x 32 pools down to nothing
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1, "num_hidden_layers": 3,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},   # must sum to the layers
    "xmod": {"default_language": "en_XX"},                   # the stock config names no default adapter
    # hybrids whose first two layers would all be recurrent (no attention layer: the default cache then fails)
    "bamba": {"attn_layer_indices": [1]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "deepseek_v2": {"num_experts_per_tok": 2, "n_group": 1, "topk_group": 1},   # None in the stock config
    "cvt": {"depth": (1, 2, 3)},                             # stage i indexes its drop-path list at i
    "hgnet_v2": {"stem_channels": (3, 16, 16), "stage_in_channels": (16, 32, 64, 128),
                 "stage_mid_channels": (16, 16, 32, 32), "stage_out_channels": (32, 64, 128, 64),
                 "stage_numb_of_layers": (2, 2, 2, 2), "stage_num_blocks": (1, 1, 1, 1)},   # hidden_sizes[-1] out
    "esm": {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32},   # the stock config has no vocabulary
    ("causal", "reformer"): {"is_decoder": True, "axial_pos_shape": (4, 4), "axial_pos_embds_dim": (16, 16),
                             "lsh_attn_chunk_length": 8, "local_attn_chunk_length": 8},
    ("masked", "reformer"): {"is_decoder": False, "axial_pos_shape": (4, 4), "axial_pos_embds_dim": (16, 16),
                             "lsh_attn_chunk_length": 8, "local_attn_chunk_length": 8},
}


# -- tiny configs --------------------------------------------------------------------------------------------------
SIZE = {   # field name -> tiny value (ints); matched exactly, then by the patterns below
    "vocab_size": 128, "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32, "dim": 32,
    "embedding_size": 32, "word_embed_proj_dim": 32, "d_embed": 32, "n_embed": 32,
    "intermediate_size": 64, "ffn_dim": 64, "d_ff": 64, "n_inner": 64, "d_inner": 64, "hidden_dim": 64,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "ffn_hidden_size": 64, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "shared_intermediate_size": 32, "expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32, "moe_ffn_hidden_size": 32, "pooler_hidden_size": 32,
    "projection_dim": 32, "pooler_output_size": 32, "projection_size": 32,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "attention_heads": 4, "num_attention_heads_per_layer": 4,
    "head_dim": 8, "d_kv": 8, "attention_head_size": 8, "dim_head": 8, "kv_channels": 8,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "qk_head_dim": 16,
    "kv_lora_rank": 16, "q_lora_rank": 16, "index_head_dim": 8, "index_n_heads": 2, "index_topk": 8,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "top_k": 2, "moe_k": 2,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "first_k_dense_replace": 1, "num_dense_layers": 1,
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_seq_len": 128,
    "max_sequence_length": 128, "max_target_positions": 128, "max_source_positions": 128,
    "model_max_length": 128, "seq_length": 128,
    "image_size": IMAGE, "kv_lora_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_head_dim": 8, "linear_num_heads": 4,
    "mamba_d_state": 8, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_chunk_size": 8, "state_size": 8,
    "time_step_rank": 4, "chunk_size": 8, "d_state": 8, "mamba_expand": 2, "expand": 2, "n_groups": 1,
    "mamba_n_groups": 1, "attention_hidden_size": 32, "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 128, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
    "swa_head_dim": 8, "d_rel": 4, "rel_extent": 32, "rotary_dim": 4, "rotary_emb_dim": 4,
    "sliding_window": 8, "sliding_window_size": 8, "attention_window": 8, "local_attention": 8,
    "block_size": 4, "num_random_blocks": 1, "mm_tokens_per_image": 4, "hidden_size_global": 32,
    "global_hidden_size": 32, "num_codebooks": 2, "codebook_size": 32, "codebook_dim": 8,
    "output_dim": 16, "out_hidden_size": 32, "num_position_embeddings": 16, "num_mel_bins": 16,
    "adapter_out_dim": 32, "auxiliary_channels": 8, "bottleneck_dim": 16, "num_hashes": 2,
    "prompt_length": 4, "num_labels": 2, "type_vocab_size": 2,
    "window_size": 4,
    "d_latents": 32, "num_latents": 16,     # Perceiver's latent array (default 256 x 1280: 271M parameters)
}
LAYER_FIELDS = re.compile(r"^(num_hidden_layers|n_layer|n_layers|num_layers|encoder_layers|decoder_layers|"
                          r"num_decoder_layers|num_encoder_layers|depth|num_blocks|text_layers|vision_layers|"
                          r"num_hidden_groups|layers|num_local_encoder_layers|num_local_decoder_layers|"
                          r"num_global_layers|num_self_attends_per_block)$")
HEADS_KV = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_key_value_groups")
TOKEN_ID = re.compile(r"(_token_id|_token_index|_id)$")
LAYERS = 2


def _is_layer_list(v, n):
    return isinstance(v, (list, tuple)) and len(v) == n and n > 1


def shrink_dict(d: dict) -> dict:
    """Shrink a config's dict (recursively into sub-config dicts). Returns the dict (changed in place)."""
    for k, v in list(d.items()):
        if isinstance(v, dict) and ("model_type" in v or k.endswith("_config") or k in ("encoder", "decoder")):
            shrink_dict(v)
    old_layers = {k: d[k] for k in d if LAYER_FIELDS.match(k) and isinstance(d[k], int) and not isinstance(d[k], bool)}
    old_heads = d.get("num_attention_heads", d.get("n_head"))
    # layer-indexed lists: keep one of every distinct kind so hybrid models keep all their block types
    n_layers = LAYERS
    for k, v in d.items():
        for n in set(old_layers.values()):
            if _is_layer_list(v, n) and all(isinstance(x, (str, int, bool)) or x is None for x in v):
                kinds = list(dict.fromkeys(v))
                if all(isinstance(x, str) for x in v):
                    n_layers = max(n_layers, min(len(kinds), 4))
    for k, v in list(d.items()):
        if isinstance(v, bool) or v is None:
            continue
        if k in old_layers:
            d[k] = min(v, n_layers) if v > 0 else v
        elif k in SIZE and isinstance(v, int):
            new = SIZE[k]
            d[k] = new if (v <= 0 and new > 0) is False else v
            if k in ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k", "moe_k") and v <= 1:
                d[k] = v
        elif k.endswith("vocab_size") and k != "type_vocab_size" and isinstance(v, int) and v > 128:
            d[k] = 128
        elif k in HEADS_KV and isinstance(v, int):
            d[k] = 4 if (old_heads is not None and v >= old_heads) else min(v, 2)
        elif k in ("hidden_sizes", "embed_dims", "dims", "embed_dim", "hidden_size", "num_channels_list") \
                and isinstance(v, (list, tuple)) and v and all(isinstance(x, int) for x in v):
            d[k] = [8 * 2 ** min(i, 3) for i in range(len(v))]
        elif k in ("depths", "num_layers", "depth", "num_blocks") and isinstance(v, (list, tuple)) \
                and v and all(isinstance(x, int) for x in v):
            d[k] = [1] * len(v)
        elif k in ("num_heads", "num_attention_heads", "heads") and isinstance(v, (list, tuple)) \
                and v and all(isinstance(x, int) for x in v):
            d[k] = [1] * len(v)
        elif k == "image_size" and isinstance(v, (list, tuple)):
            d[k] = [IMAGE] * len(v)
    # token ids inside the vocabulary
    vocab = d.get("vocab_size")
    if isinstance(vocab, int) and vocab > 0:
        for k, v in list(d.items()):
            if not TOKEN_ID.search(k) or k in ("initializer_range",):
                continue
            if isinstance(v, int) and not isinstance(v, bool) and v >= vocab:
                d[k] = vocab - 1 - (hash(k) % 8)
            elif isinstance(v, list) and all(isinstance(x, int) for x in v):
                d[k] = [x if x < vocab else vocab - 1 - i for i, x in enumerate(v)]
    # layer-indexed lists follow the new number of layers
    for k, v in list(d.items()):
        for name, n in old_layers.items():
            new_n = d[name]
            if _is_layer_list(v, n) and new_n < n:
                if all(isinstance(x, str) for x in v):
                    kinds = list(dict.fromkeys(v))
                    d[k] = (kinds * new_n)[:new_n]
                else:
                    d[k] = list(v[:new_n])
                break
        if k.endswith("_layers") and k not in old_layers and isinstance(v, list) \
                and all(isinstance(x, int) for x in v) and v and not _is_layer_list(v, max(old_layers.values(), default=0)):
            d[k] = [x for x in v if x < LAYERS] or v[:0]       # lists of layer indices (mlp_only_layers, ...)
    return d


def shrink_config(cfg, overrides: dict) -> None:
    """Shrink a live config object in place (attributes set directly: constructors of composite configs do not
    round-trip every attribute through to_dict/from_dict), recursively into its sub-configs."""
    from transformers import PretrainedConfig

    attrs = {k: v for k, v in vars(cfg).items() if not k.startswith("__")}
    for k, v in attrs.items():
        if isinstance(v, PretrainedConfig):
            shrink_config(v, overrides.get(k, {}) if isinstance(overrides.get(k), dict) else {})
    plain = {k: v for k, v in attrs.items() if not isinstance(v, PretrainedConfig) and not k.startswith("_")}
    new = shrink_dict(copy.deepcopy(plain))
    # derived sizes: head_dim left None means hidden_size // heads in most models; set it so both agree
    if "head_dim" in new and new["head_dim"] is None and "hidden_size" in new:
        new["head_dim"] = 8
    # backbone-style output stages follow the new number of stages (recomputed from stage_names)
    for k in ("out_features", "out_indices", "_out_features", "_out_indices"):
        if k in attrs and attrs[k] is not None:
            new[k] = None
    for k, v in overrides.items():
        if not isinstance(v, dict) or k in plain:
            new[k] = v
    for k, v in new.items():
        if k not in attrs or attrs[k] != v or k in overrides:
            try:
                setattr(cfg, k, v)
            except Exception:   # properties that cannot be set keep their value
                pass
    depths = new.get("depths") or new.get("num_layers")
    if isinstance(depths, list) and hasattr(cfg, "stage_names"):
        try:
            cfg.stage_names = ["stem"] + [f"stage{i}" for i in range(1, len(depths) + 1)]
            cfg._out_features, cfg._out_indices = [cfg.stage_names[-1]], [len(depths)]
        except Exception:
            pass


def tiny_config(model_type: str, cls=None, mapping: str = ""):
    from transformers import AutoConfig

    if model_type == "encoder-decoder":     # the generic pair: a BERT encoder and a BERT decoder (bert2bert)
        from transformers import EncoderDecoderConfig

        enc, dec = tiny_config("bert"), tiny_config("bert")
        dec.is_decoder, dec.add_cross_attention = True, True
        cfg = EncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
        cfg.decoder_start_token_id, cfg.pad_token_id = 2, 0
        return cfg
    cfg = AutoConfig.for_model(model_type)
    if cls is not None and getattr(cls, "config_class", None) is not None and not isinstance(cfg, cls.config_class):
        cfg = cls.config_class()     # e.g. a ...ForCausalLM of a multimodal model type takes its text config
    shrink_config(cfg, OVERRIDES.get((mapping, model_type), OVERRIDES.get(model_type, {})))
    if mapping == "seq2seq" and getattr(cfg, "decoder_start_token_id", None) is None \
            and hasattr(cfg, "pad_token_id") and not hasattr(cfg, "audio_config"):
        cfg.decoder_start_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    return cfg


# -- batches -------------------------------------------------------------------------------------------------------
def forward_params(model) -> set:
    return set(inspect.signature(model.forward).parameters)


def text_batch(model, cfg, mapping: str, g) -> dict:
    import torch

    vocab = getattr(cfg.get_text_config(), "vocab_size", None) or getattr(cfg, "vocab_size", 128)
    params = forward_params(model)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    batch = {"input_ids": ids}
    if "attention_mask" in params:
        batch["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.long)
    if mapping == "masked":     # DataCollatorForLanguageModeling: 15% of the tokens predicted, the rest -100
        pick = torch.rand(BATCH, SEQ, generator=g) < 0.15
        pick[:, 1] = True
        batch["labels"] = torch.where(pick, ids, torch.full_like(ids, -100))
        mask_id = getattr(cfg, "mask_token_id", None)
        if isinstance(mask_id, int) and 0 <= mask_id < vocab:
            batch["input_ids"] = torch.where(pick, torch.full_like(ids, mask_id), ids)
    elif mapping == "seq2seq":
        batch["labels"] = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    else:
        batch["labels"] = ids.clone()
    return batch


def image_batch(model, cfg, g) -> dict:
    import torch

    ch = getattr(cfg, "num_channels", 3) or 3
    size = getattr(cfg, "image_size", IMAGE)
    size = size if isinstance(size, int) else IMAGE
    return {"pixel_values": torch.randn(BATCH, ch, size, size, generator=g),
            "labels": torch.randint(0, cfg.num_labels, (BATCH,), generator=g)}


def audio_batch(model, cfg, mapping, g) -> dict:
    import torch

    enc = getattr(cfg, "encoder_config", None) or getattr(cfg, "audio_config", None) or cfg
    bins = getattr(enc, "num_mel_bins", None) or getattr(cfg, "num_mel_bins", 16)
    frames = 2 * (getattr(enc, "max_source_positions", None) or 16)
    b = {"input_features": torch.randn(BATCH, bins, frames, generator=g)}
    vocab = cfg.get_text_config().vocab_size
    b["labels"] = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    return b


def make_batch(model, cfg, mapping: str) -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    if mapping == "image" and getattr(model, "main_input_name", "") == "input_ids":   # ImageGPT: pixels as tokens
        b = text_batch(model, cfg, "causal", g)
        b["labels"] = torch.randint(0, cfg.num_labels, (BATCH,), generator=g)
        return b
    if mapping == "image":
        return image_batch(model, cfg, g)
    if getattr(model, "main_input_name", "input_ids") == "input_features":
        return audio_batch(model, cfg, mapping, g)
    return text_batch(model, cfg, mapping, g)


def model_class(mapping: str, model_type: str):
    import transformers
    from transformers.models.auto import modeling_auto as ma

    name = getattr(ma, MAPPINGS[mapping])[model_type]
    if isinstance(name, (tuple, list)):
        name = name[0]
    return name, getattr(transformers, name)


# -- one architecture ------------------------------------------------------------------------------------------------
def first_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:300] if msg else ''}"


def hf_loss(m, batch):
    out = m(**batch)
    return out["loss"] if isinstance(out, dict) else out[0]


def _double(batch):
    import torch

    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


def compare(prog, ref, batch, loss_fn, steps=STEPS, eps=1e-8, reorder=False) -> dict:
    """`steps` steps of prog next to eager AdamW on ref: the largest relative loss error and the largest parameter
    error. Adam divides each gradient by its own magnitude, so an element whose fp32 gradient is rounding noise (a
    key bias under softmax, a weight behind a channel that ReLU switched off) moves by +-lr whatever its sign, on
    one device as much as on eight. Such elements are found with a float64 copy of the model that computes each
    step's gradients at the fp32 run's parameters: where the fp32 gradient is more than 0.1% off the float64 one, the element is left out of the
    parameter check and counted ("ill"). Parameters that get no gradient at all (unused by this call) are
    checked: torch.optim leaves them untouched (no weight decay either).

    reorder=True (models without random ops): one device is also trained on the same batch with its samples in
    another order (the same step in exact arithmetic; fp32 sums run in another order, as they do across ranks).
    Elements whose result that reordering moves beyond the tolerance are decided by rounding, not by the program:
    they join the "ill" set (counted; "reorder_err" is how far one device moved from itself). Every other element
    must match. The float64 gradient test above misses such elements when the rounding happens earlier than the
    gradient (batch norm's statistics over a batch of 8 at 1x1 resolution, amplified by Adam's first steps)."""
    import torch

    ref_init = copy.deepcopy(ref) if reorder else None
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=eps)
    try:
        ref64 = copy.deepcopy(ref).double()
        batch64 = _double(batch)
    except Exception:
        ref64 = None
    loss_err, first_loss_err, losses, first_losses = 0.0, 0.0, [], (None, None)
    ill = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in ref.named_parameters()}
    unused = set()
    for step in range(steps):
        torch.manual_seed(step)
        loss = prog.train_step(batch)
        torch.manual_seed(step)
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref, batch)
        ref_loss.backward()
        g64 = None
        if ref64 is not None:
            try:
                with torch.no_grad():    # at the fp32 run's point: the difference is rounding alone
                    for (_, p64), p in zip(ref64.named_parameters(), ref.parameters()):
                        p64.copy_(p)
                        p64.grad = None
                torch.manual_seed(step)
                loss_fn(ref64, batch64).backward()
                g64 = {n: p.grad for n, p in ref64.named_parameters()}
            except Exception:
                ref64 = None
        for n, p in ref.named_parameters():
            if p.grad is None:
                unused.add(n)
            elif g64 is not None and g64.get(n) is not None:
                ill[n] |= (p.grad.double() - g64[n]).abs() > 1e-3 * g64[n].abs()
            elif g64 is None:    # no float64 run: non-zero gradients at rounding level of the tensor's largest
                g = p.grad.abs()
                ill[n] |= (g > 0) & (g <= 1e-5 * float(g.max()))
        ref_opt.step()
        a, b = float(loss.detach()), float(ref_loss.detach())
        losses.append(b)
        loss_err = max(loss_err, abs(a - b) / max(abs(b), 1e-12))
        if step == 0:
            first_loss_err, first_losses = loss_err, (a, b)
    reorder_err, reorder_loss_err = _reorder_floor(ref_init, batch, loss_fn, steps, eps, ill) if reorder \
        else (None, None)
    got = prog.gather_parameters()
    param_err, raw_err, worst, ok, n_ill, bad = 0.0, 0.0, "", True, 0, []
    for name, p in ref.named_parameters():
        if name not in got or not p.numel():
            continue
        q, r = got[name].detach().to(p.dtype), p.detach()
        diff = (q - r).abs()
        raw_err = max(raw_err, float(diff.max()))
        keep = ~ill[name] if name not in unused else torch.ones_like(ill[name])
        n_ill += int((~keep).sum())
        if keep.any():
            err = float(diff[keep].max())
            if not torch.allclose(q[keep], r[keep], rtol=RTOL, atol=ATOL, equal_nan=True):
                ok = False
                bad.append(name)
            if err > param_err:
                param_err, worst = err, name
    loss_ok = loss_err <= RTOL + 1e-6
    extra = {}
    if bad and loss_ok and all(n in unused for n in bad):
        extra["reason"] = (f"{len(bad)} parameters without a gradient (unused by this call, e.g. {bad[0]}) "
                           f"changed: torch.optim skips them, partir_torch's update decays them")
    return {**extra, "loss": losses[-1] if losses else None, "loss_err": loss_err, "param_err": param_err,
            "raw_param_err": raw_err, "ill": n_ill, "worst_param": worst, "match": bool(loss_ok and ok),
            "first_loss_err": first_loss_err, "first_loss_got": first_losses[0], "first_loss_eager": first_losses[1],
            **({"reorder_err": reorder_err, "reorder_loss_err": reorder_loss_err} if reorder else {})}


REORDERS = 3


def _reorder_floor(model, batch, loss_fn, steps, eps, ill) -> tuple:
    """Train `model` (the untrained copy) on one device with the batch's samples permuted, REORDERS times, next to
    the unpermuted run; mark in `ill` every element some permutation moves beyond the parameter tolerance. Returns
    the largest parameter movement and the largest relative movement of the first step's loss. Only for
    deterministic models: a permutation changes which sample draws which dropout mask."""
    import torch

    def train(perm):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, eps=eps)
        b = {k: v[perm] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n else v
             for k, v in batch.items()}
        losses = []
        for step in range(steps):
            torch.manual_seed(step)
            opt.zero_grad()
            loss = loss_fn(m, b)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        return {k: p.detach() for k, p in m.named_parameters()}, losses

    n = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim())
    (base, base_losses), worst, worst_loss = train(torch.arange(n)), 0.0, 0.0
    for seed in range(REORDERS):
        moved, losses = train(torch.randperm(n, generator=torch.Generator().manual_seed(seed)))
        for k, p in base.items():
            d = (moved[k] - p).abs()
            worst = max(worst, float(d.max()) if d.numel() else 0.0)
            ill[k] |= d > ATOL + RTOL * p.abs()
        worst_loss = max(worst_loss, abs(losses[0] - base_losses[0]) / max(abs(base_losses[0]), 1e-12))
    return worst, worst_loss


def partition_and_compare(model, batch, loss_fn, megatron: bool, reorder: bool = False) -> dict:
    import torch
    import partir_torch as pt
    from partir_torch import tactics as T

    ref = copy.deepcopy(model)
    row = {}
    prog = None
    if os.environ.get(SCHEDULE_ENV) == "dp":           # --schedule dp: data parallel alone, on 2 ranks
        prog = pt.partition(model, pt.Mesh({"dp": 2}), [T.data_parallel("dp")], example_inputs=(batch,),
                            loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        row["sched"] = "BP"
        megatron = False
    if os.environ.get(SCHEDULE_ENV) == "pp":           # --schedule pp: 2 pipeline stages (the automatic cut) x dp 2
        prog = pt.partition(model, pt.Mesh(PP_MESH), [T.pipeline("pp", stages=2), T.data_parallel("dp")],
                            example_inputs=(batch,), loss_fn=loss_fn,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        row["sched"], row["stages"] = "PP+BP", [list(g) for g in prog.plan.pipeline.modules]
        megatron = False
    mesh = pt.Mesh(MESH)
    base = [T.data_parallel("dp"), T.data_parallel("zero", name="BP-zero")]
    if megatron:
        try:
            prog = pt.partition(model, mesh, base + [T.megatron("tp"), T.zero(3, "zero")], example_inputs=(batch,),
                                loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
            row["sched"] = "BP+MP+Z3"
        except pt.PartitionError as e:
            # no pair, or pairs none of which the axis divides (a tiny config's one head per stage): BP+Z3
            if "found no column-parallel/row-parallel linear pair" not in str(e) \
                    and "but none can be tiled on axis" not in str(e):
                raise
            row["megatron"] = "no structure"
    if prog is None:
        prog = pt.partition(model, mesh, base + [T.zero(3, "zero")], example_inputs=(batch,), loss_fn=loss_fn,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        row["sched"] = "BP+Z3"
    row["conflicts"] = len(prog.conflicts)
    records = prog.collectives()
    row["collectives"] = dict(Counter(r.kind for r in records))
    # issue 20: bytes per step of collectives no tactic asked for, by op; under data parallel alone, of any
    # collective but the gradient reductions (and the loss's all_reduce, a few bytes)
    row["reshard_bytes"] = sum(r.nbytes for r in records if r.why == "reshard")
    ops = Counter()
    for r in records:
        if r.why == "reshard":
            ops[str(r.op)] += r.nbytes
    row["reshard_ops"] = dict(ops)
    row["non_gradient_bytes"] = sum(r.nbytes for r in records if r.why != "gradient")
    row.update(compare(prog, ref, batch, loss_fn, reorder=reorder))
    return row


def run_hf(mapping: str, model_type: str) -> dict:
    import torch

    row = {"suite": "hf", "mapping": mapping, "arch": model_type}
    if model_type in SKIP:
        return {**row, "result": "skip", "reason": SKIP[model_type]}
    t0 = time.time()
    stage = "config"
    try:
        cls_name, cls = model_class(mapping, model_type)
        row["class"] = cls_name
        cfg = tiny_config(model_type, cls, mapping)
        stage = "build"
        torch.manual_seed(0)
        model = cls(cfg).float().train()
        row["params"] = sum(p.numel() for p in model.parameters())
        batch = make_batch(model, cfg, mapping)
        stage = "eager"
        probe = copy.deepcopy(model)          # the one-device run must work before partir_torch is asked
        torch.manual_seed(0)
        loss = hf_loss(probe, batch)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise RuntimeError(f"model(**batch) returned no scalar loss ({type(loss).__name__})")
        loss.backward()
        torch.manual_seed(0)
        again = hf_loss(copy.deepcopy(model), batch)     # same seed, same loss? (else no run can match it)
        if float(again.detach()) != float(loss.detach()):
            row["eager_nondeterministic"] = True
        del probe
    except Alarm:
        raise
    except Exception as e:   # the harness or the model, not partir_torch
        return {**row, "result": "skip", "reason": f"{stage}: {first_line(e)}", "s": round(time.time() - t0, 1)}
    if os.environ.get("HF_COVERAGE_EAGER_ONLY"):
        return {**row, "result": "eager-ok", "s": round(time.time() - t0, 1)}
    try:
        pristine = copy.deepcopy(model)
        row.update(partition_and_compare(model, batch, hf_loss, megatron=True))
        if not row["match"] and not row.get("eager_nondeterministic"):
            row.update(_float64_verdict(pristine, batch, hf_loss, row))
        row["result"] = "pass" if row["match"] else "mismatch"
        if not row["match"] and row.get("eager_nondeterministic"):
            row["reason"] = "eager forward differs between two runs under the same torch.manual_seed"
    except Alarm:
        raise
    except Exception as e:
        import partir_torch as pt

        row["result"] = "fail"
        row["reason"] = first_line(e)
        row["error_type"] = "PartitionError" if isinstance(e, pt.PartitionError) else "bug"
        row["where"] = "".join(traceback.format_exception(e)[-3:])[-600:]
    row["s"] = round(time.time() - t0, 1)
    return row


# -- timm ------------------------------------------------------------------------------------------------------------
TIMM = {   # family -> (model name, kwargs for create_model, image size)
    "resnet": ("resnet18", {"layers": (1, 1, 1, 1)}, 32),   # BatchNorm
    "convnext": ("convnext_atto", {}, 32),
    "vit": ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 2}, 32),
    "swin": ("swin_tiny_patch4_window7_224", {"img_size": 32, "window_size": 4, "embed_dim": 24,
                                              "depths": (1, 1), "num_heads": (2, 4)}, 32),
    "efficientnet": ("efficientnet_b0", {}, 32),
    "regnet": ("regnetx_002", {}, 32),
    "mixer": ("timm.models.mlp_mixer.MlpMixer", {"img_size": 32, "patch_size": 8, "num_blocks": 2,
                                                 "embed_dim": 64}, 32),
    "deit": ("deit_tiny_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 2}, 32),
    "mobilenetv3": ("mobilenetv3_small_050", {}, 32),
    "densenet": ("densenet121", {"growth_rate": 8, "block_config": (1, 1, 1, 1)}, 32),
    "resmlp": ("timm.models.mlp_mixer.MlpMixer", {"img_size": 32, "patch_size": 8, "num_blocks": 2,
                                                  "embed_dim": 64, "mlp_ratio": 4, "resmlp": True}, 32),
    "convmixer": ("timm.models.convmixer.ConvMixer", {"dim": 32, "depth": 2, "kernel_size": 3,
                                                      "patch_size": 4}, 32),
    "levit": ("levit_128s", {"img_size": 32}, 32),
    "poolformer": ("timm.models.metaformer.MetaFormer", {"depths": (1, 1, 1, 1), "dims": (16, 32, 64, 128)}, 32),
    "ghostnet": ("ghostnet_050", {}, 32),
}


def _deterministic(model, batch, loss_fn) -> bool:
    """Does the training loss depend on the generator's state (dropout, drop path, random erasing)?"""
    import torch

    m = copy.deepcopy(model)
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            losses.append(float(loss_fn(m, batch)))
    return losses[0] == losses[1]


F64_TOL = 1e-9


def _float64_verdict(model, batch, loss_fn, row: dict) -> dict:
    try:
        with _grouped_mm_fallback_in_float64():
            return _float64_check(model, batch, loss_fn, row)
    except Alarm:
        raise
    except Exception as e:       # the model does not run in float64 (a kernel without a double version): fp32 only
        cause = e
        while cause is not None and not isinstance(cause, Alarm):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:    # the alarm went off inside partir_torch's program, which reported it as its error
            raise cause
        return {"fp64": f"not run: {first_line(e)[:120]}"}


@contextlib.contextmanager
def _grouped_mm_fallback_in_float64():
    """torch's grouped matmul has no float64 kernel ("Expected mat_a to be Float32, BFloat16 or Float16"), and
    transformers' grouped-mm experts call it whatever the dtype: in float64 they take transformers' own fallback
    (`transformers::grouped_mm_fallback`, one matmul per expert), on one device and in the partitioned program
    alike (partir_torch's experts op runs transformers' function). fp32 rows are untouched."""
    import torch

    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    usable = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda input, weight, offs: weight.dtype != torch.float64 and usable(input, weight, offs)
    try:
        yield
    finally:
        moe._can_use_grouped_mm = usable


def _float64_check(model, batch, loss_fn, row: dict, make_opt=None) -> dict:
    """Where fp32 rounding decides more elements than the masks catch: the row's schedule on the model in float64
    next to one device in float64 (rounding ~1e-16, so every element is decided by the program). It passes with
    verdict "fp64" when the float64 parameters agree to F64_TOL relative, or to one device's own float64 movement
    where that is larger (a deterministic model: on a reordered batch; any model: with its initial parameters moved
    by one ulp, `_ulp_floor`), the float64 losses to F64_TOL (rtol 1e-5 where the model computes its loss in fp32,
    as HF's upcast logits), and the fp32 run's first loss, before any update, to RTOL, or to its own movement on a
    reordered batch where that is larger, or, where eager's own fp32 first loss is further from the float64 one
    than RTOL, to the float64 loss no further than eager's fp32 loss is (`_first_loss_ok`). The fp32 columns stay
    in the row, next to how far one device in fp32 moves from itself ("1-dev reorder"). make_opt: the partitioned
    run's optimizer (tests inject a wrong one to show the check fails)."""
    import torch
    import partir_torch as pt
    from partir_torch import tactics as T

    m64 = model.double()
    b64 = _double(batch)
    ref = copy.deepcopy(m64)
    pristine = copy.deepcopy(m64)
    base = [T.data_parallel("dp"), T.data_parallel("zero", name="BP-zero")]
    schedule = base + ([T.megatron("tp")] if row.get("sched") == "BP+MP+Z3" else []) + [T.zero(3, "zero")]
    mesh = MESH
    if row.get("sched") == "PP+BP":
        mesh, schedule = PP_MESH, [T.pipeline("pp", stages=2), T.data_parallel("dp")]
    floor64 = 0.0
    if row.get("reorder_err") is not None:   # how far one device in float64 moves from itself on a reordered batch
        floor64, _ = _reorder_floor(ref, b64, loss_fn, STEPS, 1e-8,
                                    {n: torch.zeros_like(p, dtype=torch.bool) for n, p in ref.named_parameters()})
    make_opt = make_opt or (lambda params: torch.optim.AdamW(params, lr=1e-3))
    prog = pt.partition(m64, pt.Mesh(mesh), schedule, example_inputs=(b64,), loss_fn=loss_fn,
                        optimizer=make_opt(m64.parameters()))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    loss_err, loss_tol, first64 = 0.0, F64_TOL, None
    for step in range(STEPS):
        torch.manual_seed(step)
        got = float(prog.train_step(b64))
        torch.manual_seed(step)
        opt.zero_grad()
        want = loss_fn(ref, b64)
        want.backward()
        opt.step()
        first64 = float(want.detach()) if step == 0 else first64
        loss_err = max(loss_err, abs(got - float(want)) / max(abs(float(want)), 1e-12))
        if want.dtype != torch.float64:     # HF's loss upcasts logits to float32 whatever the model's dtype
            loss_tol = RTOL
    gathered = prog.gather_parameters()
    err = _rel_err(gathered, dict(ref.named_parameters()))
    if err > max(F64_TOL, floor64):          # as far as rounding-level noise moves one device?
        floor64 = max(floor64, _ulp_floor(pristine, b64, loss_fn, ref))
    first_ok = _first_loss_ok(row, first64)
    ok = err <= max(F64_TOL, floor64) and loss_err <= loss_tol and first_ok
    return {"fp64_param_err": err, "fp64_loss_err": loss_err, "fp64_reorder_err": floor64, "match": ok,
            **({"verdict": "fp64"} if ok else {})}


def _rel_err(got: dict, want: dict) -> float:
    return max((float(((got[n].double() - p.detach()).abs() / (1 + p.detach().abs())).max())
                for n, p in want.items() if p.numel()), default=0.0)


ULP_RUNS = 2


def _ulp_floor(model, batch, loss_fn, trained) -> float:
    """How far one device in float64 moves from itself (`trained`: model after STEPS AdamW steps) when every initial
    parameter is moved by one ulp, with a random sign: rounding-level noise, amplified by the model's conditioning
    (batch norms over 1x1 maps of a batch of 8, Adam's first steps) as the program's own rounding is. The largest of
    ULP_RUNS draws. Needs no determinism: the dropout draws are the same in every run."""
    import torch

    want, worst = dict(trained.named_parameters()), 0.0
    for seed in range(ULP_RUNS):
        m = copy.deepcopy(model)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1 + (torch.randint(0, 2, p.shape, generator=g) * 2 - 1).to(p.dtype) * 2.0 ** -52)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for step in range(STEPS):
            torch.manual_seed(step)
            opt.zero_grad()
            loss_fn(m, batch).backward()
            opt.step()
        worst = max(worst, _rel_err(dict(m.named_parameters()), want))
    return worst


def _first_loss_ok(row: dict, first64) -> bool:
    """The fp32 run's first loss (before any update): within RTOL of eager's fp32 first loss (or of its movement on
    a reordered batch); else, when the float64 first loss is known, no further from it than max(RTOL, eager's own
    fp32 first loss) relative: the program's fp32 rounding is then no worse than eager's own (mobilenet_v1: eager
    fp32 is 1.8e-5 off the float64 loss, the program 4.9e-6, so they are 2.3e-5 apart)."""
    if row["first_loss_err"] <= max(RTOL + 1e-6, row.get("reorder_loss_err") or 0.0):
        return True
    got, eager = row.get("first_loss_got"), row.get("first_loss_eager")
    if first64 is None or got is None or eager is None:
        return False
    scale = max(abs(first64), 1e-12)
    return abs(got - first64) / scale <= max(RTOL, abs(eager - first64) / scale)


def run_timm(family: str) -> dict:
    import torch
    import torch.nn.functional as F
    import timm

    name, kwargs, size = TIMM[family]
    row = {"suite": "timm", "mapping": "timm", "arch": family, "class": name}
    t0 = time.time()
    stage = "build"
    try:
        torch.manual_seed(0)
        if name.startswith("timm."):      # a family's class built directly (its registered names fix sizes)
            import importlib

            mod, cls = name.rsplit(".", 1)
            kw = dict(kwargs)
            if kw.pop("resmlp", False):
                from timm.models.mlp_mixer import Affine, ResBlock

                kw.update(block_layer=ResBlock, norm_layer=Affine)
            model = getattr(importlib.import_module(mod), cls)(num_classes=10, **kw)
        else:
            model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        model = model.float().train()
        row["params"] = sum(p.numel() for p in model.parameters())
        g = torch.Generator().manual_seed(1)
        x = torch.randn(BATCH, 3, size, size, generator=g)
        y = torch.randint(0, 10, (BATCH,), generator=g)
        stage = "eager"
        probe = copy.deepcopy(model)
        F.cross_entropy(probe(x), y).backward()
        del probe
    except Alarm:
        raise
    except Exception as e:
        return {**row, "result": "skip", "reason": f"{stage}: {first_line(e)}", "s": round(time.time() - t0, 1)}

    def loss_fn(m, batch):
        return F.cross_entropy(m(batch["x"]), batch["y"])

    try:
        # timm's families draw no random numbers with their default rates (checked): the reorder floor applies
        pristine, batch = copy.deepcopy(model), {"x": x, "y": y}
        det = _deterministic(model, batch, loss_fn)
        row.update(partition_and_compare(model, batch, loss_fn, megatron=False, reorder=det))
        if not row["match"]:
            row.update(_float64_verdict(pristine, batch, loss_fn, row))
        row["result"] = "pass" if row["match"] else "mismatch"
    except Alarm:
        raise
    except Exception as e:
        import partir_torch as pt

        row["result"] = "fail"
        row["reason"] = first_line(e)
        row["error_type"] = "PartitionError" if isinstance(e, pt.PartitionError) else "bug"
        row["where"] = "".join(traceback.format_exception(e)[-3:])[-600:]
    row["s"] = round(time.time() - t0, 1)
    return row


# -- driver ----------------------------------------------------------------------------------------------------------
class Alarm(Exception):
    pass


def worker(tasks: list, out: str, timeout: int) -> None:
    """Run tasks [(suite, mapping, arch)] in this process, one JSON line each to `out`."""
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)

    def on_alarm(*_):
        raise Alarm(f"timeout after {timeout} s")

    signal.signal(signal.SIGALRM, on_alarm)
    for suite, mapping, arch in tasks:
        print(f"START {suite} {mapping} {arch}", flush=True)
        signal.alarm(timeout)
        try:
            row = run_timm(arch) if suite == "timm" else run_hf(mapping, arch)
        except Alarm as e:
            row = {"suite": suite, "mapping": mapping, "arch": arch, "result": "timeout", "reason": str(e)}
        except BaseException as e:  # noqa: BLE001 - one row per architecture, whatever happens
            row = {"suite": suite, "mapping": mapping, "arch": arch, "result": "fail", "reason": first_line(e),
                   "error_type": "bug"}
        finally:
            signal.alarm(0)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"DONE {arch} {row['result']} {row.get('reason', '')[:150]}", flush=True)


def all_tasks(suite: str, mappings: list) -> list:
    if suite == "timm":
        return [("timm", "timm", f) for f in TIMM]
    from transformers.models.auto import modeling_auto as ma

    per = [[("hf", m, t) for t in getattr(ma, MAPPINGS[m])] for m in mappings]
    out = []     # round-robin over the mappings, so a partial run covers all of them
    for i in range(max(map(len, per), default=0)):
        out += [p[i] for p in per if i < len(p)]
    return out


def drive(tasks: list, out: str, timeout: int, per_worker: int = 25) -> None:
    """Run tasks in worker processes (a fresh one every `per_worker` tasks, or after a hang or crash)."""
    todo = list(tasks)
    while todo:
        chunk, todo = todo[:per_worker], todo[per_worker:]
        while chunk:
            arg = json.dumps(chunk)
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", arg, "--out", out,
                                  "--timeout", str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, bufsize=1)
            current, last = None, time.time()
            done = set()
            import selectors

            sel = selectors.DefaultSelector()
            sel.register(p.stdout, selectors.EVENT_READ)
            while True:
                if sel.select(timeout=5):
                    line = p.stdout.readline()
                    if not line:
                        break
                    if line.startswith("START "):
                        current, last = line.split()[1:4], time.time()
                    elif line.startswith("DONE "):
                        done.add(tuple(current))
                        print(line.rstrip()[5:], flush=True)
                        current = None
                elif current and time.time() - last > timeout + 60:
                    p.kill()
                    break
            p.wait()
            if current is not None:    # hung past the alarm, or crashed: record it and carry on after it
                suite, mapping, arch = current
                why = "timeout (worker killed)" if p.returncode in (-9,) else f"worker died (exit {p.returncode})"
                with open(out, "a") as f:
                    f.write(json.dumps({"suite": suite, "mapping": mapping, "arch": arch,
                                        "result": "timeout" if "timeout" in why else "fail", "reason": why,
                                        "error_type": "bug"}) + "\n")
                print(f"{arch} {why}", flush=True)
                done.add(tuple(current))
            chunk = [t for t in chunk if tuple(t) not in done]


# -- report ----------------------------------------------------------------------------------------------------------
def load(path: str) -> list:
    rows = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            reason = r.get("reason") or ""
            if r["result"] == "fail" and "Alarm: timeout" in reason:     # the alarm went off inside partir_torch
                r["result"] = "timeout"
            elif r["result"] == "fail" and reason.startswith("InternalError"):
                r["error_type"] = "bug"     # a PartitionError subclass, but partir_torch's own failure
            rows[(r["mapping"], r["arch"])] = r       # the last run of an architecture wins
    return list(rows.values())


def report(rows: list) -> str:
    from tabulate import tabulate

    table = []
    for r in rows:
        coll = r.get("collectives") or {}
        table.append([r["mapping"], r["arch"], r["result"] + (" (fp64)" if r.get("verdict") == "fp64" else ""),
                      r.get("sched", ""),
                      f"{r['loss_err']:.1e}" if r.get("loss_err") is not None else "",
                      f"{r['param_err']:.1e}" if r.get("param_err") is not None else "",
                      f"{r['reorder_err']:.1e}" if r.get("reorder_err") is not None else "",
                      r.get("ill", ""),
                      f"{r['fp64_param_err']:.0e}" if r.get("fp64_param_err") is not None else "",
                      r.get("conflicts", ""),
                      _kib(r.get("reshard_bytes")),
                      " ".join(f"{k.replace('all_', '').replace('reduce_scatter', 'rs')}={v}"
                               for k, v in sorted(coll.items())),
                      (r.get("reason") or "")[:110]])
    out = [tabulate(table, headers=["mapping", "arch", "result", "sched", "loss err", "param err", "1-dev reorder", "ill", "fp64 err",
                                    "confl", "reshard",
                                    "collectives", "reason"])]
    out += ["", groups(rows), "", summary(rows)]
    return "\n".join(out)


def _kib(b) -> str:
    return "" if b is None else "0" if b == 0 else f"{b / 1024:.1f}K"


def source(r: dict) -> str:
    """The user's source line a trace error names (file: code), or ''."""
    at = re.search(r"\n  at \S+/(\w+)\.py:\d+ in \w+: (.*)", r.get("where") or "")
    return f"{at.group(1).replace('modeling_', '')}: {at.group(2).strip()[:50]}" if at else ""


def cause(r: dict) -> str:
    """A failure's cause with names and numbers taken out, so rows with one cause group together."""
    if r["result"] == "mismatch":
        if "without a gradient" in (r.get("reason") or ""):
            return "mismatch: parameters unused by the call are updated (weight decay) where torch.optim skips them"
        if "eager forward differs" in (r.get("reason") or ""):
            return "mismatch: the eager model is not deterministic under torch.manual_seed (not partir_torch)"
        return "mismatch: loss differs" if (r.get("loss_err") or 0) > RTOL + 1e-6 else "mismatch: parameters differ"
    if r["result"] == "timeout":
        return "timeout (240-300 s on the shared 2-core machine)"
    text = r.get("reason") or ""
    text = re.sub(r"partition: the train step of \w+ could not be traced into one graph: ", "", text)
    text = re.sub(r"(params|buffers|inputs)\.[\w.]+", r"\1.<name>", text)
    text = re.sub(r"%[\w.]+", "%<n>", text)
    text = re.sub(r"\b\d+\b", "<n>", text)
    return text[:150]


def groups(rows: list) -> str:
    """Failures and mismatches grouped by cause: count and example architectures (with the source line)."""
    from tabulate import tabulate

    by = {}
    for r in rows:
        if r["result"] in ("fail", "mismatch", "timeout"):
            by.setdefault(cause(r), []).append(r)
    table = []
    for c, rs in sorted(by.items(), key=lambda kv: -len(kv[1])):
        ex = [f"{r['arch']}({r['mapping'][0]})" + (f" [{source(r)}]" if source(r) else "") for r in rs[:5]]
        table.append([len(rs), sum(1 for r in rs if r["result"] == "fail" and r.get("error_type") == "bug"), c,
                      "; ".join(ex) + (f"; +{len(rs) - 5}" if len(rs) > 5 else "")])
    return tabulate(table, headers=["n", "bugs", "cause", "examples (mapping initial) [user source line]"])


def summary(rows: list) -> str:
    lines = []
    by = {}
    for r in rows:
        by.setdefault(r["mapping"], []).append(r)
    tot = Counter()
    for m, rs in by.items():
        c = Counter(r["result"] for r in rs)
        tot.update(c)
        ran = len(rs) - c["skip"]
        pct = 100.0 * c["pass"] / ran if ran else 0.0
        fb = sum(1 for r in rs if r.get("megatron") == "no structure")
        bugs = sum(1 for r in rs if r["result"] == "fail" and r.get("error_type") == "bug")
        lines.append(f"{m:8s} {len(rs):4d} archs, {c['skip']:3d} skipped (eager/harness), {ran:4d} run: "
                     f"{c['pass']:4d} pass, {c['mismatch']:3d} mismatch, {c['fail']:3d} fail ({bugs} internal/not "
                     f"PartitionError), {c['timeout']:3d} timeout; coverage {pct:5.1f}% (BP+Z3 fallback: {fb})")
        measured = [r for r in rs if r["result"] == "pass" and r.get("reshard_bytes") is not None]
        if measured:
            clean = sum(1 for r in measured if r["reshard_bytes"] == 0)
            lines.append(f"{'':8s} zero reshard bytes on {clean} of {len(measured)} passing rows "
                         f"({100.0 * clean / len(measured):.1f}%); the others: "
                         + (", ".join(f"{r['arch']} ({', '.join(sorted(r.get('reshard_ops') or {}))})"
                                      for r in measured if r["reshard_bytes"]) or "-"))
    few = [r for r in rows if r["result"] == "fail" and "repeated blocks" in (r.get("reason") or "")]
    if few or any(r.get("sched") == "PP+BP" for r in rows):     # --schedule pp: rows with >= 2 repeated blocks
        ran = [r for r in rows if r["result"] != "skip" and r not in few]
        ok = sum(1 for r in ran if r["result"] == "pass")
        lines.append(f"{'pipeline':8s} {len(few)} run eagerly with fewer than 2 repeated blocks (refused: "
                     f"{', '.join(r['arch'] for r in few) or '-'}); of the {len(ran)} others {ok} pass: coverage "
                     f"{100.0 * ok / max(len(ran), 1):5.1f}%")
    ran = sum(tot.values()) - tot["skip"]
    lines.append(f"{'all':8s} {sum(tot.values()):4d} archs, {tot['skip']:3d} skipped, {ran:4d} run: "
                 f"{tot['pass']:4d} pass; coverage {100.0 * tot['pass'] / max(ran, 1):5.1f}%")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", choices=["hf", "timm"], default="hf")
    ap.add_argument("--mapping", default="causal,masked,seq2seq,image", help="comma-separated: " + ",".join(MAPPINGS))
    ap.add_argument("--only", default="", help="comma-separated model types / timm families")
    ap.add_argument("--limit", type=int, default=0, help="first N architectures per mapping")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per architecture")
    ap.add_argument("--out", default="", help="JSON lines (appended); default benchmarks/results/<suite>_coverage.jsonl")
    ap.add_argument("--resume", action="store_true", help="skip architectures already in --out")
    ap.add_argument("--shard", default="", help="i/n: every n-th architecture from the i-th (parallel sweeps)")
    ap.add_argument("--report", default="", help="print the table of a JSON-lines file and exit")
    ap.add_argument("--schedule", choices=["bp_mp_z3", "dp", "pp"], default="bp_mp_z3",
                    help="dp: data_parallel alone on 2 ranks (issue 20's reshard goal); pp: pipeline('pp', stages=2) "
                         "+ data_parallel('dp') on {pp: 2, dp: 2}, the automatic cut (issue 37)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker([tuple(t) for t in json.loads(a.worker)], a.out, a.timeout)
        return
    if a.report:
        print(report(load(a.report)))
        return
    os.environ[SCHEDULE_ENV] = a.schedule          # the workers (subprocesses) read it
    out = a.out or os.path.join(RESULTS, f"{a.suite}_coverage.jsonl")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    mappings = a.mapping.split(",")
    tasks = all_tasks(a.suite, mappings)
    if a.only:
        only = set(a.only.split(","))
        tasks = [t for t in tasks if t[2] in only]
    if a.limit:
        per = Counter()
        keep = []
        for t in tasks:
            per[t[1]] += 1
            if per[t[1]] <= a.limit:
                keep.append(t)
        tasks = keep
    with open(out, "a"):
        pass
    if a.shard:
        i, n = map(int, a.shard.split("/"))
        tasks = tasks[i::n]
    if a.resume:
        seen = {(r["mapping"], r["arch"]) for r in load(out)}
        tasks = [t for t in tasks if (t[1], t[2]) not in seen]
    start = time.time()
    before = sum(1 for _ in open(out))
    drive(tasks, out, a.timeout)
    rows = [json.loads(l) for l in list(open(out))[before:]]
    print(report(rows))
    print(f"{len(tasks)} architectures in {time.time() - start:.0f} s; rows in {out}")


if __name__ == "__main__":
    main()
