"""Faults on real ranks (issue 25), the parts that need no process: what counts as a peer failure, the messages of
RankFailureError and of diverging ranks, and the groups they name. The real-rank behaviour (a dead, hung or
diverging rank among 4 gloo processes) is tested in test_real_ranks.py's "diverge", "hang" and "dead" phases."""
from __future__ import annotations

import pytest
import torch

import partir_torch as pt
from examples.models import get
from partir_torch.contract import META_COLLECTIVE
from partir_torch.errors import PartitionError, RankFailureError, RuntimeMismatchError
from partir_torch.runtime import faults

CLOSED = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                      "[127.0.0.1]:29584. This is typically caused by a remote worker crashing.")
TIMED_OUT = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for "
                         "recv operation to complete")


def test_peer_failures_are_told_from_errors_of_the_step():
    assert faults.peer_failure_kind(CLOSED) == "closed"
    assert faults.peer_failure_kind(TIMED_OUT) == "timeout"
    assert faults.peer_failure_kind(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)")) is None
    assert faults.peer_failure_kind(ValueError("timeout must be positive")) is None   # no backend named
    assert issubclass(RankFailureError, PartitionError)


def test_group_ranks_are_the_ranks_that_differ_on_that_axis_only():
    mesh = pt.Mesh({"batch": 2, "model": 2})          # rank = 2 * batch + model
    assert faults.group_ranks(mesh, 3, "model") == [2, 3]
    assert faults.group_ranks(mesh, 3, "batch") == [1, 3]
    assert faults.group_ranks(pt.Mesh({"dp": 2, "tp": 4}), 5, "dp") == [1, 5]


@pytest.fixture(scope="module")
def lowered():
    spec = get("gpt")
    batch = spec.batch(4)
    model = spec.build()
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}),
                        [pt.tactics.data_parallel("batch"), pt.tactics.megatron("model")], example_inputs=batch,
                        loss_fn=spec.loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return prog.plan.lowered()


def test_rank_failure_names_step_collective_value_source_group_and_cause(lowered):
    wait = next(n for n in lowered.gm.graph.nodes if n.target is torch.ops._c10d_functional.wait_tensor.default
                and (faults.collective_of(n) or object()).__dict__.get("axis") == "model"
                and faults.collective_of(n).source)
    rec = faults.collective_of(wait)
    assert rec is wait.args[0].meta[META_COLLECTIVE]
    mesh = pt.Mesh({"batch": 2, "model": 2})
    msg = str(faults.step_failure("train_step (step 3)", 2, mesh, rec, CLOSED, 30.0))
    assert msg.startswith("partir_torch: train_step (step 3) failed on rank 2: " + rec.kind), msg
    assert "mesh axis 'model' (size 2, ranks [2, 3])" in msg and rec.value in msg and rec.source in msg, msg
    assert "it died" in msg and "Connection closed by peer" in msg and "--max-restarts" in msg, msg
    hung = str(faults.step_failure("train_step (step 3)", 2, mesh, rec, TIMED_OUT, 30.0))
    assert "did not answer within timeout_s=30 s" in hung, hung
    assert "internal error" not in msg + hung


def test_roll_call_names_the_dead_and_in_a_timeout_the_live_ranks_that_did_not_fail(lowered):
    """answers: None (no live process), "running" (alive, its step had not failed), "failed", "silent" (no answer
    where only failing ranks answer)."""
    rec = next(n.meta[META_COLLECTIVE] for n in lowered.gm.graph.nodes if META_COLLECTIVE in n.meta)
    mesh = pt.Mesh({"batch": 2, "model": 2})
    died = str(faults.step_failure("train_step (step 3)", 0, mesh, rec, CLOSED, 30.0,
                                   answers={1: "running", 2: "failed", 3: None}))
    assert "Dead: rank 3 (no answer to the roll call 1.5 s after the failure" in died, died
    assert "rank 1" not in died and "rank 2" not in died, died    # a live rank still to notice is not blamed
    hung = str(faults.step_failure("train_step (step 3)", 0, mesh, rec, TIMED_OUT, 30.0,
                                   answers={1: "failed", 2: "running", 3: "running"}))
    assert "Alive but not failing: ranks 2, 3 (stuck, much slower" in hung and "Dead:" not in hung, hung
    two = str(faults.step_failure("x", 0, mesh, rec, CLOSED, 30.0, answers={1: None, 2: None, 3: "failed"}))
    assert "Dead: ranks 1, 2 (" in two, two
    assert "only failing ranks answer" in str(faults.step_failure("x", 0, mesh, rec, CLOSED, 30.0,
                                                                  answers={1: "silent", 2: "failed", 3: "failed"}))
    gone = {1: "unknown", 2: "unknown", 3: "unknown"}
    assert "could not reach the store" in str(faults.step_failure("x", 0, mesh, rec, CLOSED, 30.0, answers=gone))
    assert "roll call" not in str(faults.step_failure("x", 0, mesh, rec, CLOSED, 30.0))    # not asked
    assert "none died" in str(faults.step_failure("x", 0, mesh, rec, CLOSED, 30.0, answers={1: "failed"}))
    closed = str(faults.step_failure("x", 0, mesh, rec, CLOSED, 30.0, answers={1: "failed", 3: "running"}))
    assert "Alive but not failing: rank 3 (" in closed and "Dead" not in closed, closed     # no death: a hang


def test_a_failing_line_of_the_generated_code_is_mapped_to_its_collective(lowered):
    """node_at reads the traceback's line in the GraphModule's generated code (what a failed wait raises from)."""
    gm = lowered.gm
    wait = next(n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.wait_tensor.default)
    line = next(i for i, text in enumerate(gm.code.splitlines(), 1) if text.strip().startswith(wait.name + " = "))
    src = "\n" * (line - 1) + "raise RuntimeError('Connection closed by peer')"
    try:
        exec(compile(src, "<eval_with_key>.7", "exec"))
    except RuntimeError as e:
        assert faults.node_at(gm, e) is wait
        assert faults.collective_of(faults.node_at(gm, e)) is wait.args[0].meta[META_COLLECTIVE]


def test_diverging_ranks_are_named_with_what_differs():
    same = faults.describe_call("train_step (step 2)", "abc", 1, [torch.zeros(4, 16, dtype=torch.int64)] * 2)
    other = faults.describe_call("train_step (step 2)", "abc", 1, [torch.zeros(8, 16, dtype=torch.int64)] * 2)
    assert faults.digest(same) == faults.digest(dict(same)) != faults.digest(other)
    err = faults.divergence([same, same, same, other], "train_step (step 2)")
    assert isinstance(err, RuntimeMismatchError)
    msg = str(err)
    assert "ranks [0, 1, 2]: inputs.0 (4, 16) int64; inputs.1 (4, 16) int64" in msg, msg
    assert "ranks [3]: inputs.0 (8, 16) int64" in msg and "\n  step:" not in msg and "\n  program:" not in msg, msg
    late = dict(same, step="2")
    assert "step: ranks [0, 1, 2]: 1\n  step: ranks [3]: 2" in str(faults.divergence([same] * 3 + [late], "x"))
