"""benchmarks/gpu_check.py's code (issue 39 item 5), here so that tests/test_gpu_check.py can run it (no test
imports a benchmark script). On ONE CUDA device, the same training step (forward, loss, backward, AdamW) of an
8B-shaped Llama block, four ways, each from the same initial weights and batch:

    plain eager        torch: a bf16 copy of the fp32 parameters each step (the cast in the graph, so the gradients
                       reach the fp32 masters), loss.backward(), AdamW(fused=True).step()
    plain compiled     the same, the cast + forward + loss through torch.compile (AOTAutograd compiles the
                       backward); the fused AdamW step eager
    partir eager       pt.partition(model, Mesh({"batch": 1}), [mixed_precision(bf16)]) on one real rank (a
                       1-process NCCL group: DistributedRuntime places the program's state on this process's GPU;
                       no emulation), prog.train_step; the same AdamW(fused=True), run as torch's fused kernel
                       (lower/fuse.py)
    partir compiled    the same with Options(compile=True): the whole per-device step is one Inductor graph
                       (runtime/compiled.py)

Measured: the median step time of `steps` steps after `warmup` (CUDA events around each step, synchronised), and
torch.cuda.max_memory_allocated over the timed steps (reset after the warm-up). Predicted: partir's
prog.simulate(hw) of the matching program (eager rows: partir eager's; compiled rows: partir compiled's) on the
preset of the GPU found (torch.cuda.get_device_name(); "no model" where no preset matches). The first step's loss
of every row is compared with plain eager's; a partir row beyond the tolerance fails the check (main raises
SystemExit after printing the table).

`--device cpu --tiny` runs the same code on a tiny config on CPU (gloo instead of NCCL) so that the script can be
tested without a GPU; memory is then "n/a (cpu)" and so is every measured/simulated ratio.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import re
import statistics
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tabulate import tabulate

import partir_torch as pt
from partir_torch import tactics as T

from examples.models import llama
from examples.models._common import lm_loss

# Llama-3 8B's block (d 4096, 32 query heads, 8 KV heads, SwiGLU 14336); a small vocabulary, so that the
# embedding and head do not hide the blocks. tiny: the same model at test size.
CONFIGS = {"8b": dict(d=4096, heads=32, kv_heads=8, hidden=14336, layers=2, seq=2048, vocab=128),
           "tiny": dict(d=64, heads=4, kv_heads=2, hidden=224, layers=1, seq=32, vocab=64)}
ROWS = ("plain eager", "plain compiled", "partir eager", "partir compiled")
LR = 1e-4
MESH = pt.Mesh({"batch": 1})
NA_CPU = "n/a (cpu)"
PLAIN = "torch, one device"

# torch.cuda.get_device_name() -> sim/hardware.py preset; first match wins. PCIe and NVL parts run at other
# clocks and bandwidths than the SXM presets, GH200 / GB200 pair another memory: "no model" for them.
GPU_PRESETS = ((r"PCIE|\bNVL\b|GH200|GB200", None), (r"\bH200\b", "h200"), (r"\bH100\b", "h100"),
               (r"\bB200\b", "b200"), (r"\bA100\b.*80\s*GB", "a100-80g"), (r"\bA100\b.*40\s*GB", "a100-40g"))


def hardware_preset(device_name: str) -> str | None:
    """The sim/hardware.py preset for a CUDA device name, or None (no model of that part)."""
    for pattern, preset in GPU_PRESETS:
        if re.search(pattern, device_name.upper()):
            return preset
    return None


@dataclass
class Row:
    name: str
    runs_as: str
    setup_s: float = 0.0              # build (and partition) before the first step
    first_step_s: float = 0.0         # the first step, compile included
    step_s: float = 0.0               # median of the timed steps
    peak_bytes: int | None = None     # torch.cuda.max_memory_allocated over the timed steps; None on CPU
    loss0: float = float("nan")       # the first step's loss (before any update)
    loss_last: float = float("nan")   # the last timed step's (after warmup + steps - 1 updates): printed, not checked
    sim: object = None                # partir's SimReport of the row's program, or None (no hardware model)
    module_bytes: int = 0             # partir rows: the eager module's own copy of the state (owner.py)
    error: str | None = None          # the row failed: the exception, its first line (the traceback on stderr)


@dataclass
class GpuCheck:
    """What main() measured: the rows, the table as printed, and the loss check."""

    rows: list
    table: str
    loss_rtol: float
    loss_ok: bool          # every row ran and every partir row's first-step loss is within loss_rtol of plain
    #                        eager's (main raises SystemExit instead of returning when not)
    hardware: str


def parse_args(argv):
    p = argparse.ArgumentParser(prog="benchmarks/gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="the tiny config (with --device cpu: the CI mode)")
    p.add_argument("--layers", type=int, help="blocks (default: 2; tiny 1)")
    p.add_argument("--seq", type=int, help="sequence length (default: 2048; tiny 32)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="compute dtype (bfloat16: partir's mixed_precision, fp32 masters and AdamW state)")
    p.add_argument("--warmup", type=int, default=3, help="steps before timing, the first (compiling) included")
    p.add_argument("--steps", type=int, default=10, help="timed steps (their median is reported)")
    p.add_argument("--hw", help="simulate on this sim/hardware.py preset instead of the one the GPU's name maps to")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1")
    return args


def pick_device(args) -> torch.device:
    """CUDA device 0; CPU only in the test mode (--device cpu --tiny). Anything else refuses, saying why."""
    if args.device == "cpu":
        if not args.tiny:
            raise SystemExit("gpu_check: --device cpu runs only with --tiny (the CI mode: the 8B-shaped block on "
                             "CPU takes minutes a step and measures nothing this check is for).")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (torch.cuda.is_available() is False); this check measures a "
                         "GPU. Run it where one is, or `--device cpu --tiny` to exercise the script on CPU.")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def pick_hardware(args, device):
    """(label, pt.sim Hardware or None) for the simulated columns."""
    if args.hw is not None:
        return args.hw, pt.sim.hardware(args.hw)
    if device.type != "cuda":
        return "no model (cpu)", None
    name = torch.cuda.get_device_name(device)
    preset = hardware_preset(name)
    return (f"{preset} ({name})", pt.sim.hardware(preset)) if preset else (f"no model ({name})", None)


@contextlib.contextmanager
def one_rank(device):
    """A 1-process group (NCCL on CUDA, gloo on CPU): partir's programs run on this process as its one real rank
    (runtime/distributed.py), torn down after."""
    if dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()      # partir's emulated ranks' scaffolding (runtime/emulate.py), not a job's
    if dist.is_initialized():
        raise SystemExit("gpu_check: torch.distributed is already initialised; run the check as one plain "
                         "process (`python benchmarks/gpu_check.py`), not under torchrun.")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device) -> None:
    """What the previous row held is gone before the next row measures its peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_steps(step, device, warmup: int, steps: int):
    """(first step's seconds, median seconds of `steps` timed steps, peak bytes or None, first loss, last loss).
    The first step compiles where the row compiles; the peak is max_memory_allocated over the timed steps (reset
    before)."""
    _sync(device)
    t0 = time.perf_counter()
    loss0 = float(step())
    _sync(device)
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            last = step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            last = step()
            times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return first, statistics.median(times), peak, loss0, float(last)


def cast_loss(model, tokens, targets, dtype):
    """lm_loss on a `dtype` copy of the parameters and buffers (what mixed_precision's capture does: the casts in
    the graph, so the gradients reach the fp32 parameters)."""
    state = {k: v.to(dtype) if v.is_floating_point() else v
             for k, v in itertools.chain(model.named_parameters(), model.named_buffers())}
    return lm_loss(lambda x: torch.func.functional_call(model, state, (x,)), tokens, targets)


def plain_row(cfg, batch, device, dtype, compiled: bool, warmup: int, steps: int) -> Row:
    t0 = time.perf_counter()
    model = llama.build(device, **cfg)       # seeded: every row starts from the same weights
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    loss_of = torch.compile(cast_loss) if compiled else cast_loss

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, *batch, dtype)
        loss.backward()
        opt.step()
        return loss.detach()

    setup = time.perf_counter() - t0
    return Row(ROWS[1] if compiled else ROWS[0], PLAIN, setup, *time_steps(step, device, warmup, steps))


def partir_row(cfg, batch, device, dtype, compiled: bool, hw, warmup: int, steps: int) -> Row:
    t0 = time.perf_counter()
    model = llama.build(device, **cfg)       # seeded: every row starts from the same weights
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)     # the plain rows' optimizer (lower/fuse.py)
    schedule = [] if dtype == torch.float32 else [T.mixed_precision(dtype)]
    prog = pt.partition(model, MESH, schedule, example_inputs=batch, loss_fn=lm_loss, optimizer=opt,
                        options=pt.Options(compile=compiled))
    setup = time.perf_counter() - t0
    sim = prog.simulate(hw, stages=False) if hw is not None else None
    measured = time_steps(lambda: prog.train_step(*batch).detach(), device, warmup, steps)
    held = itertools.chain(model.parameters(), model.buffers(),
                           (t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)))
    module_bytes = sum(t.numel() * t.element_size() for t in held if t.device == device)
    return Row(ROWS[3] if compiled else ROWS[2], partir_runs_as(device), setup, *measured, sim=sim,
               module_bytes=module_bytes)


def partir_runs_as(device) -> str:
    return f"1 real rank, {MESH} ({'nccl' if device.type == 'cuda' else 'gloo'}), no emulation"


def _ms(s) -> str:
    return f"{1e3 * s:.2f}"


def _bytes(b) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b} B"


def _simulated(r: Row, sim, device) -> list:
    """[sim step, sim peak, step measured/simulated, memory measured/simulated] of row r against `sim`."""
    if sim is None:
        return ["no model"] * 4
    t_ratio = NA_CPU if device.type != "cuda" or r.error else f"{r.step_s / sim.step_time_s:.2f}"
    m_ratio = NA_CPU if r.peak_bytes is None else f"{r.peak_bytes / sim.peak_memory_bytes:.2f}"
    return [_ms(sim.step_time_s), _bytes(sim.peak_memory_bytes), t_ratio, m_ratio]


def table(rows: list, device) -> str:
    """One row per way of running the step. A plain row's simulated columns are partir's program of the same kind
    (eager / compiled): the simulator models partir's program, and the step it computes is the same step."""
    want = rows[0].loss0
    out = []
    for r in rows:
        partir = rows[3] if "compiled" in r.name else rows[2]
        sim = _simulated(r, partir.sim, device) if not partir.error else ["partir failed"] * 4
        if r.error:
            out.append([r.name, r.runs_as, "FAILED", "-", "-", "-", *sim, "-", "-", "-"])
            continue
        mem = NA_CPU if r.peak_bytes is None else _bytes(r.peak_bytes)
        rel = abs(r.loss0 - want) / abs(want)
        out.append([r.name, r.runs_as, f"{r.setup_s:.2f}", f"{r.first_step_s:.2f}", _ms(r.step_s), mem, *sim,
                    f"{r.loss0:.6g}", f"{rel:.2e}", f"{r.loss_last:.6g}"])
    headers = ["row", "runs as", "setup s", "first step s", "step ms (median)", "max_memory_allocated",
               "sim step ms", "sim peak", "step meas/sim", "mem meas/sim", "loss, step 1", "rel. diff vs plain eager",
               "loss, last step"]
    return tabulate(out, headers=headers, tablefmt="simple")


def loss_check(rows: list, rtol: float) -> list:
    """What fails the check, one string each: a row that failed to run, a partir row whose first-step loss differs
    from plain eager's by more than rtol (relative). Empty: the check passed."""
    bad = [f"{r.name} failed ({r.error})" for r in rows if r.error]
    want = rows[0].loss0
    if rows[0].error:
        return bad
    for r in rows:
        rel = abs(r.loss0 - want) / abs(want)
        if r.name.startswith("partir") and not r.error and not rel <= rtol:
            bad.append(f"{r.name}'s first-step loss {r.loss0:.6g} is {rel:.2e} from plain eager's {want:.6g} "
                       f"(tolerance {rtol:g})")
    return bad


def attempt(name: str, runs_as: str, measure, device) -> Row:
    """measure() -> Row; an exception (a missing kernel rule, out of memory) is the row's error, its traceback on
    stderr, so that the other rows are still measured; the check then fails (loss_check)."""
    try:
        return measure()
    except Exception as e:  # noqa: BLE001 - reported in the table, the traceback on stderr, the check failed
        traceback.print_exc()
        return Row(name, runs_as, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    finally:
        _free(device)


def main(argv, loss_rtol: dict) -> GpuCheck:
    """Runs the check and prints its table; loss_rtol: {torch dtype: relative tolerance on the first-step loss}
    (tests/harness.py's, passed in by the caller). Raises SystemExit (non-zero) without CUDA (unless --device cpu
    --tiny) and, after printing the table, when a row failed or a partir row's loss is beyond the tolerance."""
    args = parse_args(argv)
    device = pick_device(args)
    cfg = dict(CONFIGS["tiny" if args.tiny else "8b"])
    cfg.update({k: v for k, v in (("layers", args.layers), ("seq", args.seq)) if v is not None})
    dtype = getattr(torch, args.dtype)
    hw_label, hw = pick_hardware(args, device)
    batch = llama.batch(1, device, 0, **cfg)              # (tokens, targets), each (1, seq)
    run = dict(cfg=cfg, batch=batch, device=device, dtype=dtype, warmup=args.warmup, steps=args.steps)
    t0 = time.perf_counter()
    with one_rank(device):
        rows = [attempt(ROWS[c], PLAIN, functools.partial(plain_row, compiled=bool(c), **run), device)
                for c in (0, 1)]
        torch._dynamo.reset()                             # plain compiled's graphs (and what they hold) go
        _free(device)
        rows += [attempt(ROWS[2 + c], partir_runs_as(device), functools.partial(partir_row, compiled=bool(c),
                                                                                 hw=hw, **run), device)
                 for c in (0, 1)]
    text = _report(args, cfg, device, hw_label, rows, time.perf_counter() - t0)
    print(text, flush=True)
    rtol = loss_rtol[dtype]
    bad = loss_check(rows, rtol)
    if bad:
        raise SystemExit("gpu_check: FAILED: " + "; ".join(bad) + ".")
    return GpuCheck(rows, text, rtol, True, hw_label)


def _report(args, cfg, device, hw_label, rows, wall_s) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shape = ", ".join(f"{k} {v}" for k, v in cfg.items())
    head = [f"gpu_check on {name}: Llama blocks ({shape}), batch 1, {args.dtype} compute"
            + (" (fp32 masters and AdamW state)" if args.dtype != "float32" else "") + f", AdamW lr {LR:g}",
            f"median of {args.steps} steps after {args.warmup} warm-up steps; simulated on: {hw_label}"]
    notes = [f"plain rows' simulated columns: partir's program of the same kind (eager / compiled); "
             f"wall time of the four rows {wall_s:.0f} s"]
    notes += [f"{r.name}: the eager module and optimizer hold their own copy of the state, written through after "
              f"every step (runtime/owner.py): {_bytes(r.module_bytes)} of the measured peak"
              for r in rows[2:] if r.peak_bytes is not None]
    notes += [f"{r.name} FAILED: {r.error}" for r in rows if r.error]
    return "\n".join(head) + "\n" + table(rows, device) + "\n" + "\n".join(notes)
