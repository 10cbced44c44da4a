"""data_parallel(axis, batchnorm="local"): per-rank batch norm statistics, as DDP (issue 37, item 4).

Checked against DDP's semantics computed eagerly: each rank's slice of the batch through the eager module in train
mode, the gradients averaged over the ranks, the running statistics rank 0's (DDP broadcasts rank 0's buffers
before each forward). The default, batchnorm="global", equals one device (tests/test_norms.py).
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import partir_torch as pt
from partir_torch.errors import PartitionError
from partir_torch.plan import capture_for, plan
from partir_torch.verify import verify_graph

from test_norms import BatchNorms, _batches, _ce, _sgd

# each rank runs eager's batch norm kernels on its batch, as DDP's rank does: the same numbers up to the order of the
# gradients' sum over the ranks (measured: bit-equal here)
RTOL, ATOL = 1e-6, 1e-7
RANKS = 4
LOCAL = [pt.tactics.data_parallel("batch", batchnorm="local")]


def _ddp_step(ref, opt, x, y, loss_fn, ranks):
    """One DDP step, eagerly: every rank from the same buffers on its slice; gradients averaged; rank 0's buffers
    kept. Returns the mean of the ranks' losses (what the global-batch loss of equal slices is)."""
    start = copy.deepcopy(dict(ref.named_buffers()))
    opt.zero_grad()
    losses, kept = [], None
    for r, (xr, yr) in enumerate(zip(x.chunk(ranks), y.chunk(ranks))):
        with torch.no_grad():
            for k, b in ref.named_buffers():
                b.copy_(start[k])
        loss = loss_fn(ref, xr, yr) / ranks
        loss.backward()                                    # summed over ranks / ranks: DDP's average
        losses.append(loss.detach() * ranks)
        if r == 0:
            kept = copy.deepcopy(dict(ref.named_buffers()))
    with torch.no_grad():
        for k, b in ref.named_buffers():
            b.copy_(kept[k])
    opt.step()
    return torch.stack(losses).mean()


def _train_local(model, batches, steps_loss_fn=_ce, tactics=LOCAL, **kw):
    ref = copy.deepcopy(model)
    opt = _sgd(ref)
    prog = pt.partition(model, pt.Mesh({"batch": RANKS}), tactics, example_inputs=batches[0], loss_fn=steps_loss_fn,
                        optimizer=_sgd(model), **kw)
    for i, (x, y) in enumerate(batches):
        got = prog.train_step(x, y)
        want = _ddp_step(ref, opt, x, y, steps_loss_fn, RANKS)
        torch.testing.assert_close(got.detach(), want, rtol=RTOL, atol=0, msg=lambda m: f"loss of step {i}: {m}")
    return prog, ref


def _assert_like_ddp(prog, ref):
    full = prog.full_state_dict()
    for k, want in ref.state_dict().items():
        if want.is_floating_point():
            torch.testing.assert_close(full[k], want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
        else:
            assert torch.equal(full[k], want), f"{k}: {full[k]} != {want}"


def test_local_batch_norm_trains_as_ddp_with_no_statistics_collective():
    """4 ranks, 2 samples each, 3 SGD steps on BatchNorm1d/2d/3d: losses, parameters and rank 0's running
    statistics equal DDP's, computed eagerly (and rank 0's statistics differ from the global batch's, so the
    comparison tells local from global). No collective for the batch statistics: the forward's one all_reduce is
    the loss's; rank 0's (2, C) statistics per norm go in one bucket with the gradients at the end of the step."""
    torch.manual_seed(0)
    model = BatchNorms()
    batches = _batches(3, 8, (3, 4, 4), 6)
    prog, ref = _train_local(model, batches)
    _assert_like_ddp(prog, ref)
    one = copy.deepcopy(model)
    one.train()(batches[0][0])                    # the global batch's statistics are not rank 0's
    assert float((one.bn2.running_mean - ref.bn2.running_mean).abs().max()) > 1e-3

    coll = Counter((r.kind, r.phase) for r in prog.collectives())
    assert set(coll) <= {("all_reduce", "forward"), ("all_reduce", "backward")}, coll
    sizes = sorted(r.nbytes for r in prog.collectives())
    grads = 4 * sum(p.numel() for p in model.parameters())
    assert sizes == [2 * 4, grads + 2 * 4 * (8 + 4 + 2 + 6)], sizes    # (nll sum, weight total); one bucket


def test_local_batch_norm_without_running_statistics_and_without_buckets():
    """track_running_stats=False and bucket_bytes=0: no forward collective but the loss's; the norms' affine
    weights reduced as gradients, one per parameter; still DDP's numbers."""
    torch.manual_seed(1)
    model = BatchNorms(track_running_stats=False)
    prog, ref = _train_local(model, _batches(2, 8, (3, 4, 4), 6, seed=1), options=pt.Options(bucket_bytes=0))
    _assert_like_ddp(prog, ref)
    fwd = [r.nbytes for r in prog.collectives() if r.phase == "forward"]
    assert fwd == [4, 4], fwd
    n_grads = sum(1 for p in model.parameters() if p.requires_grad)
    assert sum(1 for r in prog.collectives() if r.phase == "backward") == n_grads


def test_audit_names_what_global_statistics_cost_and_the_local_option():
    """prog.audit() of the default (global) program counts the norms' statistics all_reduces (4 norms: 4 forward,
    4 backward; (2, C) float64 forward (160 B), float32 backward (80 B)) and names batchnorm='local'; the local
    program's audit has none to name."""
    progs = {}
    for bn in ("global", "local"):
        model = BatchNorms()
        progs[bn] = pt.partition(model, pt.Mesh({"batch": RANKS}), [pt.tactics.data_parallel("batch", batchnorm=bn)],
                                 example_inputs=_batches(1, 8, (3, 4, 4), 6)[0], loss_fn=_ce, optimizer=_sgd(model))
    text = progs["global"].audit()
    assert "8 all_reduces, 480 B per step" in text and "data_parallel(axis, batchnorm='local')" in text, text
    assert "batch norm" not in progs["local"].audit()


def test_local_batch_norm_refuses_what_it_cannot_do():
    """A batch the axis does not divide, an unknown mode, a capture planned on another axis size: each one error
    naming the fix."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(16, 2))
    x, y = torch.randn(6, 3, 4, 4), torch.randint(0, 2, (6,))
    with pytest.raises(PartitionError, match=r"4 does not divide the batch 6.*batchnorm='global'"):
        pt.partition(model, pt.Mesh({"batch": 4}), LOCAL, example_inputs=(x, y), loss_fn=_ce, optimizer=_sgd(model))
    with pytest.raises(PartitionError, match=r"batchnorm is 'global'.*or 'local'"):
        pt.tactics.data_parallel("batch", batchnorm="sync")
    x = torch.randn(8, 3, 4, 4)
    cap = capture_for(model, LOCAL, (x,), mesh=pt.Mesh({"batch": 2}))
    with pytest.raises(PartitionError, match=r"over 4 per-rank batches.*over 2 per-rank batches"):
        plan(cap, pt.Mesh({"batch": 4}), LOCAL)
    with pytest.raises(PartitionError, match=r"needs the size of axis 'batch'.*mesh=mesh"):
        capture_for(model, LOCAL, (x,))


def test_group_batch_norm_rules_verify():
    """The grouped batch norm op and its backward (rules/group_bn.py) pass the brute-force verifier: tiling the
    groups or the channels gives the whole op's values on every rank; the weight gradients' group sums partial."""
    model = BatchNorms()
    cap = capture_for(model, LOCAL, (torch.randn(4, 3, 4, 4),), lambda m, x: m(x).square().mean(), _sgd(model),
                      mesh=pt.Mesh({"batch": 2}))
    ops = {str(n.target) for n in cap.gm.graph.nodes}
    assert {"partir.group_batch_norm.default", "partir.group_batch_norm_backward.default"} <= ops
    report = verify_graph(cap.gm)
    assert report.nodes > 10 and report.factor_checks > 20, str(report)
    assert not report.wrong and not report.missing and not report.errors, str(report)


# ---- real ranks: torch DDP itself as the reference -----------------------------------------------------------------
def _ddp_worker(rank, port, ckpt, queue):
    """Each of 4 gloo ranks trains the same BatchNorms with torch's DDP (its defaults) and with partir's
    batchnorm="local" program, 2 SGD steps on the same global batches; reports both losses, rank 0's DDP state and
    the program's, and the running statistics this rank holds (every rank must hold rank 0's)."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    out = {"rank": rank}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=RANKS, timeout=timedelta(seconds=60))
        torch.manual_seed(0)
        model = BatchNorms()
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        opt = _sgd(ddp)
        prog = pt.partition(model, pt.Mesh({"batch": RANKS}), LOCAL, example_inputs=_batches(1, 8, (3, 4, 4), 6)[0],
                            loss_fn=_ce, optimizer=_sgd(model))
        out["losses"], out["ddp_losses"] = [], []
        for x, y in _batches(2, 8, (3, 4, 4), 6, seed=3):
            out["losses"].append(float(prog.train_step(x, y)))
            opt.zero_grad()
            loss = _ce(ddp, x.chunk(RANKS)[rank], y.chunk(RANKS)[rank])
            loss.backward()
            opt.step()
            dist.all_reduce(loss := loss.detach().clone())
            out["ddp_losses"].append(float(loss) / RANKS)
        # plain Python to the parent (a tensor through the queue dies with its process)
        out["ddp_state"] = {k: v.tolist() for k, v in ddp.module.state_dict().items()}
        out["state"] = {k: v.tolist() for k, v in prog.full_state_dict().items()}
        out["held_running_mean"] = prog.executor.state["buffers.bn2.running_mean"].tolist()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent
        import traceback
        out["fatal"] = traceback.format_exc()
    queue.put(out)


def test_local_batch_norm_on_real_ranks_equals_torch_ddp():
    from tests.spawn import spawn_ranks

    res = spawn_ranks(_ddp_worker, RANKS, 300, prefix="partir_bn_")
    for rank, r in sorted(res.items()):
        assert "fatal" not in r, f"rank {rank}:\n{r['fatal']}"
        torch.testing.assert_close(r["losses"], r["ddp_losses"], rtol=RTOL, atol=0)
    # torch's DDP divides each rank's gradient by the world size before its all_reduce: rounding apart, 2e-7 on fc
    rtol, atol = 1e-5, 1e-6
    ddp0, state = res[0]["ddp_state"], res[0]["state"]
    assert set(ddp0) == set(state)
    for k, want in ddp0.items():
        torch.testing.assert_close(torch.tensor(state[k]), torch.tensor(want), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{k}: {m}")
    moved = torch.tensor(ddp0["bn2.running_mean"])
    assert float(moved.abs().max()) > 1e-2                     # the statistics moved from their zeros
    for rank, r in res.items():     # rank 0's buffers on every rank, as DDP's broadcast leaves them
        torch.testing.assert_close(torch.tensor(r["held_running_mean"]), moved, rtol=rtol, atol=atol)
    assert res[1]["ddp_state"]["bn2.running_mean"] != ddp0["bn2.running_mean"]   # DDP's rank 1 differs till its
    # next forward's broadcast: the program's state is what DDP checkpoints (rank 0's)
