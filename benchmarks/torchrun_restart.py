"""A rank dies under torchrun; the job restarts and resumes from its last checkpoint (issue 25).

    python benchmarks/torchrun_restart.py [--steps 8 --ckpt-every 3 --kill-at 5]

Runs examples/train_loop.py twice on 4 real gloo ranks (torchrun --standalone --nproc-per-node 4):

  whole:   uninterrupted, --steps N.
  crashed: torchrun --max-restarts 1; in the first attempt rank 3 is SIGKILLed after step K. torchrun terminates the
           others (or they raise RankFailureError at their next step and exit); it restarts all four, which resume from the newest checkpoint (step C <= K) and run to N.

Checks, printed: the crashed job ends with exit code 0 after one restart; no survivor reports an InternalError (on
one node torchrun terminates the survivors as soon as rank 3 exits; a survivor that reaches its next collective
first raises RankFailureError); the first attempt's lines equal the whole run's steps 1..K; the resumed attempt's
lines equal the whole run's steps C+1..N, eval losses and final line included, to the last printed digit. Not a test
(two torchrun jobs take ~40 s on 2 cores); tests/test_real_ranks.py covers the failure itself.
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
           "--ckpt-every", str(ckpt_every), "--eval-every", "4", "--timeout", "30", *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": ROOT}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    return proc, time.perf_counter() - t0


def log_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("step", "done", "resumed"))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ckpt-every", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=5)
    args = ap.parse_args()
    n, every, k = args.steps, args.ckpt_every, args.kill_at
    c = k // every * every
    ok = True
    with tempfile.TemporaryDirectory() as whole_dir, tempfile.TemporaryDirectory() as crash_dir:
        whole, t_whole = torchrun(whole_dir, n, every)
        print(f"whole run: exit {whole.returncode}, {t_whole:.1f} s")
        crashed, t_crash = torchrun(crash_dir, n, every, launcher=("--max-restarts", "1"),
                                    script=("--kill-at", str(k), "--kill-rank", "3"))
        print(f"crashed run (--max-restarts 1, rank 3 SIGKILLed after step {k}): exit {crashed.returncode}, "
              f"{t_crash:.1f} s")
    want = [x for x in log_lines(whole.stdout) if not x.startswith("resumed")]
    got = log_lines(crashed.stdout)
    cut = next((i for i, x in enumerate(got) if x.startswith("resumed")), None)
    first, resumed = (got[:cut], got[cut + 1:]) if cut is not None else (got, [])
    step_of = lambda x: int(re.match(r"step\s+(\d+)", x).group(1)) if x.startswith("step") else n + 1
    errors = sorted(set(re.findall(r"partir_torch\.errors\.(\w+)", crashed.stdout + crashed.stderr)))
    terminated = len(re.findall(r"closing signal SIGTERM", crashed.stderr))
    checks = {
        "whole run exits 0": whole.returncode == 0,
        "crashed job exits 0 after the restart": crashed.returncode == 0,
        "no InternalError on a survivor": "InternalError" not in errors,
        f"resumed from the step-{c} checkpoint": cut is not None and f"(step {c}," in got[cut],
        f"attempt 1 equals the whole run's steps 1..{k}": first == [x for x in want if step_of(x) <= k],
        f"the resumed attempt equals the whole run's steps {c + 1}..{n} and its last line":
            resumed == [x for x in want if step_of(x) > c],
    }
    for what, passed in checks.items():
        print(f"  {'ok  ' if passed else 'FAIL'} {what}")
        ok &= passed
    print(f"  errors named in the crashed job's output: {errors}; survivors terminated by torchrun (SIGTERM): "
          f"{terminated}. On one node torchrun's agent sees rank 3 exit within its monitor interval and terminates "
          f"the others, usually before they reach their next collective; RankFailureError is what a survivor "
          f"raises when it gets there first (another node's ranks, or a rank that hangs instead of exiting).")
    first_err = next((line for line in (crashed.stdout + crashed.stderr).splitlines()
                      if "RankFailureError: partir_torch" in line), "")
    print(f"  a survivor's error: {first_err.strip()[:400]}")
    print("  whole run's log:\n    " + "\n    ".join(want))
    print("  crashed run's log (both attempts):\n    " + "\n    ".join(got))
    if not ok:
        print(crashed.stdout[-3000:], crashed.stderr[-6000:])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
