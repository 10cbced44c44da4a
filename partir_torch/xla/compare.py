"""partir's own per-device collectives next to those of XLA's partitioned HLO, per kind and mesh axis.

partir's side is the lowered program (`prog.collectives()` as lowering records them; lowering needs no process
group and nothing of the runtime). XLA's side is parsed from its post-partitioning HLO (hlo.py). Bytes follow one
convention on both sides (CollectiveRecord: the full array along the axis). The plan is carried out when every
kind/axis partir uses appears in XLA's program and, per axis, the bytes agree within `tolerance`; XLA's
collectives of a kind/axis partir does not use are listed as extra.
"""
from __future__ import annotations

from dataclasses import dataclass

from tabulate import tabulate


@dataclass
class Comparison:
    rows: list            # [kind, axis, partir count, partir bytes, xla count, xla bytes]
    axis_bytes: dict      # axis -> (partir bytes, xla bytes)
    missing: list         # (kind, axis) partir uses and XLA's program lacks
    extra: list           # (kind, axis, count, bytes) in XLA's program only
    tolerance: float
    host_ops: list = None   # ops torch-xla ran on the host: the step was split, XLA's side is incomplete

    @property
    def extra_bytes(self) -> int:
        return sum(b for *_, b in self.extra)

    @property
    def partir_bytes(self) -> int:
        return sum(p for p, _ in self.axis_bytes.values())

    def axis_errors(self) -> dict:
        """axis -> relative difference of XLA's bytes from partir's (over the kinds partir uses on the axis)."""
        return {a: abs(x - p) / p if p else float(x > 0) for a, (p, x) in self.axis_bytes.items()}

    @property
    def ok(self) -> bool:
        """The whole step is one XLA program, every partir kind/axis is in it, bytes per axis within tolerance,
        extra bytes within tolerance of partir's total."""
        bytes_ok = all(e <= self.tolerance for e in self.axis_errors().values())
        return not self.host_ops and not self.missing and bytes_ok and \
            self.extra_bytes <= self.tolerance * max(self.partir_bytes, 1)

    def summary_line(self) -> str:
        """What differs, on one line: axes whose bytes differ beyond the tolerance, XLA's extra collectives, the
        kinds it lacks."""
        err = self.axis_errors()
        parts = [f"{a} {p:,} B in partir's plan vs {x:,} B in XLA's" for a, (p, x) in self.axis_bytes.items()
                 if err[a] > self.tolerance]
        if self.extra:
            parts.append(f"extra {', '.join(f'{k}[{a}] x{n} {b:,} B' for k, a, n, b in self.extra)}")
        if self.missing:
            parts.append(f"missing {', '.join(f'{k}[{a}]' for k, a in self.missing)}")
        if self.host_ops:
            parts.append(f"ops on the host {', '.join(self.host_ops)}")
        return "; ".join(parts) or "carried out"

    def table(self) -> str:
        body = tabulate(self.rows, headers=["kind", "axis", "partir n", "partir bytes", "xla n", "xla bytes"],
                        tablefmt="simple", intfmt=",")
        err = self.axis_errors()
        lines = [body, "bytes per axis (kinds partir uses): " + ", ".join(
            f"{a} {p:,} vs {x:,} ({100 * err[a]:.1f}%)" for a, (p, x) in self.axis_bytes.items())]
        if self.missing:
            lines.append("MISSING in XLA's program: " + ", ".join(f"{k}[{a}]" for k, a in self.missing))
        if self.extra:
            lines.append(f"extra in XLA's program ({self.extra_bytes:,} B, "
                         f"{100 * self.extra_bytes / max(self.partir_bytes, 1):.1f}% of partir's bytes): "
                         + ", ".join(f"{k}[{a}] x{n} {b:,} B" for k, a, n, b in self.extra))
        if self.host_ops:
            lines.append("ops run on the host (the step is split; XLA's side shows the largest program only): "
                         + ", ".join(self.host_ops))
        lines.append(f"plan carried out: {'yes' if self.ok else 'NO'} (tolerance {100 * self.tolerance:.0f}%)")
        return "\n".join(lines)

    __str__ = table


def _by_kind_axis(records) -> dict:
    out: dict = {}
    for r in records:
        if r.axis == "-":      # groups of one device move nothing
            continue
        n, b = out.get((r.kind, r.axis), (0, 0))
        out[(r.kind, r.axis)] = (n + 1, b + r.nbytes)
    return out


def compare(plan, xla_records, tolerance: float = 0.05, host_ops=()) -> Comparison:
    ours = _by_kind_axis(plan.lowered().records)
    theirs = _by_kind_axis(xla_records)
    rows, axis_bytes, missing, extra = [], {}, [], []
    for key in sorted(set(ours) | set(theirs)):
        (pn, pb), (xn, xb) = ours.get(key, (0, 0)), theirs.get(key, (0, 0))
        rows.append([key[0], key[1], pn, pb, xn, xb])
        if key in ours:
            p, x = axis_bytes.get(key[1], (0, 0))
            axis_bytes[key[1]] = (p + pb, x + xb)
            if key not in theirs:
                missing.append(key)
        else:
            extra.append((key[0], key[1], xn, xb))
    return Comparison(rows, axis_bytes, missing, extra, tolerance, list(host_ops))
