"""Is a sweep row's mismatch rounding or a bug? (issue 26; benchmarks/notes/hf_coverage.md "hf_coverage.py, session 9").

    # partir fp32 / fp64 against eager fp32 / fp64 per step (BP+Z3 as the sweep), where the fp64 differences sit
    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hf_rounding.py image mobilenet_v2
    # one device in float64 against itself with every initial parameter moved by one ulp (the model's conditioning)
    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hf_rounding.py ulp mobilenet_v2
    # nemo_speechlm with its first 16 text layers, float64, one schedule alone: dp (data_parallel on 2 ranks), mp
    # (megatron on 2 ranks) or bpz3 (the sweep's BP+Z3 on {dp: 2, tp: 2, zero: 2}), against eager float64
    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hf_rounding.py nemo-schedule mp
    # eager nemo_speechlm (16 text layers) in float64 as the sweep runs it vs with its explicit float32 casts kept
    # float64: how far the model's own fp32 rounding moves the parameters
    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hf_rounding.py nemo-casts
"""
from __future__ import annotations

import copy
import importlib
import os
import sys
import time
import types
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.simplefilter("ignore")
from examples.zoo import hf as H  # noqa: E402

import partir_torch as pt  # noqa: E402
from partir_torch import tactics as T  # noqa: E402


def rel_err(got: dict, want: dict) -> float:
    return max(float(((got[k].double() - w.double()).abs() / (1 + w.double().abs())).max())
               for k, w in want.items() if w.numel())


def build(mapping, arch, text_layers=None):
    _, cls = H.model_class(mapping, arch)
    cfg = H.tiny_config(arch, cls, mapping)
    if text_layers:
        tc = cfg.text_config
        tc.layers_block_type = tc.layers_block_type[:text_layers]
        tc.num_hidden_layers = text_layers
    torch.manual_seed(0)
    model = cls(cfg).float().train()
    return model, H.make_batch(model, cfg, mapping)


def eager(m, b, steps=H.STEPS):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    losses, grads = [], []
    for step in range(steps):
        torch.manual_seed(step)
        opt.zero_grad()
        loss = H.hf_loss(m, b)
        loss.backward()
        grads.append({k: p.grad.detach().clone() for k, p in m.named_parameters() if p.grad is not None})
        opt.step()
        losses.append(float(loss))
    return losses, {k: p.detach() for k, p in m.named_parameters()}, grads


def partir(m, b, mesh, schedule, steps=H.STEPS):
    prog = pt.partition(m, pt.Mesh(mesh), schedule, example_inputs=(b,), loss_fn=H.hf_loss,
                        optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3))
    losses = []
    for step in range(steps):
        torch.manual_seed(step)
        losses.append(float(prog.train_step(b)))
    return losses, prog.gather_parameters()


def image(arch):
    model, batch = build("image", arch)
    sched = [T.data_parallel("dp"), T.data_parallel("zero", name="BP-zero"), T.zero(3, "zero")]
    b64 = H._double(batch)
    e32, p32 = eager(copy.deepcopy(model), batch), partir(copy.deepcopy(model), batch, H.MESH, sched)
    e64, p64 = eager(copy.deepcopy(model).double(), b64), partir(copy.deepcopy(model).double(), b64, H.MESH, sched)
    t, rel = e64[0], (lambda a, b: abs(a - b) / abs(b))
    for s in range(H.STEPS):
        print(f"step {s}: loss eager32-vs-64 {rel(e32[0][s], t[s]):.2e}  partir32-vs-64 {rel(p32[0][s], t[s]):.2e}  "
              f"partir32-vs-eager32 {rel(p32[0][s], e32[0][s]):.2e}  partir64-vs-eager64 {rel(p64[0][s], t[s]):.2e}")
    print(f"params: eager32-vs-eager64 {rel_err(e32[1], e64[1]):.2e}  partir32-vs-eager32 {rel_err(p32[1], e32[1]):.2e}"
          f"  partir64-vs-eager64 {rel_err(p64[1], e64[1]):.2e}")
    rows = []
    for k, w in e64[1].items():
        if w.numel():
            d = ((p64[1][k] - w).abs() / (1 + w.abs())).flatten()
            i = int(d.argmax())
            g = [gr[k].flatten()[i].item() / max(gr[k].abs().max().item(), 1e-300) if k in gr else None
                 for gr in e64[2]]
            rows.append((float(d[i]), k, i, g))
    for r in sorted(rows, reverse=True)[:6]:
        print(f"  {r[0]:.2e} {r[1]}[{r[2]}] grad/max|grad| per step: "
              f"{['%.1e' % x if x is not None else None for x in r[3]]}")


def ulp(arch, mapping="image"):
    model, batch = build(mapping, arch)
    m64, b64 = copy.deepcopy(model).double(), H._double(batch)
    base = eager(copy.deepcopy(m64), b64)[1]
    for seed in range(2):
        m = copy.deepcopy(m64)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1 + (torch.randint(0, 2, p.shape, generator=g) * 2 - 1).double() * 2.0 ** -52)
        got = eager(m, b64)[1]
        errs = sorted(((float(((got[k] - w).abs() / (1 + w.abs())).max()), k) for k, w in base.items() if w.numel()),
                      reverse=True)
        print(arch, "1-ulp floor", seed, [(f"{e:.2e}", k) for e, k in errs[:3]])


def nemo_schedule(which):
    model, batch = build("seq2seq", "nemo_speechlm", text_layers=16)
    m64, b64 = model.double(), H._double(batch)
    with H._grouped_mm_fallback_in_float64():
        e = eager(copy.deepcopy(m64), b64)
        mesh, sched = {"dp": ({"dp": 2}, [T.data_parallel("dp")]), "mp": ({"tp": 2}, [T.megatron("tp")]),
                       "bpz3": (H.MESH, [T.data_parallel("dp"), T.data_parallel("zero", name="BP-zero"),
                                         T.zero(3, "zero")])}[which]
        p = partir(m64, b64, mesh, sched)
    print(which, "losses partir", p[0], "eager", e[0])
    errs = sorted(((rel_err({k: p[1][k]}, {k: w}), k) for k, w in e[1].items() if w.numel()), reverse=True)
    print(which, "float64 parameters, worst:", [(f"{x:.2e}", k) for x, k in errs[:4]])


def nemo_casts():
    model, batch = build("seq2seq", "nemo_speechlm", text_layers=16)
    m64, b64 = model.double(), H._double(batch)
    with H._grouped_mm_fallback_in_float64():
        as_run = eager(copy.deepcopy(m64), b64)
        mod = importlib.import_module("transformers.models.nemotron_h.modeling_nemotron_h")

        class Float64Torch(types.ModuleType):     # the module's `torch.float32` is float64
            def __getattr__(self, k):
                return torch.float64 if k == "float32" else getattr(torch, k)
        mod.torch = Float64Torch("torch")
        as_float = torch.Tensor.float
        torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else as_float(self, *a, **k)
        full = eager(copy.deepcopy(m64), b64)
    errs = sorted(((rel_err({k: as_run[1][k]}, {k: w}), k) for k, w in full[1].items() if w.numel()), reverse=True)
    print("eager float64 as run vs all-float64, worst:", [(f"{x:.2e}", k) for x, k in errs[:4]])


if __name__ == "__main__":
    t0 = time.time()
    cmd, args = sys.argv[1], sys.argv[2:]
    {"image": image, "ulp": ulp, "nemo-schedule": nemo_schedule, "nemo-casts": lambda: nemo_casts()}[cmd](*args)
    print(f"{time.time() - t0:.1f} s")
