"""A training run end to end: warmup + cosine schedule, gradient clipping, gradient accumulation, periodic
evaluation, a checkpoint every N steps, and resuming after the process is killed.

    python examples/train_loop.py --ckpt /tmp/run1                          # 4 ranks emulated in this process
    torchrun --nproc-per-node 4 examples/train_loop.py --ckpt /tmp/run1     # 4 real gloo ranks (CPU)
    python examples/train_loop.py --ckpt /tmp/run1 --kill-at 13             # dies (SIGKILL) after step 13 ...
    python examples/train_loop.py --ckpt /tmp/run1                          # ... and resumes from step 10

    # a rank dies under torchrun: the others raise RankFailureError at once, torchrun restarts all four, and they
    # resume from the last checkpoint (step 10) with the losses of a run that never stopped
    torchrun --nproc-per-node 4 --max-restarts 1 examples/train_loop.py --ckpt /tmp/run2 --kill-at 13 --kill-rank 3
    # ... or hangs: the others raise RankFailureError after --timeout seconds, and torchrun restarts all four
    torchrun --nproc-per-node 4 --max-restarts 1 examples/train_loop.py --ckpt /tmp/run3 --kill-at 13 --kill-rank 3 \
        --hang --timeout 10

The model is a small GPT on a built-in text; the mesh {batch: 2, model: 2} carries data parallel + Megatron +
ZeRO-3. Every optimizer step takes a batch of 16 windows as 2 micro-batches of 8 (accumulate=2, one gradient
reduction per step), clips the gradients to a global norm of 1 and reads the learning rate the scheduler set
(LambdaLR: linear warmup, then cosine decay). Every --eval-every steps the loss on a held-out batch of another
size runs on the live sharded state (prog.eval_step, eval mode). Every --ckpt-every steps the program state
(DTensors on real ranks, in torch.distributed.checkpoint's get_state_dict layout) is saved with
torch.distributed.checkpoint, next to the scheduler, the step and the random generator (dropout); a run started
with the same --ckpt resumes from the newest complete checkpoint and continues exactly as if it had never stopped
(the data of step s is a function of s). At the end the weights go back into the eager module (prog.export_to).
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import partir_torch as pt  # noqa: E402
from examples.models import get  # noqa: E402
from examples.train_gpt import TEXT, encode  # noqa: E402

SEQ = 32


def get_batch(ids: torch.Tensor, step: int, batch: int, split: str = "train"):
    """`batch` windows of SEQ tokens, a function of (split, step) only: a resumed run sees the same data."""
    g = torch.Generator().manual_seed(step if split == "train" else 10_000 + step)
    lo, hi = (0, len(ids) * 9 // 10) if split == "train" else (len(ids) * 9 // 10 - SEQ, len(ids))
    starts = torch.randint(lo, hi - SEQ - 1, (batch,), generator=g)
    windows = torch.stack([ids[s:s + SEQ + 1] for s in starts.tolist()])   # (batch, SEQ + 1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def warmup_cosine(warmup: int, total: int, floor: float = 0.1):
    """lr multiplier: linear warmup over `warmup` steps, then cosine decay to `floor` at `total`."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
    return f


def latest_checkpoint(root: str) -> tuple[int, str] | None:
    """The newest complete checkpoint under root (step_<n>/, written to a temporary name and renamed)."""
    if not os.path.isdir(root):
        return None
    done = [(int(d.split("_")[1]), os.path.join(root, d)) for d in os.listdir(root)
            if d.startswith("step_") and d.split("_")[1].isdigit()]
    return max(done) if done else None


def save_checkpoint(root: str, step: int, prog, sched, real: bool) -> None:
    rank = dist.get_rank() if real else 0
    final, tmp = os.path.join(root, f"step_{step}"), os.path.join(root, f"tmp_step_{step}")
    # DTensors on real ranks: every rank writes its own shards; emulated: one process, full tensors
    dcp.save(prog.state_dict(), checkpoint_id=tmp, no_dist=not real)
    if rank == 0:
        torch.save({"step": step, "scheduler": sched.state_dict(), "rng": torch.get_rng_state()},   # dropout
                   os.path.join(tmp, "trainer.pt"))
    if real:
        dist.barrier()
    if rank == 0:
        os.replace(tmp, final)
    if real:
        dist.barrier()


def load_checkpoint(path: str, prog, sched, real: bool) -> int:
    sd = prog.state_dict()                      # the layout to load into: this program's shardings
    dcp.load(sd, checkpoint_id=path, no_dist=not real)    # reshards whatever layout the checkpoint was saved in
    prog.load_state_dict(sd)                    # parameters, buffers, optimizer state, step, param-group values
    trainer = torch.load(os.path.join(path, "trainer.pt"), weights_only=False)
    sched.load_state_dict(trainer["scheduler"])
    torch.set_rng_state(trainer["rng"])
    return trainer["step"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (resumes from its newest checkpoint)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16, help="global batch of one optimizer step")
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-batch", type=int, default=4)
    ap.add_argument("--ckpt-every", type=int, default=5)
    ap.add_argument("--kill-at", type=int, default=None, help="SIGKILL this process after that step (a crash); "
                    "under torchrun only in the first attempt (TORCHELASTIC_RESTART_COUNT 0), so a restart runs on")
    ap.add_argument("--kill-rank", type=int, default=None, help="with --kill-at under torchrun: only this rank dies "
                    "(the others raise RankFailureError at the next step and torchrun restarts them all)")
    ap.add_argument("--hang", action="store_true", help="with --kill-at: the rank hangs (sleeps for good) instead "
                    "of dying; the others raise RankFailureError after --timeout")
    ap.add_argument("--timeout", type=float, default=60.0, help="timeout_s: how long a rank waits for a peer that "
                    "does not answer before RankFailureError")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    real = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if real and not dist.is_initialized():
        # partir_torch imported first: under torchrun --max-restarts every attempt gets store keys of its own
        dist.init_process_group("gloo")
    rank = dist.get_rank() if real else 0
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))     # torchrun --max-restarts: 0, 1, ...
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(0)                         # every rank alike (dropout draws are compared at start-up)

    ids, vocab = encode(TEXT)
    spec = get("gpt_sdpa", vocab=vocab, seq=SEQ, d=64, heads=4, layers=2, dropout=0.1)
    model = spec.build()
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps))

    mesh = pt.Mesh({"batch": 2, "model": 2})
    schedule = [pt.tactics.data_parallel("batch"), pt.tactics.megatron("model"), pt.tactics.zero(3, "batch")]
    prog = pt.partition(model, mesh, schedule, example_inputs=get_batch(ids, 0, args.batch), loss_fn=spec.loss_fn,
                        optimizer=opt,
                        step=pt.StepOptions(clip_grad_norm=args.clip, accumulate=args.accumulate),
                        options=pt.Options(timeout_s=args.timeout))

    start = 0
    found = latest_checkpoint(args.ckpt)
    if found is not None:
        start = load_checkpoint(found[1], prog, sched, real)
        say(f"resumed from {found[1]} (step {start}, lr {opt.param_groups[0]['lr']:.3e})")
    say(f"mesh {mesh}, {'real gloo ranks' if real else 'emulated ranks'}; {args.steps} steps of {args.batch} "
        f"windows as {args.accumulate} micro-batches, clip {args.clip}")

    for step in range(start, args.steps):
        lr = opt.param_groups[0]["lr"]
        loss = prog.train_step(*get_batch(ids, step, args.batch)).item()
        sched.step()
        say(f"step {step + 1:3d} loss {loss:.7f} grad_norm {prog.last_grad_norm.item():.5f} lr {lr:.3e}")
        if (step + 1) % args.eval_every == 0:
            val = prog.eval_step(*get_batch(ids, step, args.eval_batch, "val")).item()
            say(f"step {step + 1:3d} eval loss {val:.7f}")
        if (step + 1) % args.ckpt_every == 0:
            save_checkpoint(args.ckpt, step + 1, prog, sched, real)
        if args.kill_at is not None and step + 1 == args.kill_at and attempt == 0 and \
                args.kill_rank in (None, rank):
            print(f"rank {rank}: {'hangs' if args.hang else 'killed'} after step {step + 1}", flush=True)
            while args.hang:
                time.sleep(3600)
            os.kill(os.getpid(), signal.SIGKILL)

    prog.export_to(model)                         # the trained weights back in the eager module
    tokens, targets = get_batch(ids, 0, args.eval_batch, "val")
    model.eval()
    say(f"done: eval loss {prog.eval_step(tokens, targets).item():.7f} (eager module after export_to: "
        f"{spec.loss_fn(model, tokens, targets).item():.7f})")
    if real:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
