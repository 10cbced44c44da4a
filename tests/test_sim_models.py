"""The simulator's reference decoder (examples/zoo/sim_decoder.py): its fused q/k/v projection."""
import collections

import pytest
import torch

from examples.zoo import sim_decoder as M
from examples.zoo import sim_validation as V

SMALL = dict(vocab=96, seq=16, d=32, heads=4, layers=2)


def _fuse(wq, wk, wv, heads):
    """The fused weight of separate q/k/v weights, head-major: rows [q_h, k_h, v_h] for each head h."""
    return torch.stack([w.reshape(heads, -1, w.shape[-1]) for w in (wq, wk, wv)], dim=1).flatten(0, 2)


def test_the_fused_qkv_decoder_computes_the_unfused_ones_loss_and_gradients():
    torch.manual_seed(0)
    sep = M.Decoder(M.DecoderConfig(**SMALL)).double()
    fused = M.Decoder(M.DecoderConfig(**SMALL, fused_qkv=True)).double()
    a = {k: v for k, v in sep.state_dict().items()}
    state = {k: v for k, v in a.items() if not k.endswith(("wq.weight", "wk.weight", "wv.weight"))}
    for i in range(SMALL["layers"]):
        p = f"layers.{i}.attn."
        state[p + "wqkv.weight"] = _fuse(a[p + "wq.weight"], a[p + "wk.weight"], a[p + "wv.weight"], SMALL["heads"])
    fused.load_state_dict(state)
    tokens = torch.randint(0, SMALL["vocab"], (3, SMALL["seq"]))
    targets = torch.randint(0, SMALL["vocab"], (3, SMALL["seq"]))
    loss_s, loss_f = M.loss_fn(sep, tokens, targets), M.loss_fn(fused, tokens, targets)
    loss_s.backward()
    loss_f.backward()
    torch.testing.assert_close(loss_f, loss_s)
    gs, gf = ({k: p.grad for k, p in m.named_parameters()} for m in (sep, fused))
    for k, g in gf.items():
        if k.endswith("wqkv.weight"):
            p = k[:-len("wqkv.weight")]
            torch.testing.assert_close(g, _fuse(gs[p + "wq.weight"], gs[p + "wk.weight"], gs[p + "wv.weight"],
                                                SMALL["heads"]))
        else:
            torch.testing.assert_close(g, gs[k])


def test_fused_qkv_needs_as_many_kv_heads_as_heads():
    with pytest.raises(ValueError, match="kv_heads"):
        M.DecoderConfig(**{**SMALL, "kv_heads": 2}, fused_qkv=True)


def _collectives(fused: bool) -> collections.Counter:
    setup = dict(model=dict(SMALL, fused_qkv=fused), mesh={"dp": 2, "tp": 2}, batch=2, schedule="tp", remat=False)
    gm = V.program(setup, SMALL["layers"])[0]
    return collections.Counter(str(n.target) for n in gm.graph.nodes if "c10d" in str(n.target))


def test_the_fused_qkv_tensor_parallel_program_has_the_unfused_ones_collectives():
    """Megatron's colwise split of the head-major fused weight gives each rank whole heads: no reshard, so the
    program's collectives are the unfused program's (one all-reduce per sub-layer each way)."""
    assert M.plan_for(M.DecoderConfig(**SMALL, fused_qkv=True))["layers.*.attn.wqkv.weight"] == "colwise"
    assert "layers.*.attn.wq.weight" not in M.plan_for(M.DecoderConfig(**SMALL, fused_qkv=True))
    fused, sep = _collectives(True), _collectives(False)
    assert fused == sep and fused
