"""How long each survivor takes to raise RankFailureError when a rank dies or hangs, over several torchrun jobs
(issue 37).

    python benchmarks/dead_rank.py [--trials 3]

Each trial is one job of tests/restart_worker.py on 4 gloo ranks (torchrun --standalone --max-restarts 2, the
user's own dist.init_process_group("gloo"), the mlp under BP + MP on {batch: 2, model: 2}, timeout_s=3):
attempt 0: rank 3 dies (exits 0) at its first collective of step 2; attempt 1: rank 3 hangs there; attempt 2:
resumes from the step-1 checkpoint and finishes. Prints, per trial and fault, each survivor's seconds from the
fault to its RankFailureError and the ranks its message names as dead / alive but not failing, then the maximum
over the trials. Not a test (a job takes 30-60 s on 2 shared cores); tests/test_restart.py runs the dead rank once.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def named(msg: str, verdict: str) -> str:
    m = re.search(verdict + r": ranks? ([\d, ]+) \(", msg)
    return m.group(1) if m else "-"


def trial() -> tuple[int, dict]:
    with tempfile.TemporaryDirectory(prefix="partir_dead_") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "--max-restarts", "2", os.path.join(ROOT, "tests", "restart_worker.py"), out, "dead,hang"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": ROOT}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
        files = {os.path.basename(p)[:-5]: json.load(open(p)) for p in glob.glob(os.path.join(out, "*.json"))}
    if proc.returncode != 0:
        print(proc.stderr[-6000:])
    return proc.returncode, files


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    worst = {"dead": 0.0, "hang": 0.0}
    for t in range(args.trials):
        rc, files = trial()
        resumed = files.get("losses_2", {}).get("start")
        print(f"trial {t}: job exit {rc}, the last attempt resumed from step {resumed}")
        for attempt, fault in enumerate(("dead", "hang")):
            at = files.get(f"{fault}_{attempt}", {}).get("at")
            for rank in (0, 1, 2):
                f = files.get(f"fault_{attempt}_{rank}")
                if at is None or f is None:
                    print(f"  {fault}: rank {rank} wrote no RankFailureError")
                    worst[fault] = float("inf")
                    continue
                s = f["at"] - at
                worst[fault] = max(worst[fault], s)
                print(f"  rank 3 {fault:4s}: rank {rank} raised {f['type']} after {s:5.2f} s; dead: "
                      f"{named(f['message'], 'Dead')}; alive but not failing: "
                      f"{named(f['message'], 'Alive but not failing')}")
    print(f"max over {args.trials} trials: dead {worst['dead']:.2f} s (bound 5 s), hang {worst['hang']:.2f} s "
          f"(bound timeout_s + 5 = 8 s)")


if __name__ == "__main__":
    main()
