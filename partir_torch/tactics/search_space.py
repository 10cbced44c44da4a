"""The automatic tactic's search space, built from the program (never from model names).

- Atoms: a named parameter group (repeated layers tied: `params.layers.*.mlp.w1.weight`, one group per FQN pattern
  and shape) or an input, with one of its dims that the axis divides; each is tried by seeding every member and
  propagating on a copy of the decisions so far (earlier tactics' decisions stay frozen).
- Classes: an atom whose seeds a previous trial already decided the same way joins that trial's class: the dims that
  propagation ties together (w1's output features, w3's, w2's input features and the hidden activations) are one
  choice. Each class keeps its *delta*: the values and ops its propagation decided.
- Macro-actions: the presets (data_parallel, megatron, megatron + sequence_parallel, expert_parallel) tried the same
  way, where they apply; zero(1) / zero(3) are completions, applied after the rest of a candidate.
- Choice points: two actions whose deltas decide a value or an op differently (a conflict) exclude each other;
  a candidate is a set of pairwise compatible actions per axis.

Trials run on a copy-on-write copy of the decisions (TacticContext.trial), so a class costs one propagation over the
values it reaches and the real decisions are never touched.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..errors import PartitionError
from ..propagate.arrays import undecided


# -- actions ------------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Action:
    """One choice on one axis: tile a class of dims (seeds), or run a preset (tactics, named like the automatic
    tactic so that provenance says who decided). `vals/states/ops/assign`: its delta from the base decisions."""

    axis: str
    label: str
    kind: str                          # "class" | "preset" | "zero"
    seeds: tuple = ()                  # class: ((value name, dim), ...)
    tactics: tuple = ()                # preset / zero
    vals: np.ndarray = None
    states: np.ndarray = None
    ops: np.ndarray = None
    assign: np.ndarray = None
    conflicts: int = 0                 # conflicts its propagation recorded
    members: list = field(default_factory=list)   # class: the atoms tied into it

    def apply(self, ctx, name: str) -> None:
        if self.kind == "class":
            seeds = [(n, d) for n, d in self.seeds if ctx.is_unknown(self.axis, n)]
            if seeds:
                ctx.seed_and_propagate(self.axis, seeds, name)
        else:
            for t in self.tactics:
                t.apply(ctx)

    def __repr__(self):
        return f"Action({self.axis!r}, {self.label!r})"


def _pattern(name: str) -> str:
    """A parameter's FQN with its layer indices as '*': repeated layers share one pattern."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _delta(base_vals: np.ndarray, base_assign: dict, trial, axis: str) -> tuple:
    after = trial.value_states(axis)
    decided = trial.op_decisions(axis)
    vals = np.nonzero(after != base_vals)[0]
    new_ops = [i for i in decided if i not in base_assign]
    ops = np.asarray(sorted(new_ops), dtype=np.int64)
    assign = np.asarray([decided[i] for i in ops], dtype=np.int64)
    return vals, after[vals], ops, assign


@dataclass
class AxisSpace:
    axis: str
    actions: list
    compatible: np.ndarray             # [n, n] bool
    trials: int
    seconds: float
    twin: str | None = None            # the axis whose space this one repeats (twin_space)


def twin_space(space: AxisSpace, axis: str, presets: list) -> AxisSpace:
    """The space of `axis` from the space built for another axis of the same size, both unused by earlier tactics:
    propagation reads an axis's size and the other axes' decisions, never its name, so every trial on `axis` would
    decide what the twin's did. The same classes, deltas and choice points, with `axis`'s own preset tactics
    (`presets`: the same labels and kinds as the twin's, in the same order; build_axis_space's form)."""
    import dataclasses

    tactics = {label: tacts for label, _, tacts in presets}
    actions = [dataclasses.replace(a, axis=axis, tactics=tactics[a.label] if a.kind != "class" else (),
                                   members=list(a.members)) for a in space.actions]
    return AxisSpace(axis, actions, space.compatible, 0, 0.0, twin=space.axis)


def build_axis_space(ctx, axis: str, name: str, presets: list, on_trial=None) -> AxisSpace:
    """Atoms -> classes (one trial propagation each), then the presets, for one axis, from ctx's decisions."""
    import time

    t0 = time.perf_counter()
    g = ctx.graph
    k = ctx.mesh.shape[axis]
    base_vals = ctx.value_states(axis)
    base_assign = ctx.op_decisions(axis)
    actions: list = []
    trials = 0

    def trial(apply) -> tuple | None:
        nonlocal trials
        t = ctx.trial([axis])
        before = t.conflicts_recorded()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                apply(t)
        except PartitionError:
            return None
        finally:
            trials += 1
            if on_trial:
                on_trial()
        if not t.axis_in_use(axis):
            return None
        d = _delta(base_vals, base_assign, t, axis)
        return (*d, t.conflicts_recorded() - before) if len(d[0]) else None

    # atoms: inputs first (one each), then parameter groups (repeated layers tied) in parameter order
    names = [n for n in g.name_to_vid if n.startswith("inputs.")]
    groups: dict = {}
    for n in g.name_to_vid:
        if n.startswith("params."):
            groups.setdefault((_pattern(n), g.shapes[g.name_to_vid[n]]), []).append(n)
    atoms = [((n,), n) for n in names] + [(tuple(ms), pat if len(ms) > 1 else ms[0]) for (pat, _), ms in
                                          groups.items()]
    for members, label in atoms:
        vids = [g.name_to_vid[m] for m in members]
        if not all(undecided(base_vals[g.canon[v]]) for v in vids):
            continue
        for d in range(len(g.shapes[vids[0]])):
            if g.shapes[vids[0]][d] <= 1 or any(ctx.local_dim(v, d) % k for v in vids):
                continue
            canon = np.array([g.canon[v] for v in vids])
            home = next((a for a in actions if a.kind == "class" and _covers(a, canon, d)), None)
            if home is not None:
                home.members.append(f"{label} dim {d}")
                continue
            seeds = tuple((m, d) for m in members)
            got = trial(lambda c, seeds=seeds: c.seed_and_propagate(axis, list(seeds), name))
            if got is None:
                continue
            vals, states, ops, assign, nconf = got
            actions.append(Action(axis, f"tile {label} dim {d}", "class", seeds, (), vals, states, ops, assign,
                                  nconf, [f"{label} dim {d}"]))
    # presets (macro-actions) and completions
    for label, kind, tactics in presets:
        got = trial(lambda c, tactics=tactics: [t.apply(c) for t in tactics])
        if got is None:
            continue
        vals, states, ops, assign, nconf = got
        actions.append(Action(axis, label, kind, (), tuple(tactics), vals, states, ops, assign, nconf))
    n = len(actions)
    comp = np.ones((n, n), dtype=bool)
    for i in range(n):
        for j in range(i + 1, n):
            comp[i, j] = comp[j, i] = _compatible(actions[i], actions[j])
    return AxisSpace(axis, actions, comp, trials, time.perf_counter() - t0)


def _covers(a: Action, canon: np.ndarray, d: int) -> bool:
    pos = np.searchsorted(a.vals, canon)
    pos = np.minimum(pos, len(a.vals) - 1)
    return bool(np.all(a.vals[pos] == canon) and np.all(a.states[pos] == d))


def _compatible(a: Action, b: Action) -> bool:
    """Do the two deltas agree wherever they overlap (no value or op decided two ways)?"""
    if a.kind == "zero" or b.kind == "zero":
        return a.kind != b.kind          # one completion per axis; a completion composes with anything else
    _, ia, ib = np.intersect1d(a.vals, b.vals, assume_unique=True, return_indices=True)
    if np.any(a.states[ia] != b.states[ib]):
        return False
    _, ia, ib = np.intersect1d(a.ops, b.ops, assume_unique=True, return_indices=True)
    return not np.any(a.assign[ia] != b.assign[ib])


def axis_candidates(space: AxisSpace, max_size: int = 3) -> list:
    """Every set of pairwise compatible non-completion actions (up to max_size), each with no completion or one:
    tuples of action indices, the completion last. The empty set (the axis left replicated) comes first."""
    acts = space.actions
    main = [i for i, a in enumerate(acts) if a.kind != "zero"]
    zeros = [i for i, a in enumerate(acts) if a.kind == "zero"]
    sets = [()]

    def grow(cur, start):
        for pos in range(start, len(main)):
            i = main[pos]
            if all(space.compatible[i, j] for j in cur):
                nxt = cur + (i,)
                sets.append(nxt)
                if len(nxt) < max_size:
                    grow(nxt, pos + 1)

    grow((), 0)
    # among candidates with one union of decisions, keep the one of fewest actions, presets before classes
    sets.sort(key=lambda s: (len(s), sum(acts[i].kind == "class" for i in s)))
    out, seen = [], set()
    for s in sets:
        for z in [None] + zeros:
            cand = s + ((z,) if z is not None else ())
            sig = _signature(acts, cand)
            if sig in seen:
                continue
            seen.add(sig)
            out.append(cand)
    return out


def _signature(acts, cand) -> int:
    """Candidates whose union of deltas is the same (megatron and its two classes) are one candidate."""
    if not cand:
        return hash(())
    vals = np.concatenate([acts[i].vals for i in cand])
    states = np.concatenate([acts[i].states for i in cand])
    key = np.unique(vals * 64 + states + 8)
    return hash(key.tobytes())


def union(acts, cand, base_vals: np.ndarray, base_assign: np.ndarray) -> tuple:
    """The decisions of a candidate on its axis: its actions' deltas applied in order, the first decision winning
    (as propagation keeps the first state it sets)."""
    vals, assign = base_vals.copy(), base_assign.copy()
    for i in cand:
        a = acts[i]
        free = undecided(vals[a.vals])
        vals[a.vals[free]] = a.states[free]
        free = undecided(assign[a.ops])
        assign[a.ops[free]] = a.assign[free]
    return vals, assign
