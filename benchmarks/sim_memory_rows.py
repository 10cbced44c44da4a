"""Where the simulated peak of the rows that publish peak memory goes, next to what torchtitan's run holds there.

The rows (benchmarks/sim_reference.py, ``mem_gib``): torchtitan Llama-3.1-8B FSDP on 8 and 128 H100s, local batch 2,
seq 8192, selective (per-op) activation checkpointing, bf16 parameters, fp32 reduction, AdamW; the published figure
is torch.cuda.max_memory_reserved. For each row, the simulated program at the run's depth (the one
``sim_validation.py --memory`` predicts) is split at its peak into categories by the node that allocates each live
storage; the right column is what torchtitan's step holds at the same moment (the log-softmax backward of the
loss), computed from its code and config (torchtitan 9dec370, the commit the benchmark names):

- parameter shards: fp32, 1/dp of the parameters; optimizer states: AdamW's exp_avg and exp_avg_sq, fp32, sharded;
- gradients: none (``optimizers.zero_grad()`` sets them to None; the first reduce-scatter runs after the loss);
- gathered parameters: the root module's (embedding, final norm, output head: FSDP2 does not reshard the root
  after forward) and the last block's (``reshard_after_forward=False`` for the last block), bf16;
- saved activations: per block, what the "op" policy stores (every block's input, kept by the checkpoint; the
  outputs of the 1st, 3rd, 5th and 7th aten.mm of the block: wq, wv, w1, w2; the flash-attention output and its
  logsumexp), and outside the blocks the final RMSNorm's (its fp32 up-cast, the normalized bf16 value and its
  product with the weight, the head's input);
- logits and loss: cross_entropy(pred.float()): the fp32 log-softmax (saved), the gradient nll_loss_backward
  makes (fp32) and the log-softmax backward's result (fp32); the bf16 logits and their fp32 up-cast are freed by
  then (``del pred``; the up-cast is not saved);
- FSDP2's other streams (reserved, not in the default stream's pool): the all-gather output is allocated on the
  all-gather copy-in stream (at least the root's, gathered first), the sharded gradients are the reduce-scatter's
  outputs, allocated on the reduce-scatter stream (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py); the
  caching allocator reuses a block only on the stream it was allocated on.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sim_memory_rows.py          # about 1 min per row
"""
from __future__ import annotations

import os
import sys

from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import sim_validation as V                               # noqa: E402
from benchmarks.sim_reference import ROWS                                 # noqa: E402
from partir_torch.contract import META_ROLE, Role                         # noqa: E402

GIB = 2 ** 30
ORDER = ("parameter shards", "optimizer states", "gradients", "gathered parameters", "saved activations",
         "logits and loss", "other temporaries", "inputs and buffers")


def _category(node, cat: str, vocab: int) -> str:
    """The fine category of a storage allocated by ``node`` (sim/memory.py's coarse category ``cat``)."""
    if node.op == "placeholder":
        role = node.meta.get(META_ROLE)
        return {Role.PARAM: "parameter shards", Role.OPT_STATE: "optimizer states"}.get(role, "inputs and buffers")
    if "all_gather" in str(node.target):
        return "gathered parameters"
    val = node.meta.get("val")
    shape = getattr(val[0] if isinstance(val, (tuple, list)) and val else val, "shape", ())
    if shape and shape[-1] == vocab and cat != "parameters":
        return "logits and loss"
    if cat == "gradients" or "reduce_scatter" in str(node.target):
        return "gradients"
    return {"activations": "saved activations"}.get(cat, "other temporaries")


def simulated(ref) -> tuple:
    """(GiB per fine category at the simulated peak, peak node, allocated GiB, reserved GiB) at the run's depth."""
    from partir_torch.sim import simulate_graph

    gm, mesh, recompute, _ = V.program(ref.setup, ref.setup["model"]["layers"])
    rep = simulate_graph(gm, mesh, V._hw(ref.setup, {}), exclude_flops=recompute, issue=V.ISSUE)
    mem = rep.allocator
    size, born, last = mem.events[:3]
    at = mem.curve.index(mem.peak_bytes)
    out = dict.fromkeys(ORDER, 0.0)
    for s, node in enumerate(mem.owners):
        if born[s] <= at <= last[s]:
            out[_category(node, mem.categories.get(node.name, ""), ref.setup["model"]["vocab"])] += size[s] / GIB
    return out, mem.peak_node, mem.peak_bytes / GIB, mem.reserved_bytes(ref.setup.get("runtime", "partir")) / GIB


def torchtitan(setup: dict) -> dict:
    """GiB per category that torchtitan's step holds in the log-softmax backward of its loss (module docstring)."""
    c, dp, B = setup["model"], setup["mesh"]["dp"], setup["batch"]
    d, L, T, V_, f = c["d"], c["layers"], c["seq"], c["vocab"], c["hidden"]
    q, kv = c["heads"] * (d // c["heads"]), c["kv_heads"] * (d // c["heads"])
    block = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d            # wq wk wv wo, w1 w2 w3, two norms
    root = 2 * V_ * d + d                                             # embedding, output head, final norm
    n = L * block + root
    bt = B * T
    saved_block = bt * (d + q + kv + q + f + d) * 2 + B * c["heads"] * T * 4   # x, wq, wv, attention, w1, w2; lse
    final_norm = bt * d * (4 + 2 + 2) + bt * 4                        # fp32 x, normalized, times weight; rsqrt
    out = dict.fromkeys(ORDER, 0.0)
    out.update({"parameter shards": 4 * n / dp, "optimizer states": 8 * n / dp,
                "gathered parameters": 2 * (root + block), "saved activations": L * saved_block + final_norm,
                "logits and loss": 3 * bt * V_ * 4})
    return {k: v / GIB for k, v in out.items()}, {"all-gather copy-in stream (root's output)": 2 * root / GIB,
                                                  "reduce-scatter stream (sharded fp32 gradients)": 4 * n / dp / GIB}


def main() -> None:
    for ref in [r for r in ROWS if r.mem_gib]:
        sim, node, alloc, reserved = simulated(ref)
        titan, streams = torchtitan(ref.setup)
        rows = [(k, f"{sim[k]:.2f}", f"{titan[k]:.2f}", f"{sim[k] - titan[k]:+.2f}") for k in ORDER]
        rows.append(("allocated (sum)", f"{alloc:.2f}", f"{sum(titan.values()):.2f}",
                     f"{alloc - sum(titan.values()):+.2f}"))
        rows += [(f"  {k}", "-", f"{v:.2f}", "") for k, v in streams.items()]
        rows.append(("reserved", f"{reserved:.2f}", f"{ref.mem_gib:g} (published)",
                     f"{100 * (reserved - ref.mem_gib) / ref.mem_gib:+.1f}%"))
        rows.append(("  segments beyond the live bytes", f"{reserved - alloc:.2f}",
                     f"{ref.mem_gib - sum(titan.values()):.2f} (published - allocated)", ""))
        print(f"\n{ref.name}: simulated peak at {node}")
        print(tabulate(rows, headers=["GiB at the peak", "simulated", "torchtitan (code + config)", "sim - titan"]))


if __name__ == "__main__":
    main()
