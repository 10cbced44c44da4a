"""One program per path of a step that branches on tensor values (issue 26; capture/branches.py traces a path).

A step whose Python reads tensor values (`if not mask.any():`, layerdrop's `torch.rand([]) < p`, `.item()`) is
captured specialised to the values it read: its guards. Per input signature, the programs of the paths seen so far
hang off a trie over the guards (`PathTrie`): every call first computes the guards in trace order, each with its
small single-device program (Guard.program: the slice of the step that produces it, on the global batch and the
full state it reads, with the random draws that precede it), walking down the trie; a complete path selects its
partitioned program from the executor's ShapeCache (key: signature and guard values), an unseen value makes the
executor capture, plan and lower that path (as a new shape: runtime/shapes.py) on the state it holds, rewind the
generator and walk again. The draws the guards make (layerdrop's, and the dropout masks drawn before a guard) are
the step's own: its program takes them as inputs (`draws.<node>`), so nothing is drawn twice and the generator
ends where eager's does. Every rank computes the same values (the global batch, the same generator: checked with
the plan on real ranks), so every rank takes the same path, and the path is the one a single device would take.

Asserts on tensor values are no guards: their predicates are outputs of the step, verified after it (`verify`).

    trie = PathTrie()
    trie.insert(plan.captured.guards, key)            # each captured path
    values, key, env = guard_values(trie, real)       # key None: a path not captured yet
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InternalError, user_stacklevel, warn


@dataclass
class _Node:
    guard: object                                   # the Guard evaluated at this point of every path through here
    children: dict = field(default_factory=dict)    # guard value -> _Node, or a cache key (a complete path)


class PathTrie:
    """The paths captured for one input signature."""

    def __init__(self):
        self.root = None
        self.paths = 0

    def insert(self, guards: tuple, key) -> None:
        if not guards:
            raise InternalError("partir_torch: internal error while recording a path: the path has no guards.")
        if self.root is None:
            self.root = _Node(guards[0])
        node = self.root
        for i, g in enumerate(guards):
            if node.guard.node != g.node or node.guard.where != g.where:
                raise InternalError(f"partir_torch: internal error while recording a path: the step read {g.node} "
                                    f"({g.where}) where an earlier path read {node.guard.node} ({node.guard.where}) "
                                    f"after the same values, so the trace is not a function of its guards. Please "
                                    f"report this with the model.")
            if i == len(guards) - 1:
                if g.value not in node.children:
                    self.paths += 1
                node.children[g.value] = key
                return
            nxt = node.children.get(g.value)
            if not isinstance(nxt, _Node):
                nxt = node.children[g.value] = _Node(guards[i + 1])
            node = nxt

    def select(self, evaluate) -> tuple:
        """(the guard values of this call, the key of its path's program or None when not captured yet)."""
        node, values = self.root, []
        while isinstance(node, _Node):
            v = evaluate(node.guard)
            values.append(v)
            node = node.children.get(v)
        return tuple(values), node


def join(tries: dict, at, entry, values: tuple) -> None:
    """A program just captured (a ShapeProgram) for a step that branches: its path joins the trie tries[at];
    `values`: the guard values computed before its capture (a prefix of its path)."""
    guards = entry.plan.captured.guards
    if not guards:
        return
    entry.path = tuple(g.value for g in guards)
    if entry.path[:len(values)] != values:
        raise InternalError(f"partir_torch: internal error: the guards computed before the step gave "
                            f"{describe(guards, values)}, the capture of its path {describe(guards, entry.path)}. "
                            f"Please report this with the model.")
    tries.setdefault(at, PathTrie()).insert(guards, entry.key)


def guard_values(trie: PathTrie, real) -> tuple:
    """Walk `trie` with this call's values: (guard values, the path's cache key or None, env). The guards' draws
    advance the generator and are the step's own: env holds them by node name (the path's "draws.<name>" inputs)."""
    env: dict = {}
    values, key = trie.select(lambda g: g.evaluate(real, env))
    return values, key, env


def generator_state(device) -> tuple:
    """The generators a step draws from (CPU, and `device`'s if CUDA), to rewind them."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def rewind(state, device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def describe(guards, values) -> str:
    """if not mask.any() -> False; ..."""
    return "; ".join(f"{g.where or g.node} -> {v}" for g, v in zip(guards, values))


def verify(checks, output_names, outs, rank0, what: str) -> None:
    """The step's asserts on tensor values (capture/branches.py's Checks), from its outputs: an AssertionError
    naming the line when one did not hold (the step has run: its update is applied, unlike eager's)."""
    for c in checks:
        got = bool(rank0(outs[output_names.index(c.output)]).item())
        if got != c.expect:
            raise AssertionError(f"{what}: the model's assert at {c.where} failed (its condition was "
                                 f"{'true' if got else 'false'}). partir_torch checks asserts on tensor values "
                                 f"after the step, from the step's own outputs, so this step's update has been "
                                 f"applied; eager PyTorch would have raised before it.")


def say_new(what: str, entry, count: int, limit: int) -> None:
    """The one line a new path costs."""
    guards = entry.plan.captured.guards
    warn(f"{what}: the step's branches took a new path ({describe(guards, entry.path)}): captured, planned with "
         f"the same schedule and lowered in {entry.info('').seconds:.2f} s; the state carries over. {count} "
         f"program(s) kept (at most {limit}, paths and shapes together); prog.shapes() lists them.",
         stacklevel=user_stacklevel())


def real_values(names, flat, held):
    """name -> the full value of a step placeholder, for the guards: this call's inputs (names[i] -> flat[i]),
    the state `held` (a HeldState) gathered whole, once per call and only the values a guard reads."""
    inputs = dict(zip(names, flat))
    gathered: dict = {}

    def real(name):
        if name in inputs:
            return inputs[name]
        if name in held.state:
            if name not in gathered:
                gathered[name] = held.full(name)
            return gathered[name]
        return None
    return real


class StepPaths:
    """An executor's side of a step that branches: a PathTrie per input signature, the draws the guards made for
    this call, and each parameter's own step count (a path that leaves a parameter without a gradient does not
    count a step for it, as torch.optim does not)."""

    def __init__(self, first, param_steps: dict):
        """first: the example inputs' program (None: no program yet, an Evaluator's)."""
        self.tries: dict = {}
        self.draws: dict = {}
        self.param_steps = param_steps     # the HeldState's (its state_dict and export_to report them)
        self.nograd = frozenset()          # a gated step (capture/gates.py): the parameters without a gradient
        self._rng = None
        if first is not None and first.plan.captured.guards:
            first.path = tuple(g.value for g in first.plan.captured.guards)
            self.tries.setdefault(first.signature, PathTrie()).insert(first.plan.captured.guards, first.key)

    def __bool__(self):
        return bool(self.tries)

    def select(self, sig, real, device) -> tuple:
        """(guard values, cache key or None): this call's path, its guards' draws kept for the step."""
        self.draws = {}
        self._rng = generator_state(device)
        if sig not in self.tries:
            return (), (sig, ())
        values, key, self.draws = guard_values(self.tries[sig], real)
        return values, key

    def before_capture(self, values, device) -> None:
        """The capture of a new path draws the guards' values from the generator the step started with."""
        if values:
            rewind(self._rng, device)

    def captured(self, sig, entry, values, real) -> None:
        """A program just captured joins its signature's trie; a path's guards run again for the step's draws."""
        join(self.tries, sig, entry, values)
        if not entry.path:
            return
        values, key, self.draws = guard_values(self.tries[sig], real)
        if key != entry.key:
            raise InternalError(f"partir_torch: internal error: the path just captured "
                                f"({describe(entry.plan.captured.guards, entry.path)}) is not the one its guards "
                                f"select ({values}). Please report this with the model.")

    def gate(self, entry) -> None:
        """A step whose layerdrop is gated (capture/gates.py): this call's draws, made now in eager's order (a
        skipped layer's not at all), and the parameters the skipped layers leave without a gradient."""
        gates = entry.plan.captured.gates
        self.nograd = frozenset()
        if gates is not None:
            self.draws, self.nograd = gates.draw()

    def draw(self, name: str):
        return self.draws[name[len("draws."):]]

    def step_of(self, name: str, steps: int) -> int:
        """The count of "step" (steps taken) or "step.<fqn>" (that parameter's)."""
        return steps if name == "step" else self.param_steps.get(name[len("step."):], steps)

    def count(self, cap, steps: int) -> None:
        """After a train step of path `cap` (steps: those taken before it)."""
        if cap.gates is not None:
            updated = [f for f in cap.updated if f not in self.nograd]
        elif cap.guards:
            updated = cap.updated
        else:
            return
        for fqn in updated:
            self.param_steps[fqn] = self.param_steps.get(fqn, steps) + 1
        for fqn in cap.trainable:
            self.param_steps.setdefault(fqn, steps)
