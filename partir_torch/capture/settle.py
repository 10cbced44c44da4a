"""Models that change themselves on their first call.

BigBird with fewer tokens than block-sparse attention covers switches to full attention inside its first forward
(`set_attention_type("original_full")`) and builds a new self-attention module per layer; the new modules' nn.Linear
inits draw from the global generator before the old projections are put back in. The trace of the step *is* that
first call: traced as is, the step would hold those draws (dead values) and make them at every step, while eager
makes them on its first call only, so from the second step on every later draw (dropout) would differ.

capture() therefore compares the module tree before and after its trace. When it changed, the step is traced
again on the changed model (the steady step, what eager runs from its second call on), and the draws the first
trace made beyond the steady one become the *first-call prelude*: a small GraphModule the runtime runs once, before
the first step, so the generator moves as eager's does on its first call:

    before = snapshot(model)
    ... trace ...                                  # the model rebuilt a module
    moved = changes(before, snapshot(model))       # ["bert.encoder.layer.0.attention.self: A -> B", ...]
    ... trace again ...                            # the steady step
    prelude, exact = first_call_draws(first_gm, steady_gm)

The prelude is exactly eager's first call when the extra draws come before every draw the steady step also makes
(BigBird: the switch happens before the embeddings' dropout); otherwise the first step's draws are in another
order than eager's (the generator still ends where eager's does, so every later step is eager's), which capture()
says in its warning. A change that adds parameters or buffers cannot be followed: their initial values were drawn
inside the trace, on fake tensors, so the program cannot hold them; that raises, naming them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..rules.tags import draws_random
from ..errors import PartitionError, source_line
from .tidy import LIKE


def snapshot(model: torch.nn.Module) -> dict:
    """What a first call may change: each submodule (by name: its object and class) and each parameter and buffer
    (by name: its tensor object)."""
    return {"modules": {name: (id(m), type(m).__name__) for name, m in model.named_modules()},
            "state": {name: id(t) for name, t in list(model.named_parameters()) + list(model.named_buffers())}}


def changes(before: dict, after: dict) -> list:
    """The submodules that were replaced, added or removed, one line each ("name: OldClass -> NewClass"), the
    outermost only (a replaced module's own children are part of it)."""
    old, new = before["modules"], after["modules"]
    moved = [n for n in list(old) + [n for n in new if n not in old] if old.get(n) != new.get(n)]
    lines = []
    for name in moved:
        a, b = old.get(name), new.get(name)
        if any(name.startswith(f"{m}.") or (not m and name) for m in moved if m != name):
            continue
        what = f"{a[1]} -> {b[1]}" if a and b else (f"added ({b[1]})" if b else f"removed ({a[1]})")
        lines.append(f"{name or '(the model)'}: {what}")
    return lines


def refuse_new_state(before: dict, model: torch.nn.Module, moved: list) -> None:
    """A parameter or buffer the first call created (a tensor object the model did not hold before) was initialised
    inside the trace, on fake tensors: the program cannot hold it as state, and eager would train it (or read it)
    from its random init on."""
    held = set(before["state"].values())
    new = [name for name, t in list(model.named_parameters()) + list(model.named_buffers()) if id(t) not in held]
    if not new:
        return
    shown = ", ".join(new[:6]) + (f" and {len(new) - 6} more" if len(new) > 6 else "")
    raise PartitionError(
        f"partition: the first call of {type(model).__name__} changed the model ({'; '.join(moved[:3])}"
        f"{' ...' if len(moved) > 3 else ''}) and created {len(new)} parameter(s) or buffer(s) that are not part of "
        f"the program's state: {shown}. Their initial values are drawn during that first call, which partition "
        f"traces on fake tensors, so partir_torch cannot hold them (eager would train them from that draw). Call "
        f"the model once eagerly on a batch before partition (and build its optimizer after that call), or create "
        f"these modules in __init__.")


def _draw_key(node: fx.Node) -> tuple:
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    return node.target, shape


@dataclass
class FirstCall:
    """The random draws of a model's first call beyond its steady step, for the runtime.

    extras: a GraphModule without inputs making them, drawn once before the first step when they precede every draw
    the steady step makes (BigBird: the switch comes first) or when that step is not the one run first (another
    input shape). lifted: when eager drew some of the step's own draws before them (BigBirdPegasus: the embeddings'
    dropout, then the switch), those draws are inputs of the steady step (`draws.<node>`, role "draw") that
    `draw(first)` makes at every call, in eager's order, with the extras among them on the first call only."""

    extras: fx.GraphModule
    lines: list                     # the user's source lines of the extra draws
    lifted: list = field(default_factory=list)     # names of the steady graph's draws made inputs (capture lifts)
    first: fx.GraphModule = None    # the first call's draws up to its last extra one, in order
    steady: fx.GraphModule = None   # the lifted draws alone, in order
    at: tuple = ()                  # per lifted draw, its output index in `first`
    exact: bool = True              # the first step's draws are in eager's order

    def before(self, first: bool, fed: bool) -> dict:
        """What the runtime draws before a call (`first`: the program's first call; `fed`: the call runs the steady
        step these draws were lifted from): the lifted draws' values (draw), else the extras on the first call."""
        if fed and self.lifted:
            return self.draw(first)
        if first:
            self.extras()
        return {}

    def draw(self, first: bool) -> dict:
        """node name -> value of each lifted draw (the step's input "draws.<name>"), drawn now, with the extras
        among them when `first`."""
        if first:
            got = self.first()
            return {name: got[i] for name, i in zip(self.lifted, self.at)}
        return dict(zip(self.lifted, self.steady()))


def first_call_draws(first: fx.GraphModule, steady: fx.GraphModule, can_lift: bool = True):
    """The random draws of the first call's graph that the steady graph does not make (matched in order, by op and
    shape), as a FirstCall (None when there are none). The steady step's draws that eager made before the last
    extra one are lifted when `can_lift` and they are drawn from templates alone (no state or input among the
    ops they read); else they stay in the step, the extras are drawn before it, and `exact` is False."""
    first_draws = [n for n in first.graph.nodes if draws_random(n)]
    steady_draws = [n for n in steady.graph.nodes if draws_random(n)]
    extra, shared, j = [], [], 0
    for n in first_draws:
        if j < len(steady_draws) and _draw_key(n) == _draw_key(steady_draws[j]):
            shared.append((n, steady_draws[j]))
            j += 1
        else:
            extra.append(n)
    if not extra:
        return None
    lines = list(dict.fromkeys(source_line(n) or str(n.target) for n in extra))
    fc = FirstCall(_program(extra), lines)
    last = first_draws.index(extra[-1])
    early = [(a, b) for a, b in shared if first_draws.index(a) < last]
    if early and can_lift and all(_from_templates(a) for a, _ in early):
        upto = first_draws[:last + 1]
        fc.lifted, fc.first, fc.steady = [b.name for _, b in early], _program(upto), _program([a for a, _ in early])
        fc.at = tuple(upto.index(a) for a, _ in early)
    fc.exact = not early or bool(fc.lifted)
    return fc


def _from_templates(node: fx.Node) -> bool:
    """Does the draw read only factories (a dropout mask's `empty_like(x)` template: x's shape alone), no state or
    input?"""
    stack, seen = list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen or n.target in LIKE:
            continue
        seen.add(n)
        if n.op == "placeholder" or draws_random(n):
            return False
        stack.extend(n.all_input_nodes)
    return True


def _program(draws: list) -> fx.GraphModule:
    """The draws with the ops they read (factories, detach), copied in graph order; a template `empty_like(x)`
    becomes the factory of x's static shape, and a placeholder they read (a draw shaped like the state) zeros of its
    shape: a draw consumes the generator by its shape alone."""
    needed, stack = set(), list(draws)
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes if n.target not in LIKE else ())
    graph, env = fx.Graph(), {}
    for n in draws[0].graph.nodes:
        if n not in needed:
            continue
        val = n.meta.get("val")
        if n.target in LIKE:
            target, value_at = LIKE[n.target]
            args = (list(val.shape),) if value_at is None else (list(val.shape), n.args[value_at])
            env[n] = graph.call_function(target, args, {"dtype": val.dtype, "device": val.device})
        elif n.op == "placeholder":
            env[n] = graph.call_function(torch.zeros, (tuple(val.shape),), {"dtype": val.dtype})
        else:
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[n] for n in draws))
    return fx.GraphModule(torch.nn.Module(), graph)
