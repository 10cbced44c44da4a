"""Where the simulated peak of the rows that publish peak memory goes, next to what torchtitan's run holds there.

The rows (examples/zoo/sim_reference.py, ``mem_gib``): torchtitan Llama-3.1-8B FSDP on 8 and 128 H100s, local batch 2,
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

The simulated columns: the program partir runs, its storages as partir's runtime holds them and as eager PyTorch
holds them (sim/allocator.eager_buffers: FSDP2's buffers on its streams, selective checkpointing's cache), each at
its own peak of live bytes; "reserved" is the caching allocator's replay of each (sim/allocator.py).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sim_memory_rows.py          # about 30 s
"""
from __future__ import annotations

import os
import sys
from itertools import accumulate

from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from examples.zoo import sim_validation as V                               # noqa: E402
from examples.zoo.sim_reference import ROWS                                 # noqa: E402
from partir_torch.contract import META_ROLE, META_SAVED, Role                        # noqa: E402

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
    if node.meta.get(META_SAVED):                     # what selective checkpointing keeps
        return "saved activations"
    val = node.meta.get("val")
    shape = getattr(val[0] if isinstance(val, (tuple, list)) and val else val, "shape", ())
    if shape and shape[-1] == vocab and cat != "parameters":
        return "logits and loss"
    if cat == "gradients" or "reduce_scatter" in str(node.target):
        return "gradients"
    return {"activations": "saved activations"}.get(cat, "other temporaries")


def simulated(ref) -> tuple:
    """At the run's depth: {runtime: (GiB per fine category at that runtime's peak of live bytes, peak node,
    allocated GiB, reserved GiB)} for partir's runtime and eager PyTorch's (sim/allocator.eager_buffers: FSDP2's
    copy-in buffers are the category "FSDP2 all-gather buffers")."""
    from partir_torch.sim import simulate_graph
    from partir_torch.sim.allocator import eager_buffers

    gm, mesh, recompute, _ = V.program(ref.setup, ref.setup["model"]["layers"])
    rep = simulate_graph(gm, mesh, V._hw(ref.setup, {}), exclude_flops=recompute, issue=V.ISSUE)
    mem, vocab, held = rep.allocator, ref.setup["model"]["vocab"], ref.setup.get("fsdp_held", ())
    nodes = list(gm.graph.nodes)
    out = {}
    for runtime in ("partir", "eager"):
        size, born, last = (mem.events if runtime == "partir" else eager_buffers(mem.events, mem.owners, held))[:3]
        delta = [0] * (len(nodes) + 2)
        for s in range(len(size)):
            delta[born[s]] += size[s]
            delta[min(last[s], len(nodes)) + 1] -= size[s]
        curve = list(accumulate(delta[:len(nodes)]))
        at = curve.index(max(curve))
        cats = dict.fromkeys(ORDER + ("FSDP2 all-gather buffers",), 0.0)
        for s in range(len(size)):
            if born[s] <= at <= last[s]:
                node = mem.owners[s] if s < len(mem.owners) else None
                cat = (_category(node, mem.categories.get(node.name, ""), vocab) if node is not None
                       else "FSDP2 all-gather buffers")
                cats[cat] += size[s] / GIB
        reserved = mem.reserved_bytes(runtime, held if runtime == "eager" else ())
        out[runtime] = (cats, nodes[at].name, curve[at] / GIB, reserved / GIB)
    return out


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
        sim = simulated(ref)
        titan, streams = torchtitan(ref.setup)
        (pc, pnode, palloc, pres), (ec, enode, ealloc, eres) = sim["partir"], sim["eager"]
        rows = [(k, f"{pc[k]:.2f}", f"{ec[k]:.2f}", f"{titan.get(k, 0.0):.2f}") for k in ec]
        rows.append(("allocated (sum)", f"{palloc:.2f}", f"{ealloc:.2f}", f"{sum(titan.values()):.2f}"))
        rows += [(f"  {k}", "", "", f"{v:.2f}") for k, v in streams.items()]
        rows.append(("reserved (max over two steps)", f"{pres:.2f}", f"{eres:.2f}", f"{ref.mem_gib:g} (published)"))
        rows.append(("  error of the reserved figure", f"{100 * (pres - ref.mem_gib) / ref.mem_gib:+.1f}%",
                     f"{100 * (eres - ref.mem_gib) / ref.mem_gib:+.1f}%", ""))
        rows.append(("  segments beyond the live bytes", f"{pres - palloc:.2f}", f"{eres - ealloc:.2f}",
                     f"{ref.mem_gib - sum(titan.values()):.2f} (published - allocated)"))
        print(f"\n{ref.name}: simulated peak at {pnode} (partir's runtime), {enode} (eager PyTorch's)")
        print(tabulate(rows, headers=["GiB at the peak", "sim, partir runtime", "sim, eager runtime",
                                      "torchtitan (code + config)"]))


if __name__ == "__main__":
    main()
