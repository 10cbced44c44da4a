"""One program for every sequence length and batch size: symbolic dims over the per-shape programs (issues 22, 40).

Dynamic padding (each batch padded to its longest sequence, as Hugging Face's data collators do) gives train_step a
new sequence length at almost every step, and the last batch of an epoch is smaller. shapes.py partitions a new
shape in full (capture, plan, lowering: about what partition() cost). This module makes such sizes symbols
(symbols.py says which): declared up front (Options(dynamic=...): at partition), or learned from the second
distinct size of a dim (train_step), with the batch dim a symbol too by default:

- A *family* is every input signature that differs from the first program's only at the positions of its symbols
  (each symbol one size at all its positions: the sequence dims of input_ids, labels and attention_mask at once).
- Its symbols are fitted at once: the step is traced with the symbols symbolic, for what the model's Python
  decides from them (capture/dims.py: `s <= 64` where a position table is sliced, `Ne(s, 4)`); programs are
  partitioned in full at the corners of a grid of two sizes per symbol (the first program's and the size seen,
  else one a multiple of the mesh's size away, where the guards hold) and at one point off the grid; and those
  programs are fitted as one program multilinear in the symbols (lower/template.py), checked at that point. With
  one symbol that is the new length's program plus one built at a third length; with two (batch, length), three.
- From then on, a signature of the family whose guards hold is instantiated from the template: its integers written
  into a copy of the program, no capture, plan or lowering (prog.shapes(): "instance of"). A size that breaks a
  guard, or at which a size of the program is fractional (a sequence-parallel axis that does not divide it), is
  partitioned in full, as any new shape; that is said once per family with the reason.
- A family whose programs are not one graph (the plan changed with the size: an uneven split, an automatic tactic
  that decided otherwise) or whose symbolic trace fails keeps a program per shape; said once, with where. Declared
  symbols raise that as a PartitionError at partition instead (the declaration cannot hold).

The programs at the grid's sizes are built on the call's batch resized (symbols.resized_batch): by the Executor for
train_step (loss_and_grads, prog(...)), by the Evaluator for eval_step and forward (each kind its own families,
the same rule). Not covered: steps that branch on tensor values (one program per path: paths.py) and pipelined programs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import PartitionError, user_stacklevel, warn
from ..lower.template import DimTemplate, Grid
from .symbols import Symbols, candidates, learned


@dataclass
class Family:
    """The programs of one family (by their sizes, one per symbol) and, once fitted, its template and guards."""

    symbols: Symbols
    points: dict = field(default_factory=dict)  # sizes -> ShapeProgram partitioned in full
    template: DimTemplate | None = None
    guards: object = None                      # capture.dims.DimGuards
    failed: str = ""                           # why the family keeps a program per shape
    built: list = field(default_factory=list)  # the sizes partitioned for the fit (not seen in a call)
    said: set = field(default_factory=set)     # what was said (once each)


class SymbolicDims:
    """The families of one kind of program (see the module docstring). step: the size a fit moves a symbol by
    when it builds a program at a size not seen (the mesh's size times the micro-batches: it keeps divisibility);
    batch: whether the batch dim joins every learned family."""

    def __init__(self, first, what: str, sig_of=lambda entry: entry.signature, step: int = 1, batch: bool = False):
        self.first, self.what, self.sig_of, self.step, self.batch = first, what, sig_of, step, batch
        self.families: dict = {}                # Symbols -> Family
        self.current: Symbols | None = None     # the latest family's symbols (learned ones extend them)

    def _sizes(self, fam: Family, sig):
        return fam.symbols.sizes(self.sig_of(self.first), sig)

    def instance(self, sig, make_entry):
        """The program for sig instantiated from its family's template, or None (partition it in full).
        make_entry(sig, plan, canonical Lowered, seconds, sizes) -> ShapeProgram."""
        for fam in self.families.values():
            s = self._sizes(fam, sig) if fam.template is not None else None
            if s is None:
                continue
            t0 = time.perf_counter()
            why = fam.guards.check(s)
            low = fam.template.instantiate(s) if why is None else None
            if why is not None or isinstance(low, str):
                reason = (f"the model's trace holds only where {why}" if why is not None else low)
                self._say(fam, "full", f"{self.what}: sizes {_show_sizes(fam, s)} are partitioned in full, not "
                                       f"instantiated from the symbolic dims: {reason} (said once).")
                return None
            base = fam.points[fam.template.points[0]]
            return make_entry(sig, base.plan, low, time.perf_counter() - t0, s[0] if len(s) == 1 else s)
        return None

    def declare(self, symbols: Symbols, trace_guards, make_at) -> None:
        """Declared symbols (Options.dynamic), fitted now (at partition); a PartitionError when they cannot be."""
        fam = self._new_family(symbols)
        why = self._fit_now(fam, None, trace_guards, make_at)
        if why:
            raise PartitionError(f"partition: the dims declared dynamic ({symbols}) cannot be one program: {why}. "
                                 f"Leave such a dim out of dynamic= (each size is then partitioned when first "
                                 f"seen), or declare it static ({{dim: None}}).")
        self._say(fam, "on", self._on_text(fam))

    def built(self, entry, trace_guards, make_at) -> None:
        """entry: a program just partitioned in full. Its family learned (symbols.learned) and fitted at once:
        make_at (sizes' signature -> ShapeProgram) builds the grid's other programs; trace_guards(Symbols) ->
        DimGuards."""
        sig = self.sig_of(entry)
        for fam in self.families.values():
            s = self._sizes(fam, sig)
            if s is not None and (fam.template is not None or fam.failed):
                return             # a size the family refused: a program of its own
        symbols = learned(self.sig_of(self.first), sig, self.current, self.batch)
        if symbols is None:
            return
        fam = self.families.get(symbols) or self._new_family(symbols)
        fam.points[self._sizes(fam, sig)] = entry
        t0 = time.perf_counter()
        why = self._fit_now(fam, entry, trace_guards, make_at)
        if why:
            self._fail(fam, why)
            return
        entry.symbolic_s = time.perf_counter() - t0
        self._say(fam, "on", self._on_text(fam))

    def _new_family(self, symbols: Symbols) -> Family:
        fam = self.families[symbols] = Family(symbols)
        fam.points[self._sizes(fam, self.sig_of(self.first))] = self.first
        for other in self.families.values():     # programs built for another family that are points of this one
            for e in other.points.values():
                s = self._sizes(fam, self.sig_of(e))
                if s is not None:
                    fam.points.setdefault(s, e)
        self.current = symbols
        return fam

    def _fit_now(self, fam: Family, entry, trace_guards, make_at) -> str:
        """Trace the guards, build the grid's missing programs, fit: "" when fitted, else why not."""
        try:
            guards = trace_guards(fam.symbols)
        except Exception as e:  # noqa: BLE001 - said once (or raised, declared); the family keeps a program per shape
            return f"the step could not be traced with the sizes as symbols: {str(e).strip().splitlines()[0][:300]}"
        first = self._sizes(fam, self.sig_of(self.first))
        seen = self._sizes(fam, self.sig_of(entry)) if entry is not None else first
        grid, check = _grid(first, seen, guards, self.step)
        if grid is None:
            return f"the model's trace fixes the sizes: no sizes near {first} satisfy its guards ({guards})"
        for s in grid.corner_points() + [check]:
            if s not in fam.points:
                try:
                    fam.points[s] = make_at(fam.symbols.signature(self.sig_of(self.first), s))
                except PartitionError as e:
                    return f"partitioning at sizes {_show_sizes(fam, s)} failed: {str(e).splitlines()[0]}"
                fam.built.append(s)
        return self._fit(fam, grid, [check], guards)

    def _fit(self, fam: Family, grid: Grid, checks: list, guards) -> str:
        pts = grid.corner_points() + checks
        fitted = _differing_constant([fam.points[s].plan.captured.consts for s in pts]) or \
            DimTemplate.fit([(s, fam.points[s].plan.lowered()) for s in pts], grid)
        if isinstance(fitted, str):
            return f"its programs at sizes {', '.join(_show_sizes(fam, s) for s in pts)} are not one program in " \
                   f"the sizes: {fitted}"
        bad = [p for p in fitted.points if guards.check(p) is not None]
        if bad:
            return f"the trace specialised the sizes ({guards.check(bad[0])})"
        fam.template, fam.guards = fitted, guards
        # only the base program's plan is read from now on (instance): the others are held by the cache of
        # programs alone, within its memory bound (shapes.ShapeCache)
        base = fitted.points[0]
        fam.points = {base: fam.points[base]}
        return ""

    def _on_text(self, fam: Family) -> str:
        pts = ", ".join(_show_sizes(fam, s) for s in fam.template.points)
        built = (f" ({len(fam.built)} of them partitioned for the fit: {', '.join(_show_sizes(fam, s) for s in fam.built)})"
                 if fam.built else "")
        return (f"{self.what}: {fam.symbols} are symbolic from now on: the programs at {pts}{built} are one "
                f"program in them, and a new size is instantiated from it without capture where the model's guards "
                f"hold ({fam.guards}). prog.shapes() lists the instances.")

    def _fail(self, fam: Family, why: str) -> None:
        fam.failed = why
        fam.points = {}            # its programs are held by the cache of programs alone
        self._say(fam, "fail", f"{self.what}: {fam.symbols} stay a program per shape: {why} (said once).")

    @staticmethod
    def _say(fam: Family, key: str, text: str) -> None:
        if key not in fam.said:
            fam.said.add(key)
            warn(text, stacklevel=user_stacklevel())


def _grid(first: tuple, seen: tuple, guards, step: int):
    """(Grid, check point) for a fit: per symbol its first size and the size seen (else a candidate), and a point
    off the grid in every symbol; (None, None) when the guards leave no such sizes."""
    lo, hi, third = [], [], []
    for j, (v0, v1) in enumerate(zip(first, seen)):
        at = lambda v: tuple(v if k == j else x for k, x in enumerate(first))   # noqa: E731
        if v1 == v0:
            v1 = next((v for v in candidates(v0, None, step) if guards.check(at(v)) is None), None)
            if v1 is None:
                return None, None
        lo.append(v0), hi.append(v1)
        third.append([v for v in candidates(v0, v1, step) if guards.check(at(v)) is None])
    check = next((c for c in _diagonal(third) if guards.check(c) is None), None)
    return (Grid(tuple(lo), tuple(hi)), check) if check is not None else (None, None)


def _diagonal(options: list):
    """Points taking the k-th candidate of every symbol (the k-th or the last, when one has fewer)."""
    if any(not o for o in options):
        return
    for k in range(max(len(o) for o in options)):
        yield tuple(o[min(k, len(o) - 1)] for o in options)


def _show_sizes(fam: Family, s) -> str:
    s = (s,) if isinstance(s, int) else s
    return s and (str(s[0]) if len(s) == 1 else "(" + ", ".join(f"{n}={v}" for n, v in zip(fam.symbols.names, s)) +
                  ")")


def _differing_constant(consts: list) -> str:
    """Why the programs are not one program in s when a tensor the step creates (a constant of the capture, fed to
    every call: `torch.tensor(1 / T)`) differs between them, else ""."""
    for name, v in consts[0].items():
        for c in consts[1:]:
            w = c.get(name)
            if w is None or w.shape != v.shape or w.dtype != v.dtype or not torch.equal(w, v):
                return f"the constant {name}, which the step creates, differs between the lengths"
    return ""
