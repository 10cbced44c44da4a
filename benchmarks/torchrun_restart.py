"""A rank dies or hangs under torchrun; the job restarts and resumes from its last checkpoint (issue 25).

    python benchmarks/torchrun_restart.py [--steps 8 --ckpt-every 3 --kill-at 5]

Runs examples/train_loop.py three times on 4 real gloo ranks (torchrun --standalone --nproc-per-node 4):

  whole:   uninterrupted, --steps N.
  crashed: torchrun --max-restarts 1; in the first attempt rank 3 is SIGKILLed after step K. torchrun terminates the
           others (or they raise RankFailureError at their next step and exit) and restarts all four, which resume
           from the newest checkpoint (step C <= K) and run to N.
  hung:    the same, but rank 3 hangs (sleeps for good) after step K; with timeout_s=10 the others raise
           RankFailureError ~10 s later and exit, and torchrun restarts all four (the hung one too).

Checks, printed, for crashed and hung: the job ends with exit code 0 after one restart; no survivor reports an
InternalError (hung: the survivors raise RankFailureError); the first attempt's lines equal the whole run's steps
1..K; the resumed attempt's lines equal the whole run's steps C+1..N, eval losses and final line included, to the
last printed digit. Not a test (three torchrun jobs take ~90 s on 2 cores); tests/test_real_ranks.py covers the
failures themselves.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(ckpt: str, steps: int, ckpt_every: int, launcher=(), script=()) -> tuple[subprocess.CompletedProcess,
                                                                                      float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", *launcher,
           os.path.join(ROOT, "examples", "train_loop.py"), "--ckpt", ckpt, "--steps", str(steps),
           "--ckpt-every", str(ckpt_every), "--eval-every", "4", *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": ROOT}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    return proc, time.perf_counter() - t0


def log_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("step", "done", "resumed"))]


def check(name: str, proc, seconds: float, want: list[str], n: int, k: int, c: int, hang: bool) -> bool:
    """Print the checks of one crashed job against the whole run's lines `want`; True when all pass."""
    print(f"{name}: exit {proc.returncode}, {seconds:.1f} s")
    got = log_lines(proc.stdout)
    cut = next((i for i, x in enumerate(got) if x.startswith("resumed")), None)
    first, resumed = (got[:cut], got[cut + 1:]) if cut is not None else (got, [])
    step_of = lambda x: int(re.match(r"step\s+(\d+)", x).group(1)) if x.startswith("step") else n + 1
    out = proc.stdout + proc.stderr
    errors = sorted(set(re.findall(r"partir_torch\.errors\.(\w+)", out)))
    checks = {
        "the job exits 0 after the restart": proc.returncode == 0,
        "no InternalError on a survivor": "InternalError" not in errors,
        f"resumed from the step-{c} checkpoint": cut is not None and f"(step {c}," in got[cut],
        f"attempt 1 equals the whole run's steps 1..{k}": first == [x for x in want if step_of(x) <= k],
        f"the resumed attempt equals the whole run's steps {c + 1}..{n} and its last line":
            resumed == [x for x in want if step_of(x) > c],
    }
    if hang:
        checks["the survivors raised RankFailureError (timeout_s=10)"] = "RankFailureError" in errors
    for what, passed in checks.items():
        print(f"  {'ok  ' if passed else 'FAIL'} {what}")
    print(f"  errors named: {errors}; survivors terminated by torchrun (SIGTERM): "
          f"{len(re.findall(r'closing signal SIGTERM', proc.stderr))}")
    err = next((line for line in out.splitlines() if "RankFailureError: partir_torch" in line), "")
    if err:
        i = out.index(err)
        print("  a survivor's error:\n    " + "\n    ".join(out[i:].splitlines()[:5]))
    print("  its log (both attempts):\n    " + "\n    ".join(got))
    if not all(checks.values()):
        print(proc.stdout[-3000:], proc.stderr[-6000:])
    return all(checks.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ckpt-every", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=5)
    args = ap.parse_args()
    n, every, k = args.steps, args.ckpt_every, args.kill_at
    c = k // every * every
    fault = ("--kill-at", str(k), "--kill-rank", "3")
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2, \
            tempfile.TemporaryDirectory() as d3:
        whole, t_whole = torchrun(d1, n, every)
        crashed, t_crash = torchrun(d2, n, every, launcher=("--max-restarts", "1"), script=fault)
        hung, t_hung = torchrun(d3, n, every, launcher=("--max-restarts", "1"), script=fault + ("--hang", "--timeout",
                                                                                                 "10"))
    want = [x for x in log_lines(whole.stdout) if not x.startswith("resumed")]
    print(f"whole run: exit {whole.returncode}, {t_whole:.1f} s; its log:\n    " + "\n    ".join(want))
    ok = whole.returncode == 0
    ok &= check(f"rank 3 SIGKILLed after step {k} (--max-restarts 1)", crashed, t_crash, want, n, k, c, False)
    ok &= check(f"rank 3 hangs after step {k} (--max-restarts 1, timeout_s 10)", hung, t_hung, want, n, k, c, True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
