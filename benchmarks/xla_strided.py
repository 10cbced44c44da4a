"""Strided tilings on torch-xla (issue 20 item 4): a stock HF GPT-2 under BP+MP (its packed c_attn tiled in 3 strided
blocks, eager attention's (B*H) folds) and the held-out GQA decoder of tests/xla/gqa_decoder.py under BP+MP+Z3,
3 AdamW steps on 8 XLA CPU devices next to one device, and compare() of partir's collectives with XLA's.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 OMP_NUM_THREADS=1 .venv-xla/bin/python benchmarks/xla_strided.py [--held-whole]

--held-whole runs the layout XLA had before the split views (xla/strided.py): every strided value held whole on its
strided axis (device.unstrided), for the figures before and after.
"""
from __future__ import annotations

import copy
import os
import sys
import warnings

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import partir_torch as pt  # noqa: E402
import partir_torch.xla  # noqa: E402,F401  (before the first XLA tensor)
import partir_torch.xla.program as xla_program  # noqa: E402
from tests.xla import gqa_decoder  # noqa: E402

T = pt.tactics


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "eager"
    return (GPT2LMHeadModel(cfg), {"batch": 4, "model": 2}, [T.data_parallel("batch"), T.megatron("model")],
            (torch.randint(0, 64, (8, 16)),), lambda m, x: m(input_ids=x, labels=x).loss)


def gqa():
    return (gqa_decoder.build(), {"dp": 4, "tp": 2}, [T.data_parallel("dp"), T.megatron("tp"), T.zero(3, "dp")],
            gqa_decoder.batch(8), gqa_decoder.loss_fn)


def run(name, make):
    model, mesh, schedule, batch, loss_fn = make()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"partir_torch: MP left .* replicated")
        prog = pt.partition(model, pt.Mesh(mesh), schedule, example_inputs=batch, loss_fn=loss_fn,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5))
    xprog = prog.to_xla()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-5)
    loss_err = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            got = xprog.train_step(*batch)
            opt.zero_grad()
            want = loss_fn(ref, *batch)
            want.backward()
            opt.step()
            loss_err = max(loss_err, abs(float(got) - float(want)) / abs(float(want)))
    params = xprog.gather_parameters()
    perr = max(float((params[k] - p.detach()).abs().max()) for k, p in ref.named_parameters())
    said = [str(w.message) for w in caught if "to_xla" in str(w.message)]
    print(f"{name}: mesh {mesh}, 3 AdamW steps: max loss rel. err {loss_err:.1e}, max |param err| {perr:.1e}, "
          f"to_xla warnings {len(said)}")
    print(xprog.compare(), "\n")


if __name__ == "__main__":
    if "--held-whole" in sys.argv:
        xla_program.form_of = lambda sh, shape, mesh: None     # no split view: device.unstrided throughout
    run("HF GPT-2, BP+MP", gpt2)
    run("held-out GQA decoder, BP+MP+Z3", gqa)
