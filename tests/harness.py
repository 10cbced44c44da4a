"""One way every parity test trains a partitioned program next to eager torch (DESIGN §5.2).

    train_next_to_eager(prog, ref, [batch] * 3, loss_fn, make_opt=lambda ps: torch.optim.AdamW(ps, lr=1e-3))

Each step: the generator is seeded alike on both sides (dropout draws agree), prog.train_step(*batch) runs, the
eager module `ref` (a deepcopy of the model taken before partition) runs loss_fn + backward + optimizer.step(), and
the losses must agree; after the last step every parameter (prog.gather_parameters(), whose names must be exactly
ref's) and, with buffers=True, every floating buffer must agree. fp32 tolerances: rtol 1e-5 on losses, rtol 1e-5
with atol 1e-6 on parameters (atol covers Adam's first steps, where an element's update is +-lr whatever the size
of its gradient); a test states a looser one only where its numerics are not fp32 (bf16)."""
from __future__ import annotations

import torch

LOSS_RTOL = 1e-5
PARAM_RTOL, PARAM_ATOL = 1e-5, 1e-6
# bf16 compute: one rounding of 2**-8 per op, summed in another order: 2% on the loss (tests/test_compose.py's
# reasoning: a missing or doubled reduction of a gradient is 50% or more)
BF16_LOSS_RTOL = 2e-2


def adamw(lr=1e-3, eps=1e-8):
    return lambda params: torch.optim.AdamW(params, lr=lr, eps=eps)


def train_next_to_eager(prog, ref, batches, loss_fn, make_opt=adamw(), *, seed=100, buffers=False,
                        loss_rtol=LOSS_RTOL, param_rtol=PARAM_RTOL, param_atol=PARAM_ATOL, what="", on_step=None):
    """Returns the per-step (partitioned, eager) losses. on_step(i, opt): called after each partitioned step."""
    opt = make_opt(ref.parameters())
    losses = []
    for i, batch in enumerate(batches):
        torch.manual_seed(seed + i)
        got = prog.train_step(*batch)
        if on_step is not None:
            on_step(i, opt)
        torch.manual_seed(seed + i)
        opt.zero_grad()
        want = loss_fn(ref, *batch)
        want.backward()
        opt.step()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=loss_rtol, atol=0,
                                   msg=lambda m: f"{what} loss of step {i}: {m}")
        losses.append((got.detach(), want.detach()))
    assert_parameters_equal(prog, ref, param_rtol, param_atol, what)
    if buffers:
        full = prog.full_state_dict()
        for k, b in ref.named_buffers():
            if b.is_floating_point():
                torch.testing.assert_close(full[k], b, rtol=param_rtol, atol=param_atol, msg=lambda m: f"{what} {k}: {m}")
            else:
                assert torch.equal(full[k], b), f"{what} {k}: {full[k]} != {b}"
    return losses


def assert_parameters_equal(prog, ref, rtol=PARAM_RTOL, atol=PARAM_ATOL, what=""):
    got = prog.gather_parameters()
    want = dict(ref.named_parameters())
    assert set(got) == set(want), f"{what}: parameter names differ: {sorted(set(got) ^ set(want))}"
    for k, w in want.items():
        torch.testing.assert_close(got[k], w.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{what} {k}: {m}")


def hf_gpt2():
    """A tiny stock GPT-2 (eager attention: heads folded into (B*H)), dropout off."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"          # attention written with matmuls: heads folded into (B*H)
    return transformers.GPT2LMHeadModel(cfg)


def hf_llama():
    """A tiny stock Llama (SDPA attention, grouped-query heads)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg)
