"""The torchrun worker of tests/test_restart.py (issue 37): the user's own dist.init_process_group("gloo"), the mlp
under BP + MP on {batch: 2, model: 2}, a DCP checkpoint after every step, and one fault per attempt.

    torchrun --nproc-per-node 4 --max-restarts 1 tests/restart_worker.py OUT dead      # or dead,hang (2 restarts)

Attempt a applies fault a of the list to rank 3 in step FAULT_STEP, just before its FAULT_AT-th collective (the
first: every survivor then waits on it inside the step, none has finished the step and gone on to the checkpoint):
"dead": it writes the time and exits 0 (torchrun waits for the others); "hang": it writes the time and sleeps
(timeout_s=TIMEOUT_S in that attempt, 60 s otherwise).
The survivors' RankFailureError (type, time, message) goes to OUT/fault_<attempt>_<rank>.json and they exit 1, so
torchrun restarts the job; every attempt resumes from the newest checkpoint. Rank 0 writes each attempt's losses to
OUT/losses_<attempt>.json.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import partir_torch as pt  # noqa: E402 - before init_process_group: every attempt gets store keys of its own
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from examples.models import get  # noqa: E402
from partir_torch.contract import META_COLLECTIVE  # noqa: E402

STEPS, FAULT_STEP, FAULT_AT, TIMEOUT_S, LR = 3, 2, 1, 3.0, 1e-2


def schedule():
    return [pt.tactics.data_parallel("batch"), pt.tactics.megatron("model")]


def fault_before_collective(prog, k: int, action) -> None:
    """Call `action` just before the k-th collective of this rank's next step (the step runs node by node)."""
    rt, seen = prog.executor.rt, [0]

    class Stall(torch.fx.Interpreter):
        def run_node(self, node):
            if META_COLLECTIVE in node.meta:
                seen[0] += 1
                if seen[0] == k:
                    action()
            return super().run_node(node)

    rt.run = lambda gm, args: Stall(gm).run(*args)


def write(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def main(out: str, faults: list[str]):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    fault = faults[attempt] if attempt < len(faults) else ""
    spec = get("mlp")
    model = spec.build()
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), schedule(), example_inputs=spec.batch(8),
                        loss_fn=spec.loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                        options=pt.Options(timeout_s=TIMEOUT_S if fault == "hang" else 60.0))
    dist.barrier()      # the ranks leave partition() apart under load: the start-up check is not what times out
    done = sorted(int(d.split("_")[1]) for d in os.listdir(out) if d.startswith("step_"))
    start = done[-1] if done else 0
    if start:
        sd = prog.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(out, f"step_{start}"))
        prog.load_state_dict(sd)
    losses = {"start": start}
    for step in range(start + 1, STEPS + 1):
        if step == FAULT_STEP and fault and rank == 3:
            def act():
                write(os.path.join(out, f"{fault}_{attempt}.json"), {"at": time.time()})
                if fault == "dead":
                    os._exit(0)
                time.sleep(60)          # hung: torchrun stops it when a survivor exits 1
            fault_before_collective(prog, FAULT_AT, act)
        try:
            losses[step] = prog.train_step(*spec.batch(8, seed=step)).item()
        except pt.errors.RankFailureError as e:
            write(os.path.join(out, f"fault_{attempt}_{rank}.json"),
                  {"at": time.time(), "type": type(e).__name__, "message": str(e)})
            sys.exit(1)
        tmp = os.path.join(out, f"tmp_{attempt}_{step}")
        dcp.save(prog.state_dict(), checkpoint_id=tmp)
        dist.barrier()
        if rank == 0:
            os.replace(tmp, os.path.join(out, f"step_{step}"))
            write(os.path.join(out, f"losses_{attempt}.json"), losses)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else [])
