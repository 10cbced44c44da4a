"""Peak memory per rank, measured: partir BP+Z3 vs FSDP2 on 4 real gloo ranks, and partir BP vs BP+Z3 (issue 19).

    python benchmarks/memory.py [--d 128] [--layers 4] [--batch 8]

One run, two parts, one model: the zoo's Llama-style decoder (RMSNorm, SwiGLU, GQA, rope) at width d, `layers`
blocks, vocab 4096, seq 16, global batch `batch`; AdamW (foreach), fp32.

1. 4 gloo ranks on 127.0.0.1 (one process each): after one warm-up step, one training step of each implementation
   measured by the same tracker (partir_torch/runtime/memtrack.py: live tensor storages per rank, the state held
   counted from the start: parameters, optimizer state, the rank's batch):
     partir BP+Z3   data_parallel("batch"), zero(3, "batch") on mesh {batch: 4}, real ranks,
                    partition(..., measure_memory=True); prog.peak_memory() (with the default 64 MiB buckets and
                    with bucket_bytes=0: one gather per parameter)
     FSDP2          fully_shard(block) for every block, then fully_shard(model) (the root: embedding, norm, head),
                    torch.optim.AdamW(foreach=True), each rank its quarter of the batch; the tracker around
                    zero_grad + forward + backward + step
2. In this process, 4 emulated ranks: partir BP vs BP+Z3 (prog.peak_memory()), and the simulator's peak for the
   same programs. Goal (issue 19): BP - BP+Z3 >= 90% of (1 - 1/N) x (parameter + gradient + optimizer-state bytes).
3. (unless --no-ratios) The simulator's peak_memory_bytes over the measured peak (max over the 4 emulated ranks),
   for every zoo model (batch 4) and Hugging Face GPT-2 and Llama (2 layers, d=64, vocab 128, batch 4 x 16) under
   BP {batch: 4}, BP+Z3 {batch: 4} and BP+MP+Z3 {batch: 2, model: 2}; AdamW; two steps, the second measured.
4. LoRA (issue 37): an HF Llama (d=128) with peft adapters on every block linear, AdamW over the adapters; the
   measured and simulated peak and the collective bytes per step under BP {batch: 4} (nothing sharded), BP+MP
   and BP+MP+Z3 {batch: 2, model: 2} (default buckets, and bucket_bytes=0). `--lora-only` runs this part alone.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORLD = 4


def spec_of(args):
    from examples.models import get

    return get("llama", d=args.d, hidden=2 * args.d, layers=args.layers, vocab=4096, heads=4, kv_heads=2)


def partir_peak(spec, batch, mesh, tactics, bucket_bytes=64 * 2 ** 20):
    """(measured {rank: bytes}, simulated bytes) of a warm-up step then one measured step."""
    import partir_torch as pt

    model = spec.build()
    prog = pt.partition(model, pt.Mesh(mesh), tactics, example_inputs=batch, loss_fn=spec.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                        options=pt.Options(measure_memory=True, bucket_bytes=bucket_bytes))
    prog.train_step(*batch)
    prog.train_step(*batch)
    sim = prog.simulate(pt.sim.hardware("h100", gpus_per_node=WORLD)).peak_memory_bytes
    return prog.peak_memory(), sim


def fsdp2_peak(spec, batch, rank) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from partir_torch.runtime.memtrack import MemoryTracker

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("batch",))
    model = spec.build()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    per = batch[0].shape[0] // WORLD
    local = tuple(t[rank * per:(rank + 1) * per] for t in batch)

    def step():
        opt.zero_grad()
        spec.loss_fn(model, *local).backward()
        opt.step()

    step()                                                     # warm-up: lazy init, optimizer state
    held = [p.to_local() for p in model.parameters()] + list(local)
    held += [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    held = [t.to_local() if hasattr(t, "to_local") else t for t in held]
    tr = MemoryTracker([rank])
    with tr.step({rank: held}):
        tr.rank = rank
        step()
    return tr.peaks[rank]


def _worker(rank, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    import partir_torch as pt

    spec = spec_of(args)
    batch = spec.batch(args.batch)
    z3 = [pt.tactics.data_parallel("batch"), pt.tactics.zero(3, "batch")]
    out = {"partir BP+Z3": partir_peak(spec, batch, {"batch": WORLD}, z3)[0][rank],
           "partir BP+Z3, bucket_bytes=0": partir_peak(spec, batch, {"batch": WORLD}, z3, 0)[0][rank],
           "FSDP2 (fully_shard per block)": fsdp2_peak(spec, batch, rank)}
    got = [None] * WORLD
    dist.all_gather_object(got, out)
    if rank == 0:
        queue.put(got)
    dist.destroy_process_group()


def real_ranks(args) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    ctx = mp.start_processes(_worker, args=(port, args, queue), nprocs=WORLD, join=False, start_method="spawn")
    got = queue.get(timeout=900)
    ctx.join(timeout=120)
    return got


def emulated(args) -> list:
    import partir_torch as pt

    T = pt.tactics
    spec = spec_of(args)
    batch = spec.batch(args.batch)
    rows = []
    for label, tactics, bb in (("BP", [T.data_parallel("batch")], 64 * 2 ** 20),
                               ("BP+Z3", [T.data_parallel("batch"), T.zero(3, "batch")], 64 * 2 ** 20),
                               ("BP+Z3, bucket_bytes=0", [T.data_parallel("batch"), T.zero(3, "batch")], 0)):
        measured, sim = partir_peak(spec, batch, {"batch": WORLD}, tactics, bb)
        rows.append((label, max(measured.values()), sim))
    return rows


RATIO_SCHEDULES = ("BP", "BP+Z3", "BP+MP+Z3")


def _schedule(label):
    import partir_torch as pt

    T = pt.tactics
    if label == "BP":
        return {"batch": WORLD}, [T.data_parallel("batch")]
    if label == "BP+Z3":
        return {"batch": WORLD}, [T.data_parallel("batch"), T.zero(3, "batch")]
    return {"batch": 2, "model": 2}, [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")]


def _hf_models():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    def gpt2():
        cfg = GPT2Config(vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        cfg._attn_implementation = "eager"
        return GPT2LMHeadModel(cfg)

    def llama():
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0,
                          eos_token_id=0)
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg)

    return {"HF GPT2LMHeadModel": gpt2, "HF LlamaForCausalLM": llama}


def ratios() -> list:
    """(model, schedule, measured max bytes, simulated bytes | error text)."""
    import types

    from examples.models import ZOO

    cases = {name: spec for name, spec in ZOO.items()}
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (4, 16))
    for name, build in _hf_models().items():
        cases[name] = types.SimpleNamespace(build=build, batch=lambda n, t=tokens: (t,),
                                            loss_fn=lambda m, x: m(input_ids=x, labels=x).loss)
    rows = []
    for name, spec in cases.items():
        for label in RATIO_SCHEDULES:
            mesh, tactics = _schedule(label)
            try:
                measured, sim = partir_peak(spec, spec.batch(4), mesh, tactics)
                rows.append((name, label, max(measured.values()), sim))
            except Exception as e:  # noqa: BLE001 - reported in the table (UNet has no linear pair for MP)
                rows.append((name, label, None, f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"))
    return rows


LORA_SCHEDULES = ("BP", "BP+MP", "BP+MP+Z3", "BP+MP+Z3, bucket_bytes=0")


def lora_llama():
    """HF LlamaForCausalLM (2 layers, d=128, SwiGLU 256, 4 heads / 2 KV heads, vocab 256) with peft LoRA r=8 on
    every block linear: everything but the adapters frozen."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0,
                      eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))


def lora_rows() -> list:
    """(schedule, measured max bytes over ranks, simulated bytes, {axis: collective bytes per step}) of lora_llama
    under each LORA_SCHEDULES entry, AdamW over the adapters only, the second of two steps."""
    import partir_torch as pt

    T = pt.tactics
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    mp = [T.data_parallel("batch"), T.megatron("model")]
    schedules = {"BP": ({"batch": WORLD}, [T.data_parallel("batch")], {}), "BP+MP": ({"batch": 2, "model": 2}, mp, {}),
                 "BP+MP+Z3": ({"batch": 2, "model": 2}, mp + [T.zero(3, "batch")], {}),
                 "BP+MP+Z3, bucket_bytes=0": ({"batch": 2, "model": 2}, mp + [T.zero(3, "batch")], {"bucket_bytes": 0})}
    rows = []
    for label in LORA_SCHEDULES:
        mesh, tactics, kw = schedules[label]
        model = lora_llama()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        prog = pt.partition(model, pt.Mesh(mesh), tactics, example_inputs=(tokens, tokens),
                            loss_fn=lambda m, x, y: m(input_ids=x, labels=y).loss, optimizer=opt,
                            options=pt.Options(measure_memory=True, **kw))
        prog.train_step(tokens, tokens)
        prog.train_step(tokens, tokens)
        comm: dict = {}
        for r in prog.collectives():
            comm[r.axis] = comm.get(r.axis, 0) + r.nbytes
        sim = prog.simulate(pt.sim.hardware("h100", gpus_per_node=WORLD)).peak_memory_bytes
        rows.append((label, max(prog.peak_memory().values()), sim, comm))
    return rows


def print_lora() -> None:
    import partir_torch

    model = lora_llama()
    frozen = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    trained = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    print(f"4. LoRA r=8 on every block linear of HF LlamaForCausalLM (2 layers, d=128, vocab 256): frozen {frozen / 2 ** 20:.3f} MiB, adapters "
          f"{trained / 2 ** 20:.3f} MiB; batch 4 x 16, AdamW over the adapters; {WORLD} emulated ranks, second "
          f"step (partir_torch from {partir_torch.__file__}):")
    for label, m, sim, comm in lora_rows():
        per_axis = ", ".join(f"{a} {b / 2 ** 20:.3f} MiB" for a, b in sorted(comm.items()))
        print(f"   {label:25s} measured peak {m / 2 ** 20:7.3f} MiB   simulated {sim / 2 ** 20:7.3f} MiB   "
              f"collective bytes per step: {per_axis}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--no-ratios", dest="ratios", action="store_false")
    ap.add_argument("--lora-only", action="store_true", help="part 4 only")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.lora_only:
        return print_lora()
    spec = spec_of(args)
    n = sum(p.numel() for p in spec.build().parameters())
    pgo = n * 4 * (1 + 1 + 2)                        # fp32 parameters, gradients, AdamW's two moments
    print(f"zoo llama d={args.d}, {args.layers} layers, vocab 4096, seq 16, global batch {args.batch}; "
          f"{n / 1e6:.2f}M parameters; params + grads + AdamW state = {pgo / 2 ** 20:.2f} MiB\n")

    got = real_ranks(args)
    print(f"1. {WORLD} gloo ranks, peak live tensor bytes of one step after a warm-up (runtime/memtrack.py), MiB "
          f"per rank:")
    for impl in got[0]:
        vals = [g[impl] for g in got]
        print(f"   {impl:32s} " + "  ".join(f"{v / 2 ** 20:7.3f}" for v in vals) + f"   max {max(vals) / 2 ** 20:.3f}")
    print()
    rows = emulated(args)
    print(f"2. {WORLD} emulated ranks (max over ranks), measured vs simulated (prog.simulate(...).peak_memory_bytes):")
    for label, m, s in rows:
        print(f"   {label:24s} measured {m / 2 ** 20:8.3f} MiB   simulated {s / 2 ** 20:8.3f} MiB   "
              f"sim/measured {s / m:.4f}")
    goal = 0.9 * (1 - 1 / WORLD) * pgo
    bp = rows[0][1]
    for label, m, _ in rows[1:]:
        print(f"   BP - {label}: {(bp - m) / 2 ** 20:.3f} MiB; goal >= 0.9 x (1 - 1/{WORLD}) x {pgo / 2 ** 20:.2f} = "
              f"{goal / 2 ** 20:.3f} MiB: {'met' if bp - m >= goal else 'MISSED'}")

    if not args.ratios:
        return
    print(f"\n3. simulated / measured peak, {WORLD} emulated ranks (max over ranks), AdamW, second step:")
    worst = 0.0
    for name, label, m, sim in ratios():
        if m is None:
            print(f"   {name:22s} {label:9s} {sim}")
            continue
        worst = max(worst, abs(sim / m - 1))
        print(f"   {name:22s} {label:9s} measured {m:>10d} B   simulated {sim:>10d} B   ratio {sim / m:.5f}")
    print(f"   largest |ratio - 1|: {100 * worst:.3f}% (goal: within 5%)")
    print()
    print_lora()


if __name__ == "__main__":
    main()
