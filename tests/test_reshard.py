"""Every reshard path against the full tensor, in emulation (4 ranks on a 2x2 mesh)."""
import pytest
import torch
import torch.fx as fx

import partir_torch as pt
from partir_torch.lower.reshard import Emitter, reshard
from partir_torch.runtime.emulate import EmulatedRuntime
from partir_torch.runtime.layout import shard_of
from partir_torch.sharding import Sharding as S

MESH = pt.Mesh({"a": 2, "b": 2})
CASES = [  # (src, dst, expected collectives)
    (S(dims=(("a",), (), ())), S(dims=((), (), ("a",))), ["all_to_all"]),
    (S(dims=(("a",), ("b",), ())), S(dims=((), ("b",), ("a",))), ["all_to_all"]),
    (S(dims=((), (), ("a",))), S(dims=(("a",), (), ())), ["all_to_all"]),
    # strided source / destination (an expert dim minor inside a (capacity * experts) dim)
    (S(dims=((), (), ("a",)), strides=(("a", 2),)), S(dims=(("a",), (), ())), ["all_to_all"]),
    (S(dims=(("a",), (), ())), S(dims=((), ("a",), ()), strides=(("a", 3),)), ["all_to_all"]),
    (S(dims=((), ("a",), ()), strides=(("a", 3),)), S(dims=((), (), ("a",)), strides=(("a", 2),)), ["all_to_all"]),
    (S(dims=(("b",), (), ("a",)), strides=(("a", 2),)), S(dims=(("b", "a"), (), ())), ["all_to_all"]),
    (S(dims=(("a", "b"), (), ())), S(dims=((), (), ())), ["all_gather", "all_gather"]),
    (S(dims=(("a",), (), ())), S(dims=(("a", "b"), (), ())), []),
    (S(dims=(("b",), (), ("a",)), strides=(("a", 2),)), S(dims=((), (), ())), ["all_gather", "all_gather"]),
    (S(dims=((), (), ())), S(dims=(("b",), (), ("a",)), strides=(("a", 2),)), []),
    (S(dims=(("a",), (), ()), partial=(("b", "sum"),)), S(dims=(("a",), (), ("b",)), strides=(("b", 2),)),
     ["reduce_scatter"]),
    (S(dims=((), (), ()), partial=(("b", "sum"),)), S(dims=((), ("b",), ())), ["reduce_scatter"]),
    (S(dims=((), (), ()), partial=(("a", "max"),)), S(dims=((), (), ())), ["all_reduce"]),
    (S(dims=(("a",), (), ())), S(dims=(("a",), (), ())), []),
]


@pytest.mark.parametrize("src,dst,kinds", CASES, ids=[f"{s}->{d}" for s, d, _ in CASES])
def test_reshard_matches_full_tensor(src, dst, kinds):
    rt = EmulatedRuntime(MESH)
    full = torch.randn(4, 6, 8)
    g = fx.Graph()
    x = g.placeholder("x")
    coords = {a: g.placeholder(f"c_{a}") for a in MESH.axes}
    em = Emitter(g, MESH, rt.groups, coords)
    g.output(reshard(em, x, src.local_shape(full.shape, MESH), full.dtype, src, dst, "x", lambda a: "t"))
    gm = fx.GraphModule(torch.nn.Module(), g)
    whole = S(src.dims, strides=src.strides)
    op = dict(src.partial)
    if "sum" in op.values():      # uneven parts that sum to the value: coincidences cannot pass
        inp = rt.per_rank(lambda r, c: shard_of(full, whole, MESH, c) * (0.25 + 0.5 * c["b"]))
    elif "max" in op.values():    # rank (a=0) holds the value, the other something smaller
        inp = rt.per_rank(lambda r, c: shard_of(full, whole, MESH, c) - 3.0 * c["a"])
    else:
        inp = rt.shard(full, src)
    out = rt.run(gm, [inp] + rt.coords())
    assert [r.kind for r in em.records] == kinds
    torch.testing.assert_close(rt.full(out, dst, full.shape), full)


PLACEMENT_CASES = [S(dims=(("batch", "model"), ())), S(dims=(("model", "batch"), ())), S(dims=(("batch",), ("model",))),
                   S(dims=(("batch",), ("model",)), strides=(("model", 3),)), S(dims=(("model",), ()))]


@pytest.mark.parametrize("sh", PLACEMENT_CASES, ids=str)
def test_dtensor_placements_describe_the_same_layout(sh):
    """A DTensor built from our local shards with sh.placements() reassembles to the full tensor: the state_dict
    DTensors (and checkpoints) mean what our shards hold, axis order and strided tilings included."""
    from torch.distributed.tensor import DTensor

    mesh = pt.Mesh({"batch": 2, "model": 2})
    rt = EmulatedRuntime(mesh)
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    with rt.mode:
        dt = DTensor.from_local(rt.shard(full, sh), rt.device_mesh, sh.placements(mesh), shape=full.shape,
                                stride=full.stride(), run_check=False)
        whole = dt.full_tensor()
    for r in range(mesh.size):
        torch.testing.assert_close(whole._local_tensors[r], full)
