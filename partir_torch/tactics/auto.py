"""AutomaticPartition: a tactic that searches the decisions still open on its axes, scored by the simulator.

    schedule = [T.data_parallel("batch"),
                T.automatic("model", hardware=pt.sim.hardware("h100", nodes=8), memory_limit=80e9)]
    prog = pt.partition(model, mesh, schedule, ...)
    print(prog.search_report())          # the candidates it lowered and simulated, and the search statistics
    print(prog.explain("params.layers.0.mlp.w1.weight"))   # "... decided by Auto, action 'megatron'"

It is a tactic like any other: it sees what earlier tactics decided (frozen), decides its axes, and later tactics
build on it. The search (PartIR's automatic tactics, TOAST's decision space):

1. The space (search_space.py): equivalence classes of dims tied by propagation (repeated layers tied, one trial
   propagation per class on a copy of the decisions), the presets as macro-actions, zero(1|3) as completions, and
   conflicts between actions as choice points.
2. Every candidate (a compatible set of actions per axis; several axes: their product) is scored by the fast
   estimate (sim/quick.py: local FLOPs from sharded shapes, the reshards lowering would insert, liveness memory),
   in a seeded order until the estimate budget is spent; candidates over the memory limit rank after all others.
3. The best few by estimate, and always the two best pure preset combinations (presets and completions, no class
   choice), are replayed on a copy of the decisions, lowered and simulated in full; the fastest within the memory
   limit wins (none within it: the one with the least peak memory), so the plan is never slower in the simulator
   than the pure preset combinations it lowered. The report gives the Spearman rank correlation of estimate and
   simulation over those.
4. The winner is replayed on the real decisions: an ordinary stage, whose provenance names this tactic, and
   explain() names the action.
"""
from __future__ import annotations

import itertools
import math
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ..contract import META_RECOMPUTE
from ..errors import PartitionError
from ..propagate.arrays import undecided
from .base import TacticBase, declare
from .search_space import Action, axis_candidates, build_axis_space, twin_space, union


@dataclass(eq=False)
class Candidate:
    actions: tuple                     # Action objects, in the order they are applied
    est_step_s: float = 0.0
    est_peak: float = 0.0
    sim: object = None                 # SimReport once lowered and simulated
    preset_only: bool = False
    low: object = field(default=None, repr=False)   # its lowered program (lower.Lowered)

    def label(self) -> str:
        by_axis: dict = {}
        for a in self.actions:
            by_axis.setdefault(a.axis, []).append(a.label)
        return "; ".join(f"{ax}: {' + '.join(ls)}" for ax, ls in by_axis.items()) or "(all replicated)"


@dataclass
class SearchReport:
    tactic: str
    axes: tuple
    memory_limit: float
    hardware: str
    classes: dict = field(default_factory=dict)      # axis -> [(label, tied members, conflicts)]
    actions: dict = field(default_factory=dict)      # axis -> number of actions
    choice_points: dict = field(default_factory=dict)  # axis -> pairs of actions that exclude each other
    trials: int = 0
    evaluated: int = 0
    space: int = 0
    lowered: list = field(default_factory=list)      # Candidates simulated in full, best first
    chosen: Candidate | None = None
    rank_correlation: float | None = None
    seconds: dict = field(default_factory=dict)      # phase -> seconds
    within_limit: bool = True
    cut_by_time: bool = False   # a safety cap on the search's CPU time cut the estimates or the lowerings
    recompute: str = ""         # what partition() chose when no plan fit without recomputation (recompute.py)

    def table(self, top: int = 8) -> str:
        from tabulate import tabulate

        rows = []
        for c in self.lowered[:top]:
            r = c.sim
            mark = "*" if c is self.chosen else ""
            rows.append([mark, c.label()[:90], f"{r.step_time_s * 1e3:.1f}", f"{c.est_step_s * 1e3:.1f}",
                         f"{r.peak_memory_bytes / 1e9:.1f}", f"{c.est_peak / 1e9:.1f}",
                         f"{r.exposed_comm_s * 1e3:.1f}", "yes" if c.preset_only else ""])
        head = (f"{self.tactic} on {', '.join(repr(a) for a in self.axes)}: {self.hardware}, memory limit "
                f"{self.memory_limit / 1e9:.1f} GB")
        t = tabulate(rows, headers=["", "actions", "step ms", "est ms", "peak GB", "est GB", "exposed comm ms",
                                    "presets only"], tablefmt="simple")
        rho = "n/a (fewer than 3 lowered)" if self.rank_correlation is None else f"{self.rank_correlation:.2f}"
        secs = ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())
        lines = [head, t,
                 f"search space: {sum(len(v) for v in self.classes.values())} classes "
                 f"({self.trials} trial propagations), {sum(self.actions.values())} actions, "
                 f"{sum(self.choice_points.values())} conflicting pairs (choice points), {self.space} candidates; "
                 f"{self.evaluated} estimated, {len(self.lowered)} lowered and simulated",
                 f"rank correlation of estimate and simulation over the lowered candidates (Spearman): {rho}",
                 f"time: {secs}"]
        if self.cut_by_time:
            lines.append("the search took more CPU time than the budget's counts assume (a slower machine or a "
                         "larger step): a safety cap cut it short (this plan may differ from another machine's with "
                         "the same seed)")
        if not self.within_limit:
            lines.append(f"no candidate within the memory limit: chose the one with the least peak memory")
        if self.recompute:
            lines.append(f"recomputation: {self.recompute}")
        for axis, cls in self.classes.items():
            shown = "; ".join(f"{label} [{len(members)} tied{f', {c} conflicts' if c else ''}]"
                              for label, members, c in cls[:10])
            more = f" ... and {len(cls) - 10} more" if len(cls) > 10 else ""
            lines.append(f"classes on '{axis}': {shown}{more}")
        return "\n".join(lines)

    def __str__(self):
        return self.table()


@declare("automatic")
@dataclass(frozen=True)
class AutomaticPartition(TacticBase):
    """Decide `axes` by search (see the module docstring). hardware: a pt.sim.hardware(...); memory_limit: bytes
    per device (default: the chip's HBM); budget_s: seconds for the search on a 2-core machine (the estimates get about a sixth,
    lowering the best candidates most of the rest; the best estimate and the two best pure preset combinations are
    always lowered);
    seed: the order candidates are sampled in when there are more than the budget allows. The budget is turned into
    counts of candidates (see _counts), so a seed gives one plan whatever the machine's load."""

    axes: tuple
    hardware: object = None
    memory_limit: float | None = None
    budget_s: float = 60.0
    seed: int = 0
    name: str = "Auto"
    progress: bool = True
    max_lowered: int = 8

    def __post_init__(self):
        axes = (self.axes,) if isinstance(self.axes, str) else tuple(self.axes)
        if not axes or not all(isinstance(a, str) for a in axes):
            raise PartitionError(f"automatic: axes must be a mesh axis name or a list of them, got {self.axes!r}.")
        object.__setattr__(self, "axes", axes)
        if self.hardware is None:
            from ..sim import hardware

            object.__setattr__(self, "hardware", hardware("h100"))

    @property
    def axis(self) -> str:
        return ",".join(self.axes)

    # -- the tactic ----------------------------------------------------------------------------------------------
    def apply(self, ctx) -> None:
        for a in self.axes:
            ctx.mesh.check_axis(a, self.name)
        from ..lower.lower import StageShare
        from ..sim.comm import check_mesh
        from ..sim.quick import ProgramFacts

        hw = check_mesh(self.hardware, ctx.mesh)
        limit = float(self.memory_limit if self.memory_limit is not None else hw.hbm_bytes)
        share = StageShare()     # what the candidates' lowerings share: unchanged ops' layouts, the meta run's memo
        t_start, c_start = time.perf_counter(), time.process_time()   # wall for the report, CPU for the caps
        report = SearchReport(self.name, self.axes, limit, hw.describe())
        bar = _bar(self.progress, f"{self.name} {'+'.join(self.axes)}")
        try:
            # 1. the space
            bar.set_description(f"{self.name} {'+'.join(self.axes)}: trial propagations")
            facts = ProgramFacts(ctx.graph, ctx.mesh, hw, ctx.captured, ctx.options.bucket_bytes,
                                 ctx.options.reduce_in_flight, ctx.options.compile, ctx.options.prefetch)
            spaces = self._spaces(ctx, report, bar)
            t_space = time.perf_counter()
            report.seconds["space"] = t_space - t_start
            # 2. estimates
            n_est, n_low = self._counts(len(ctx.graph.values))
            scored = self._estimates(ctx, facts, spaces, n_est, report, bar, c_start)
            t_est = time.perf_counter()
            report.seconds["estimate"] = t_est - t_space
            # 3. lower and simulate the best few (always the best pure preset combinations too)
            lowered = self._lower_best(ctx, scored, limit, n_low, report, bar, c_start, share)
            report.seconds["lower+simulate"] = time.perf_counter() - t_est
        finally:
            bar.close()
        chosen = self._choose(lowered, limit, report)
        # 4. the winner, on the real decisions
        self._replay(ctx, chosen.actions, label=True)
        report.seconds["total"] = time.perf_counter() - t_start
        ctx.record_search(report)
        desc = chosen.label()
        ctx.remark(self.name, f"{self.name} chose {desc} (simulated step {chosen.sim.step_time_s * 1e3:.1f} ms, "
                              f"peak {chosen.sim.peak_memory_bytes / 1e9:.1f} GB of {limit / 1e9:.1f} GB); "
                              f"prog.search_report() for the candidates")

    # -- the search's phases -------------------------------------------------------------------------------------
    def _spaces(self, ctx, report: SearchReport, bar) -> dict:
        """1. Per axis: its classes (one trial propagation each), the presets and completions, the choice points. An
        axis of the same size as one built before, both unused by earlier tactics and offered the same presets,
        repeats that axis's space (search_space.twin_space): its trials are not run again."""
        spaces = {}
        for axis in self.axes:
            presets = self._presets(ctx, axis)
            twin = next((a for a in spaces if self._twins(ctx, a, axis, presets)), None)
            if twin is not None:
                spaces[axis] = twin_space(spaces[twin], axis, presets)
            else:
                spaces[axis] = build_axis_space(ctx, axis, self.name, presets, on_trial=lambda: bar.update(1))
            sp = spaces[axis]
            report.classes[axis] = [(a.label, a.members, a.conflicts) for a in sp.actions if a.kind == "class"]
            report.actions[axis] = len(sp.actions)
            report.choice_points[axis] = int((~sp.compatible).sum() // 2)
            report.trials += sp.trials
        return spaces

    def _estimates(self, ctx, facts, spaces: dict, n_est: int, report: SearchReport, bar, c_start: float) -> list:
        """2. The fast estimate of up to n_est candidates: the all-replicated one, then every combination of presets
        (macro-actions; fewest actions first), then the rest in an order drawn from the seed. Returns the scored
        Candidates."""
        per_axis: dict = {}
        for axis in self.axes:       # a twin's candidates are its twin's (the same actions, in the same order)
            twin = spaces[axis].twin
            per_axis[axis] = per_axis[twin] if twin in per_axis else axis_candidates(spaces[axis])
        base = {a: ctx.axis_arrays(a) for a in ctx.mesh.axes}
        unions: dict = {}                                  # (axis, candidate) -> its decisions, when first needed

        def decisions(axis, i):
            if (axis, i) not in unions:
                unions[(axis, i)] = union(spaces[axis].actions, per_axis[axis][i], *base[axis])
            return unions[(axis, i)]

        report.space = math.prod(len(per_axis[a]) for a in self.axes)
        order = self._candidate_order(per_axis, spaces, n_est)
        bar.reset(total=len(order))
        bar.set_description(f"{self.name} {'+'.join(self.axes)}: estimating")
        scored, sizes = [], _dim_sizes(facts.shapes)
        # a safety net for a machine slower than _counts assumes, on this process's CPU time: the machine's load
        # (other processes) does not cut the search
        cap = c_start + 0.5 * self.budget_s + 3.0
        for combo in order:
            if time.process_time() > cap and scored:
                report.cut_by_time = True
                break
            if not self._divisible(sizes, ctx.mesh, [decisions(a, i)[0] for a, i in zip(self.axes, combo)]):
                bar.update(1)
                continue
            dec = dict(base)
            for axis, i in zip(self.axes, combo):
                dec[axis] = decisions(axis, i)
            est = facts.estimate(dec)
            acts = tuple(spaces[a].actions[j] for a, i in zip(self.axes, combo) for j in per_axis[a][i])
            scored.append(Candidate(acts, est.step_s, est.peak_bytes,
                                    preset_only=all(x.kind != "class" for x in acts)))
            bar.update(1)
        report.evaluated = len(scored)
        return scored

    def _candidate_order(self, per_axis: dict, spaces: dict, n_est: int) -> list:
        """Up to n_est candidates (one index per axis into per_axis): every pure preset combination, fewest actions
        first (the all-replicated one leads), then the others in an order drawn from the seed (sampled from the
        space's indices, so a space of millions is never listed)."""
        pure = [[i for i, c in enumerate(per_axis[a]) if all(spaces[a].actions[j].kind != "class" for j in c)]
                for a in self.axes]
        size = lambda combo: sum(len(per_axis[a][i]) for a, i in zip(self.axes, combo))  # noqa: E731
        order = sorted(itertools.product(*pure), key=size)[:n_est]
        sizes = [len(per_axis[a]) for a in self.axes]
        total, n_pure = math.prod(sizes), math.prod(len(p) for p in pure)
        pure_sets = [set(p) for p in pure]
        for flat in random.Random(self.seed).sample(range(total), min(total, n_est - len(order) + n_pure)):
            if len(order) >= n_est:
                break
            combo = []
            for n in reversed(sizes):                  # itertools.product's order: the last axis varies fastest
                flat, i = divmod(flat, n)
                combo.append(i)
            combo = tuple(reversed(combo))
            if not all(i in ps for i, ps in zip(combo, pure_sets)):
                order.append(combo)
        return order

    def _lower_best(self, ctx, scored: list, limit: float, n_low: int, report: SearchReport, bar,
                    c_start: float, share=None) -> list:
        """3. Lower and simulate the best n_low by estimate and, always, the best estimate and the PURE_LOWERED best
        pure preset combinations (presets and completions only, see _rank): the plan chosen is then never slower in
        the simulator than those. share: a lower.StageShare the candidates' lowerings reuse (see _simulate)."""
        ranked = sorted(scored, key=lambda c: _rank(c, limit))
        pure = sorted((c for c in scored if c.preset_only), key=lambda c: _rank(c, limit, completions=True))
        must = list(dict.fromkeys(ranked[:1] + pure[:self.PURE_LOWERED]))
        queue = (must + [c for c in ranked if c not in must])[:max(n_low, len(must))]
        bar.reset(total=len(queue))
        bar.set_description(f"{self.name} {'+'.join(self.axes)}: lowering")
        lowered = []
        last = 0.0
        for c in queue:
            now = time.process_time()
            if len(lowered) >= len(must) and now + last > c_start + self.budget_s:
                report.cut_by_time = True
                break
            c.sim, c.low = self._simulate(ctx, c.actions, share)
            last = time.process_time() - now
            lowered.append(c)
            bar.update(1)
        return lowered

    def _choose(self, lowered: list, limit: float, report: SearchReport) -> Candidate:
        """The fastest lowered candidate within the memory limit (none within it: the one with the least peak
        memory); fills the report's ranking."""
        ok = [c for c in lowered if c.sim.peak_memory_bytes <= limit]
        report.within_limit = bool(ok)
        chosen = min(ok, key=lambda c: _score(c, c.sim.step_time_s)) if ok else \
            min(lowered, key=lambda c: (c.sim.peak_memory_bytes, c.sim.step_time_s))
        report.lowered = sorted(lowered, key=lambda c: (c.sim.peak_memory_bytes > limit, c.sim.step_time_s))
        report.chosen = chosen
        report.rank_correlation = _spearman([c.est_step_s for c in lowered], [c.sim.step_time_s for c in lowered])
        return chosen

    # -- pieces --------------------------------------------------------------------------------------------------
    def _twins(self, ctx, built: str, axis: str, presets: list) -> bool:
        """Would `axis`'s space repeat `built`'s (twin_space)? Same size, neither used by earlier tactics, the same
        presets offered."""
        same = [p[:2] for p in self._presets(ctx, built)] == [p[:2] for p in presets]
        return (same and ctx.mesh.shape[built] == ctx.mesh.shape[axis] and not ctx.axis_in_use(built)
                and not ctx.axis_in_use(axis))

    def _presets(self, ctx, axis) -> list:
        """The macro-actions the tactic classes declare (base.declare(macro=True)): presets, then completions."""
        from . import experts  # noqa: F401  (declares ExpertParallel)
        from .base import MACRO_TACTICS

        acts = [a for cls in MACRO_TACTICS for a in cls.macro_actions(ctx, axis, self.name)]
        return sorted(acts, key=lambda a: a[1] == "zero")

    # seconds per value of the captured graph, measured on a 2-core machine (benchmarks/auto.py; the MoE's are the
    # dearest per value: 6.5e-7 s per estimate, 5.5e-4 s per lowering): one fast estimate, and one lowering + local
    # shapes + simulation. The budget is turned into counts with them, so that the search is deterministic for a
    # seed (a wall-clock cut-off would depend on the machine's load).
    EST_S_PER_VALUE = 6.0e-7
    LOWER_S_PER_VALUE = 5.0e-4
    PURE_LOWERED = 2          # pure preset combinations always lowered, with the best estimate (see _lower_best)

    def _counts(self, n_values: int) -> tuple:
        """(candidates to estimate, candidates to lower) within budget_s: 15% of it for the estimates, 60% for
        lowering (at least two; _lower_best adds the best pure preset combinations beyond them)."""
        n_est = max(1, int(0.15 * self.budget_s / (self.EST_S_PER_VALUE * n_values)))
        n_low = int(0.6 * self.budget_s / (self.LOWER_S_PER_VALUE * n_values))
        return n_est, max(2, min(self.max_lowered, n_low))

    def _divisible(self, sizes_of, mesh, vals_list) -> bool:
        """Two searched axes tiling one dim of a value: its size must divide by both (the first 4096 such values;
        sizes_of: _dim_sizes)."""
        if len(vals_list) < 2:
            return True
        for (a, va), (b, vb) in itertools.combinations(zip(self.axes, vals_list), 2):
            both = np.nonzero((va >= 0) & (va == vb))[0][:4096]
            if len(both):
                k = mesh.shape[a] * mesh.shape[b]
                if np.any(sizes_of[both, va[both]] % k):
                    return False
        return True

    def _order(self, actions) -> list:
        """Replay order: each axis's actions in the order of self.axes, then the completions (ZeRO last, as a
        schedule would put it)."""
        main = [a for ax in self.axes for a in actions if a.axis == ax and a.kind != "zero"]
        return main + [a for ax in self.axes for a in actions if a.axis == ax and a.kind == "zero"]

    def _replay(self, ctx, actions, label=False):
        import warnings

        for a in self._order(actions):
            before = ctx.value_states(a.axis) if ctx.axis_in_use(a.axis) else None
            with warnings.catch_warnings():
                if not label:
                    warnings.simplefilter("ignore")
                try:
                    a.apply(ctx, self.name)
                except PartitionError:
                    if label:
                        raise
                    continue
            if label:
                after = ctx.value_states(a.axis)
                new = np.nonzero(after != before)[0] if before is not None else np.nonzero(~undecided(after))[0]
                for c in new.tolist():
                    ctx.mark_action(c, a.axis, self.name, a.label)

    def _simulate(self, ctx, actions, share=None):
        """(SimReport, lower.Lowered) of one candidate. share (lower.StageShare): candidates of one search differ in
        a few axes' decisions, so the op layouts of the ops whose decisions the previous candidate had too, and the
        meta run's memo of local shapes (a function of its keys alone), are reused; the program is the same as a
        lowering without it (tests/test_auto.py)."""
        from ..lower.fakeprop import annotate_local_vals
        from ..sim import simulate_graph

        trial = ctx.trial(self.axes)
        self._replay(trial, actions)
        low = trial.lower(share)
        annotate_local_vals(low, ctx.captured, share.meta_memo if share is not None else None)
        recompute = {n.name for n in low.gm.graph.nodes if n.meta.get(META_RECOMPUTE)}
        rep = simulate_graph(low.gm, ctx.mesh, self.hardware, exclude_flops=recompute, stage_name=self.name)
        return rep, low


def automatic(axes, hardware=None, memory_limit: float | None = None, budget_s: float = 60.0, seed: int = 0,
              name: str = "Auto", progress: bool = True) -> AutomaticPartition:
    """A tactic that decides `axes` (a mesh axis or a list of them) by search, given everything earlier tactics
    decided (see AutomaticPartition)."""
    return AutomaticPartition(axes, hardware, memory_limit, budget_s, seed, name, progress)




def _score(c: Candidate, step_s: float) -> float:
    """Step time, with 0.3% added per class action: of two plans within the simulator's error, the one built from
    presets and fewer choices (a layer norm's weight tiled alone saves a few bytes and adds a reshard)."""
    return step_s * (1.0 + 0.003 * sum(a.kind == "class" for a in c.actions))


def _rank(c: Candidate, limit: float, completions: bool = False) -> tuple:
    """Lowering order: candidates the estimate puts within 90% of the limit (it leaves out some temporaries) by
    _score, the others by estimated peak. completions=True (pure preset combinations): 0.3% more per completion,
    so of near ties the plainer recipe is lowered first (a zero(3) on an axis whose preset already shards the large
    weights moves little and adds gathers the estimate resolves to a fraction of a percent)."""
    margin = 0.9 * limit
    if c.est_peak > margin:
        return (True, c.est_peak)
    n = sum(a.kind == "zero" for a in c.actions) if completions else 0
    return (False, _score(c, c.est_step_s) * (1.0 + 0.003 * n))


def _spearman(x, y) -> float | None:
    if len(x) < 3:
        return None
    rx = np.argsort(np.argsort(x)).astype(float)
    ry = np.argsort(np.argsort(y)).astype(float)
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


class _NoBar:
    def update(self, n=1):
        pass

    def reset(self, total=None):
        pass

    def set_description(self, s):
        pass

    def close(self):
        pass


def _bar(enabled: bool, desc: str):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:            # tqdm comes with transformers; without it the search runs silently
        return _NoBar()
    return tqdm(total=0, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


def _dim_sizes(shapes) -> np.ndarray:
    """[value, dim] -> the dim's size (0 past a value's rank), built once per search: the estimate phase checks every
    candidate's divisibility against it without a Python loop over values."""
    rank = max((len(s) for s in shapes), default=0)
    got = np.zeros((len(shapes), max(rank, 1)), dtype=np.int64)
    for v, shape in enumerate(shapes):
        got[v, :len(shape)] = shape
    return got
