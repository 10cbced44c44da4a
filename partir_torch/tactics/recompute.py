"""Recomputation for the automatic tactic: when no plan it searched fits the memory limit, the step is captured
again with the repeated blocks checkpointed (tactics.remat), selective first, then full, and searched again.

Recomputation acts at capture (memory.py), before any tactic runs, so the automatic tactic cannot try it by itself;
partition() calls :func:`recompute_to_fit` with a function that captures and plans a schedule. Each policy tried
costs one more capture and search. The search report (prog.search_report()) and one warning say what was chosen.
"""
from __future__ import annotations

import torch

from ..errors import warn
from ..sim.report import _bytes
from .memory import Remat

TRIED = ("selective", "full")      # memory.POLICIES, least recomputation first: the first that fits is kept


def repeated_blocks(model) -> str | None:
    """The glob naming the repeated blocks of ``model`` (the children of its largest nn.ModuleList of one module
    class, e.g. "layers.*" or "model.layers.*"), None when it has none.

    >>> repeated_blocks(torch.nn.Sequential())    # no ModuleList
    """
    best, size = None, 0
    for fqn, m in model.named_modules():
        if not fqn or not isinstance(m, torch.nn.ModuleList) or len(m) < 2:
            continue
        if len({type(c) for c in m}) != 1:
            continue
        n = sum(p.numel() for p in m.parameters())
        if n > size:
            best, size = f"{fqn}.*", n
    return best


def _short_of(planned) -> list:
    """The automatic searches of ``planned`` that found no plan within their memory limit."""
    return [r for r in planned.searches if not r.within_limit]


def recompute_to_fit(planned, tactics: list, model, replan, can_rewrite: bool):
    """``planned``, or when one of its automatic searches found no plan within its limit, the plan of ``tactics``
    with the repeated blocks recomputed (TRIED policies in order; the first whose searches all fit). ``replan``:
    a list of tactics -> Plan (capture and plan). ``can_rewrite``: a training step to rewrite (loss_fn given)."""
    short = _short_of(planned)
    if not short or any(isinstance(t, Remat) for t in tactics):
        return planned
    names = ", ".join(r.tactic for r in short)
    selector = repeated_blocks(model) if can_rewrite else None
    if selector is None:
        why = ("the step has no backward to recompute for (no loss_fn)" if not can_rewrite else
               "the model has no repeated blocks (an nn.ModuleList of one module class) to checkpoint")
        warn(f"partir_torch: {names}: no plan fits the memory limit and recomputation was not tried: {why}. "
             f"Add tactics.remat('<module glob>') to the schedule, or a larger mesh.", stacklevel=3)
        return planned
    none = _peak(planned)
    tried, best = [], (none, "none", planned)
    for policy in TRIED:
        candidate = replan(list(tactics) + [Remat(selector, policy)])
        tried.append(f"{policy}: {_bytes(_peak(candidate))}")
        if not _short_of(candidate):
            return _said(candidate, names, f"no plan fit the memory limit without recomputation; chose "
                                           f"remat({selector!r}, policy={policy!r}) (peak per device with "
                                           f"none: {_bytes(none)}, {', '.join(tried)})")
        best = min(best, (_peak(candidate), policy, candidate), key=lambda b: b[0])
    return _said(best[2], names, f"no plan fits the memory limit, with or without recomputing {selector!r} (peak "
                                 f"per device with none: {_bytes(none)}, {', '.join(tried)}); kept "
                                 f"the least peak (recomputation: {best[1]}). Use a larger mesh, a smaller batch "
                                 f"or a higher memory_limit")


def _peak(planned) -> float:
    """The largest simulated peak of the plans the automatic searches of ``planned`` chose."""
    return max((r.chosen.sim.peak_memory_bytes for r in planned.searches if r.chosen is not None), default=0.0)


def _said(planned, names: str, text: str):
    """``planned`` with ``text`` in its search reports (prog.search_report()) and in one warning."""
    for r in planned.searches:
        r.recompute = text
    warn(f"partir_torch: {names}: {text}.", stacklevel=4)
    return planned
