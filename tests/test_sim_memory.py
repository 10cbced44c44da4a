"""Peak memory from buffer liveness, and its breakdown."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from partir_torch.sim.memory import analyze_memory
from partir_torch.sim.synthetic import GraphBuilder

aten = torch.ops.aten


def test_liveness_peak_counts_views_once():
    b = GraphBuilder()
    x = b.input("x", (4, 8), "input")                      # 128 B, live all step
    p = b.input("p", (8, 16), "param")                     # 512 B, live all step
    a = b.call(aten.mm.default, x, p)                      # 256 B, dies after relu (through its view)
    v = b.call(aten.view.default, a, [64])                 # alias of a
    r = b.call(aten.relu.default, v)                       # 256 B, dies after sum
    s = b.call(aten.sum.default, r)                        # 4 B, returned
    b.output([s], ["loss"])
    mem = analyze_memory(list(b.graph.nodes))
    assert mem.peak_bytes == 128 + 512 + 256 + 256 and mem.peak_node == r.name
    assert mem.breakdown["parameters"] == 512 and mem.breakdown["inputs"] == 128
    assert mem.breakdown["temporaries"] == 512
    assert mem.curve[-2] == 128 + 512 + 256 + 4            # at the sum: mm freed, relu read, loss born
    assert mem.curve[-1] == 128 + 512 + 4                  # at the output: only the loss is left


def test_collective_input_lives_until_wait():
    from partir_torch.mesh import Mesh
    b = GraphBuilder(Mesh({"dp": 2}))
    x = b.input("x", (256,), "input")                      # 1 KiB
    y = b.call(aten.mul.Tensor, x, 2.0)                    # 1 KiB: input of the all_reduce
    c = b.collective("all_reduce", y, "dp")                # 1 KiB output
    z = b.call(aten.mul.Tensor, x, 3.0)                    # 1 KiB, while y is still being sent
    w = b.wait(c)
    o = b.call(aten.add.Tensor, w, z)
    b.output([o])
    mem = analyze_memory(list(b.graph.nodes))
    names = [n.name for n in b.graph.nodes]
    assert mem.curve[names.index(z.name)] == 4 * 1024     # x, y (still being sent), c, z
    assert mem.curve[names.index(o.name)] == 4 * 1024     # y freed at the wait: x, c(=w), z, o
    assert mem.peak_bytes == 4 * 1024


def _train_step_graph():
    def step(x, w1, w2, lr):
        w1 = w1.detach().requires_grad_()
        w2 = w2.detach().requires_grad_()
        loss = (torch.relu(x @ w1) @ w2).sum()
        g1, g2 = torch.autograd.grad(loss, (w1, w2))
        return w1 - lr * g1, w2 - lr * g2, loss
    gm = make_fx(step, tracing_mode="fake")(torch.randn(64, 128), torch.randn(128, 256), torch.randn(256, 128),
                                             torch.tensor(0.1))
    roles = {"x_1": "input", "w1_1": "param", "w2_1": "param", "lr_1": "lr"}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta["partir_role"] = roles[n.name]
        if n.op == "output":
            n.meta["partir_name"] = ["params.w1", "params.w2", "loss"]
    return gm


def test_breakdown_finds_activations_gradients_and_updated_params():
    gm = _train_step_graph()
    mem = analyze_memory(list(gm.graph.nodes))
    cat = mem.categories
    assert cat["relu"] == "activations"                    # forward value read by backward
    assert cat["mm"] == "temporaries"                      # pre-activation, dead before backward
    assert cat["mm_2"] == cat["mm_4"] == "gradients"       # dW2, dW1: alive into the optimizer update
    assert cat["mm_3"] == "temporaries"                    # dX of the second matmul
    assert cat["sub"] == cat["sub_1"] == "parameters"      # updated parameters (named params.*)
    assert cat["w1_1"] == "parameters" and cat["lr_1"] == "inputs"
    assert mem.breakdown["parameters"] >= 2 * (128 * 256 * 4)
    assert sum(mem.breakdown.values()) == mem.peak_bytes


# -- what a GPU reserves: PyTorch's CUDA caching allocator replayed (sim/allocator.py) ---------------------------------
MiB = 1 << 20


def test_caching_allocator_pools_segments_best_fit_split_and_merge():
    from partir_torch.sim.allocator import CachingAllocator

    a = CachingAllocator()
    x = a.malloc(100)                     # rounded to 512 B, carved from a 2 MiB small-pool segment
    assert a.reserved == 2 * MiB
    y = a.malloc(3 * MiB)                 # under 10 MiB: a 20 MiB large-pool segment, the rest kept free
    assert a.reserved == 22 * MiB
    z = a.malloc(17 * MiB + 1)            # more than the 17 MiB left there: a segment of its own, rounded to 2 MiB
    assert a.reserved == 22 * MiB + 18 * MiB
    w = a.malloc(16 * MiB)                # best fit: the 17 MiB left of the 20 MiB segment, no new segment
    assert a.reserved == 40 * MiB
    for b in (x, y, z, w):
        a.release(b)
    assert sorted(a.free[0, False]) == [(18 * MiB, z), (20 * MiB, y)]   # y merged again (default stream, large pool)
    assert a.malloc(19 * MiB) == y and a.reserved == 40 * MiB           # reused, not reserved again


def test_a_hole_too_small_for_the_next_tensor_is_fragmentation():
    """Two 8 MiB tensors share a 20 MiB segment; freeing one leaves an 8 MiB hole, and a 9 MiB tensor (under
    10 MiB, so it wants a 20 MiB segment) fits neither the hole nor the 4 MiB tail: a second segment is reserved
    while 17 MiB are live."""
    from partir_torch.sim.allocator import reserved_bytes

    sizes, born, last = [8 * MiB, 8 * MiB, 9 * MiB], [0, 0, 2], [1, 3, 3]
    assert reserved_bytes(sizes, born, last, end=4, steps=1) == 40 * MiB
    assert reserved_bytes(sizes, born, last, end=4, steps=3) == 40 * MiB     # the steady state: reused


def test_a_block_freed_on_one_stream_is_not_reused_on_another():
    """The caching allocator keys its pools by stream: a 30 MiB tensor freed on a side stream (FSDP2's
    reduce-scatter stream) leaves a free 30 MiB segment that a 30 MiB tensor of the default stream cannot use, so a
    second segment is reserved; on one stream it is reused."""
    from partir_torch.sim.allocator import CachingAllocator, reserved_bytes

    a = CachingAllocator()
    a.release(a.malloc(30 * MiB, stream=1))
    a.malloc(30 * MiB)
    assert a.reserved == 60 * MiB
    sizes, born, last = [30 * MiB, 30 * MiB], [0, 2], [1, 3]
    assert reserved_bytes(sizes, born, last, end=4) == 30 * MiB
    assert reserved_bytes(sizes, born, last, end=4, streams={0: 1}) == 60 * MiB


def test_report_reserved_is_at_least_the_live_peak_on_gpus_and_absent_on_tpus():
    import partir_torch as pt
    from examples.models import get

    spec = get("gpt")
    m = spec.build()
    prog = pt.partition(m, pt.Mesh({"batch": 2}), [pt.tactics.data_parallel("batch"), pt.tactics.zero(3, "batch")],
                        example_inputs=spec.batch(8), loss_fn=spec.loss_fn, optimizer=torch.optim.AdamW(m.parameters()))
    gpu = prog.simulate(pt.sim.hardware("h100", gpus_per_node=2))
    assert gpu.reserved_memory_bytes >= gpu.peak_memory_bytes > 0
    assert gpu.reserved_memory_bytes % (2 * MiB) == 0                       # whole segments
    assert "reserved by PyTorch's CUDA caching allocator" in gpu.table()
    tpu = prog.simulate(pt.sim.hardware("tpu-v5e", topology=(2, 1)))
    assert tpu.reserved_memory_bytes is None and "caching allocator" not in tpu.table()


def test_eager_runtime_puts_fsdp2_gathers_and_reductions_on_their_streams():
    """FSDP2 allocates an all-gather's output on its copy-in stream, copies it out at the wait into the unsharded
    parameters (the program's storage, from the wait on) and frees it; the reduce-scatter's output, the sharded
    gradient, lives on the reduce-scatter stream. Their segments are the other streams' own: more is reserved."""
    import partir_torch as pt
    from examples.models import get
    from partir_torch.errors import PartitionError
    from partir_torch.sim.allocator import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM, eager_buffers

    spec = get("gpt")
    m = spec.build()
    prog = pt.partition(m, pt.Mesh({"batch": 2}), [pt.tactics.data_parallel("batch"), pt.tactics.zero(3, "batch")],
                        example_inputs=spec.batch(8), loss_fn=spec.loss_fn, optimizer=torch.optim.AdamW(m.parameters()))
    mem = prog.simulate(pt.sim.hardware("h100", gpus_per_node=2)).allocator
    sizes, born, last, _, _, _, streams = eager_buffers(mem.events, mem.owners)
    n = len(mem.events[0])
    gathers = [s for s, node in enumerate(mem.owners[:n]) if "all_gather" in str(node.target)]
    reductions = [s for s, node in enumerate(mem.owners[:n]) if "reduce_scatter" in str(node.target)]
    assert gathers and reductions and len(sizes) == n + len(gathers)
    assert {streams[s] for s in reductions} == {REDUCE_SCATTER_STREAM}
    for g, s in zip(gathers, range(n, len(sizes))):       # the copy-in buffer: issue to the copy-out at the wait
        assert streams[s] == ALL_GATHER_STREAM and sizes[s] == sizes[g]
        assert born[s] == mem.events[1][g] < born[g] == last[s]
    assert mem.reserved_bytes("eager") > mem.reserved_bytes("partir") >= mem.peak_bytes
    with pytest.raises(PartitionError, match="'ddp' is not modelled"):
        mem.reserved_bytes("ddp")


def test_eager_runtime_holds_what_selective_checkpointing_saves_until_the_recomputation():
    """torch.utils.checkpoint's selective checkpointing stores every output its policy saves, read by the backward
    or not, until its region is recomputed; partir frees one nobody reads. In a SwiGLU block the 7th matmul (w2,
    saved by the every-other-matmul policy) only feeds the residual add: partir frees it in the forward, eager
    PyTorch holds it until the block's recomputation in the backward."""
    import partir_torch as pt
    from examples.zoo import sim_decoder as M
    from partir_torch.contract import META_RECOMPUTE, META_SAVED
    from partir_torch.sim.allocator import eager_buffers

    cfg = M.DecoderConfig(vocab=64, seq=16, d=32, heads=4, kv_heads=2, layers=2, hidden=64, gated=True, tied=False)
    model = M.build(cfg)
    tokens = torch.zeros(2, cfg.seq, dtype=torch.int64, device="meta")
    prog = pt.partition(model, pt.Mesh({"dp": 2}), [pt.tactics.data_parallel("dp"),
                                                    pt.tactics.remat("layers.*", policy="selective")],
                        example_inputs=(tokens, tokens), loss_fn=M.loss_fn,
                        optimizer=torch.optim.AdamW(model.parameters()))
    mem = prog.simulate(pt.sim.hardware("h100", gpus_per_node=2)).allocator
    nodes = list(mem.owners[0].graph.nodes)
    start = {}
    for i, node in enumerate(nodes):
        start.setdefault(node.meta.get(META_RECOMPUTE), i)
    sizes, born, last = eager_buffers(mem.events, mem.owners)[:3]
    saved = [s for s, node in enumerate(mem.owners) if node.meta.get(META_SAVED)]
    mms = [s for s in saved if "mm" in str(mem.owners[s].target)]
    assert len(mms) == 4 * cfg.layers                     # wq, wv, w1, w2 of each block
    unread = [s for s in mms if mem.events[2][s] < start[mem.owners[s].meta[META_SAVED]]]
    assert len(unread) == cfg.layers                      # w2's output, freed by partir in the forward
    for s in saved:
        assert last[s] == max(mem.events[2][s], start[mem.owners[s].meta[META_SAVED]])
    assert mem.reserved_bytes("eager") >= mem.reserved_bytes("partir")


def test_eager_runtime_keeps_the_modules_fsdp2_does_not_reshard_gathered_to_the_end_of_the_backward():
    """FSDP2 frees a module's gathered parameters at the module's reshard, not after their last use: the root's own
    parameters (never resharded after the forward) and a block with reshard_after_forward=False stay gathered until
    the end of the backward. partir frees the embedding's gathered copy after the embedding's forward (its backward
    does not read the weight); held=("emb.*",) keeps it to the update."""
    import partir_torch as pt
    from examples.zoo import sim_decoder as M
    from partir_torch.contract import META_NAME
    from partir_torch.errors import PartitionError
    from partir_torch.sim.allocator import eager_buffers

    cfg = M.DecoderConfig(vocab=64, seq=16, d=32, heads=4, kv_heads=2, layers=2, hidden=64, gated=True, tied=False)
    model = M.build(cfg)
    tokens = torch.zeros(2, cfg.seq, dtype=torch.int64, device="meta")
    prog = pt.partition(model, pt.Mesh({"dp": 2}), [pt.tactics.data_parallel("dp"), pt.tactics.zero(3, "dp")],
                        example_inputs=(tokens, tokens), loss_fn=M.loss_fn,   # a gather per parameter
                        optimizer=torch.optim.AdamW(model.parameters()), options=pt.Options(bucket_bytes=0))
    mem = prog.simulate(pt.sim.hardware("h100", gpus_per_node=2)).allocator
    nodes = list(mem.owners[0].graph.nodes)
    update = next(i for i, x in enumerate(nodes) if x.op == "call_function" and any(
        a.op == "placeholder" and str(a.meta.get(META_NAME, "")).startswith("opt.") for a in x.all_input_nodes))

    def gathers_of(name):
        return [s for s, x in enumerate(mem.owners) if "all_gather" in str(x.target)
                and any(a.meta.get(META_NAME) == name for a in x.all_input_nodes)]

    emb = gathers_of("params.emb.weight")
    assert len(emb) == 1 and mem.events[2][emb[0]] < update - 1            # partir: freed after the forward
    last = eager_buffers(mem.events, mem.owners)[2]
    assert last[emb[0]] == mem.events[2][emb[0]]
    last = eager_buffers(mem.events, mem.owners, held=("emb.*",))[2]
    assert last[emb[0]] == update - 1                                      # FSDP2: to the end of the backward
    other = gathers_of("params.layers.0.mlp.w1.weight")
    assert other and all(last[s] == mem.events[2][s] for s in other)
    assert mem.reserved_bytes("eager", ("emb.*",)) >= mem.reserved_bytes("eager")
    with pytest.raises(PartitionError, match="applies to runtime 'eager'"):
        mem.reserved_bytes("partir", ("emb.*",))
