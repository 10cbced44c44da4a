"""Small walks over captured graphs shared by the passes (capture rewrites, presets, lowering)."""
from __future__ import annotations

import contextlib
import gc

from ..contract import META_PHASE, META_TAG, META_TAGS, Phase, _reach
from ..errors import source_line  # noqa: F401  (re-exported for the capture passes)


def descendants(roots) -> set:
    """Every node that depends on the roots, the roots included."""
    return _reach(roots, lambda n: n.users)


def split_for_backward(gm, n, fwd: set, index: dict) -> bool:
    """Give the backward its own copy of forward node `n` (a parameter's view or cast) when both phases use it: a
    tiled parameter is then gathered once per phase and the gathered copy does not live from forward to
    backward (ZeRO-3's memory saving). Returns whether it split."""
    late = [u for u in n.users if u not in fwd and u.op != "output"]
    if not late or len(late) == len(n.users):
        return False
    with gm.graph.inserting_before(min(late, key=index.__getitem__)):
        dup = gm.graph.call_function(n.target, n.args, n.kwargs)
    dup.meta.update({k: v for k, v in n.meta.items() if k not in (META_TAG, META_TAGS)})
    dup.meta[META_PHASE] = Phase.BACKWARD
    for u in late:
        u.replace_input_with(n, dup)
    return True


@contextlib.contextmanager
def no_gc():
    """The cyclic garbage collector off during a bulk pass over a traced graph (the trace itself, propagation):
    the pass allocates many objects that live as long as the graph (nodes, fake tensors, tables), and each full
    collection walks all of them again, which made capture and partition time superlinear in the graph's size.
    The cycles a pass leaves go at the next automatic collection."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def memo_of_step(captured, name: str, make):
    """``make()`` once per captured step: a structural reading of its graph (the linear regions, the LoRA adapters)
    that tactics ask for again and again (the automatic search runs every preset once per axis) is kept with the
    Captured, read again if its graph was replaced or changed size. Callers must not mutate what it returns."""
    gm = captured.gm
    key = (id(gm), len(gm.graph.nodes))
    memo = captured.__dict__.setdefault("_partir_memo", {})
    hit = memo.get(name)
    if hit is None or hit[0] != key:
        hit = memo[name] = (key, make())
    return hit[1]
