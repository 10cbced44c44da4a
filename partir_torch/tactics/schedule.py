"""Schedules: an ordered list of tactics (a tactic may itself be a list, as presets return)."""
from __future__ import annotations

from ..errors import PartitionError
from .base import CaptureRewrite, Tactic


def flatten_schedule(schedule) -> list:
    if not isinstance(schedule, (list, tuple)):
        schedule = [schedule]
    out = []
    for t in schedule:
        if isinstance(t, (list, tuple)):
            out += flatten_schedule(t)
        elif isinstance(t, (Tactic, CaptureRewrite)):
            out.append(t)
        else:
            raise PartitionError(f"schedule entry {t!r} is not a tactic (an object with name, axis and apply(ctx), "
                                 f"e.g. pt.ManualPartition or a pt.tactics preset) nor a capture rewrite "
                                 f"(mixed_precision, remat).")
    names = [t.name for t in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise PartitionError(f"schedule: tactic names must be unique so explain() can tell them apart; "
                             f"{sorted(dup)} appear more than once. Pass name=... to each.")
    return out
