"""Scheduling (lower/schedule.py, issue 19): where collectives are issued and waited for in the per-device program.

- state gathers (ZeRO-3) are issued `prefetch` gathers ahead of their use: matmuls run between a gather's issue and
  its wait; with prefetch=0 none do (the gather waits where it is issued);
- gradient reductions keep at most `reduce_in_flight` in flight per axis: never more issued-but-not-waited ones;
  with no bound, all of them are held to the end of the backward;
- the simulator's default is the program's own order, and the memory it predicts for ZeRO-3 drops with the bound;
- numerics do not depend on the schedule (trained next to eager).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

from tests import harness
import partir_torch as pt
from examples.models import get
from tests.harness import train_next_to_eager
from partir_torch.lower.fuse import adam_update
from partir_torch.lower.ring import RING_SHIFT

T = pt.tactics
SPEC = get("llama", vocab=128, seq=16, d=32, heads=4, kv_heads=2, layers=3)
BATCH = SPEC.batch(4)
WIDE = get("llama", vocab=128, seq=8, d=128, heads=4, kv_heads=2, layers=3)    # parameters outweigh activations
WAIT = torch.ops._c10d_functional.wait_tensor.default
MM = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}
_PROGS: dict = {}


def program(prefetch, reduce_in_flight, bucket_bytes=0, spec=SPEC):
    key = (prefetch, reduce_in_flight, bucket_bytes, id(spec))
    if key not in _PROGS:
        model = spec.build()
        _PROGS[key] = model, pt.partition(
            model, pt.Mesh({"batch": 2}), [T.data_parallel("batch"), T.zero(3, "batch")],
            example_inputs=spec.batch(2) if spec is not SPEC else BATCH,
            loss_fn=SPEC.loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
            options=pt.Options(bucket_bytes=bucket_bytes, prefetch=prefetch, reduce_in_flight=reduce_in_flight))
    return _PROGS[key][1]


def positions(prog, role):
    """[(issue index, wait index, matmuls between them)] of the collectives the pass gave `role`, program order."""
    low = prog.plan.lowered()
    nodes = list(low.gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    out = []
    for n in nodes:
        if low.scheduled.roles.get(n.name) == role:
            w = next(u for u in n.users if u.target is WAIT)
            out.append((at[n], at[w], sum(m.target in MM for m in nodes[at[n]:at[w]])))
    return out


def test_state_gathers_prefetched_one_ahead():
    got = positions(program(1, 1), "state")
    assert len(got) > 10
    # every gather after the first has compute to overlap: it was issued when the previous one's use began
    assert sum(mm > 0 for _, _, mm in got[1:]) >= 0.8 * (len(got) - 1), got
    waits = sorted(w for _, w, _ in got)
    for k, (issue, wait, _) in enumerate(sorted(got, key=lambda t: t[1])):
        if k >= 1:          # issued after the wait of the gather one ahead of it, never two
            assert issue > waits[k - 1] or issue < waits[0], (k, issue, waits[k - 1])
        if k >= 2:
            assert issue > waits[k - 2]
    none = positions(program(0, 1), "state")
    assert len(none) == len(got) and all(mm == 0 for _, _, mm in none)


def _max_in_flight(spans):
    events = sorted([(i, 1) for i, _, _ in spans] + [(w, -1) for _, w, _ in spans])
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("bound", [1, 2])
def test_gradient_reductions_bounded(bound):
    spans = positions(program(1, bound), "gradient")
    assert len(spans) > 10
    assert _max_in_flight(spans) == bound
    assert _max_in_flight(positions(program(1, 0), "gradient")) == len(spans)   # unbounded: all held to the end


def _backward_peak(prog):
    """The simulator's live bytes (sim/memory.py) at their highest before the optimizer update starts."""
    from partir_torch.sim.memory import analyze_memory

    nodes = list(prog.plan.annotated_lowered().gm.graph.nodes)
    first = next(i for i, n in enumerate(nodes) if n.target is adam_update)
    return max(analyze_memory(nodes).curve[:first])


def test_simulator_replays_the_program_and_its_memory():
    hw = pt.sim.hardware("h100", gpus_per_node=2)
    bounded = program(0, 1, spec=WIDE).simulate(hw)
    assert not any("what-if" in n for n in bounded.notes)
    assert any("what-if" in n for n in program(0, 1).simulate(hw, issue="ready").notes)
    # all unsharded gradients held to the end of the backward, or one at a time: the backward's peak drops by
    # about the gradient bytes per rank (1/2 of the parameter bytes on 2 ranks)
    held, freed = _backward_peak(program(0, 0, spec=WIDE)), _backward_peak(program(0, 1, spec=WIDE))
    params = sum(p.numel() * 4 for p in _PROGS[(0, 1, 0, id(WIDE))][0].parameters())
    assert held - freed > 0.4 * params, (held, freed, params)
    # and the step's peak, now at the in-place update (parameters, gradients, moments and one list of scratch)
    assert bounded.peak_memory_bytes < program(0, 0, spec=WIDE).simulate(hw).peak_memory_bytes
    assert bounded.peak_memory_bytes == pytest.approx(params / 2 * 5, rel=0.01)


@pytest.mark.parametrize("prefetch,bound,bucket", [(2, 2, 0), (1, 1, 2 ** 20)])
def test_numerics_do_not_depend_on_the_schedule(prefetch, bound, bucket):
    torch.manual_seed(0)
    model = SPEC.build()
    ref = copy.deepcopy(model)
    prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}),
                        [T.data_parallel("batch"), T.megatron("model"), T.zero(3, "batch")], example_inputs=BATCH,
                        loss_fn=SPEC.loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                        options=pt.Options(bucket_bytes=bucket, prefetch=prefetch, reduce_in_flight=bound))
    train_next_to_eager(prog, ref, [BATCH] * 2, SPEC.loss_fn, make_opt=harness.adamw(lr=1e-3))


def test_options_are_checked():
    with pytest.raises(pt.PartitionError, match="prefetch"):
        program(-1, 1)
    with pytest.raises(pt.PartitionError, match="reduce_in_flight"):
        program(1, 1.5)


def test_tp_chunks_overlap_megatron_all_reduces_and_keep_the_numbers():
    """tp_chunks=2: each row-parallel matmul and its all_reduce in two row chunks (lower/overlap.py): twice the
    forward all_reduces, the same bytes, a chunk's all_reduce in flight over the next chunk's matmul, and the same
    training."""
    def make(chunks):
        torch.manual_seed(0)
        model = SPEC.build()
        ref = copy.deepcopy(model)
        prog = pt.partition(model, pt.Mesh({"batch": 2, "model": 2}), [T.data_parallel("batch"), T.megatron("model")],
                            example_inputs=BATCH, loss_fn=SPEC.loss_fn,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                            options=pt.Options(tp_chunks=chunks))
        return prog, ref

    (plain, _), (chunked, ref) = make(0), make(2)
    fwd = lambda p: [r for r in p.collectives() if r.phase == "forward" and r.axis == "model"]  # noqa: E731
    assert len(fwd(chunked)) == 2 * len(fwd(plain)) == 4 * 3              # 2 row-parallel linears x 3 layers
    assert sum(r.nbytes for r in fwd(chunked)) == sum(r.nbytes for r in fwd(plain))
    # every chunk's all_reduce but a row's last is in flight over the next chunk's matmul
    nodes = list(chunked.lowered.gm.graph.nodes)
    at = {x: i for i, x in enumerate(nodes)}
    starts = [x for x in nodes if "all_reduce" in str(x.target) and x.meta.get("partir_phase", "") != "backward"]
    overlapped = [s for s in starts
                  if any(x.target in MM for x in nodes[at[s]:at[next(u for u in s.users if u.target is WAIT)]])]
    assert len(overlapped) >= len(fwd(plain))                             # at least one chunk per matmul
    # the simulator sees it: part of the chunked program's communication runs under compute (on a model this small
    # the chunks' extra latencies can outweigh it against the plain program, which is not what this checks)
    rep = chunked.simulate(pt.sim.hardware("h100", gpus_per_node=4))
    assert rep.exposed_comm_s < rep.comm_s
    train_next_to_eager(chunked, ref, [BATCH] * 2, SPEC.loss_fn, make_opt=harness.adamw(lr=1e-3))


@pytest.mark.parametrize("name,mesh,schedule", [
    ("llama", {"model": 4}, lambda: [T.megatron("model"), T.sequence_parallel("model")]),
    ("gpt_sdpa", {"batch": 2, "model": 2},       # (B * T, d) rows, the sequence tiled within them (strided)
     lambda: [T.data_parallel("batch"), T.megatron("model"), T.sequence_parallel("model")])])
def test_async_tp_rings_sequence_parallel_collectives_and_keeps_the_numbers(name, mesh, schedule):
    """async_tp=True (lower/ring.py): every tensor-parallel all_gather / reduce_scatter of sequence parallelism
    becomes n - 1 ring steps (collective_permute) carrying the same bytes, each step's transfer in flight while a
    matmul runs; less exposed communication in the simulator; the same training on emulated ranks."""
    spec = get(name)
    n = mesh["model"]

    def make(ring):
        torch.manual_seed(0)
        model = spec.build()
        ref = copy.deepcopy(model)
        prog = pt.partition(model, pt.Mesh(mesh), schedule(), example_inputs=spec.batch(4), loss_fn=spec.loss_fn,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5),
                            options=pt.Options(bucket_bytes=0, async_tp=ring))
        return prog, ref

    (plain, _), (ring, ref) = make(False), make(True)
    sp = lambda p, kinds: [r for r in p.collectives() if r.axis == "model" and r.why == "tactic"  # noqa: E731
                           and r.kind in kinds]
    before = sp(plain, ("all_gather", "reduce_scatter"))
    steps = sp(ring, ("collective_permute",))
    # every one: a gather of a matmul's rows (the column-parallel input, the row-parallel output gradient) and a
    # gather of a weight gradient's transposed operand (its rows summed over: gpt_sdpa's backward) alike
    assert before and not sp(ring, ("all_gather", "reduce_scatter"))
    assert len(steps) == (n - 1) * len(before)
    assert sum(r.nbytes for r in steps) == sum((n - 1) * (r.nbytes // n) for r in before)
    nodes = list(ring.lowered.gm.graph.nodes)
    at = {x: i for i, x in enumerate(nodes)}
    for s in (x for x in nodes if x.target is RING_SHIFT):
        w = next(u for u in s.users if u.target is WAIT)
        assert any(x.target in MM for x in nodes[at[s]:at[w]]), f"no matmul while {s.name} is in flight"
    hw = pt.sim.hardware("h100", gpus_per_node=math.prod(mesh.values()))
    assert ring.simulate(hw).exposed_comm_s < plain.simulate(hw).exposed_comm_s
    train_next_to_eager(ring, ref, [spec.batch(4)] * 3, spec.loss_fn, make_opt=harness.adamw(lr=1e-3, eps=1e-5))


def test_async_tp_is_checked_and_pipelines_refuse_it_and_say_reduce_in_flight_does_not_apply():
    with pytest.raises(pt.PartitionError, match="async_tp"):
        program(1, 1) and pt.partition(torch.nn.Linear(2, 2), pt.Mesh({"batch": 2}), [], example_inputs=(),
                                       options=pt.Options(async_tp=1))
    model = SPEC.build()
    with pytest.raises(pt.PartitionError, match="async_tp=True with a pipeline"):
        pt.partition(model, pt.Mesh({"pp": 2}), [T.pipeline("pp", 2)], example_inputs=BATCH, loss_fn=SPEC.loss_fn,
                     optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), options=pt.Options(async_tp=True))
    # a pipelined program waits for its reductions where its update reads them: a bound given is said not to apply
    with pytest.warns(UserWarning, match="reduce_in_flight=2 does not apply to a pipelined program"):
        pt.partition(model, pt.Mesh({"pp": 2}), [T.pipeline("pp", 2)], example_inputs=BATCH, loss_fn=SPEC.loss_fn,
                     optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), options=pt.Options(reduce_in_flight=2))


def test_zero3_without_reshard_after_forward_gathers_once_per_step():
    """zero(3, reshard_after_forward=False): the forward's gathered copy serves the backward (FSDP2's False): one
    gather per parameter per step, none in the backward, more memory than resharding, the same training."""
    def make(reshard):
        torch.manual_seed(0)
        model = WIDE.build()
        ref = copy.deepcopy(model)
        prog = pt.partition(model, pt.Mesh({"batch": 2}),
                            [T.data_parallel("batch"), T.zero(3, "batch", reshard_after_forward=reshard)],
                            example_inputs=WIDE.batch(2), loss_fn=WIDE.loss_fn,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                            options=pt.Options(bucket_bytes=0))
        return prog, ref

    (again, _), (kept, ref) = make(True), make(False)
    gathers = lambda p, phase: [r for r in p.collectives() if r.kind == "all_gather" and r.phase == phase]  # noqa
    assert gathers(again, "backward") and not gathers(kept, "backward")
    assert len(gathers(kept, "forward")) == len(gathers(again, "forward"))
    hw = pt.sim.hardware("h100", gpus_per_node=2)
    assert _backward_peak(kept) > _backward_peak(again)
    assert kept.simulate(hw).comm_s < again.simulate(hw).comm_s
    train_next_to_eager(kept, ref, [WIDE.batch(2)] * 2, WIDE.loss_fn, make_opt=harness.adamw(lr=1e-3))
    with pytest.raises(pt.PartitionError, match="reshard_after_forward"):
        T.zero(2, "batch", reshard_after_forward=False)


def test_memory_budget_picks_the_schedule_that_fits():
    """Options.memory_budget: prefetching one gather ahead holds one more gathered copy (SGD: no optimizer state, so
    the peak is in the backward); a budget between the two peaks makes the plan lower with prefetch=0; a budget
    nothing fits keeps the smallest and warns."""
    from partir_torch.sim.memory import analyze_memory

    def make(**options):
        model = WIDE.build()
        return pt.partition(model, pt.Mesh({"batch": 2}), [T.data_parallel("batch"), T.zero(3, "batch")],
                            example_inputs=WIDE.batch(2), loss_fn=WIDE.loss_fn,
                            optimizer=torch.optim.SGD(model.parameters(), lr=1e-2),
                            options=pt.Options(bucket_bytes=0, **options))

    def peak(prog):
        return analyze_memory(list(prog.plan.annotated_lowered().gm.graph.nodes)).peak_bytes

    ahead, at_use = peak(make(prefetch=1)), peak(make(prefetch=0))
    assert at_use < ahead
    fit = make(prefetch=1, memory_budget=(ahead + at_use) / 2)
    assert peak(fit) == at_use and fit.plan.lowered().scheduled.prefetch == 0
    with pytest.warns(UserWarning, match="memory_budget: no schedule"):
        tiny = make(prefetch=1, memory_budget=1024)
        tiny.plan.lowered()
    assert peak(tiny) == at_use
    with pytest.raises(pt.PartitionError, match="memory_budget"):
        make(memory_budget=-1)


def test_kept_gathers_under_mixed_precision_serve_the_backward():
    """The backward traces its own bf16 casts of the parameters; with reshard_after_forward=False they are the
    forward's values and share its gathered copies (they had been gathered again: a silent no-op of the flag)."""
    def gathers(reshard):
        model = WIDE.build()
        prog = pt.partition(model, pt.Mesh({"batch": 2}),
                            [T.mixed_precision(torch.bfloat16), T.data_parallel("batch"),
                             T.zero(3, "batch", reshard_after_forward=reshard)],
                            example_inputs=WIDE.batch(2), loss_fn=WIDE.loss_fn,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                            options=pt.Options(bucket_bytes=0))
        recs = [r for r in prog.collectives() if r.kind == "all_gather"]
        return [r for r in recs if r.phase == "forward"], [r for r in recs if r.phase == "backward"]

    (fwd, bwd), (kept_fwd, kept_bwd) = gathers(True), gathers(False)
    assert bwd and not kept_bwd
    assert len(kept_fwd) == len(fwd) and all(r.dtype == "bfloat16" for r in kept_fwd)


def test_tp_backward_all_reduce_overlaps_the_weight_gradient_matmuls():
    """Megatron's backward all_reduce of an input gradient is issued before the independent weight-gradient matmuls
    the program listed just before it: they run while it is in flight (they had run before its issue)."""
    model = SPEC.build()
    prog = pt.partition(model, pt.Mesh({"model": 2}), [T.megatron("model")], example_inputs=BATCH,
                        loss_fn=SPEC.loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    low = prog.plan.lowered()
    nodes = list(low.gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    spans = [(at[n], at[next(iter(n.users))]) for n in nodes
             if n.meta.get("partir_collective") is not None and n.meta["partir_collective"].phase == "backward"
             and n.meta["partir_collective"].axis == "model"]
    assert spans and all(sum(m.target in MM for m in nodes[i:w]) >= 1 for i, w in spans), spans
