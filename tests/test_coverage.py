"""A fast sample of the coverage sweep (benchmarks/hf_coverage.py, issue 9 items 6-7): stock Hugging Face models
of the four auto mappings (causal LM, masked LM, seq2seq LM, image classification) built from tiny random configs
and called the way the HF Trainer calls them (`model(**batch).loss`, labels in the batch, default config flags,
dropout as configured), partitioned with data parallel + Megatron + ZeRO-3 on an emulated 2x2x2 mesh, train 2
AdamW steps like one device. timm families (data parallel + ZeRO-3) run in .venv-timm (`make test` runs them
there: `pytest tests/test_coverage.py -k timm`); without timm they are skipped."""
from __future__ import annotations

import pytest

from benchmarks import hf_coverage as H

# (mapping, model type): architectures the sweep lists as passing, a few of each mapping, chosen fast
HF_SAMPLE = [
    ("causal", "gpt2"), ("causal", "llama"), ("causal", "apertus"), ("causal", "arcee"),
    ("masked", "bert"), ("masked", "distilbert"), ("masked", "camembert"),
    ("seq2seq", "t5"), ("seq2seq", "blenderbot-small"),
    ("image", "vit"), ("image", "deit"), ("image", "convnext"),
]
TIMM_SAMPLE = ["vit", "swin", "mixer", "densenet"]     # densenet: BatchNorm with running statistics


def check(row):
    assert row["result"] == "pass", row
    assert row["loss_err"] <= 1e-5 and row["param_err"] <= 1e-4, row


@pytest.mark.parametrize("mapping,arch", HF_SAMPLE, ids=[f"{m}-{a}" for m, a in HF_SAMPLE])
def test_hf_stock_call_matches_single_device(mapping, arch):
    pytest.importorskip("transformers")
    row = H.run_hf(mapping, arch)
    check(row)
    if mapping != "image":      # every text sample has linear pairs: Megatron applied, no fallback
        assert row["sched"] == "BP+MP+Z3", row


@pytest.mark.parametrize("family", TIMM_SAMPLE)
def test_timm_family_matches_single_device(family):
    pytest.importorskip("timm")
    check(H.run_timm(family))


def test_sample_spans_the_four_mappings():
    assert {m for m, _ in HF_SAMPLE} == set(H.MAPPINGS) and len(HF_SAMPLE) >= 12 and len(TIMM_SAMPLE) >= 4
