"""Branches on tensor values inside the step (issue 26): the step is traced once per path the user's Python takes.

A whole-step trace cannot hold a Python `if` on a tensor's value: `if not padding_mask.any():`, layerdrop's
`if torch.rand([]) < self.layerdrop:`, `.item()`, `assert not x.isnan().any()`. Each of them reads one scalar
through `aten._local_scalar_dense`; `Recorder`, a dispatch mode on top of the trace's modes, answers that read:

- a **guard** (a branch, an `.item()`): the value is computed for real, on one device's semantics, from the part
  of the graph traced so far that produces it (its backward slice) plus every random op traced before it, on the
  step's real inputs and state, with the caller's generator, so the draws are eager's (layerdrop's `torch.rand([])`
  draws what eager draws). The trace goes on with that value: the graph is the step *specialised to this path*.
  Each guard keeps the slice it evaluated as a small GraphModule (`Guard.program`, single device, unpartitioned);
  at run time these programs compute the step's guard values on the global batch, which select the path's
  program (runtime/paths.py). The draws they make are the step's own: in the path's program they are inputs
  (`draws.<node>`, `lift_draws`), so nothing is drawn twice and the generator advances as eager's.
- a **check** (a Python `assert` on a tensor, `torch._assert`; recognised from the bytecode that called `bool()`:
  a conditional jump one of whose targets raises AssertionError): the trace goes on as if it held, and the
  predicate becomes an extra output of the step (`asserts.<i>`), verified after each step (runtime/paths.py): it
  costs no path and no evaluation before the step.

    with Recorder(names, real) as rec:   # inside make_fx, above FunctionalTensorMode (capture.py)
        ... the step ...
    rec.build()                          # -> the guards' programs, before any pass edits the graph

Values that cannot be evaluated (a model on `meta`, fake example inputs) make a TraceError naming the line.
"""
from __future__ import annotations

import contextlib
import dis
import linecache
import math
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._subclasses import fake_impls
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx.experimental.proxy_tensor import get_proxy_slot
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..rules.tags import draws_random
from ..errors import TraceError
from . import sources
from .tidy import LIKE

_SCALAR = torch.ops.aten._local_scalar_dense.default
_NONZERO = torch.ops.aten.nonzero.default
_MASKED_SELECT = torch.ops.aten.masked_select.default
_TORCH, _OURS = sources._TORCH, sources._OURS
_JUMPS = {"POP_JUMP_FORWARD_IF_TRUE": True, "POP_JUMP_IF_TRUE": True, "POP_JUMP_BACKWARD_IF_TRUE": True,
          "POP_JUMP_FORWARD_IF_FALSE": False, "POP_JUMP_IF_FALSE": False, "POP_JUMP_BACKWARD_IF_FALSE": False,
          "JUMP_IF_TRUE_OR_POP": True, "JUMP_IF_FALSE_OR_POP": False}


@dataclass
class Guard:
    """One scalar the step's Python read from a tensor: the value this path took, where, and the program that
    computes it (inputs: `reads`, named step placeholders, then `takes`, values of earlier guards' programs by node
    name; outputs: the predicate, then `gives`, its values that later guards read)."""

    node: str
    value: object
    where: str
    count: bool = False                 # the value is the number of nonzero elements of the node (nonzero's size)
    program: fx.GraphModule = None
    reads: tuple = ()
    takes: tuple = ()
    gives: tuple = ()

    def evaluate(self, real, env: dict):
        """The guard's value for this step: real(name) gives a step placeholder's full value; env holds earlier
        guards' outputs (and receives this one's)."""
        args = [real(n) for n in self.reads] + [env[n] for n in self.takes]
        with torch.no_grad():
            outs = self.program(*args)
        env.update(zip(self.gives, outs[1:]))
        return key_of(outs[0].item())


@dataclass(frozen=True)
class Check:
    """An assert on a tensor: the step's output `output` must equal `expect` (verified after the step)."""

    output: str
    expect: bool
    where: str


def key_of(v):
    """A guard value as a path key (NaN is not equal to itself)."""
    return "nan" if isinstance(v, float) and v != v else v


def traced_node(tracer, t):
    """The node make_fx's `tracer` traced tensor t (functional or fake) as, or None."""
    if tracer is None or not isinstance(t, torch.Tensor):
        return None
    inner = torch._from_functional_tensor(t.elem) if isinstance(t, FunctionalTensor) else t
    slot = get_proxy_slot(inner, tracer, None)
    return None if slot is None else slot.proxy.node


def _factory(node: fx.Node):
    """`empty_like(x)` and its kin as the factory of x's static shape (target, args, kwargs), else None: a guard's
    slice reads a dropout template's shape, never the activation x it was shaped like (tidy.py does the same to the
    step)."""
    if node.op != "call_function" or node.target not in LIKE:
        return None
    val = node.meta["val"]
    target, value_at = LIKE[node.target]
    args = (list(val.shape),) if value_at is None else (list(val.shape), node.args[value_at])
    return target, args, {"dtype": val.dtype, "device": val.device}


def _frames():
    """The frame that read the scalar (its bytecode), and the user's line (file:line: text) for messages."""
    f, code_frame, user = sys._getframe(2), None, None
    while f is not None:
        fn = sources.real_path(f.f_code.co_filename)
        inside = fn.startswith(os.path.join(_OURS, "capture")) or fn.startswith(os.path.join(_OURS, "runtime"))
        internal = inside or (fn.startswith(_TORCH) and not fn.endswith(os.path.join("torch", "__init__.py")))
        if code_frame is None and not internal:
            code_frame = f
        if user is None and not fn.startswith(_TORCH) and not fn.startswith(_OURS) and not fn.startswith(_NOT_USER):
            user = f
        if code_frame is not None and user is not None:
            break
        f = f.f_back
    return code_frame, "" if user is None else _line(user)


# generated code that is not the user's: Python's frozen modules, fx GraphModules' forward
_NOT_USER = ("<frozen", "<eval_with_key")


def _line(frame) -> str:
    """file:line: text of a frame; code defined through exec/compile ("<string>") has no source to read, so its
    function is named instead."""
    code = frame.f_code
    text = linecache.getline(code.co_filename, frame.f_lineno).strip()
    if not text:
        text = f"in {code.co_name} (no source: code defined through exec)"
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno}: {text}"


def assert_expect(frame):
    """If the scalar is the condition of an `assert` (the current instruction is a conditional jump and one of
    its two continuations starts with LOAD_ASSERTION_ERROR), the value that passes it; else None."""
    if frame is None:
        return None
    ins = {i.offset: i for i in dis.get_instructions(frame.f_code)}
    here = ins.get(frame.f_lasti)
    if here is None or here.opname not in _JUMPS:
        return None
    offsets = sorted(ins)
    nxt = ins.get(offsets[offsets.index(here.offset) + 1]) if here.offset != offsets[-1] else None
    target = ins.get(here.argval)
    jump_on = _JUMPS[here.opname]
    if nxt is not None and nxt.opname == "LOAD_ASSERTION_ERROR":
        return jump_on                 # falling through raises: the jump's condition passes
    if target is not None and target.opname == "LOAD_ASSERTION_ERROR":
        return not jump_on
    return None


class Recorder(TorchDispatchMode):
    """Answers the step's scalar reads while make_fx traces (see the module docstring). names: the step's
    placeholder names in order; real: name -> the full real tensor of that placeholder, or None if unknown."""

    def __init__(self, names: list, real):
        super().__init__()
        self.names, self.real = names, real
        self.guards: list = []
        self.checks: list = []          # (Check, fx node)
        self.drawn: list = []           # the random draws the guards made (fx nodes, in draw order)
        self._env: dict = {}            # fx node -> real value (evaluated once per capture)
        self._nodes: list = []          # per guard: the fx nodes it evaluated, in trace order
        self._preds: list = []          # per guard: its predicate node
        self._placeholders: dict = {}
        self._consts: dict = {}         # get_attr node -> its tensor
        self._root = self._tracer = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not _SCALAR:
            return func(*args, **(kwargs or {}))
        node = self._node(args[0])
        if node is None:                # not a traced value (a constant): as without us
            return func(*args, **(kwargs or {}))
        frame, where = _frames()
        expect = assert_expect(frame)
        if expect is not None:
            self.checks.append((Check(f"asserts.{len(self.checks)}", bool(expect), where), node))
            return bool(expect)
        value = self._evaluate(node, where)
        self.guards.append(Guard(node.name, value, where))
        self._preds.append(node)
        return value

    @contextlib.contextmanager
    def counting_nonzero(self):
        """While tracing: `nonzero` (and what fake tensors compute with it: boolean-mask indexing, masked_select,
        torch.where(mask)) gets the real number of nonzero elements of its traced operand, a guard: the path is
        specialised to that size (a new count is a new path). And a traced 0-dim tensor in an f-string
        (Switch Transformers' `self.experts[f"expert_{idx}"]`) formats its value, a guard, as eager's does."""
        table = fake_impls.op_implementations_dict
        was, was_select = table[_NONZERO], table[_MASKED_SELECT]

        def nonzero(fake_mode, func, arg):
            node = self._node(arg)
            if node is None:            # an operand made inside a kernel: as without us
                return was(fake_mode, func, arg)
            _, where = _frames()
            n = self._evaluate(node, where, count=True)
            self.guards.append(Guard(node.name, n, where, count=True))
            self._preds.append(node)
            return arg.new_empty_strided((n, arg.dim()), (1, max(n, 1)), dtype=torch.int64)

        def masked_select(fake_mode, func, arg, mask):     # its size: the mask's count, broadcast to arg's shape
            node = self._node(mask)
            if node is None:
                return was_select(fake_mode, func, arg, mask)
            _, where = _frames()
            n = self._evaluate(node, where, count=True)
            self.guards.append(Guard(node.name, n, where, count=True))
            self._preds.append(node)
            shape = torch.broadcast_shapes(arg.shape, mask.shape)
            n *= math.prod(shape) // max(math.prod(mask.shape), 1)
            return arg.new_empty((n,))

        fmt = torch.Tensor.__format__

        def format_(t, spec):          # f"expert_{idx}" of a traced 0-dim tensor formats its value, as eager
            if isinstance(t, FunctionalTensor) and t.dim() == 0:
                return t.detach().item().__format__(spec)
            return fmt(t, spec)

        table[_NONZERO], table[_MASKED_SELECT] = nonzero, masked_select
        torch.Tensor.__format__ = format_
        try:
            yield self
        finally:
            table[_NONZERO], table[_MASKED_SELECT] = was, was_select
            torch.Tensor.__format__ = fmt

    def __enter__(self):
        mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)
        self._tracer = None if mode is None else mode.tracer      # make_fx's, entered under it (capture.py)
        return super().__enter__()

    def _node(self, t):
        """The traced node of tensor t (functional or fake), or None."""
        node = traced_node(self._tracer, t)
        if node is None:
            return None
        self._root = self._tracer.root
        if not self._placeholders:
            ph = [n for n in self._tracer.graph.nodes if n.op == "placeholder"]
            self._placeholders = {n: self.names[i] for i, n in enumerate(ph)}
        return node

    def _evaluate(self, pred: fx.Node, where: str, count: bool = False):
        """pred's real value (count: its number of nonzero elements): its backward slice and every random op traced
        so far, each node once per capture."""
        graph = pred.graph
        todo, seen = [], set()

        def need(n):
            stack = [n]
            while stack:
                m = stack.pop()
                if m in self._env or m in seen:
                    continue
                seen.add(m)
                todo.append(m)
                if _factory(m) is None:
                    stack.extend(m.all_input_nodes)

        for n in graph.nodes:            # every draw before pred, so the generator advances as eager's does
            if draws_random(n) and n not in self._env:
                need(n)
        need(pred)
        order = {n: i for i, n in enumerate(graph.nodes)}
        todo.sort(key=order.__getitem__)
        done = []
        with _disable_current_modes(), torch.no_grad():
            for n in todo:
                if n.op == "placeholder":
                    v = self.real(self._placeholders[n])
                    if v is None:
                        raise TraceError(f"partition: the step branches on a tensor value at {where or pred.name} "
                                         f"and {self._placeholders[n]} has no real value to compute it from (a "
                                         f"model on the meta device, or fake example inputs). Give real example "
                                         f"inputs and a materialised model, or rewrite the branch with torch.where.")
                elif n.op == "get_attr":       # a tensor created in the step (torch.tensor(...)): real already
                    v = _attr(self._root, n.target)
                    self._consts[n] = v
                elif _factory(n) is not None:
                    target, args, kwargs = _factory(n)
                    v = target(*args, **kwargs)
                else:
                    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: self._env[a])
                    v = n.target(*args, **kwargs)
                self._env[n] = v
                if n.op != "placeholder":
                    done.append(n)
                if n.op == "call_function" and draws_random(n):
                    self.drawn.append(n)
        self._nodes.append(done)
        if count:
            return int(torch.count_nonzero(self._env[pred]))
        return key_of(self._env[pred].item())

    def build(self) -> None:
        """Each guard's program, from the nodes it evaluated (call before any pass edits the traced graph)."""
        owner = {n: g for g, nodes in enumerate(self._nodes) for n in nodes}
        for g, (guard, nodes, pred) in enumerate(zip(self.guards, self._nodes, self._preds)):
            # every value computed is given to the guards after it: the paths that share this guard (the same
            # values before it) differ after it, and so do the values their later guards read
            _build_one(guard, nodes, pred, nodes, owner, g, self._placeholders, self._consts)
        self._env.clear()               # the real values evaluated during capture are not kept
        self._prune()

    def _prune(self) -> None:
        """The predicates' ops the step itself does not use (`mask.any()`, `rand < p`: Python read them) leave the
        traced step, so the path's program does not compute them (nor gather their operands); random draws stay,
        so the step's draws remain eager's."""
        dead = [n for nodes in self._nodes for n in nodes] + self._preds
        order = {n: i for i, n in enumerate(self._preds[0].graph.nodes)} if self._preds else {}
        for n in sorted(set(dead), key=lambda n: order.get(n, -1), reverse=True):
            if n in order and n.op == "call_function" and not n.users and not draws_random(n):
                n.graph.erase_node(n)


def _attr(root, target: str):
    for part in target.split("."):
        root = getattr(root, part)
    return root


def _build_one(guard: Guard, nodes: list, pred, gives: list, owner: dict, g: int, placeholders: dict,
               consts: dict) -> None:
    graph, root = fx.Graph(), torch.nn.Module()
    inputs = []
    for a in [a for n in nodes if _factory(n) is None for a in n.all_input_nodes] + ([] if pred in nodes else [pred]):
        if a not in inputs and (a.op == "placeholder" or owner.get(a, g) != g):   # a step input, an earlier value
            inputs.append(a)
    reads = [a for a in inputs if a.op == "placeholder"]
    takes = [a for a in inputs if a.op != "placeholder"]
    vmap = {a: graph.placeholder(f"in_{i}") for i, a in enumerate(reads + takes)}
    for n in nodes:
        made = _factory(n)
        vmap[n] = graph.call_function(*made) if made is not None else graph.node_copy(n, lambda a: vmap[a])
        if n.op == "get_attr":
            vmap[n].target = f"const_{len(root._buffers)}"
            root.register_buffer(vmap[n].target, consts[n])
    out = graph.call_function(torch.ops.aten.count_nonzero.default, (vmap[pred],)) if guard.count else vmap[pred]
    graph.output([out] + [vmap[n] for n in gives])
    guard.program = fx.GraphModule(root, graph)
    guard.reads = tuple(placeholders[a] for a in reads)
    guard.takes = tuple(a.name for a in takes)
    guard.gives = tuple(n.name for n in gives)


def lift_draws(gm: fx.GraphModule, drawn: list, names: list, roles: list) -> None:
    """The random draws the guards made before the step become placeholders `draws.<node>` (role "draw"), fed with
    the guards' values at each call (paths.py): the step does not draw them again, and the generator, which the
    guards advanced, goes on from there as eager's does. Draws whose results are not a tensor cannot be fed."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in drawn:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            raise TraceError(f"partition: the step draws {node.format_node()} before a branch on a tensor value; "
                             f"its result is not one tensor, and partir_torch feeds such draws to the step as "
                             f"tensors. Please report this with the model.")
        with gm.graph.inserting_after(placeholders[-1]):
            ph = gm.graph.placeholder(f"draws_{node.name}")
        ph.meta.update(node.meta)
        placeholders.append(ph)
        names.append(f"draws.{node.name}"), roles.append("draw")
        inputs = node.all_input_nodes
        node.replace_all_uses_with(ph)
        gm.graph.erase_node(node)
        for a in inputs:               # dropout's `empty` template, now unused
            if a.op == "call_function" and not a.users:
                gm.graph.erase_node(a)


_PY_DRAWS = (("random", "random"), ("random", "uniform"), ("numpy.random", "random"), ("numpy.random", "uniform"),
             ("numpy.random", "rand"))


@contextlib.contextmanager
def python_draws(found: list):
    """While the step is traced, a draw from Python's or NumPy's generator (MusicGen's layerdrop draws
    `random.uniform(0, 1)`) is recorded in `found` (the user's line): the trace fixes its value, so the program
    takes that draw's path at every step, and capture says so (a torch.rand draw would be a guard)."""
    import importlib

    saved = []
    for mod_name, fn_name in _PY_DRAWS:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        orig = getattr(mod, fn_name)

        def wrapped(*a, _orig=orig, **k):
            if not sources.library_code(sys._getframe(1).f_code.co_filename):   # the model's draw, not a library's
                where = _frames()[1]
                if where and where not in found:
                    found.append(where)
            return _orig(*a, **k)
        saved.append((mod, fn_name, orig))
        setattr(mod, fn_name, wrapped)
    try:
        yield found
    finally:
        for mod, fn_name, orig in saved:
            setattr(mod, fn_name, orig)


def add_checks(gm: fx.GraphModule, checks: list, out_names: list) -> list:
    """The asserts' predicates as extra outputs of the traced step, named as their Checks; returns the Checks."""
    if not checks:
        return []
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    out_node.args = (list(out_node.args[0]) + [node for _, node in checks],)
    out_names.extend(c.output for c, _ in checks)
    return [c for c, _ in checks]
