"""A bucket's gather and all_reduce (lower/bucket.py) as collectives that write every member's result in place into
one output buffer, so that unpacking a bucket is slices and views only (issue 39: no copies the model does not
make).

    all_gather_bucket(xs, k, group) -> flat    member i's gathered (k * n_i) elements, member after member, each
                                               laid out as all_gather_into_tensor(xs[i]) lays it out. One
                                               all_gather of the members' concatenation would lay them out rank
                                               after rank instead: a cat to pack, a strided copy per member to
                                               unpack. Real ranks: ProcessGroup.allgather_into_tensor_coalesced into
                                               the buffer's chunks (one call; NCCL groups the launches).
    all_reduce_bucket(xs, op, group) -> flat   the members' elements reduced over the group, member after member.
                                               The buffer is the all_reduce's own output: a functional all_reduce
                                               copies its operand into a new tensor and reduces that in place; here
                                               the members are written into one such output and reduced in place by
                                               one collective, so the members' copies are the ones each functional
                                               all_reduce would make, and no cat is added.

Both are asynchronous like the functional collectives: their result is read through wait_tensor. The emulator
computes them exactly over the ranks' values (runtime/interpret.py); the simulator costs them as the all_gather /
all_reduce of their bytes (sim/compute.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _gathered(x: torch.Tensor, k: int) -> tuple:
    """all_gather_into_tensor's result shape for operand x: dim 0 times k."""
    return (x.shape[0] * k,) + tuple(x.shape[1:]) if x.dim() else (k,)


@torch.library.custom_op("partir::all_gather_bucket", mutates_args=())
def all_gather_bucket(xs: list[torch.Tensor], group_size: int, group: str) -> torch.Tensor:
    """Every member gathered over `group` (dim 0), into its own chunk of one flat buffer (see the module
    docstring). Asynchronous: read the result through wait_tensor."""
    out = torch.empty(sum(x.numel() for x in xs) * group_size, dtype=xs[0].dtype, device=xs[0].device)
    outs, off = [], 0
    for x in xs:
        n = x.numel() * group_size
        outs.append(out[off:off + n].view(_gathered(x, group_size)))
        off += n
    work = _group(group).allgather_into_tensor_coalesced(outs, [x.contiguous() for x in xs])
    torch._C._distributed_c10d._register_work(out, work)
    return out


@all_gather_bucket.register_fake
def _(xs, group_size, group):
    return xs[0].new_empty(sum(x.numel() for x in xs) * group_size)


@torch.library.custom_op("partir::all_reduce_bucket", mutates_args=())
def all_reduce_bucket(xs: list[torch.Tensor], reduce_op: str, group: str) -> torch.Tensor:
    """The members reduced over `group` (`reduce_op`: sum, avg, max, min, product) into one flat buffer, member
    after member (see the module docstring). Asynchronous: read the result through wait_tensor."""
    out = torch.empty(sum(x.numel() for x in xs), dtype=xs[0].dtype, device=xs[0].device)
    off = 0
    for x in xs:                  # the all_reduce's own output, as a functional all_reduce's copy of its operand
        out[off:off + x.numel()].view(x.shape).copy_(x)
        off += x.numel()
    work = dist.all_reduce(out, op=_OPS[reduce_op], group=_group(group), async_op=True)
    torch._C._distributed_c10d._register_work(out, work)
    return out


@all_reduce_bucket.register_fake
def _(xs, reduce_op, group):
    return xs[0].new_empty(sum(x.numel() for x in xs))


ALL_GATHER_BUCKET = torch.ops.partir.all_gather_bucket.default
ALL_REDUCE_BUCKET = torch.ops.partir.all_reduce_bucket.default


def _functional_gather(xs, group_size, group):
    c10d = torch.ops._c10d_functional
    return torch.cat([c10d.wait_tensor(c10d.all_gather_into_tensor(x, group_size, group)).reshape(-1) for x in xs])


def _functional_reduce(xs, reduce_op, group):
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(torch.cat([x.reshape(-1) for x in xs]), reduce_op, group))


# the same results through the functional collectives (a cat of the members): for LocalTensorMode
# (runtime/emulate.py), which runs an op it does not know on every rank alone
FUNCTIONAL = {ALL_GATHER_BUCKET: _functional_gather, ALL_REDUCE_BUCKET: _functional_reduce}
