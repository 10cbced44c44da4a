"""The optimizer update of the per-device program as fused multi-tensor kernels (eager programs).

Capture traces Adam/AdamW and SGD op by op (capture/optim.py: about a dozen elementwise passes per parameter for
Adam; for SGD with momentum a `where` of the first step's buffer, a multiply, an add and the update, each out of
place). Here each
parameter's update is found in the lowered program (the optimizer-phase ops between its parameter, its moments,
its gradient and the group's hyperparameters, and nothing else), and the updates of one param group and dtype are
replaced by one node, `adam_update`, over the lists of local shards, which updates them in place as torch.optim
does when nothing reads them after it (donate=True):

    new_params, new_exp_avgs, new_exp_avg_sqs, new_max = adam_update(params, grads, exp_avgs, exp_avg_sqs, ...)

Its kernels are torch.optim's: `torch._foreach_*` in the order of `_multi_tensor_adam` (the foreach
implementation; on CPU bitwise equal to the single-tensor update the capture mirrors), or `aten._fused_adamw_` /
`_fused_adam_` when the user's optimizer was built with fused=True (then the numerics are torch.optim's fused
ones). SGD's node is `sgd_update(params, grads, momentum_buffers, ...)`, torch.optim's `_multi_tensor_sgd` in place
(the first step copies the gradient into the buffer, as torch starts it) or `aten._fused_sgd_` for fused=True. The
simulator costs each node as one memory-bound kernel: one read of parameter, gradient and state, one write of
parameter and state (sim/compute.py).

A masked update (a gated step, capture/gates.py: `where(nograd, old, new)` on the parameter and each moment, with
`nograd` its input `draws.nograd.<fqn>`) is fused too: the node takes the flags (`skip`) and updates only the
parameters that have a gradient this step, as torch.optim skips those without one (no extra pass over the
others). An update that does not match (an unknown optimizer, an op outside the pattern, an intermediate read
elsewhere) stays op by op. Compiled programs (partition(..., compile=True)) keep the ops: Inductor fuses them itself.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from ..contract import META_NAME, META_ROLE, META_SRC, Phase, Role, phase_of
from ..rules import tags
from .order import reorder
from .reshard import call_function

aten = torch.ops.aten

# the ops capture/optim.py's updates emit (tensor and float64 scalar math), per optimizer kind
_UPDATE_OPS = {"adam": tags.ops("adam_math"), "adamw": tags.ops("adam_math"), "sgd": tags.ops("sgd_math")}


# a kernel for the simulator (rules/tags.py's KERNELS): its results alias params, exp_avgs, exp_avg_sqs and
# max_exp_avg_sqs when its last argument (donate) is True (its own temporaries: sim/memory.py's _transient)
def _adam_transient(a, size) -> int:
    """Bytes adam_update allocates and frees inside itself: the foreach path holds, at its last kernel, sqrt(v) (one
    exp_avg_sq each) and the modified gradients (maximize, or L2 weight decay; decoupled weight decay scales the
    parameters in place); the fused path a 0-dim float32 step per parameter."""
    if a[14]:
        return 4 * len(a[0])
    wd, maximize, decoupled = a[9] is not None, a[12], a[13]
    return size(a[3]) + (size(a[1]) if maximize or (wd and not decoupled) else 0)


@tags.kernel(donates=(0, 2, 3, 4), transient=_adam_transient)
def adam_update(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                max_exp_avg_sqs: list[Tensor], step: Tensor, lr: Tensor, beta1: Tensor, beta2: Tensor,
                weight_decay: Optional[Tensor], eps: float, amsgrad: bool, maximize: bool, decoupled: bool,
                fused: bool, skip: Optional[list], donate: bool) -> tuple[list[Tensor], list[Tensor], list[Tensor],
                                                                           list[Tensor]]:
    """One Adam/AdamW step over lists of tensors of one dtype. Hyperparameters are 0-dim float64 tensors (fed at
    every step); the scalar math is capture/optim.py's _adam_scalars, rounded to the dtype.

    donate=True: the step's parameters and moments are updated in place, as torch.optim does, and returned (the
    program donates them: fuse_optimizer checks that nothing reads them after this node, and the runtimes hold
    state they own, runtime/backend.py); donate=False: on copies, the inputs stay as they were. skip: per
    parameter a bool 0-dim tensor, True when it has no gradient this step (left as it is, with its moments)."""
    first = step[0] if isinstance(step, (list, tuple)) else step     # a list: one count per parameter
    if first.is_meta or is_fake(first):   # shapes only (lower/fakeprop.py): the scalar math needs values
        like = (lambda ts: ts) if donate else (lambda ts: [torch.empty_like(t) for t in ts])  # noqa: E731
        return like(params), like(exp_avgs), like(exp_avg_sqs), like(max_exp_avg_sqs) if amsgrad else []
    if not donate:
        params, exp_avgs, exp_avg_sqs = ([t.clone() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs))
        max_exp_avg_sqs = [t.clone() for t in max_exp_avg_sqs] if amsgrad else []
    if skip is not None:
        keep = [i for i, s in enumerate(skip) if not bool(s)]
        pick = lambda ts: [ts[i] for i in keep] if ts else []  # noqa: E731
        if keep:
            adam_update(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(max_exp_avg_sqs),
                        pick(step) if isinstance(step, (list, tuple)) else step, lr, beta1, beta2, weight_decay,
                        eps, amsgrad, maximize, decoupled, fused, None, True)
        return params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else []
    if isinstance(step, (list, tuple)):  # a step count per parameter (a step that branches): one update per count
        by: dict = {}
        for i, s in enumerate(step):
            by.setdefault(float(s), []).append(i)
        for idx in by.values():
            pick = lambda ts: [ts[i] for i in idx] if ts else []  # noqa: E731
            adam_update(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(max_exp_avg_sqs),
                        step[idx[0]], lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, decoupled, fused, None,
                        True)
        return params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else []
    dtype = params[0].dtype
    step64, lr64, b1, b2 = step.double(), lr.double(), beta1.double(), beta2.double()
    if fused:
        return _fused(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step64, lr64, b1, b2, weight_decay,
                      eps, amsgrad, maximize, decoupled)
    bc1 = 1 - torch.pow(b1, step64)
    bc2 = 1 - torch.pow(b2, step64)
    f = lambda t: t.to(dtype).item()  # noqa: E731 - a float64 scalar rounded as the dtype (torch.optim's floats)
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay is not None and decoupled:
        torch._foreach_mul_(params, f(1 - lr64 * weight_decay.double()))
    elif weight_decay is not None:
        grads = torch._foreach_add(grads, params, alpha=f(weight_decay.double()))
    torch._foreach_lerp_(exp_avgs, grads, f(1 - b1))
    torch._foreach_mul_(exp_avg_sqs, f(b2))
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, f(1 - b2))
    if amsgrad:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
    denom = torch._foreach_sqrt(max_exp_avg_sqs if amsgrad else exp_avg_sqs)
    torch._foreach_div_(denom, f(bc2 ** 0.5))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, f(-(lr64 / bc1)))
    return params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else []



def _fused(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step, lr, b1, b2, weight_decay, eps, amsgrad,
           maximize, decoupled):
    """aten._fused_adamw_ / _fused_adam_ (torch.optim's fused=True kernels), in place."""
    steps = [step.float() for _ in params]
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(params, list(grads), exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], steps, lr=lr.item(),
           beta1=b1.item(), beta2=b2.item(), weight_decay=0.0 if weight_decay is None else weight_decay.item(),
           eps=eps, amsgrad=amsgrad, maximize=maximize)
    return params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else []


def _sgd_transient(a, size) -> int:
    """Bytes sgd_update allocates and frees inside itself: the modified gradients of the foreach path (maximize, L2
    weight decay, Nesterov's lookahead: made one after the other, at most two lists alive at once); none fused."""
    if a[10]:
        return 0
    made = int(bool(a[8])) + int(a[4] is not None) + int(bool(a[7]))
    return min(made, 2) * size(a[1])


@tags.kernel(donates=(0, 2), transient=_sgd_transient)
def sgd_update(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], step: Tensor, weight_decay:
               Optional[Tensor], momentum: Optional[Tensor], lr: Tensor, nesterov: bool, maximize: bool,
               dampening: float, fused: bool, skip: Optional[list], donate: bool) -> tuple[list[Tensor], list[Tensor]]:
    """One SGD step over lists of tensors of one dtype, torch.optim's `_multi_tensor_sgd` (capture/optim.py's _sgd
    per parameter, bitwise on CPU): hyperparameters are 0-dim tensors fed at every step, rounded to the dtype as
    the capture rounds them; momentum None: no buffers (bufs empty); the first step (step <= 1) starts each buffer
    as a copy of its gradient. donate, skip and a list of step counts as in adam_update."""
    first = step[0] if isinstance(step, (list, tuple)) else step
    if first.is_meta or is_fake(first):      # shapes only (lower/fakeprop.py)
        like = (lambda ts: ts) if donate else (lambda ts: [torch.empty_like(t) for t in ts])  # noqa: E731
        return like(params), like(bufs)
    if not donate:
        params, bufs = [t.clone() for t in params], [t.clone() for t in bufs]
    keep = None
    if skip is not None:
        keep = [i for i, s in enumerate(skip) if not bool(s)]
    if isinstance(step, (list, tuple)):       # a count per parameter: one update per count
        keep = range(len(params)) if keep is None else keep
        by: dict = {}
        for i in keep:
            by.setdefault(float(step[i]), []).append(i)
        groups = [(idx, step[idx[0]]) for idx in by.values()]
    else:
        groups = [(keep, step)] if keep is None or keep else []
    for idx, st in groups:
        pick = (lambda ts: ts) if idx is None else (lambda ts: [ts[i] for i in idx] if ts else [])  # noqa: E731
        _sgd_lists(pick(params), pick(grads), pick(bufs), st, weight_decay, momentum, lr, nesterov, maximize,
                   dampening, fused)
    return params, bufs


def _sgd_lists(params, grads, bufs, step, weight_decay, momentum, lr, nesterov, maximize, dampening, fused) -> None:
    dtype = params[0].dtype
    f = lambda t: t.to(dtype).item()  # noqa: E731 - a hyperparameter rounded as the dtype (capture/optim.py's casts)
    first = bool(step <= 1)
    if fused:
        torch._fused_sgd_(params, list(grads), bufs if momentum is not None else [],
                          weight_decay=0.0 if weight_decay is None else f(weight_decay),
                          momentum=0.0 if momentum is None else f(momentum), lr=f(lr), dampening=dampening,
                          nesterov=nesterov, maximize=maximize, is_first_step=first)
        return
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay is not None:
        grads = torch._foreach_add(grads, params, alpha=f(weight_decay))
    if momentum is not None:
        if first:
            torch._foreach_copy_(bufs, grads)
        else:
            torch._foreach_mul_(bufs, f(momentum))
            torch._foreach_add_(bufs, grads, alpha=1 - dampening)
        grads = torch._foreach_add(grads, bufs, alpha=f(momentum)) if nesterov else bufs
    torch._foreach_add_(params, grads, alpha=-f(lr))


FUSED_UPDATES = (adam_update, sgd_update)


# -- the pass ----------------------------------------------------------------------------------------------------
def fuse_optimizer(graph: fx.Graph, captured) -> int:
    """Replace each Adam/AdamW/SGD param group's per-parameter updates in `graph` (a lowered program) with one
    adam_update / sgd_update node. Returns the number of parameters fused."""
    fopt = captured.fopt
    if fopt is None or fopt.kind not in _UPDATE_OPS:
        return 0
    cap_nodes = {n.name: n for n in captured.gm.graph.nodes}
    phase = {}
    for n in graph.nodes:
        src = cap_nodes.get(n.meta.get(META_SRC))
        phase[n] = phase_of(src) if src is not None else None
    by_src = {}
    for n in graph.nodes:
        if n.op == "call_function" and META_SRC in n.meta:
            by_src.setdefault(n.meta[META_SRC], n)
    placeholders = {n.meta.get(META_NAME): n for n in graph.nodes if n.op == "placeholder"}
    cap_out = next(n for n in captured.gm.graph.nodes if n.op == "output").args[0]
    result_of = {}   # output name -> lowered node of the update's result
    for name, o in zip(captured.output_names, cap_out):
        if isinstance(o, fx.Node) and o.op != "placeholder" and o.name in by_src:
            result_of[name] = by_src[o.name]
    step = placeholders.get("step")
    if step is None:
        return 0
    index = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict = {}
    for fqn in fopt._trainable():
        found = _match(fqn, fopt, placeholders, result_of, phase, index)
        if found is not None:
            # a step that branches counts steps per parameter (placeholders step.<fqn>: capture/branches.py)
            found["step"] = placeholders.get(f"step.{fqn}", step)
            key = (fopt._group[fqn], captured.names[f"params.{fqn}"].meta["val"].dtype, found["skip"] is not None)
            groups.setdefault(key, []).append(found)
    n_fused = 0
    for (gi, _, _), members in groups.items():
        own = [m["step"] for m in members]
        emit = _emit_sgd if fopt.kind == "sgd" else _emit
        if emit(graph, fopt, gi, members, placeholders, step if all(s is step for s in own) else own):
            n_fused += len(members)
    if n_fused:
        reorder(graph)     # every node after its inputs; the current order kept wherever it is valid
        _donate(graph)
    return n_fused


def _donate(graph) -> None:
    """Let each fused update write its parameters and moments in place (donate=True) when nothing reads them after
    it: the program's own order then guarantees no reader sees the updated values early."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node.target not in FUSED_UPDATES:
            continue
        readers, stack = [], [s for k in tags.donated_args(node.target) for s in node.args[k]]
        while stack:                      # the states and every view of them (a view would see the update)
            for u in stack.pop().users:
                if u is not node:
                    readers.append(u)
                    if _aliases(u.target):
                        stack.append(u)
        if all(index[u] < index[node] for u in readers):
            node.args = node.args[:-1] + (True,)


def _aliases(target) -> bool:
    """A view: its result may share its input's storage (reshape may)."""
    if target is operator.getitem or target is aten.reshape.default:
        return True
    rets = getattr(getattr(target, "_schema", None), "returns", ())
    return any(r.alias_info is not None for r in rets)


def _match(fqn, fopt, placeholders, result_of, phase, index):
    """The lowered nodes of one parameter's update, or None when they are not exactly its optimizer's pattern."""
    names = fopt.names_for(fqn)
    outs = [f"params.{fqn}"] + [f"opt.{s}.{fqn}" for s in names]
    if any(o not in result_of or o not in placeholders for o in outs):
        return None
    results = [result_of[o] for o in outs]
    skip = placeholders.get(f"draws.nograd.{fqn}")
    cone, leaves, stack = set(), set(), list(results)
    if skip is not None:     # a masked update (capture/gates.py): where(nograd, old, new) on every result
        if not all(r.target is aten.where.self and r.args[0] is skip and r.args[1] is placeholders[o]
                   for r, o in zip(results, outs)):
            return None
        cone.update(results)
        stack = [r.args[2] for r in results]
    while stack:
        n = stack.pop()
        if n in cone:
            continue
        if n.op == "call_function" and phase.get(n) == Phase.OPTIMIZER:
            if n.target not in _UPDATE_OPS[fopt.kind]:
                return None
            cone.add(n)
            stack.extend(n.all_input_nodes)
        else:
            leaves.add(n)
    state = {placeholders[o] for o in outs}
    leaves.discard(skip)
    hyper = {n for n in leaves if n.op == "placeholder" and n.meta.get(META_ROLE) in (Role.LR, Role.STEP)}
    grads = leaves - state - hyper
    if len(grads) != 1 or not state <= leaves:
        return None
    (grad,) = grads
    if fopt._opt.param_groups[fopt._group[fqn]]["maximize"]:
        # `grad = -grad` reads no optimizer input, so capture stamped it backward: the update negates itself
        if grad.target is not aten.neg.default or any(u not in cone for u in grad.users):
            return None
        cone.add(grad)
        grad = grad.args[0]
    if grad.op == "placeholder":
        return None
    # tensor intermediates (those that read a state, the gradient or another tensor intermediate) belong to this
    # update alone: nothing outside reads them
    tensorish = set(state) | {grad}
    for n in sorted(cone, key=index.__getitem__):
        if any(a in tensorish for a in n.all_input_nodes):
            tensorish.add(n)
    for n in tensorish & cone:
        if n not in results and any(u not in cone for u in n.users):
            return None
    return {"fqn": fqn, "results": results, "state": [placeholders[o] for o in outs], "grad": grad,
            "cone": cone, "hyper": hyper, "skip": skip}


def _emit(graph, fopt, gi, members, placeholders, step) -> bool:
    group = fopt._opt.param_groups[gi]
    hp = lambda h: placeholders.get(f"hparams.{gi}.{h}")  # noqa: E731
    lr, b1, b2, wd = hp("lr"), hp("beta1"), hp("beta2"), hp("weight_decay")
    if lr is None or b1 is None or b2 is None or (wd is None) != (group["weight_decay"] == 0):
        return False
    amsgrad = bool(group["amsgrad"])
    cols = [[m["state"][k] for m in members] for k in range(1 + 2 + amsgrad)]
    grads = [m["grad"] for m in members]
    skips = [m["skip"] for m in members]
    args = (cols[0], grads, cols[1], cols[2], cols[3] if amsgrad else [], step, lr, b1, b2, wd, float(group["eps"]),
            amsgrad, bool(group["maximize"]), fopt.kind == "adamw", bool(fopt._opt.defaults.get("fused") or False),
            skips if skips[0] is not None else None, False)
    _replace(graph, members, adam_update, args, 1 + 2 + amsgrad)
    return True


def _emit_sgd(graph, fopt, gi, members, placeholders, step) -> bool:
    group = fopt._opt.param_groups[gi]
    hp = lambda h: placeholders.get(f"hparams.{gi}.{h}")  # noqa: E731
    lr, mom, wd = hp("lr"), hp("momentum"), hp("weight_decay")
    if lr is None or (wd is None) != (group["weight_decay"] == 0) or (mom is None) != (group["momentum"] == 0):
        return False
    cols = [[m["state"][k] for m in members] for k in range(1 + (mom is not None))]
    skips = [m["skip"] for m in members]
    args = (cols[0], [m["grad"] for m in members], cols[1] if mom is not None else [], step, wd, mom, lr,
            bool(group["nesterov"]), bool(group["maximize"]), float(group["dampening"]),
            bool(fopt._opt.defaults.get("fused") or False), skips if skips[0] is not None else None, False)
    _replace(graph, members, sgd_update, args, len(cols))
    return True


def _replace(graph, members, kernel, args, n_results) -> None:
    """`kernel(*args)` in place of the members' updates: its results (a list per state column: parameters first)
    replace each member's results; the updates' ops are erased."""
    first = min((n for m in members for n in m["cone"]), key=_index_of(graph))
    with graph.inserting_before(first):
        node = call_function(graph, kernel, args)
        node.meta[META_SRC] = members[0]["results"][0].meta.get(META_SRC)
        outs = []
        for k in range(n_results):
            lst = call_function(graph, operator.getitem, (node, k))
            outs.append([call_function(graph, operator.getitem, (lst, i)) for i in range(len(members))])
    # the program's output reads every result: rewritten once (replacing one use at a time scans its arguments each
    # time, quadratic in the parameters)
    swap = {r: outs[k][i] for i, m in enumerate(members) for k, r in enumerate(m["results"])}
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    for r, new in swap.items():
        r.replace_all_uses_with(new, delete_user_cb=lambda u: u is not out)
    out.args = fx.map_arg(out.args, lambda n: swap.get(n, n))
    dead = set().union(*(m["cone"] for m in members))
    changed = True
    while changed:
        changed = False
        for n in reversed(list(graph.nodes)):
            if n in dead and not n.users:
                graph.erase_node(n)
                dead.discard(n)
                changed = True


def _index_of(graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__
