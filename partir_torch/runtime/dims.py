"""One program for every sequence length: a symbolic dim over the per-shape programs (issue 22).

Dynamic padding (each batch padded to its longest sequence, as Hugging Face's data collators do) gives train_step a
new sequence length at almost every step. shapes.py partitions each new shape in full (capture, plan, lowering:
about what partition() cost). This module makes such a size a symbol after three of them:

- A *family* is every input signature that differs from the first program's only in sizes that are all one value
  s (the sequence dims of input_ids, labels and attention_mask at once), keyed by those (input, dim) positions.
- Each new shape of a family is partitioned in full, as shapes.py does, until three lengths have programs. Their
  per-device programs are then fitted as one program in s (lower/template.py: every integer that differs between
  them is affine in s, checked on all three), and the step is traced once more with s a symbol, for what the model's
  Python decides from s (capture/dims.py: `s <= 64` where a position table is sliced, `Ne(s, 4)`).
- From then on, a length of the family whose guards hold is instantiated from the template: its integers written
  into a copy of the program, no capture, plan or lowering (prog.shapes(): "instance of s"). A length that breaks a
  guard, or at which a size of the program is fractional (a sequence-parallel axis that does not divide it), is
  partitioned in full, as any new shape; that is said once per family with the reason.
- A family whose programs are not one graph in s (the plan changed with the length: an uneven split, an automatic
  tactic that decided otherwise) or whose symbolic trace fails keeps a program per shape; said once, with where.

The Executor's train program and the Evaluator's eval_step and forward programs (each kind its own families) use it.
Not covered: steps that branch on tensor values (one program per path: paths.py) and pipelined programs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import user_stacklevel, warn
from ..lower.template import DimTemplate

_MAX_TRIES = 3     # fits tried on a family (each new full program retries) before it keeps a program per shape


def positions(first_sig: tuple, sig: tuple):
    """((input, dim) pairs where sig differs from first_sig, s), when they all hold one size s (and held one size
    in first_sig); None otherwise (another rank or dtype, or two sizes that vary apart)."""
    if len(sig) != len(first_sig):
        return None
    where, new, old = [], set(), set()
    for i, ((shape, dtype), (was, was_dtype)) in enumerate(zip(sig, first_sig)):
        if dtype != was_dtype or len(shape) != len(was):
            return None
        for d, (n, m) in enumerate(zip(shape, was)):
            if n != m:
                where.append((i, d))
                new.add(n)
                old.add(m)
    if not where or len(new) != 1 or len(old) != 1:
        return None
    return tuple(where), new.pop()


@dataclass
class Family:
    """The programs of one family and, once fitted, its template and guards."""

    where: tuple                               # (input, dim) positions of s
    points: list = field(default_factory=list)  # (s, ShapeProgram) partitioned in full
    template: DimTemplate | None = None
    guards: object = None                      # capture.dims.DimGuards
    failed: str = ""                           # why the family keeps a program per shape
    tries: int = 0
    said: set = field(default_factory=set)     # what was said (once each)


class SymbolicDims:
    """The families of an Executor's train program (see the module docstring)."""

    def __init__(self, first, what: str, sig_of=lambda entry: entry.signature):
        self.first, self.what, self.sig_of = first, what, sig_of     # sig_of: a ShapeProgram's input signature
        self.families: dict = {}

    def _family(self, sig):
        got = positions(self.sig_of(self.first), sig)
        if got is None:
            return None, None
        where, s = got
        fam = self.families.get(where)
        if fam is None:
            fam = self.families[where] = Family(where, [(s_of(self.sig_of(self.first), where), self.first)])
        return fam, s

    def instance(self, sig, make_entry):
        """The program for sig instantiated from its family's template, or None (partition it in full).
        make_entry(sig, plan, canonical Lowered, seconds, s) -> ShapeProgram."""
        fam, s = self._family(sig)
        if fam is None or fam.template is None:
            return None
        t0 = time.perf_counter()
        why = fam.guards.check(s)
        low = fam.template.instantiate(s) if why is None else None
        if why is not None or isinstance(low, str):
            reason = (f"the model's trace holds only where {why}" if why is not None else low)
            self._say(fam, "full", f"{self.what}: length {s} is partitioned in full, not instantiated from the "
                                   f"symbolic dim: {reason} (said once).")
            return None
        base = next(e for p, e in fam.points if p == fam.template.points[0])
        return make_entry(sig, base.plan, low, time.perf_counter() - t0, s)

    def built(self, entry, trace_guards) -> None:
        """entry: a program just partitioned in full. When its family now has three lengths, fit the template and
        trace the guards (trace_guards(where) -> DimGuards; its cost is added to entry.symbolic_s)."""
        fam, s = self._family(self.sig_of(entry))
        if fam is None or fam.template is not None or fam.failed:
            return
        fam.points.append((s, entry))
        if len({p for p, _ in fam.points}) < 3:
            return
        t0 = time.perf_counter()
        last = fam.points[-3:]
        fitted = _differing_constant([e.plan.captured.consts for _, e in last]) or \
            DimTemplate.fit([(p, e.plan.lowered()) for p, e in last])
        if isinstance(fitted, str):
            fam.tries += 1
            if fam.tries >= _MAX_TRIES:
                self._fail(fam, f"its programs at lengths {sorted(p for p, _ in fam.points)} are not one program "
                                f"in the length: {fitted}")
            return
        try:
            guards = trace_guards(fam.where)
        except Exception as e:  # noqa: BLE001 - said once; the family keeps a program per shape
            self._fail(fam, f"the step could not be traced with the length as a symbol: "
                            f"{str(e).strip().splitlines()[0][:300]}")
            return
        entry.symbolic_s = time.perf_counter() - t0
        bad = [p for p in fitted.points if guards.check(p) is not None]
        if bad:
            self._fail(fam, f"the trace specialised the length ({guards.check(bad[0])})")
            return
        fam.template, fam.guards = fitted, guards
        self._say(fam, "on", f"{self.what}: dims {_show(fam.where)} are one symbol s from now on: the programs at "
                             f"lengths {', '.join(map(str, fitted.points))} are one program in s, and a new length is "
                             f"instantiated from it without capture where the model's guards hold ({guards}); "
                             f"fitted and traced in {entry.symbolic_s:.2f} s. prog.shapes() lists the instances.")

    def _fail(self, fam: Family, why: str) -> None:
        fam.failed = why
        self._say(fam, "fail", f"{self.what}: dims {_show(fam.where)} stay a program per shape: {why} (said once).")

    @staticmethod
    def _say(fam: Family, key: str, text: str) -> None:
        if key not in fam.said:
            fam.said.add(key)
            warn(text, stacklevel=user_stacklevel())


def _differing_constant(consts: list) -> str:
    """Why the programs are not one program in s when a tensor the step creates (a constant of the capture, fed to
    every call: `torch.tensor(1 / T)`) differs between them, else ""."""
    for name, v in consts[0].items():
        for c in consts[1:]:
            w = c.get(name)
            if w is None or w.shape != v.shape or w.dtype != v.dtype or not torch.equal(w, v):
                return f"the constant {name}, which the step creates, differs between the lengths"
    return ""


def s_of(sig: tuple, where: tuple) -> int:
    i, d = where[0]
    return sig[i][0][d]


def _show(where) -> str:
    return ", ".join(f"inputs.{i} dim {d}" for i, d in where)
