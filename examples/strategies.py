"""One runnable example per strategy family, each on a model of the zoo, emulated on 4-8 ranks in this process.

    python examples/strategies.py            # all of them
    python examples/strategies.py llama_sp   # one: gpt_3d, llama_sp, moe_ep, unet_fsdp, gns_edges, mq_inference

Each trains (or, for the inference one, runs) a few steps next to an unpartitioned copy, prints both losses and the
partitioned program's per-tactic summary.
"""
from __future__ import annotations

import copy
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import partir_torch as pt  # noqa: E402
from partir_torch import tactics as T  # noqa: E402
from examples.models import get  # noqa: E402

FAMILIES = {
    # name: (model, mesh, schedule, batch size)
    "gpt_3d": ("gpt_sdpa", {"batch": 2, "model": 2}, lambda: [T.data_parallel("batch"), T.megatron("model"),
                                                               T.zero(3, "batch")], 4),
    "llama_sp": ("llama", {"batch": 2, "model": 2}, lambda: [T.data_parallel("batch"), T.megatron("model"),
                                                              T.sequence_parallel("model")], 4),
    # GShard dispatch; experts and token groups share the "data" axis (tokens exchanged by all_to_all), Megatron
    # on "model" for attention
    "moe_ep": ("moe_capacity", {"data": 2, "model": 2},
               lambda: [T.expert_parallel("data"), T.megatron("model"), T.zero(3, "data")], 4),
    "unet_fsdp": ("unet", {"batch": 4}, lambda: [T.data_parallel("batch"), T.zero(3, "batch")], 4),
    # nodes tiled on dim 0 and the edge list on its edge dim: each rank holds a slice of nodes and of edges
    "gns_edges": ("gns", {"batch": 2}, lambda: [T.data_parallel("batch", dims={1: 1})], 2),
}


def train(family: str, steps: int = 3) -> None:
    model_name, mesh, schedule, batch = FAMILIES[family]
    spec = get(model_name)
    model = spec.build()
    ref = copy.deepcopy(model)
    data = spec.batch(batch)
    prog = pt.partition(model, pt.Mesh(mesh), schedule(), example_inputs=data, loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    print(f"\n== {family}: {model_name} on {pt.Mesh(mesh)}")
    for step in range(steps):
        loss = float(prog.train_step(*data))
        ref_opt.zero_grad()
        ref_loss = spec.loss_fn(ref, *data)
        ref_loss.backward()
        ref_opt.step()
        print(f"step {step}: loss {loss:.6f}   single device {float(ref_loss):.6f}")
    print(prog.summary())


def mq_inference() -> None:
    """Inference sharding for grouped-query attention: query heads tiled, the shared K/V kept replicated."""
    spec = get("llama")
    model = spec.build()
    tokens = spec.batch(4)[0]
    prog = pt.partition(model, pt.Mesh({"model": 2}), [T.multi_query("model")], example_inputs=(tokens,))
    print(f"\n== mq_inference: llama forward on {prog.mesh}")
    err = (prog(tokens) - model(tokens)).abs().max()
    print(f"logits max |partitioned - single device| = {float(err):.2e}")
    print(prog.summary())


def main(which=None):
    warnings.simplefilter("ignore")
    for family in FAMILIES:
        if which in (None, family):
            train(family)
    if which in (None, "mq_inference"):
        mq_inference()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
