"""The fast HF sample of the coverage sweep (tests/test_coverage.py HF_SAMPLE) through the torch-xla backend (issue 20
item 4): each stock model built and called as benchmarks/hf_coverage.py does (tiny config, `model(**batch).loss`),
the sweep's schedule (data_parallel(dp), data_parallel(zero), megatron(tp), zero(3, zero); BP+Z3 where Megatron
finds no pair) on dp 2 x tp 2 x zero 2 = 8 XLA CPU devices, 2 AdamW steps (lr 1e-3, eps 1e-5) next to one device,
and compare() of partir's collectives with those of XLA's partitioned HLO.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 OMP_NUM_THREADS=1 .venv-xla/bin/python benchmarks/xla_hf_sample.py [arch ...]
        [--no-dropout]     every dropout probability of the tiny configs set to 0
        [--held-whole]     strided values held whole on their axis (device.unstrided) instead of split views
"""
from __future__ import annotations

import copy
import os
import sys
import time
import warnings

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import partir_torch as pt  # noqa: E402
import partir_torch.xla  # noqa: E402,F401  (before the first XLA tensor)
from examples.zoo import hf as H  # noqa: E402
from tests.test_coverage import HF_SAMPLE  # noqa: E402

T = pt.tactics
STEPS = 2


DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
            "dropout_rate", "dropout", "attention_dropout", "activation_dropout")


def partition(model, batch):
    base = [T.data_parallel("dp"), T.data_parallel("zero", name="BP-zero")]
    opt = dict(example_inputs=(batch,), loss_fn=H.hf_loss)
    try:
        return pt.partition(model, pt.Mesh(H.MESH), base + [T.megatron("tp"), T.zero(3, "zero")], **opt,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)), "BP+MP+Z3"
    except pt.PartitionError as e:
        if "found no column-parallel/row-parallel linear pair" not in str(e) and "but none can be tiled" not in str(e):
            raise
    return pt.partition(model, pt.Mesh(H.MESH), base + [T.zero(3, "zero")], **opt,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)), "BP+Z3"


def run(mapping: str, arch: str) -> list:
    t0 = time.perf_counter()
    _, cls = H.model_class(mapping, arch)
    cfg = H.tiny_config(arch, cls, mapping)
    if "--no-dropout" in sys.argv:
        for f in DROPOUTS:
            if hasattr(cfg, f):
                setattr(cfg, f, 0.0)
    torch.manual_seed(0)
    model = cls(cfg).float().train()
    batch = H.make_batch(model, cfg, mapping)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"partir_torch: ")
        prog, sched = partition(model, batch)
    xprog = prog.to_xla()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-5)
    loss_err = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            torch.manual_seed(0)
            got = xprog.train_step(batch)
            opt.zero_grad()
            torch.manual_seed(0)
            want = H.hf_loss(ref, batch)
            want.backward()
            opt.step()
            loss_err = max(loss_err, abs(float(got) - float(want)) / abs(float(want)))
    params = xprog.gather_parameters()
    perr = max(float((params[k] - p.detach()).abs().max()) for k, p in ref.named_parameters())
    cmp = xprog.compare()
    said = sum("to_xla" in str(w.message) for w in caught)
    worst = max(cmp.axis_errors().items(), key=lambda kv: kv[1], default=("-", 0.0))
    strided = len(xprog.backend.forms)
    return [f"{mapping}/{arch}", sched, f"{loss_err:.1e}", f"{perr:.1e}", strided,
            f"{worst[0]} {100 * worst[1]:.1f}%", f"{100 * cmp.extra_bytes / max(cmp.partir_bytes, 1):.1f}%", said,
            "yes" if cmp.ok else "NO: " + cmp.summary_line()[:90], f"{time.perf_counter() - t0:.0f} s"]


def main():
    only = {a for a in sys.argv[1:] if not a.startswith("--")}
    if "--held-whole" in sys.argv:
        import partir_torch.xla.program as xla_program

        xla_program.form_of = lambda sh, shape, mesh: None
    rows = []
    for mapping, arch in HF_SAMPLE:
        if only and arch not in only:
            continue
        try:
            rows.append(run(mapping, arch))
        except Exception as e:        # noqa: BLE001  (a row that fails is a row of the table)
            rows.append([f"{mapping}/{arch}", "-", "-", "-", "-", "-", "-", "-", f"error: {H.first_line(e)[:90]}",
                         "-"])
        print(rows[-1], flush=True)
    print(tabulate(rows, headers=["model", "schedule", "loss rel. err", "max param err", "split views",
                                  "worst axis diff", "xla extra", "warnings", "plan carried out", "time"]))


if __name__ == "__main__":
    main()
