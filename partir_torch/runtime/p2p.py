"""Real ranks of a pipelined program (lower/pipeline.py): each process runs its own stage's part of the program.

`rank_program` cuts the rank's program out of the pipelined per-device program (bound to the runtime's groups):
its nodes (META_STAGE = its coordinate on the pipeline axis), in the program's order, with every pp_transfer it
sends as an isend to its peer (the rank at the destination coordinate with its coordinates on the other axes) and
every one it receives as a blocking recv from its peer; the nodes every rank runs (META_STAGE None: the
all_reduces on the pipeline axis, clip_grad_norm's and tied weights') are in every rank's program, each rank
contributing its own part (pp_select). The order is the schedule's merged order, in which every
transfer is sent before anything waits on a transfer listed after it, so the blocking receives cannot deadlock; the
sends are waited for at the end of the step. The step's non-state outputs (the loss) are broadcast on the pipeline
axis from the stage that computed them; a state value another stage owns comes back as an empty tensor (the rank
neither holds nor reads it; DistributedRuntime.full_owned reads it from its owner).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.fx._lazy_graph_module import _LazyGraphModule

from ..contract import META_NAME, META_STAGE, STATE_PREFIXES
from ..lower.pipeline import pp_select, pp_transfer

_PENDING: list = []          # (work, tensor) of the isends of the step running in this process


def pp_send(x: torch.Tensor, dst: int, group: str) -> None:
    t = x.contiguous()
    _PENDING.append((dist.isend(t, dst=dst, group=_resolve_process_group(group)), t))


def pp_recv(shape: list, dtype, src: int, group: str, device: str) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buf, src=src, group=_resolve_process_group(group))
    return buf


def pp_flush() -> None:
    """Wait for this step's sends (their buffers are then free)."""
    while _PENDING:
        work, _ = _PENDING.pop(0)
        work.wait()


def pp_broadcast(x, shape: list, dtype, src: int, group: str, device: str) -> torch.Tensor:
    buf = x.contiguous() if x is not None else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buf, src=src, group=_resolve_process_group(group))
    return buf


def rank_program(low, plan, rt):
    """This rank's program of the pipelined `low` (annotated with local values, bound to rt's groups); see the
    module docstring. Returns a Lowered whose gm runs with the same arguments as the whole program."""
    from ..lower.lower import Lowered

    spec = plan.pipeline
    me = rt.coord[spec.axis]
    peer = lambda c: plan.mesh.rank_of({**rt.coord, spec.axis: c})   # noqa: E731
    group, dev = rt.groups[spec.axis], str(rt.device)
    g = fx.Graph()
    env: dict = {}
    out_node = None
    for n in low.gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = g.placeholder(n.name)
            env[n].meta.update(n.meta)
        elif n.op == "output":
            out_node = n
        elif n.target is pp_transfer:
            x, src, dst, _ = n.args
            if src == me:
                g.call_function(pp_send, (env[x], peer(dst), group))
            elif dst == me:
                v = n.meta["val"]
                env[n] = g.call_function(pp_recv, (list(v.shape), v.dtype, peer(src), group, dev))
        elif n.target is pp_select:           # this rank's own part (of an all_reduce, of a tied weight's copies)
            if n.args[1 + me] is not None:
                env[n] = env[n.args[1 + me]]
        elif n.meta.get(META_STAGE) in (me, None):      # None: every rank runs it (the all_reduces on the axis)
            env[n] = g.node_copy(n, lambda a: env[a])
    g.call_function(pp_flush, ())
    outs = []
    for name, o in zip(plan.captured.output_names, out_node.args[0]):
        if not isinstance(o, fx.Node):
            outs.append(o)
            continue
        v = o.meta["val"]
        if name.startswith(STATE_PREFIXES):
            outs.append(env[o] if o in env else g.call_function(torch.empty, ((0,),), {"dtype": v.dtype,
                                                                                       "device": dev}))
        elif o.meta.get(META_STAGE) is None:     # computed by every rank (the gradient norm)
            outs.append(env[o])
        else:      # the loss: every rank returns it
            outs.append(g.call_function(pp_broadcast, (env.get(o), list(v.shape), v.dtype,
                                                       peer(o.meta[META_STAGE]), group, dev)))
    g.output(tuple(outs))
    gm = _LazyGraphModule(torch.nn.Module(), g)
    gm.meta.update(low.gm.meta)
    return Lowered(gm, low.records, low.input_layouts, low.output_layouts, low.coord_axes, low.local_shapes,
                   annotated=False, scheduled=low.scheduled, pipeline=low.pipeline)


def state_coords(plan) -> dict:
    """State value name -> the coordinate on the pipeline axis of the stage that holds it."""
    spec = plan.pipeline
    out = {}
    for n in plan.captured.gm.graph.nodes:
        if n.op == "placeholder" and n.name in spec.stage_of:
            out[n.meta.get(META_NAME)] = spec.rank_of(spec.stage_of[n.name])
    return out
