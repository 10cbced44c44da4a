"""Restarts and dead ranks under torchrun (issue 37): one job of 4 gloo ranks on 127.0.0.1 (tests/restart_worker.py),
`torchrun --max-restarts 1`, the user's own `dist.init_process_group("gloo")`, two attempts (about 25 s on 2 idle
cores; a hung rank is tested in test_real_ranks.py's "hang" phase):

  attempt 0: rank 3 dies (exits 0) in step 2: every survivor raises RankFailureError within 5 s naming rank 3 as
             dead and no live rank, then exits 1, and torchrun restarts the job;
  attempt 1: the restart comes up on the shared agent store (pytorch#135712: the previous attempt's gloo
             addresses are still in it), resumes from the step-1 checkpoint and runs steps 2 and 3 with the
             single-device losses.

Plus the part that needs no process: the program's groups on a store of this attempt when the default group's store
is the agent's without one (restart.program_groups_store).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

from examples.models import get
from tests import restart_worker as W

pytestmark = pytest.mark.xdist_group("real_ranks")     # under pytest-xdist, the torchrun job shares their worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reference_losses() -> dict:
    spec = get("mlp")
    model = spec.build()
    opt = torch.optim.AdamW(model.parameters(), lr=W.LR)
    out = {}
    for step in range(1, W.STEPS + 1):
        loss = spec.loss_fn(model, *spec.batch(8, seed=step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        out[str(step)] = loss.item()
    return out


@pytest.fixture(scope="module")
def job():
    with tempfile.TemporaryDirectory(prefix="partir_restart_") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "--max-restarts", "1", os.path.join(ROOT, "tests", "restart_worker.py"), out, "dead"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": ROOT}
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)        # the shared agent store: the case to test
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        files = {os.path.basename(p)[:-5]: json.load(open(p)) for p in glob.glob(os.path.join(out, "*.json"))}
    return proc, files


def _survivors(files, attempt: int) -> dict:
    return {r: files[f"fault_{attempt}_{r}"] for r in (0, 1, 2) if f"fault_{attempt}_{r}" in files}


def test_dead_rank_every_survivor_raises_within_5_s_naming_only_it(job):
    proc, files = job
    assert proc.returncode == 0, proc.stderr[-4000:]
    died = files["dead_0"]["at"]
    survivors = _survivors(files, 0)
    assert sorted(survivors) == [0, 1, 2], (sorted(files), proc.stderr[-4000:])
    for rank, f in survivors.items():
        assert f["type"] == "RankFailureError", f
        assert f["at"] - died < 5, f"rank {rank} raised {f['at'] - died:.1f} s after rank 3 died"
        msg = f["message"]
        assert "train_step (step 2)" in msg and "Dead: rank 3 (no answer" in msg, msg
        assert "Alive but not failing" not in msg and "did not answer within timeout_s" not in msg, msg
        assert "internal error" not in msg, msg


def test_restarts_on_the_shared_agent_store_resume_from_the_checkpoint(job):
    proc, files = job
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = _reference_losses()
    assert files["losses_0"]["start"] == 0 and files["losses_0"]["1"] == pytest.approx(want["1"], rel=1e-5)
    last = files["losses_1"]
    assert last["start"] == 1, last              # the step-1 checkpoint, after the restart
    for step in ("2", "3"):
        assert last[step] == pytest.approx(want[step], rel=1e-5), (step, last, want)
    assert "connectFullMesh" not in proc.stderr, proc.stderr[-4000:]


def test_program_groups_get_a_store_of_this_attempt_on_the_shared_agent_store(monkeypatch, tmp_path):
    """A default group initialised without the per-attempt prefix (before partir_torch was imported): the groups a
    program creates inside program_groups_store put their keys under partir_attempt_<n>_groups/, said once."""
    import torch.distributed as dist

    from partir_torch.runtime import restart

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setattr(restart, "_per_attempt", False)
    monkeypatch.setattr(restart, "_warned", False)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.warns(RuntimeWarning, match="restart 1 .* TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
            with restart.program_groups_store():
                pg = dist.new_group(backend="gloo")
        c10d = dist.distributed_c10d
        c10d._world.pg_map[pg][1].set("probe", "1")
        default_store = c10d._world.pg_map[c10d._get_default_group()][1]     # restored after the block
        assert dist.PrefixStore("partir_attempt_1_groups", default_store).check([f"{pg.group_name}//probe"])
        assert not default_store.check([f"{pg.group_name}//probe"])
        x = torch.ones(2)
        dist.all_reduce(x, group=pg)
        assert x.tolist() == [1.0, 1.0]
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # said once
            with restart.program_groups_store():
                dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()
