"""What a plan prints and reports: explain(), the annotated graph, the per-device program, the per-tactic summary,
the simulation of every stage and the automatic searches. Reports reads a Plan (plan.py) and nothing else: its
graph, mesh, stages and their Decisions, and the notes, remarks and search reports the tactics left in it."""
from __future__ import annotations

import math

import torch
from tabulate import tabulate

from .capture.counts import describe as describe_counts
from .contract import META_ACTION, META_COLLECTIVE, META_NAME, META_RECOMPUTE, META_SRC, META_TAG, Role
from .errors import PartitionError, closest
from .lower.copies import layout_copies, one_device_copies
from .lower.pipeline import pp_transfer
from .lower.records import RESHARD, WHYS
from .tactics.base import Tactic


class Reports:
    """explain / annotated / device_program / summary / simulate / search_report of a Plan."""

    def __init__(self, plan):
        self.plan = plan
        self.graph, self.mesh, self.tactics, self.stages = plan.graph, plan.mesh, plan.tactics, plan.stages

    # -- values --------------------------------------------------------------------------------------------------
    def vid(self, name: str) -> int:
        """The value index of a named value, or of an FX node's name (as conflicts and collective records give it)."""
        vid = self.graph.name_to_vid.get(name)
        if vid is None:
            vid = next((v for n, v in self.graph.vid.items() if n.name == name), None)
        if vid is None:
            near = closest(name, self.graph.name_to_vid, n=5)
            raise PartitionError(f"no value named {name!r}." + (f" Closest: {', '.join(near)}." if near else ""))
        return vid

    # -- explain -------------------------------------------------------------------------------------------------
    def explain(self, name: str) -> str:
        """Which tactic decided each axis of a value, and through which path."""
        vid = self.vid(name)
        d = self.plan.decisions
        lines = [f"{name}: {d.sharding(vid)}  shape {tuple(self.graph.shapes[vid])}"]
        for axis in self.mesh.axes:
            if d.provenance(axis, vid) is None:
                lines.append(f"  axis '{axis}': replicated (no tactic decided it)")
                continue
            lines.append(f"  axis '{axis}': {self._why(axis, vid)}")
        for text in self.plan.notes.get(name, ()):
            lines.append(f"  note: {text}")
        for conflict, via in self._conflicts_of(vid):
            lines.append(f"  conflict: {conflict}" + (f" (reached from this value's seed through {via})"
                                                      if via else ""))
        return "\n".join(lines)

    def _conflicts_of(self, vid: int) -> list:
        """(conflict, value it reached) for the conflicts that involve this value: it is one of the competing
        values, or a competing value's decision comes (by provenance) from this value's seed."""
        g, d = self.graph, self.plan.decisions
        out = []
        for conflict in d.conflicts:
            if conflict.axis not in d.axes:
                continue
            for value, _, _ in conflict.states:
                v = g.name_to_vid.get(value, next((x for n, x in g.vid.items() if n.name == value), None))
                if v is None:
                    continue
                if g.canon[v] == g.canon[vid]:
                    out.append((conflict, ""))
                    break
                if self._seed_of(conflict.axis, g.canon[v]) == g.canon[vid]:
                    out.append((conflict, value))
                    break
        return out

    def _seed_of(self, axis: str, c: int) -> int | None:
        """The canonical value whose seed decided `c` on this axis (following provenance), or None."""
        d, seen = self.plan.decisions, set()
        while c not in seen:
            seen.add(c)
            prov = d.provenance(axis, c)
            if prov is None:
                return None
            if prov.op is None:
                return c
            c = self.graph.canon[prov.source]
        return None

    def search_report(self) -> str:
        """The automatic tactics' searches (tactics.automatic): the candidates lowered and simulated (actions, step
        time, peak memory, exposed communication, next to the fast estimate) and the search statistics."""
        if not self.plan.searches:
            raise PartitionError("search_report: no automatic tactic in this schedule (pt.tactics.automatic).")
        return "\n\n".join(r.table() for r in self.plan.searches)

    def _why(self, axis: str, vid: int) -> str:
        auto = self.plan.actions.get((self.graph.canon[vid], axis))
        why = self._why_path(axis, vid)
        return why + (f"; decided by {auto[0]} (automatic), action '{auto[1]}'" if auto else "")

    def _why_path(self, axis: str, vid: int) -> str:
        g, d = self.graph, self.plan.decisions
        prov = d.provenance(axis, vid)
        what = d.state_text(axis, vid)
        if prov.op is None:
            return f"{what} by tactic {prov.tactic}: seeded"
        path, cur, seen = [], prov, set()
        while cur is not None and cur.op is not None and len(path) < 6:
            node = g.ops[cur.op].node
            path.append(f"{node.target} ({node.name}) from {g.name(cur.source)}")
            src = g.canon[cur.source]
            if src in seen:
                break
            seen.add(src)
            cur = d.provenance(axis, src)
        more = " ..." if cur is not None and cur.op is not None else ""
        origin = f" (seeded by {cur.tactic})" if cur is not None and cur.op is None else ""   # the last `from` value
        return f"{what} by {prov.tactic} via " + " <- ".join(path) + more + origin

    # -- printing ------------------------------------------------------------------------------------------------
    def annotated(self, max_nodes: int | None = None) -> str:
        """The captured graph, one line per value, with its sharding."""
        g = self.graph
        lines = [f"# mesh {self.mesh}; schedule: " + ", ".join(f"{t.name}[{t.axis if isinstance(t, Tactic) else '?'}]" for t in self.tactics)]
        for i, node in enumerate(g.gm.graph.nodes):
            if max_nodes is not None and i >= max_nodes:
                lines.append("...")
                break
            if node.op == "output":
                lines.append(f"return {node.args[0]}")
                continue
            vid = g.vid.get(node)
            val = node.meta.get("val")
            shape = list(val.shape) if vid is not None else ""
            lhs = f"%{node.name}: {shape}" if vid is not None else f"%{node.name}"
            if node.op == "placeholder":
                rhs = f"input {node.meta.get(META_NAME, '')}"
            else:
                args = ", ".join(f"%{a.name}" if hasattr(a, "name") else repr(a) for a in node.args)
                rhs = f"{node.target}({args})"
            sh = f"  # {self.plan.sharding(vid)}" if vid is not None else ""
            tag = f"  ({node.meta[META_TAG]})" if node.meta.get(META_TAG) else ""
            lines.append(f"{lhs} = {rhs}{sh}{tag}")
        return "\n".join(lines)

    def device_program(self) -> str:
        """The per-device program: local shapes, each op's value sharding, and every collective with its kind,
        axis, bytes and the tactic that made it necessary."""
        low = self.plan.annotated_lowered()
        g = self.graph
        src = {n.name: n for n in g.gm.graph.nodes}
        lines = [f"# per-device program on mesh {self.mesh}; schedule: "
                 + ", ".join(f"{t.name}[{t.axis if isinstance(t, Tactic) else '?'}]" for t in self.tactics)]
        for node in low.gm.graph.nodes:
            if node.op == "output":
                lines.append(f"return {node.args[0]}")
                continue
            val = node.meta.get("val")
            shape = f": {_dt(val)}{list(val.shape)}" if hasattr(val, "shape") else ""
            if node.op == "placeholder":
                lines.append(f"%{node.name}{shape} = input {node.meta.get(META_NAME, '')}")
                continue
            args = ", ".join(f"%{a.name}" if hasattr(a, "name") else repr(a) for a in node.args)
            line = f"%{node.name}{shape} = {_short(node.target)}({args})"
            rec = node.meta.get(META_COLLECTIVE)
            origin = src.get(node.meta.get(META_SRC, ""))
            if rec is not None:
                op = f"({rec.reduce_op})" if rec.reduce_op else ""
                line += f"  # {rec.kind}{op} on '{rec.axis}' (x{rec.group_size}) {_fmt_bytes(rec.nbytes)} " \
                        f"<- {rec.tactic}, for {rec.value}"
            elif origin is not None and origin in g.vid:
                line += f"  # {self.plan.sharding(g.vid[origin])}"
            lines.append(line)
        return "\n".join(lines)

    # -- stages: what each tactic changed ------------------------------------------------------------------------
    def simulate(self, hw, axis_map=None, issue: str = "program", stages: bool = True):
        """SimReport for the final program on hardware `hw` (pt.sim.hardware(...)); with stages, `.stages` holds one
        report per tactic stage (the first: nothing partitioned), so the table shows what each tactic changed (each
        stage is lowered: stages=False simulates the final program alone, one lowering instead of one per stage).
        MFU counts the model's FLOPs: the captured step's (recomputation excluded) shared out over the devices."""
        from .sim import simulate_graph
        from .sim.simulate import step_flops

        cap = self.plan.captured.gm
        per_device = step_flops(cap, hw, {n.name for n in cap.graph.nodes if n.meta.get(META_RECOMPUTE)}) \
            / self.mesh.size
        chosen = [(-1, "replicated")] + [(k, s.tactic) for k, s in enumerate(self.stages)]
        reports = []
        for k, name in (chosen if stages else chosen[-1:]):
            low = self.plan.annotated_lowered(k)
            recompute = {n.name for n in low.gm.graph.nodes if n.meta.get(META_RECOMPUTE)}
            if low.pipeline is not None:      # one timeline per rank of the pipeline axis (sim/pipeline.py)
                from .sim.pipeline import simulate_pipeline

                reports.append(simulate_pipeline(low.gm, self.mesh, hw, low.pipeline, axis_map=axis_map,
                                                 stage_name=name, exclude_flops=recompute))
                continue
            reports.append(simulate_graph(low.gm, self.mesh, hw, axis_map=axis_map, stage_name=name, issue=issue,
                                          exclude_flops=recompute, model_flops=per_device,
                                          compiled=self.plan.options.compile))
        final = reports[-1]
        final.notes.extend(describe_counts(self.plan.captured))     # padded selections cost their N rows
        final.stages = reports if stages else []
        return final

    def summary(self) -> str:
        """One row per tactic stage: decisions, conflicts, collectives added (by kind and axis), bytes per step,
        parameter and optimizer-state memory per device."""
        rows = []
        prev = self._stage_stats(-1)
        for k, s in enumerate(self.stages):
            cur = self._stage_stats(k)
            added = {key: n - prev["by"].get(key, 0) for key, n in cur["by"].items() if n != prev["by"].get(key, 0)}
            added_s = ", ".join(f"{kind}[{axis}] {'+' if n > 0 else ''}{n}" for (kind, axis), n in sorted(added.items()))
            rows.append([s.tactic, s.axis, s.decided, len(s.conflicts), added_s or "-", _fmt_bytes(cur["bytes"]),
                         _fmt_bytes(cur["param"]), _fmt_bytes(cur["opt"])])
            prev = cur
        table = tabulate(rows, headers=["tactic", "axis", "decisions", "conflicts", "collectives added",
                                        "comm bytes/step", "params/device", "opt state/device"], tablefmt="simple")
        notes = [why_line(self.plan.lowered().records)]
        if self.plan.pipeline.staged:
            notes.append(self.pipeline_table())
        notes += [text for s in self.stages for text in self.plan.remarks.get(s.tactic, ())]
        conflicts = self.plan.conflicts
        if conflicts:
            shown = "\n".join(f"  {c}" for c in conflicts[:3])
            more = f"\n  ... and {len(conflicts) - 3} more (prog.conflicts)" if len(conflicts) > 3 else ""
            notes.append(f"{len(conflicts)} conflict{'s' if len(conflicts) > 1 else ''} (propagation "
                         f"stopped there; lowering reshards the values around them; prog.explain(<value or FX node "
                         f"name>) names the cause):\n{shown}{more}")
        return "\n".join([table] + notes)

    def audit(self) -> str:
        """The "reshard" collectives of the program (records.py: a layout change no tactic asked for), grouped by
        the op they serve and its source line, with their bytes per step; the fix for each. Then what batch norm's
        global statistics cost, if any (batchnorm_text), and the program's layout copies against the one-device
        step's (copies_text)."""
        records = self.plan.lowered().records
        bn = batchnorm_text(records, self.plan.captured.gm.graph)
        cap = self.plan.captured
        copies = copies_text(layout_copies(self.plan.annotated_lowered(), cap), one_device_copies(cap))
        return audit_text(records) + (f"\n{bn}" if bn else "") + f"\n{copies}"

    def _stage_stats(self, k: int) -> dict:
        low = self.plan.lowered(k)
        by: dict = {}
        for r in low.records:
            by[(r.kind, r.axis)] = by.get((r.kind, r.axis), 0) + 1
        sent = sum(r.nbytes for r in low.records)
        cap = self.plan.captured
        spec = low.pipeline_spec
        param, opt = [0] * spec.ranks, [0] * spec.ranks      # a pipelined device holds its stages' state only
        for role, shape, n in zip(cap.input_roles, low.local_shapes,
                                  [n for n in cap.gm.graph.nodes if n.op == "placeholder"]):
            if role in (Role.PARAM, Role.OPT_STATE) and shape is not None:
                b = math.prod(shape) * n.meta["val"].element_size()
                held = spec.holders(n.meta.get(META_NAME)) or \
                    (spec.rank_of(spec.stage_of.get(n.name, 0)),)     # a tied weight: on each rank holding it
                for r in held:
                    if role == Role.PARAM:
                        param[r] += b
                    else:
                        opt[r] += b
        return {"by": by, "bytes": sent, "param": max(param), "opt": max(opt)}

    def pipeline_table(self) -> str:
        """The stage split of a pipelined program: per stage its rank, modules, parameters and the bytes it sends
        per micro-batch (forward activations and backward gradients, in their layout on the other axes)."""
        low = self.plan.annotated_lowered()
        spec = low.pipeline.spec
        sent = [0] * spec.n_stages
        for n in low.gm.graph.nodes:
            if n.target is pp_transfer:
                v = n.meta.get("val")
                if isinstance(v, torch.Tensor):
                    sent[n.meta[META_ACTION][0]] += v.numel() * v.element_size()
        names = self.plan.captured.names
        rows = []
        for s in range(spec.n_stages):
            nbytes = sum(names[f"params.{p}"].meta["val"].numel() * names[f"params.{p}"].meta["val"].element_size()
                         for p in spec.params[s] if f"params.{p}" in names)
            mods = ", ".join(spec.modules[s])
            rows.append([s, spec.rank_of(s), mods if len(mods) <= 48 else mods[:45] + "...", len(spec.params[s]),
                         _fmt_bytes(nbytes), _fmt_bytes(sent[s] / spec.microbatches)])
        head = (f"pipeline on axis '{spec.axis}': {spec.n_stages} stages, {spec.schedule}, {spec.microbatches} "
                f"micro-batches")
        tied = [f"tied weight {n[len('params.'):]}: held by stages {', '.join(map(str, st))}, its gradient summed "
                f"over them (all_reduce on '{spec.axis}')" for n, st in spec.tied.items() if n.startswith("params.")]
        return "\n".join([head, tabulate(rows, headers=["stage", "rank", "modules", "params", "param bytes",
                                                        "sent/micro-batch"], tablefmt="simple")] + tied)


def why_line(records) -> str:
    """'collectives by why: gradient 4 (1.50 MiB), state 2 (...), tactic 2 (8 B), reshard 0' (bucket members
    counted one by one)."""
    count = {w: 0 for w in WHYS}
    size = {w: 0 for w in WHYS}
    for r in records:
        for m in r.parts():
            if m.why in count:
                count[m.why] += 1
                size[m.why] += m.nbytes
    return "collectives by why: " + ", ".join(f"{w} {count[w]}" + (f" ({_fmt_bytes(size[w])})" if count[w] else "")
                                              for w in WHYS if w in WHYS[:4] or count[w])


def reshard_groups(records) -> list:
    """The "reshard" collectives by op: [(op, bytes per step, {source: bytes}, [records])], most bytes first."""
    by_op: dict = {}
    for r in records:
        for m in r.parts():
            if m.why == RESHARD:
                total, sources, recs = by_op.setdefault(m.op, [0, {}, []])
                by_op[m.op][0] = total + m.nbytes
                where = m.source or NO_SOURCE
                sources[where] = sources.get(where, 0) + m.nbytes
                recs.append(m)
    return sorted(((op, t, src, recs) for op, (t, src, recs) in by_op.items()), key=lambda x: -x[1])


NO_SOURCE = "(no source line: a backward op, or code outside a forward)"
_FIX = ("register a rule for the op (pt.register_rule) so that it keeps the split, or add a tactic that decides "
        "the value's layout there")


def audit_text(records) -> str:
    """What prog.audit() prints: per op, its reshard collectives' bytes per step and the source lines."""
    groups = reshard_groups(records)
    if not groups:
        return "no reshard collectives: every collective is a gradient, state or tactic one (prog.summary())"
    total = sum(t for _, t, _, _ in groups)
    lines = [f"{sum(len(recs) for *_, recs in groups)} reshard collectives, {_fmt_bytes(total)} per step "
             f"(layout changes no tactic asked for; fix: {_FIX}):"]
    for op, t, sources, recs in groups:
        kinds = ", ".join(f"{k}[{a}] x{n}" for (k, a), n in _counts((r.kind, r.axis) for r in recs).items())
        lines.append(f"  {op}: {_fmt_bytes(t)} per step ({kinds})")
        for src, b in sorted(sources.items(), key=lambda x: -x[1]):
            values = sorted({r.value for r in recs if (r.source or NO_SOURCE) == src})
            lines.append(f"    {src}: {_fmt_bytes(b)}  ({', '.join(values[:4])}{' ...' if len(values) > 4 else ''})")
    return "\n".join(lines)


def copies_text(copies, one_device) -> str:
    """What prog.audit() prints about layout copies (lower/copies.py): the program's per step, the one-device step's
    own, and the extra ones (copies the one-device step does not make) by op and source line."""
    extra = [c for c in copies if c.extra]
    head = (f"layout copies per step: {len(copies)} ({_fmt_bytes(sum(c.nbytes for c in copies))} on this device); "
            f"the one-device step makes {len(one_device)} ({_fmt_bytes(sum(c.nbytes for c in one_device))}); ")
    if not extra:
        return head + "extra: none"
    lines = [head + f"extra: {len(extra)}, {_fmt_bytes(sum(c.nbytes for c in extra))} per step (lowering's copies "
                    f"next to the collectives, or views that copy on the local shards):"]
    for op, recs in _counts_by(extra, lambda c: c.op).items():
        lines.append(f"  {op}: {_fmt_bytes(sum(c.nbytes for c in recs))} per step (x{len(recs)})")
        for src, rs in _counts_by(recs, lambda c: c.source or NO_SOURCE).items():
            values = list(dict.fromkeys(c.value.split(", ")[0] for c in rs))
            lines.append(f"    {src}: {_fmt_bytes(sum(c.nbytes for c in rs))}  ({', '.join(values[:4])}"
                         f"{' ...' if len(values) > 4 else ''})")
    return "\n".join(lines)


def _counts_by(items, key) -> dict:
    out: dict = {}
    for x in items:
        out.setdefault(key(x), []).append(x)
    return dict(sorted(out.items(), key=lambda kv: -sum(c.nbytes for c in kv[1])))


def _bn_moments(node) -> bool:
    """A batch norm's stacked per-channel sums (capture/decompositions.py: (2, C) = cat of two unsqueezed sums),
    or a scaling or cast of them (a partial value is reduced after the linear ops it flows through)."""
    aten = torch.ops.aten
    while node is not None and node.target in (aten.div.Scalar, aten._to_copy.default, aten.mul.Scalar):
        node = node.args[0]
    return node is not None and node.target is torch.ops.aten.cat.default and len(node.args[0]) == 2 and all(
        a.target is torch.ops.aten.unsqueeze.default and a.args[0].target is torch.ops.aten.sum.dim_IntList
        for a in node.args[0])


def batchnorm_text(records, graph) -> str:
    """The all_reduces of batch norm's statistics over the whole batch (data_parallel's batchnorm="global"), their
    count and bytes per step, and how to do without them; "" when there are none."""
    nodes = {n.name: n for n in graph.nodes}
    recs = [m for r in records for m in r.parts() if m.kind == "all_reduce" and _bn_moments(nodes.get(m.value))]
    if not recs:
        return ""
    return (f"batch norm statistics over the whole batch (data_parallel(batchnorm='global'), the default: equal to "
            f"one device): {len(recs)} all_reduces, {_fmt_bytes(sum(r.nbytes for r in recs))} per step (one per "
            f"norm in forward, one in backward). data_parallel(axis, batchnorm='local') normalises each rank's "
            f"batch by its own statistics, as DDP does: no collective (running statistics: rank 0's).")


def reshard_warnings(records) -> list:
    """One warning text per op type with "reshard" collectives: the op, the user's line, the bytes per step, the fix."""
    out = []
    for op, t, sources, recs in reshard_groups(records):
        where = ", ".join(s for s in sources if s != NO_SOURCE) or NO_SOURCE
        out.append(f"partir_torch: {op} forces {len(recs)} reshard collective{'s' if len(recs) > 1 else ''} "
                   f"({_fmt_bytes(t)} per step) at {where}: its operand loses its split there (the op has no "
                   f"rule, needs the dim whole, or propagation met a conflict), so the op runs on the whole "
                   f"tensor on every rank of the axis. Fix: {_FIX}. prog.audit() lists them.")
    return out


def _counts(items) -> dict:
    out: dict = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def _dt(val) -> str:
    return {"torch.float32": "f32", "torch.bfloat16": "bf16", "torch.float16": "f16", "torch.int64": "i64",
            "torch.bool": "b8"}.get(str(getattr(val, "dtype", "")), str(getattr(val, "dtype", "")))


def _short(target) -> str:
    name = str(target)
    for prefix in ("aten.", "_c10d_functional."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.rsplit(".default", 1)[0]


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if b < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1024
