"""Layerdrop as gates: one program for every combination of skipped layers (issue 26).

Layerdrop (`if torch.rand([]) < self.layerdrop: continue` before each layer of a list) is a branch on a random
draw per layer: as path guards (branches.py) an L-layer stack has 2^L paths, and at p = 0.1 over 12 layers a new
one comes most steps, each captured, planned and lowered. Such a draw decides nothing about the data, only whether
one layer runs, so capture first tries to trace the step once as a *gated* step:

- `GateTracer` answers a scalar read of a boolean computed from random draws alone (no input, no state) with
  "run the layer" (False), inside a module's forward, and takes the next module call as the layer it gates. That
  call must be an element of a list of layers (`nn.ModuleList` / `nn.Sequential` child of the module that read
  the draw), its first output a tensor shaped as its first input (the hidden states) and its other outputs None.
  Its output becomes `torch.where(skip, hidden_in, hidden_out)`: autograd derives the backward, which gives the
  layer's parameters exact zeros when skipped and passes the incoming gradient through unchanged (g + 0).
- Every layer of that list must be gated, each once (the shape of layerdrop; a single draw before a single
  layer, a layer run twice (activation checkpointing), a read of data, a draw fed by data, a nested gate or any
  other shape raises `NotGated` and capture traces paths instead, saying why).
- The layers of a list pass the hidden states from one to the next unchanged (layer k + 1 takes layer k's output:
  `h = layer(h)`), so a skipped layer leaves h as it was; `h = h + layer(h)` is traced as paths.
- A parameter has no gradient in eager when the layers skipped cut every way from it to the loss: a skipped
  layer's own parameters, and also, say, an encoder's when every decoder layer (the only readers of its output)
  was skipped; torch.optim then leaves it, its state and its count alone. `Reach` finds these parameters at every
  step from the gates' values, over the forward graph (the gated wheres are the switches); each parameter upstream
  of a switch gets an input `draws.nograd.<fqn>` and a masked update (`where(nograd, old, new)` for the parameter
  and its optimizer state: replicate.splice_update; lower/fuse.py folds them into the fused update, which skips
  those parameters), and its own step count (`step.<fqn>`).
- Also refused: a layer's output read outside the next layer (an auxiliary loss per layer), a gated layer writing
  running statistics. Reads of data before the step's first draw (HF's check of the labels) are path guards of
  a Recorder beside the tracer; selections are traced padded (counts.py).
- Every random draw of the step becomes an input (`draws.<node>`): `Gates.draw` draws them before each step in
  the trace's order from the caller's generator, evaluating each gate from its draw, and skips the draws inside a
  skipped layer (eager does not make them): the generator advances exactly as eager's. A skipped layer's draws are
  fed as zeros (its output is discarded by the where).

The program computes every layer at every step: it costs what the step without layerdrop costs, and the skipped
layers' compute is not saved (eager saves it); summary() says so.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from ..rules.tags import draws_random
from .branches import _SCALAR, _factory, _frames, assert_expect, traced_node


class NotGated(Exception):
    """The step's scalar reads are not layerdrop's shape; `reason` says why (None: no draw-only read at all)."""

    def __init__(self, reason=None):
        super().__init__(reason or "not gated")
        self.reason = reason


@dataclass
class Gate:
    """One gated layer: `pred` (node name) is True when it is skipped, computed by `program` from the draws
    `reads` (node names)."""

    pred: str
    where: str
    module: str
    program: fx.GraphModule = None
    reads: tuple = ()


class Reach:
    """Which parameters the loss reaches through the gates' switches, by the gates skipped (cached per set)."""

    def __init__(self, inputs: list, params: dict):
        self.inputs = inputs            # per forward node, users first (the loss is 0): [(input, gate or -1, value)]
        self.params = params            # fqn -> its placeholder's index
        self._memo: dict = {}

    def unreached(self, skipped: frozenset) -> frozenset:
        if skipped not in self._memo:
            if len(self._memo) >= 4096:       # 2^L sets at most: keep the memo bounded over a long run
                self._memo.clear()
            reach = [False] * len(self.inputs)
            reach[0] = True
            for i, ins in enumerate(self.inputs):
                if reach[i]:
                    for a, k, v in ins:
                        if k < 0 or (k in skipped) == v:
                            reach[a] = True
            self._memo[skipped] = frozenset(f for f, i in self.params.items() if not reach[i])
        return self._memo[skipped]


@dataclass
class GatedDraw:
    """One random draw of the step: `program()` draws it; `region`: the gate of the layer it is drawn in, or None."""

    node: str
    program: fx.GraphModule
    region: int | None
    shape: tuple
    dtype: torch.dtype
    device: torch.device


@dataclass
class Gates:
    gates: tuple
    draws: tuple
    lists: tuple = ()                    # the fqns of the gated lists of layers
    reach: Reach = None                  # TRAIN: the parameters whose update is masked, and when

    def draw(self) -> tuple:
        """This step's draws, in eager's order (name -> tensor; with `nograd.<fqn>`, whether a masked parameter has
        no gradient), and the parameters without a gradient."""
        env: dict = {}
        skip: dict = {}

        def skipped(k):
            if k not in skip:
                g = self.gates[k]
                with torch.no_grad():
                    skip[k] = bool(g.program(*[env[r] for r in g.reads]).item())
            return skip[k]

        for d in self.draws:
            if d.region is not None and skipped(d.region):
                env[d.node] = torch.zeros(d.shape, dtype=d.dtype, device=d.device)
            else:
                with torch.no_grad():
                    env[d.node] = d.program()
        if self.reach is None:
            return env, frozenset()
        nograd = self.reach.unreached(frozenset(k for k in range(len(self.gates)) if skipped(k)))
        device = self.draws[0].device
        for f in self.reach.params:
            env[f"nograd.{f}"] = torch.tensor(f in nograd, device=device)
        return env, nograd


@dataclass
class _Pending:
    pred: fx.Node
    tensor: torch.Tensor
    where: str
    owner: torch.nn.Module


@dataclass
class _Layer:
    pending: _Pending
    hidden: torch.Tensor
    mark: fx.Node
    list: torch.nn.Module
    index: int


class GateTracer(TorchDispatchMode):
    """Answers layerdrop's reads while make_fx traces (see the module docstring); `hooks()` installs the module
    hooks that find the layer each read gates."""

    def __init__(self, model: torch.nn.Module, recorder=None):
        super().__init__()
        self.model, self.recorder = model, recorder
        self.fqn = {id(m): f for f, m in model.named_modules()}
        self.gates: list = []            # (Gate, pred node, region nodes)
        self.switches: dict = {}         # the gated where node -> its gate
        self.reach = None
        self._pending = None
        self._active: dict = {}          # id(module) -> _Layer
        self._seen: set = set()          # ids of gated modules
        self._chain: dict = {}           # id(list of layers) -> (the last gated layer's merged output, its index, gate)
        self._next: dict = {}            # gate -> the gate of the next layer of its list
        self._tracer = None

    def __enter__(self):
        mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)
        self._tracer = None if mode is None else mode.tracer
        if self.recorder is not None:
            self.recorder._tracer = self._tracer
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not _SCALAR:
            return func(*args, **(kwargs or {}))
        node = traced_node(self._tracer, args[0])
        if node is None:
            return func(*args, **(kwargs or {}))
        frame, where = _frames()
        if assert_expect(frame) is not None or not _draw_only(node):
            # an assert, a branch on data: the recorder's check or path guard while the step has drawn nothing
            # (its guard programs then draw nothing either), else the whole step is traced as paths
            if self.recorder is None or any(draws_random(n) for n in node.graph.nodes):
                raise NotGated(None)
            return self.recorder.__torch_dispatch__(func, types, args, kwargs)
        if node.meta["val"].dtype != torch.bool:
            raise NotGated(f"the step reads a random draw as a number at {where}")
        owner = frame.f_locals.get("self") if frame is not None else None
        if not isinstance(owner, torch.nn.Module):
            raise NotGated(f"the branch on a random draw at {where} is not in a module's forward")
        if self._pending is not None:
            raise NotGated(f"no layer call follows the branch on a random draw at {self._pending.where}")
        self._pending = _Pending(node, args[0], where, owner)
        return False

    def hooks(self) -> list:
        handles = []
        for mod in self.model.modules():
            handles.append(mod.register_forward_pre_hook(self._pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(self._post, with_kwargs=True))
        return handles

    def _pre(self, mod, args, kwargs):
        if id(mod) in self._seen:
            raise NotGated(f"the gated layer {self.fqn.get(id(mod))} runs twice in one step (activation "
                           f"checkpointing recomputes it)")
        p, self._pending = self._pending, None
        if p is None:
            return None
        name = self.fqn.get(id(mod), "?")
        lists = [c for c in p.owner.children() if isinstance(c, (torch.nn.ModuleList, torch.nn.Sequential))
                 and any(x is mod for x in c)]
        if not lists:
            raise NotGated(f"the branch on a random draw at {p.where} is followed by a call of {name}, not of a "
                           f"layer of a list of layers")
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor):
            raise NotGated(f"the layer {name} gated by {p.where} takes no hidden states as its first argument")
        index = next(i for i, x in enumerate(lists[0]) if x is mod)
        prev = self._chain.get(id(lists[0]))
        # the hidden states go from layer to layer unchanged (`h = layer(h)`): then a skipped layer leaves h as it
        # was; `h = h + layer(h)` would not, and is traced as paths
        if (prev is None and index != 0) or (prev is not None and (prev[1] != index - 1 or hidden is not prev[0])):
            raise NotGated(f"the layers of {self.fqn[id(lists[0])]} do not pass the hidden states from one to the "
                           f"next unchanged ({name} does not take the output of the layer before it), so what a "
                           f"skipped layer leaves is not known")
        self._seen.add(id(mod))
        self._active[id(mod)] = _Layer(p, hidden, _last(self._tracer.graph), lists[0], index)
        return None

    def _post(self, mod, args, kwargs, out):
        layer = self._active.pop(id(mod), None)
        if layer is None:
            return None
        name = self.fqn[id(mod)]
        first = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, (tuple, list)) and out else None
        rest = () if isinstance(out, torch.Tensor) else tuple(out[1:]) if first is not None else ()
        h = layer.hidden
        if not isinstance(first, torch.Tensor) or first.shape != h.shape or first.dtype != h.dtype \
                or any(r is not None for r in rest):
            raise NotGated(f"the layer {name} gated by {layer.pending.where} returns more than hidden states shaped "
                           f"as its input ({_describe(out)}): what a skipped layer leaves is not known")
        region = _after(layer.mark)
        if self._active:
            raise NotGated(f"the layer {name} is gated inside another gated layer")
        merged = torch.where(layer.pending.tensor, h, first)
        prev = self._chain.get(id(layer.list))
        if prev is not None:
            self._next[prev[2]] = len(self.gates)
        self._chain[id(layer.list)] = (merged, layer.index, len(self.gates))
        self.switches[traced_node(self._tracer, merged)] = len(self.gates)
        self.gates.append((Gate(layer.pending.pred.name, layer.pending.where, name), layer.pending.pred, region))
        return merged if isinstance(out, torch.Tensor) else type(out)([merged, *rest])

    def check(self, model, gm: fx.GraphModule, names: list) -> None:
        """After the trace: each read gated a layer, every layer of a gated list is gated, no parameter is shared
        with anything outside its layer, the forward reads each layer's output only in the next layer (what reads
        it elsewhere, an auxiliary loss on every layer's output, would read a skipped layer's too), and no gated
        layer writes into the module's state (batch norm's running statistics: eager's skipped layer does not)."""
        if self._pending is not None:
            raise NotGated(f"no layer call follows the branch on a random draw at {self._pending.where}")
        if not self.gates:
            raise NotGated(None)
        lists = []
        for owner_list in {id(c): c for m in model.modules() for c in m.children()
                           if isinstance(c, (torch.nn.ModuleList, torch.nn.Sequential))
                           and any(id(x) in self._seen for x in c)}.values():
            missing = [self.fqn[id(x)] for x in owner_list if id(x) not in self._seen]
            if len(owner_list) < 2:
                raise NotGated(f"{self.fqn[id(owner_list)]} has one layer: nothing shows that it replaces the "
                               f"hidden states")
            if missing:
                raise NotGated(f"only some layers of {self.fqn[id(owner_list)]} have a layerdrop draw ({missing[0]} "
                               f"has none)")
            lists.append(self.fqn[id(owner_list)])
        count: dict = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            count[id(p)] = count.get(id(p), 0) + 1
        for _, m in ((f, m) for f, m in model.named_modules() if id(m) in self._seen):
            shared = [n for n, p in m.named_parameters() if count[id(p)] > 1]
            if shared:
                raise NotGated(f"the gated layer {self.fqn[id(m)]} shares its parameter {shared[0]} with another "
                               f"module")
        self.lists = tuple(lists)
        self._check_graph(gm, names)

    def _check_graph(self, gm: fx.GraphModule, names: list) -> None:
        graph = gm.graph
        forward = set(_closure(next(iter(reversed(graph.nodes))).args[0][0], lambda m: False))   # what the loss reads
        region = [set(r) for _, _, r in self.gates]
        switch = {k: n for n, k in self.switches.items()}
        for k, (gate, _, _) in enumerate(self.gates):
            nxt = self._next.get(k)
            if nxt is None:
                continue
            allowed = region[nxt] | {switch[nxt]}
            bad = [u for u in switch[k].users if u in forward and u not in allowed]
            if bad:
                raise NotGated(f"the output of the gated layer {gate.module} is read outside the next layer "
                               f"({bad[0].format_node()[:120]}): that read would see a skipped layer's output")
        placeholders = dict(zip((n for n in graph.nodes if n.op == "placeholder"), names))
        gated = [g.module + "." for g, _, _ in self.gates]
        for n in graph.nodes:
            if n.op == "call_function" and n.target is torch.ops.aten.copy_.default:
                name = placeholders.get(n.args[0], "")
                if name.startswith("buffers.") and any(name[len("buffers."):].startswith(m) for m in gated):
                    raise NotGated(f"the gated layers write into {name} (running statistics): a skipped layer "
                                   f"would write too")

    def masks(self, gm: fx.GraphModule, lay, updated: list) -> dict:
        """Before the update is spliced in (gm's output: [loss, gradients...]): an input `draws.nograd.<fqn>` for
        each updated parameter upstream of a switch (fqn -> its placeholder), and the Reach that feeds them."""
        graph = gm.graph
        loss = next(iter(reversed(graph.nodes))).args[0][0]
        fwd = set(_closure(loss, lambda m: False))
        upstream = set(_closure([a for sw in self.switches for a in sw.args[1:3]], lambda m: False))
        placeholders = dict(zip(lay.names, (n for n in graph.nodes if n.op == "placeholder")))
        masked = [f for f in updated if placeholders[f"params.{f}"] in upstream]
        order = [n for n in reversed(graph.nodes) if n in fwd]
        index = {n: i for i, n in enumerate(order)}
        inputs = []
        for n in order:
            k = self.switches.get(n, -1)
            cond = {} if k < 0 else {n.args[1]: (k, True), n.args[2]: (k, False)}
            inputs.append([(index[a], *cond.get(a, (-1, False))) for a in n.all_input_nodes if a in index])
        self.reach = Reach(inputs, {f: index[placeholders[f"params.{f}"]] for f in masked})
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        val = loss.meta["val"]
        out = {}
        for i, f in enumerate(masked):
            with graph.inserting_after(last):
                last = out[f] = graph.placeholder(f"nograd_{i}")
            with val.fake_mode:
                last.meta["val"] = torch.zeros((), dtype=torch.bool, device=val.device)
            lay.names.append(f"draws.nograd.{f}"), lay.roles.append("draw")
        return out

    def build(self, gm: fx.GraphModule) -> Gates:
        """The gates' and the draws' programs, from the traced graph (before any pass edits it)."""
        regions = {}
        for k, (_, _, region) in enumerate(self.gates):
            for n in region:
                if draws_random(n):
                    regions[n] = k
        draws, order = [], {n: i for i, n in enumerate(gm.graph.nodes)}
        for n in gm.graph.nodes:
            if not draws_random(n):
                continue
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise NotGated(f"the step draws {n.format_node()}, which is not one tensor")
            draws.append(GatedDraw(n.name, _program(gm, [], n, False, order), regions.get(n),
                                   tuple(val.shape), val.dtype, val.device))
        gates = []
        for gate, pred, _ in self.gates:
            reads = _draw_inputs(pred)
            gate.reads = tuple(r.name for r in reads)
            gate.program = _program(gm, reads, pred, True, order)
            gates.append(gate)
        return Gates(tuple(gates), tuple(draws), self.lists, self.reach)


def traced_draws(gm: fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if draws_random(n)]


def _last(graph: fx.Graph) -> fx.Node:
    return next(iter(reversed(graph.nodes)))


def _after(mark: fx.Node) -> list:
    out, n = [], mark.next
    while n.op != "root":
        out.append(n)
        n = n.next
    return out


def _describe(out) -> str:
    if isinstance(out, (tuple, list)):
        return f"{type(out).__name__} of " + ", ".join(type(x).__name__ for x in out)
    return type(out).__name__


def _closure(node, stop) -> list:
    """The nodes `node` (or each node of a list) is computed from, itself included, up to factories and nodes for
    which stop(n) holds: one walk, each node once."""
    roots = set(node) if isinstance(node, list) else {node}
    seen, todo, stack = set(), [], list(roots)
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.append(m)
        if m in roots or (not stop(m) and _factory(m) is None):
            stack.extend(a for a in m.all_input_nodes)
    return todo


def _draw_only(pred: fx.Node) -> bool:
    """Whether pred is computed from random draws of templates and constants only (no input, no state)."""
    return not any(m.op == "placeholder" for m in _closure(pred, lambda m: False))


def _draw_inputs(pred: fx.Node) -> list:
    return [m for m in _closure(pred, draws_random) if m is not pred and draws_random(m)]


def _program(gm: fx.GraphModule, inputs: list, out: fx.Node, stop_at_draws: bool, order: dict) -> fx.GraphModule:
    """A small GraphModule computing `out` from `inputs` (nodes, its placeholders), factories and constants."""
    stop = (lambda m: m in inputs) if stop_at_draws else (lambda m: False)
    nodes = _closure(out, stop)
    if any(m.op == "placeholder" for m in nodes):
        raise NotGated(f"the step's draw {out.name} reads the step's data")
    graph, root = fx.Graph(), torch.nn.Module()
    env = {a: graph.placeholder(f"in_{i}") for i, a in enumerate(inputs)}
    for n in sorted((m for m in nodes if m not in env), key=order.__getitem__):
        made = _factory(n)
        if made is not None:
            env[n] = graph.call_function(*made)
        elif n.op == "get_attr":
            name = f"const_{len(root._buffers)}"
            root.register_buffer(name, _attr(gm, n.target))
            env[n] = graph.get_attr(name)
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[out])
    return fx.GraphModule(root, graph)


def _attr(root, target: str):
    for part in target.split("."):
        root = getattr(root, part)
    return root


_ENABLED = [True]


class disabled:
    """`with partir_torch.capture.gates.disabled():` layerdrop is traced as paths (branches.py), one program per
    combination of skipped layers (the tests that compare the two)."""

    def __enter__(self):
        _ENABLED.append(False)

    def __exit__(self, *exc):
        _ENABLED.pop()


def enabled() -> bool:
    return _ENABLED[-1]

