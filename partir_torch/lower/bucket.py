"""Bucketing: collectives of one kind on one axis merged into one call, as DDP (all_reduce) and FSDP do, so the fixed cost of a
collective is paid once per bucket instead of once per parameter. Bytes are unchanged.

- all_gather of a parameter shard (an input of the program, so it can move): consecutive gathers of the same
  axis, dtype and phase are issued together where the first is, up to `cap` bytes (a prefetch).
- all_reduce / reduce_scatter of a gradient (and all_gather of an updated parameter): consecutive ones are issued
  together
  where the last input is ready, when every member's result is first read after that point.

A bucket runs one collective for its members and slices each member's result out of its output as a view: the
gather and the all_reduce write each member's result into its own chunk of one buffer (lower/bucketops.py), the
reduce_scatter reads one buffer of the members' rank-major chunks (a cat: its copy-in; prog.audit() counts it). A
bucket holds at most `cap` bytes and at most 1/8 of what its kind moves on its axis in its phase (64 KiB at
least): on a small model one 64 MiB bucket (or a 1 MiB floor, as this once had) would be the whole model, gathered
at once and its gradients all held until the last one is produced, and ZeRO would raise the measured peak it is
meant to lower; below 64 KiB merging holds next to nothing more and saves a launch per value (the loss's two
scalars, a toy model's biases).

A pipelined program (lower/pipeline.py) buckets only what `parts` names (collective node -> its stage): the gradient
reductions and state gathers of one stage, keyed by the stage, so that no bucket mixes two stages.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .bucketops import ALL_GATHER_BUCKET, ALL_REDUCE_BUCKET
from .records import ALL_GATHER, ALL_REDUCE, GRADIENT, REDUCE_SCATTER, RESHARD, STATE, TACTIC, CollectiveRecord
from ..contract import META_COLLECTIVE, META_IN_SHAPE, META_LOCAL_SHAPE

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
UNITS = 8                   # a bucket holds at most this fraction (1/UNITS) of its kind's bytes on its axis and phase
MIN_BUCKET = 64 * 2 ** 10   # ... unless that is under 64 KiB: a few KiB more held costs nothing, a launch per value does


def bucket_collectives(graph: fx.Graph, records: list, cap: int, parts: dict | None = None) -> list:
    """Merge buckets in place; returns the new record list (program order). parts: when given, only the collectives
    it names are bucketed, and only with others of the same part (a pipelined program's stage)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    runs: dict = {}
    groups = []
    members = []
    for node in list(graph.nodes):
        rec = node.meta.get(META_COLLECTIVE)
        if rec is None or rec.kind not in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE) or not _plain(node, rec):
            continue
        if parts is not None and node not in parts:
            continue
        part = () if parts is None else (parts[node],)
        members.append((node, rec, (rec.kind, rec.axis, rec.dtype, rec.phase, rec.reduce_op, node.args[-1]) + part))
    total: dict = {}
    for _, rec, key in members:
        total[key] = total.get(key, 0) + rec.nbytes
    for node, rec, key in members:
        # at most 1/UNITS of what this kind moves on this axis in this phase: on a model whose whole state fits
        # one bucket, buckets stay about a block's size (FSDP2's unit), so prefetching one ahead and bounding the
        # reductions in flight (schedule.py) keep their meaning
        limit = min(cap, max(total[key] // UNITS, MIN_BUCKET))
        run = runs.get(key)
        if run is None or sum(m[1].nbytes for m in run) + rec.nbytes > limit or not _fits(run, node, rec, order):
            run = []
            runs[key] = run
            groups.append(run)
        run.append((node, rec))
    merged = {}
    for run in groups:
        # an earlier merge may have replaced a member's input with one of its slices (chained collectives): skip
        if len(run) > 1 and all(n.args[0] in order for n, _ in run):
            rec = _merge(graph, run, order)
            for node, old in run:
                merged[old.node] = rec
    out, seen = [], set()
    for r in records:
        new = merged.get(r.node, r)
        if id(new) not in seen:
            seen.add(id(new))
            out.append(new)
    return out


def _plain(node, rec) -> bool:
    """A dim-0 collective whose result goes straight to one wait (no interleaving, no moved dims)."""
    users = list(node.users)
    shaped = node.meta.get(META_IN_SHAPE) is not None or rec.kind == ALL_REDUCE
    return rec.dim in (0, -1) and len(users) == 1 and users[0].target is c10d.wait_tensor.default and shaped


def _prefetch(run) -> bool:
    """Gathers of program inputs (parameter shards) can all be issued where the first one is."""
    return run[0][1].kind == ALL_GATHER and all(n.args[0].op == "placeholder" for n, _ in run)


def _fits(run, node, rec, order) -> bool:
    if _prefetch(run + [(node, rec)]):
        return True
    # otherwise the merged collective sits after the last member's input: every member's result must be read later
    members = run + [(node, rec)]
    if any(n.args[0] not in order for n, _ in members):
        return False                      # an input made by an earlier bucket: keep it simple, do not merge
    ready = max(order[n.args[0]] for n, _ in members)
    return all(min(order.get(u, -1) for u in _reads(next(iter(n.users)))) > ready for n, _ in members)


def _narrow(wait):
    """The slice an uneven gather keeps its first positions with (lower/uneven.py), when it is the wait's only
    reader: a view, moved after the bucket with its input."""
    users = list(wait.users)
    return users[0] if len(users) == 1 and users[0].target is aten.slice.Tensor else None


def _reads(wait) -> list:
    """The nodes that read a collective's result, through an uneven gather's narrow."""
    narrow = _narrow(wait)
    if narrow is None:
        return list(wait.users)
    return list(narrow.users) or [narrow]


def _merge(graph, run, order) -> CollectiveRecord:
    first_node, first = run[0]
    k, group = first.group_size, first_node.args[-1]
    if _prefetch(run):
        anchor = first_node
        insert = graph.inserting_before(anchor)
    else:
        anchor = max((n.args[0] for n, _ in run), key=order.__getitem__)   # original nodes keep their order
        insert = graph.inserting_before(anchor.next)
    with insert:
        if first.kind == ALL_REDUCE:       # into one buffer, member after member (lower/bucketops.py): no cat
            coll = graph.call_function(ALL_REDUCE_BUCKET, ([n.args[0] for n, _ in run], first.reduce_op, group))
        elif first.kind == ALL_GATHER:
            coll = graph.call_function(ALL_GATHER_BUCKET, ([n.args[0] for n, _ in run], k, group))
        else:
            flats = [graph.call_function(aten.reshape.default, (n.args[0], [k, -1])) for n, _ in run]
            buf = graph.call_function(aten.view.default, (graph.call_function(aten.cat.default, (flats, 1)), [-1]))
            coll = graph.call_function(c10d.reduce_scatter_tensor.default, (buf, first.reduce_op, k, group))
        wait = graph.call_function(c10d.wait_tensor.default, (coll,))
        off = 0
        for node, rec in run:
            # every member's result is a chunk of the buffer: a slice and a view
            shape = list(node.meta[META_LOCAL_SHAPE] if first.kind == ALL_REDUCE else node.meta[META_IN_SHAPE])
            if first.kind == ALL_GATHER:
                shape[0] *= k
            elif first.kind == REDUCE_SCATTER:
                shape[0] //= k
            part = graph.call_function(aten.slice.Tensor, (wait, 0, off, off + _numel(shape)))
            out = graph.call_function(aten.view.default, (part, shape))
            off += _numel(shape)
            narrow = _narrow(next(iter(node.users)))
            next(iter(node.users)).replace_all_uses_with(out)
            if narrow is not None and first.kind == ALL_GATHER:
                out.append(narrow)       # it read the member's wait, which may sit before the bucket
    for node, _ in run:   # collectives count as side effects: dead-code elimination would keep them
        wait = next(iter(node.users))
        graph.erase_node(wait)
        graph.erase_node(node)
    rec = CollectiveRecord(first.kind, first.axis, k, sum(r.nbytes for _, r in run), first.dtype,
                           "+".join(dict.fromkeys(r.tactic for _, r in run)),
                           ", ".join(r.value for _, r in run), coll.name, first.reduce_op, 0, first.phase,
                           "+".join(dict.fromkeys(r.family for _, r in run if r.family)), _why(run),
                           ", ".join(dict.fromkeys(r.source for _, r in run if r.source)),
                           "+".join(dict.fromkeys(r.op for _, r in run if r.op)),
                           tuple(m for _, r in run for m in r.parts()))
    coll.meta[META_COLLECTIVE] = rec
    return rec


def _why(run) -> str:
    """A bucket's why: the first of reshard, tactic, gradient, state that a member has (records.py)."""
    whys = {r.why for _, r in run}
    return next((w for w in (RESHARD, TACTIC, GRADIENT, STATE) if w in whys), "")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
