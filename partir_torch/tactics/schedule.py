"""Schedules: an ordered list of tactics (a tactic may itself be a list, as presets return)."""
from __future__ import annotations

from ..errors import PartitionError


def flatten_schedule(schedule) -> list:
    if not isinstance(schedule, (list, tuple)):
        schedule = [schedule]
    out = []
    for t in schedule:
        if isinstance(t, (list, tuple)):
            out += flatten_schedule(t)
        elif hasattr(t, "apply"):
            out.append(t)
        else:
            raise PartitionError(f"schedule entry {t!r} is not a tactic (an object with apply(ctx), e.g. "
                                 f"pt.ManualPartition or a pt.tactics preset).")
    names = [t.name for t in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise PartitionError(f"schedule: tactic names must be unique so explain() can tell them apart; "
                             f"{sorted(dup)} appear more than once. Pass name=... to each.")
    return out
