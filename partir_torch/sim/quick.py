"""Fast estimate of a partitioning decision: step time and peak memory read from the propagated decisions alone,
without lowering (the automatic tactic scores thousands of candidates with it; the few best are then lowered and
simulated in full, see tactics/auto.py).

From the decisions of every mesh axis (per value: tiled dim / partial / replicated; per op: the factor it tiles)
the estimate derives, with numpy over all ops and operand slots at once:

- compute: each op's FLOPs divided by the sizes of the axes that tile one of its factors, its bytes from the local
  shapes of its operands and results; roofline time as sim/compute.py (kernel_time, memory_time);
- communication: the reshards lowering would insert (lower/reshard.py's table: tiled -> replicated is an
  all_gather, partial -> replicated an all_reduce, partial -> tiled a reduce_scatter, tiled(d1) -> tiled(d2) an
  all_to_all), one per (value, wanted layout), a parameter's once per phase; each costed by sim/comm.py's model,
  tabulated per (kind, axis) and interpolated. A value resharded on several axes is moved in lowering's order
  (un-tiling innermost axis first, reductions outermost first; nesting taken as the mesh's axis order), so each
  collective moves the bytes the other axes leave at that point. Gathers of state (issued at the start, as the
  simulator does) and gradient reductions overlap compute; every other reshard is exposed, and an op waiting on
  collectives of several axes waits for the longest (each axis has its own stream): the exposed time is summed
  per window of the program of each axis, and the longest axis counts per window;
- memory: the liveness of every storage over the captured program's order (sim/memory.py's rules: views alias,
  placeholders live all step), each storage divided by its value's tilings (a partial value every consumer wants
  tiled is reduce-scattered where it is produced), plus each resharded copy from where lowering issues it (right
  after its value is produced when every consumer wants one layout; state gathers at most `prefetch` ahead of their
  use, lower/schedule.py) to its last use. A gradient reduced for the optimizer is waited for reduce_in_flight
  buckets after its own (lower/schedule.py's bound, lower/bucket.py's buckets of 1/UNITS of the bytes): its reduced
  copy lives until the update, the whole gradient (and its bucket's buffer) until then; unbounded
  (reduce_in_flight=0), the whole partial gradient lives until the update too (a collective's input lives until its
  wait).

step ~= max(compute + exposed communication, busiest axis's communication + the optimizer update, which waits for
the last gradient reduction).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np
import torch

from ..contract import META_ROLE, STATE_ROLES, Phase, Role, phase_of
from ..propagate.arrays import partial, partial_code, replicated, replicated_code, tiled, undecided_array, whole
from ..rules import tags
from ..rules.factors import REDUCE
from ..lower.bucket import MIN_BUCKET, UNITS
from .comm import estimate as comm_estimate
from .compute import COMPUTE, FREE, WAIT, combine_legs, op_class

KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
aten = torch.ops.aten
# ops that make a state gather's input from the state alone (lower/schedule.py moves them up with the gather)
_PREPARE = tags.ops("prepares_gather")   # what lowering moves up with the gather (cat of state included)
_SIZES = np.array([0.0] + [2.0 ** i for i in range(6, 42)])      # collective sizes tabulated (bytes)


@dataclass
class Estimate:
    step_s: float
    compute_s: float
    exposed_comm_s: float
    comm_s: float
    peak_bytes: float
    by_kind: dict             # (kind, axis) -> (count, bytes)


class ProgramFacts:
    """What the estimate needs from one captured program on one hardware, read once (a few hundred ms on a
    48-layer model): per-op FLOPs and roofline constants, per-slot factor positions, value sizes, liveness."""

    def __init__(self, graph, mesh, hw, captured=None, bucket_bytes: int = 64 * 2 ** 20, reduce_in_flight: int = 1,
                 compile: bool = False, prefetch: int = 1):
        self.g, self.mesh, self.hw, self.bucket_bytes = graph, mesh, hw, bucket_bytes
        self.reduce_in_flight, self.prefetch = reduce_in_flight, prefetch
        nodes = list(graph.gm.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        self.n_nodes = len(nodes)
        self._values(captured)
        self._ops(index)
        self._slots()
        _schedule_facts(self, index, captured)
        # the eager program's fused Adam and SGD updates write parameters and state in place (lower/fuse.py): the
        # updated values share their state's storage; compiled programs' updates are out of place
        fopt = None if captured is None else captured.fopt
        fused = fopt is not None and fopt.kind in ("adam", "adamw", "sgd") and not compile
        in_place = {new: old for old, new in captured.ties} if fused else {}
        self.fused = bool(in_place)
        self.st_owner, self.st_born, self.st_last, self.st_size, self.al_val, self.al_sid = _storages(graph, nodes,
                                                                                                     in_place)
        self._comm_tables()

    def _values(self, captured) -> None:
        """Per value: canonical id, bytes, shape, whether it is state / a placeholder; per op and value: its phase
        (0 forward, 1 backward, 2 optimizer update)."""
        g = self.g
        nv = len(g.values)
        self.canon = np.asarray(g.canon, dtype=np.int64)
        self.val_bytes = np.array([math.prod(s) * g.values[v].meta["val"].dtype.itemsize
                                   for v, s in enumerate(g.shapes)], dtype=np.float64)
        self.ndim = np.array([len(s) for s in g.shapes], dtype=np.int64)
        self.shapes = g.shapes
        role = [g.values[v].meta.get(META_ROLE) if g.values[v].op == "placeholder" else None for v in range(nv)]
        self.is_state = np.array([r in STATE_ROLES for r in role])
        self.is_param = np.array([r == Role.PARAM for r in role])
        self.is_placeholder = np.array([g.values[v].op == "placeholder" for v in range(nv)])
        code = {Phase.FORWARD: 0, Phase.BACKWARD: 1, Phase.OPTIMIZER: 2}
        self.op_phase = np.array([2 if captured is None else code[phase_of(op.node)] for op in g.ops],
                                 dtype=np.int64)
        self.val_phase = np.full(nv, 0, dtype=np.int64)
        for v in range(nv):
            p = g.producer[v]
            self.val_phase[v] = self.op_phase[p] if p >= 0 else 0

    def _ops(self, index: dict) -> None:
        """Per op: its node's position, FLOPs, compute class and the FLOP/s it reaches at best (roofline)."""
        g, hw = self.g, self.hw
        no = len(g.ops)
        self.op_node_index = np.array([index[op.node] for op in g.ops], dtype=np.int64)
        flops = np.zeros(no)
        rate = np.ones(no)            # FLOP/s the op reaches at best (efficiency x peak of its dtype)
        compute = np.zeros(no, dtype=bool)
        for i, op in enumerate(g.ops):
            cls, formula = op_class(op.node.target)
            if cls != COMPUTE:
                continue
            compute[i] = True
            f, dtype = _flops(op.node, formula)
            if f > 0:
                flops[i] = f
                eff = hw.attn_efficiency if "scaled_dot_product" in str(op.node.target) else hw.mm_efficiency
                rate[i] = eff * hw.peak_flops(dtype)
        self.op_flops, self.op_rate, self.op_compute = flops, rate, compute

    def _slots(self) -> None:
        """Every tensor operand and result of every op (a slot): its op, value, side, bytes, phase and, per factor of
        its op's rule, the dim that holds it (fdim[s, f], -1: none); per op and factor: reduction and partial code."""
        g = self.g
        no = len(g.ops)
        maxf = max((len(op.rule.factors) for op in g.ops if op.rule is not None), default=1)
        self.maxf = maxf
        s_op, s_val, s_res, s_dims = [], [], [], []
        reduce = np.zeros((no, maxf), dtype=bool)
        partial_codes = undecided_array((no, maxf))
        for i, op in enumerate(g.ops):
            rule = op.rule
            if rule is not None:
                for f, fac in enumerate(rule.factors):
                    if fac.kind == REDUCE:
                        reduce[i, f] = True
                        partial_codes[i, f] = partial_code(fac.reduce_op)
            for is_res, vids, dims_list in ((False, op.operands, rule.operands if rule else None),
                                            (True, op.results, rule.results if rule else None)):
                for j, v in enumerate(vids):
                    if v is None:
                        continue
                    dims = dims_list[j] if dims_list is not None else ()
                    if dims_list is not None and dims is None:
                        continue            # an ignored slot (the rule says it does not matter)
                    s_op.append(i)
                    s_val.append(v)
                    s_res.append(is_res)
                    s_dims.append(dims)
        fdim = np.full((len(s_op), maxf), -1, dtype=np.int64)
        for s, dims in enumerate(s_dims):
            for d, fs in enumerate(dims or ()):
                for f in fs:
                    if fdim[s, f] < 0:
                        fdim[s, f] = d
        self.s_op = np.asarray(s_op, dtype=np.int64)
        self.s_val = np.asarray(s_val, dtype=np.int64)
        self.s_canon = self.canon[self.s_val]
        self.s_res = np.asarray(s_res, dtype=bool)
        self.s_bytes = self.val_bytes[self.s_val]
        self.fdim, self.reduce, self.partial_code = fdim, reduce, partial_codes
        self.s_node = self.op_node_index[self.s_op]
        self.s_phase = self.op_phase[self.s_op]
        # collective classes: state gathered ahead of use, gradients reduced while the backward runs
        self.s_overlap = ~self.s_res & (self.is_state[self.s_val] | ((self.val_phase[self.s_val] == 1)
                                                                     & (self.s_phase == 2)))
        self.s_keyphase = _keyphase(self)
        # per canonical value: produced in the backward and read by the optimizer update (a gradient)
        self.grad_to_update = np.zeros(len(self.canon), dtype=bool)
        read = ~self.s_res & (self.s_phase == 2) & (self.val_phase[self.s_val] == 1)
        self.grad_to_update[self.s_canon[read]] = True

    def _comm_tables(self) -> None:
        self.comm_table = {}
        for axis in self.mesh.axes:
            for kind in KINDS:
                if self.mesh.shape[axis] == 1:
                    self.comm_table[(kind, axis)] = np.zeros(len(_SIZES))
                    continue
                self.comm_table[(kind, axis)] = np.array(
                    [comm_estimate(self.hw, kind, s, self.mesh, axis).time_s if s > 0 else 0.0 for s in _SIZES])

    def comm_time(self, kind: str, axis: str, nbytes: np.ndarray) -> np.ndarray:
        return np.interp(nbytes, _SIZES, self.comm_table[(kind, axis)])

    # -- the estimate ------------------------------------------------------------------------------------------
    def estimate(self, decisions: dict) -> Estimate:
        """decisions: axis -> (value states per canonical vid, op assignments), for every mesh axis."""
        want, have, op_div, slot_div, val_tdiv = self._layouts(decisions)
        compute, update = self._compute(op_div, slot_div)
        # per value: divisor over all axes
        all_div = np.ones(len(self.canon))
        for axis in decisions:
            all_div *= val_tdiv[axis]
        exposed, per_axis, by_kind, temps, eff_div, grad = self._comm(decisions, want, have, val_tdiv, all_div)
        comm = sum(per_axis.values())
        step = max(compute + exposed, max(per_axis.values(), default=0.0) + update)
        return Estimate(step, compute, exposed, comm, self._peak(eff_div, temps, grad), by_kind)

    def _layouts(self, decisions: dict) -> tuple:
        """Per axis and slot: the state its op wants (want) and the state its value has (have); over all axes: the
        divisors of each op's FLOPs and of each slot's bytes; per axis and canonical value: k where tiled."""
        op_div = np.ones(len(self.g.ops))
        slot_div = np.ones(len(self.s_op))
        want, have = {}, {}
        val_tdiv = {}                      # axis -> per canonical value: k where tiled on the axis
        for axis, (vals, assign) in decisions.items():
            k = self.mesh.shape[axis]
            f = assign[self.s_op]
            tiled_op = tiled(f)
            fi = np.where(tiled_op, f, 0)
            wd = np.where(tiled_op, self.fdim[np.arange(len(f)), fi], -1)
            h = vals[self.s_canon]
            w = np.where(wd >= 0, wd, replicated_code())
            # a reduce factor missing from a result slot makes it partial; a partial pass keeps it partial
            red = tiled_op & self.s_res & (wd < 0) & self.reduce[self.s_op, fi]
            w = np.where(red, self.partial_code[self.s_op, fi], w)
            passing = partial(f) & ((h == f) | self.s_res)
            w = np.where(passing, f, w)
            want[axis], have[axis] = w, h
            slot_div *= np.where(wd >= 0, k, 1)
            op_div *= np.where(tiled(assign), k, 1)
            val_tdiv[axis] = np.where(tiled(vals), k, 1).astype(np.float64)
        return want, have, op_div, slot_div, val_tdiv

    def _compute(self, op_div: np.ndarray, slot_div: np.ndarray) -> tuple:
        """(compute seconds of the step, of the optimizer update alone): per op the roofline of its local FLOPs and
        bytes."""
        hw = self.hw
        op_bytes = np.bincount(self.s_op, weights=self.s_bytes / slot_div, minlength=len(self.g.ops))
        t_mem = op_bytes / (hw.hbm_efficiency * hw.hbm_bw) + hw.kernel_overhead_s
        t_flop = np.where(self.op_flops > 0, self.op_flops / op_div / self.op_rate + hw.mm_half_time_s, 0.0)
        t_stream = op_bytes / (hw.hbm_efficiency * hw.hbm_bw)      # a FLOP-carrying kernel's memory leg (compute.py)
        t_op = np.where(self.op_compute, np.where(t_flop > 0, combine_legs(t_flop, t_stream, hw.roofline_p), t_mem),
                        0.0)
        compute = float(np.sum(t_op))
        update = float(np.sum(t_op[self.op_phase == 2]))      # the optimizer update waits for the gradients
        return compute, update

    # an op's waits on collectives of several axes overlap within this many nodes of the captured program (an op,
    # its weight's cast and transpose, its input's view: one layer of a transformer holds a few hundred)
    WAIT_WINDOW = 64

    def _comm(self, decisions: dict, want: dict, have: dict, val_tdiv: dict, all_div: np.ndarray) -> tuple:
        """Per axis, the reshards lowering would insert (lower/reshard.py's table) and their seconds: (exposed
        seconds, seconds per axis, (count, bytes) per (kind, axis), the resharded copies' lifetimes, per canonical
        value the divisor of its storage)."""
        per_axis, by_kind, temps, waits = {}, {}, [], {}
        eff_div = all_div.copy()
        rs_k = np.ones(len(self.canon))                    # per value: product of the axes it is reduce-scattered on
        has_ar = np.zeros(len(self.canon), dtype=bool)     # ... and whether it is all-reduced on one
        for axis, (vals, assign) in decisions.items():
            k = self.mesh.shape[axis]
            w, h = want[axis], have[axis]
            res = self.s_res
            ag = np.where(res, tiled(w) & whole(h), tiled(h) & replicated(w))
            a2a = tiled(h) & tiled(w) & (h != w)
            ar = np.where(res, partial(w) & whole(h), partial(h) & replicated(w))
            rs = np.where(res, partial(w) & tiled(h), partial(h) & tiled(w))
            div = _other_div(self, axis, want, have)
            total, waits[axis] = 0.0, []
            for kind, mask in (("all_gather", ag), ("all_to_all", a2a), ("all_reduce", ar),
                               ("reduce_scatter", rs)):
                idx = np.nonzero(mask)[0]
                if not len(idx):
                    continue
                t_exp, at, t_over, n, nbytes, temp = self._collectives(kind, axis, idx, w, div[kind])
                total += float(t_exp.sum()) + t_over
                waits[axis].append((at, t_exp))
                by_kind[(kind, axis)] = (n, nbytes)
                if temp is not None:
                    temps.append(temp)
            per_axis[axis] = total
            # partial values every consumer wants tiled are reduce-scattered where they are produced
            cons = np.full(len(self.canon), float(k))
            op_slots = ~self.s_res
            np.minimum.at(cons, self.s_canon[op_slots], np.where(tiled(want[axis][op_slots]), float(k), 1.0))
            part = partial(vals)
            eff_div *= np.where(part, cons, 1.0)
            rs_k *= np.where(part & (cons > 1), cons, 1.0)
            has_ar |= part & (cons == 1)
        # unbounded (reduce_in_flight=0), a gradient's reductions are waited for where the update reads it: the whole
        # partial value lives until then with its reduced copy (reduce_scatter: 1/rs_k of it), or with the reduced
        # shard and its all-reduced copy (lowering reduce-scatters first and all-reduces the shard); bounded
        # (lower/schedule.py), its reduced copy alone lives until the update, the whole value a reduction or so
        grad = self.grad_to_update & ((rs_k > 1) | has_ar)
        temps.append(_state_outputs(self, want, have, all_div))
        if self.reduce_in_flight:
            temps.append(_gradient_transients(self, grad, self.val_bytes / all_div))
        else:
            live = np.where(has_ar, 2.0 / rs_k, 1.0 + 1.0 / rs_k)
            eff_div = np.where(grad, eff_div / rs_k / live, eff_div)
        return self._exposed(waits), per_axis, by_kind, temps, eff_div, grad

    def _exposed(self, waits: dict) -> float:
        """Exposed seconds: per window of the program, each axis's exposed collectives summed, the longest axis
        counted (the axes' streams run concurrently: an op that waits on two axes waits for the slower)."""
        per_axis = []
        for pairs in waits.values():
            acc = np.zeros(self.n_nodes // self.WAIT_WINDOW + 2)
            for at, t in pairs:
                np.add.at(acc, at // self.WAIT_WINDOW, t)
            per_axis.append(acc)
        return float(np.max(np.stack(per_axis), axis=0).sum()) if per_axis else 0.0

    def _collectives(self, kind: str, axis: str, idx: np.ndarray, w: np.ndarray, div: np.ndarray) -> tuple:
        """The collectives of one kind on one axis for the slots idx that need it, one per (value, wanted layout[,
        phase]), each moving its value's bytes over div: (exposed seconds of each exposed one, the node of its first
        use, overlapped seconds, count, bytes, (first use, last use, bytes) of the resharded copies for gathers and
        all_to_alls, else None)."""
        key = (self.s_val[idx] * 64 + (w[idx] + 8)) * 4 + self.s_keyphase[idx]
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        uses = idx
        idx = idx[first]
        lo = np.full(len(idx), self.n_nodes, dtype=np.int64)
        np.minimum.at(lo, inverse, self.s_node[uses])
        nbytes = self.val_bytes[self.s_val[idx]] / div[idx]
        over = self.s_overlap[idx]
        t_exp = self.comm_time(kind, axis, nbytes[~over])
        # state gathers and gradient reductions are bucketed by lowering (lower/bucket.py): one collective per
        # bucket_bytes per phase
        t_over = 0.0
        for ph in (0, 1, 2):
            b = nbytes[over & (self.s_phase[idx] == ph)].sum()
            if b > 0:
                nb = max(1, math.ceil(b / self.bucket_bytes)) if self.bucket_bytes else int(
                    np.sum(over & (self.s_phase[idx] == ph)))
                t_over += nb * float(self.comm_time(kind, axis, np.array([b / nb]))[0])
        temp = None
        if kind in ("all_gather", "all_to_all"):
            # one resharded copy per (value, layout[, phase]) is shared by its uses: it lives from where lowering
            # issues it to the last of them (an activation gathered for the forward is kept for the backward)
            hi = np.zeros(len(idx), dtype=np.int64)
            np.maximum.at(hi, inverse, self.s_node[uses])
            temp = (_issued(self, idx, lo, w), hi, nbytes / np.where(tiled(w[idx]), self.mesh.shape[axis], 1))
        return t_exp, lo[~over], t_over, len(idx), float(nbytes.sum()), temp

    def _peak(self, eff_div: np.ndarray, temps: list, grad: np.ndarray) -> float:
        """Peak bytes: the liveness sweep with each storage divided by its value's layout (a gradient's storage by
        the gradient's, when the update reads a view of it), plus each resharded copy while it lives."""
        owner = self.st_owner
        div = np.where(owner >= 0, eff_div[self.canon[np.maximum(owner, 0)]], 1.0)
        alias = grad[self.canon[self.al_val]]
        div[self.al_sid[alias]] = eff_div[self.canon[self.al_val[alias]]]
        size = self.st_size / div
        delta = np.zeros(self.n_nodes + 2)
        np.add.at(delta, self.st_born, size)
        np.add.at(delta, self.st_last + 1, -size)
        for lo, hi, b in temps:
            np.add.at(delta, lo, b)
            np.add.at(delta, hi + 1, -b)
        return float(np.max(np.cumsum(delta[:self.n_nodes]))) if self.n_nodes else 0.0


def _keyphase(facts: ProgramFacts) -> np.ndarray:
    """Per slot, the phase part of its reshard's key: a placeholder's copy is made once per phase (ZeRO-3 gathers a
    parameter again for the backward), except the parameter the forward reads last, whose gathered copy serves the
    backward too (lower/lower.py, _tail_of_forward); other values' once."""
    out = np.where(facts.is_placeholder[facts.s_val], facts.s_phase, 0)
    param = facts.is_param[facts.s_val] & ~facts.s_res
    fwd = np.nonzero(param & (facts.s_phase == 0))[0]
    if len(fwd):
        out[param & (facts.s_val == facts.s_val[fwd[np.argmax(facts.s_node[fwd])]])] = 0
    return out


def _schedule_facts(facts: ProgramFacts, index: dict, captured) -> None:
    """What lowering's placement needs (lower/lower.py, lower/schedule.py): per value the node that produces it
    (a value every consumer wants in one layout is resharded right there), whether it is state or made from
    state alone by casts and views (its gather is a state gather: prefetched), and the update's first node."""
    g = facts.g
    nv = len(g.values)
    facts.val_node = np.array([index[g.values[v]] for v in range(nv)], dtype=np.int64)
    state_like = facts.is_state.copy()
    for op in g.ops:
        if op_class(op.node.target)[1] == "view" or op.node.target in _PREPARE:
            srcs = [v for v in op.operands if v is not None]
            if srcs and all(state_like[v] for v in srcs):
                state_like[[v for v in op.results if v is not None]] = True
    facts.state_like = state_like
    upd = facts.op_node_index[facts.op_phase == 2]
    facts.update_node = int(upd.min()) if len(upd) else facts.n_nodes
    pairs = () if captured is None else captured.ties
    ties = [(g.vid[old], g.vid[new]) for old, new in pairs if old in g.vid and new in g.vid]
    facts.tie_old, facts.tie_new = np.asarray(ties, dtype=np.int64).reshape(-1, 2).T
    result_slot = {v: k for k, v in enumerate(facts.s_val) if facts.s_res[k]}
    keep = np.array([v in result_slot for v in facts.tie_new], dtype=bool)
    facts.tie_old, facts.tie_new = facts.tie_old[keep], facts.tie_new[keep]
    facts.tie_slot = np.array([result_slot[v] for v in facts.tie_new], dtype=np.int64)


def _issued(facts: ProgramFacts, idx: np.ndarray, lo: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Where lowering issues the reshards of slots idx (one per key, sorted by key) first used at lo: an op's
    result every consumer wants in one layout right where it is produced (lower/lower.py), a program input and any
    other at its first use; then state gathers (of state, or of its casts) at most `prefetch` gathers
    ahead of their use, the first ones where the earliest is (lower/schedule.py)."""
    v = facts.s_val[idx]
    layouts = np.unique(v * 64 + (w[idx] + 8)) // 64
    single = np.bincount(layouts, minlength=len(facts.val_bytes))[v] == 1
    first = np.zeros(len(idx), dtype=bool)
    first[np.unique(v, return_index=True)[1]] = True          # keys sorted: a value's earliest phase first
    at = np.where(single & first & ~facts.is_placeholder[v], np.minimum(facts.val_node[v], lo), lo)
    state = np.nonzero(facts.state_like[v])[0]
    if facts.prefetch and len(state):
        order = state[np.argsort(lo[state], kind="stable")]
        ahead = np.full(len(order), at[order].min())       # the first `prefetch`: where the earliest is
        ahead[facts.prefetch:] = lo[order[:max(len(order) - facts.prefetch, 0)]]
        at[order] = np.minimum(at[order], ahead)
    return at


def _gradient_transients(facts: ProgramFacts, grad: np.ndarray, whole: np.ndarray) -> tuple:
    """The whole gradients of bounded reductions (lower/bucket.py, lower/schedule.py), as (born, last, bytes):
    in the order they are produced, gradients fill buckets of at most 1/UNITS of their bytes (bucket_bytes at
    most); a bucket is issued when its last member is produced and waited for just before the bucket
    reduce_in_flight later is issued (its input lives until then). A bucket of several members copies them
    into one buffer where it is issued (they die there); a bucket of one reduces the gradient itself."""
    c = np.nonzero(grad)[0]
    c = c[np.argsort(facts.val_node[c], kind="stable")]
    born, b = facts.val_node[c], whole[c]
    if not len(c):
        return born, born, b
    limit = min(facts.bucket_bytes, max(b.sum() / UNITS, MIN_BUCKET)) if facts.bucket_bytes else 0
    if limit:
        # a gradient over the limit is a bucket alone; between two such, each bucket holds what ends in its
        # limit-sized stretch of the running total (no more than the limit, as lowering's greedy fill)
        big = b > limit
        seg = np.cumsum(big)
        cum = np.cumsum(np.where(big, 0.0, b))
        local = cum - np.maximum.accumulate(np.where(big, cum, 0.0))
        ids = seg * (len(c) + 2) + np.where(big, 0, np.maximum(np.ceil(local / limit), 1))
    else:
        ids = np.arange(len(c))
    _, start, bucket = np.unique(ids, return_index=True, return_inverse=True)
    issue = np.maximum.reduceat(born, start)                 # per bucket: where its last member is produced
    n_members = np.diff(np.append(start, len(c)))
    nxt = np.arange(len(start)) + facts.reduce_in_flight
    end = np.where(nxt < len(start), issue[np.minimum(nxt, len(start) - 1)], facts.update_node)
    end = np.maximum(end, issue)
    single = n_members[bucket] == 1
    member_last = np.where(single, end[bucket], issue[bucket])
    multi = n_members > 1
    buf = np.add.reduceat(b, start)[multi]
    return (np.concatenate([born, issue[multi]]), np.concatenate([member_last, end[multi]]),
            np.concatenate([b, buf]))


def _state_outputs(facts: ProgramFacts, want: dict, have: dict, all_div: np.ndarray) -> tuple:
    """The eager fused update writes its state in place only where it computes the state in the state's own
    layout: where it computes a more finely tiled copy (ZeRO-1/2), the updated value is gathered into a new tensor
    that lives from the update to the end of the step (the step returns it)."""
    slot = facts.tie_slot
    moved = np.zeros(len(slot), dtype=bool)
    if facts.fused:
        for axis in want:
            moved |= tiled(want[axis][slot]) & whole(have[axis][slot])
    new = facts.tie_new[moved]
    return facts.val_node[new], np.full(len(new), facts.n_nodes), facts.val_bytes[new] / all_div[facts.canon[new]]


def _other_div(facts: ProgramFacts, axis: str, want: dict, have: dict) -> dict:
    """Per collective kind and slot: the divisor of its value's bytes from the other axes while lowering reshards
    it on `axis` (lower/reshard.py): gathers and all_to_alls un-tile the innermost axis first (an axis before this
    one in the mesh still tiles the value), reductions follow them outermost first, all-reduces come last."""
    axes = list(want)
    pos = axes.index(axis)
    ones = np.ones(len(facts.s_op))
    gather, scatter, reduce = ones.copy(), ones.copy(), ones
    for j, b in enumerate(axes):
        if b == axis:
            continue
        k = facts.mesh.shape[b]
        src = np.where(facts.s_res, want[b], have[b])    # the layout before the reshard: the op's result, or
        dst = np.where(facts.s_res, have[b], want[b])    # the value an operand reads
        kept = tiled(src) & (dst == src)
        moved = tiled(src) & (dst != src)
        scattered = partial(src) & tiled(dst)
        gather = gather * np.where(kept | (moved & (j < pos)), k, 1)
        scatter = scatter * np.where(kept | (scattered & (j < pos)), k, 1)
        reduce = reduce * np.where(kept | scattered, k, 1)
    return {"all_gather": gather, "all_to_all": gather, "reduce_scatter": scatter, "all_reduce": reduce}


def _storages(g, nodes, in_place: dict) -> tuple:
    """Liveness over the captured program (sim/memory.py's rules: views alias, placeholders live all step): per
    storage its owning value (-1: none), the node it is born at and the last node that reads it, and its bytes;
    then the values that view another's storage, and that storage. in_place: updated value -> the state placeholder
    whose storage it is written into."""
    end = len(nodes)
    sid_of: dict = {}
    owner, born, last, size, aliases = [], [], [], [], []

    def new(v, nbytes, i):
        owner.append(v)
        born.append(i)
        last.append(i)
        size.append(nbytes)
        return len(owner) - 1

    getitem_vid: dict = {}
    for n in nodes:
        if n.target is operator.getitem and n in g.vid:
            getitem_vid[(n.args[0], n.args[1])] = g.vid[n]
    for i, n in enumerate(nodes):
        val = n.meta.get("val")
        if n.op == "placeholder":
            sid_of[n] = [new(g.vid.get(n, -1), _nbytes(val), 0)]
            continue
        if n.op == "output":
            for a in n.all_input_nodes:
                for s in sid_of.get(a, ()):
                    last[s] = end
            continue
        if n.op != "call_function":
            continue
        if n in in_place and sid_of.get(in_place[n]):
            sid_of[n] = [sid_of[in_place[n]][0]]
        elif n.target is operator.getitem:
            srcs = sid_of.get(n.args[0], ())
            k = n.args[1]
            sid_of[n] = [srcs[k]] if isinstance(k, int) and k < len(srcs) else []
        else:
            cls, info = op_class(n.target)
            base = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
            if (info == "view" or cls == WAIT) and base is not None and sid_of.get(base):
                sid_of[n] = [sid_of[base][0]]
                if n in g.vid:
                    aliases.append((g.vid[n], sid_of[n][0]))
            elif cls == FREE and info != "alloc":
                sid_of[n] = []
            elif isinstance(val, torch.Tensor):
                sid_of[n] = [new(g.vid.get(n, -1), _nbytes(val), i)]
            elif isinstance(val, (tuple, list)):
                sid_of[n] = [new(getitem_vid.get((n, k), -1), _nbytes(x), i) for k, x in enumerate(val)]
            else:
                sid_of[n] = []
        for a in n.all_input_nodes:
            for s in sid_of.get(a, ()):
                last[s] = max(last[s], i)
    for s, v in enumerate(owner):
        if born[s] == 0 and v >= 0 and g.values[v].op == "placeholder":
            last[s] = end
    al = np.asarray(aliases, dtype=np.int64).reshape(-1, 2)
    return (np.asarray(owner, dtype=np.int64), np.asarray(born, dtype=np.int64), np.asarray(last, dtype=np.int64),
            np.asarray(size, dtype=np.float64), al[:, 0], al[:, 1])


def _nbytes(val) -> float:
    if isinstance(val, torch.Tensor):
        return float(math.prod(val.shape) * val.dtype.itemsize)
    return 0.0


def _flops(node, formula) -> tuple:
    """(FLOPs, dtype) of one compute node on its global shapes (sim/compute.py's CostModel, without timing)."""
    dtype = None
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            dtype = v.dtype
            break
    if formula is None:
        return 0, dtype or torch.float32
    meta = lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a   # noqa: E731
    try:
        args = torch.fx.node.map_aggregate(node.args, meta)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, meta)
        flops = int(formula(*args, out_val=node.meta.get("val"), **kwargs))
    except Exception:                  # a formula that cannot read these args (as the simulator does)
        flops = 0
    return flops, dtype or torch.float32
