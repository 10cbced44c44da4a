"""XlaBackend: a partitioned step run by torch-xla's SPMD partitioner under partir's decisions (prog.to_xla(): the
same Program, on this backend).

The captured *global* step graph runs op by op on XLA tensors (lazily traced, compiled once per graph):

- every input, parameter, buffer and optimizer-state value is placed with `xs.mark_sharding` from its partir
  Sharding, and every value computed gets its Sharding as a constraint (the same call on an intermediate tensor);
- where partir's lowering reshards, i.e. an op uses an operand (or makes a result) in another layout than the
  value keeps (lower.op_layouts), a copy constrained to the op's layout makes XLA reshard at that op, that way;
- backward uses of parameters go through an optimization barrier, so ZeRO-3 gathers them again (as partir does)
  instead of reusing the forward's gathered copy;
- CPU-only kernels of the capture run as XLA ops (kernels.py), so the step stays one XLA program;
- a value with a strided tiling (packed q|k|v, eager attention's (B*H) folds) is held and computed as the split
  view XLA can tile (strided.py: [d, 3d] tiled {model:s3} as [d, 3, d] tiled on its last dim), the ops on it
  rewritten onto the views; the few layouts no such view tiles are held whole on the strided axis (device.unstrided)
  and one warning per mode names them and what XLA's program moves beyond the plan.

A partial value (a pending reduction has no HLO sharding) that partir reduces before each of its uses is
constrained to its reduced layout where it is made, so GSPMD reduces it there as partir does rather than computing
it tiled on an axis the plan leaves whole and permuting the tiles (_reduced_at_every_use). GSPMD is then left to
choose little more than how to reduce the partial values kept partial through sums. State stays on the devices
between steps.

    xprog = prog.to_xla()                 # a Program on this backend; PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 for 8 devices
    loss = xprog.train_step(tokens, targets)
    print(xprog.compare())                # partir's collectives next to those of XLA's partitioned HLO
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..capture import FORWARD
from ..contract import META_ROLE, STATE_ROLES, Role, forward_nodes
from ..errors import PartitionError, warn
from ..runtime.backend import InProcess
from ..sharding import Sharding
from . import device as xdev
from .hlo import parse_collectives
from .kernels import xla_target
from .strided import Rewriter, form_of



def _host_op_counts() -> dict:
    """torch-xla's per-op counters of ops it ran on the host (its CPU fallback): 'aten::<op>' -> calls."""
    import torch_xla.debug.metrics as met

    return {k: met.counter_value(k) for k in met.counter_names() if k.startswith("aten::")}


def param_derived(gm, kept=frozenset()) -> set:
    """Parameter placeholders and the forward nodes computed from parameters alone (transposes, casts): the values
    partir gathers again at their backward uses (ZeRO-3 does not keep a gathered copy alive from the forward),
    except those made from the parameters in `kept` alone (names: the lowered program's kept_to_backward, whose
    forward copy serves the backward)."""
    fwd = forward_nodes(gm)
    out, roots = set(), {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.meta.get(META_ROLE) == Role.PARAM:
            out.add(n)
            roots[n] = {n.name}
        elif n.op == "call_function" and n in fwd and n.all_input_nodes and all(a in out for a in n.all_input_nodes):
            out.add(n)
            roots[n] = set().union(*(roots[a] for a in n.all_input_nodes))
    return {n for n in out if not roots[n] <= kept}


class _Run(fx.Interpreter):
    """Runs the captured graph on XLA tensors; after each node, its sharding constraint (if any). Backward uses of
    parameter-derived values read them through an optimization barrier: a separate HLO value, so XLA reshards it
    again there (as partir does) instead of reusing the forward's gathered copy."""

    def __init__(self, gm, dev, mesh, constraints: dict, regather: set = frozenset(), op_specs=None, rewriter=None):
        super().__init__(gm, garbage_collect_values=True)
        self.dev, self.mesh, self.constraints = dev, mesh, constraints
        self.operand_specs, self.result_specs = op_specs or ({}, {})
        self.regather, self.fwd = regather, forward_nodes(gm) if regather else set()
        self.copies: dict = {}
        self.rewriter, self.node = rewriter, None     # ops on values held in a strided Form (strided.py)

    def _backward_copy(self, node, value):
        if node.name not in self.copies:
            import torch_xla

            copy = value.clone()
            torch_xla._XLAC._xla_optimization_barrier_([copy])
            spec = self.constraints.get(node.name)
            if spec is not None:
                _mark(copy, self.mesh, spec)
            self.copies[node.name] = copy
        return self.copies[node.name]

    def fetch_args_kwargs_from_env(self, n):
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        env = {}
        if self.regather and n.op == "call_function" and n not in self.fwd:
            env = {a: self._backward_copy(a, self.env[a]) for a in n.all_input_nodes if a in self.regather}
        for a, spec in self.operand_specs.get(n.name, {}).items():    # as this op uses it (a reshard)
            env[a] = _constrained(self._natural(a, env.get(a, self.env[a])), self.mesh, spec)
        if env:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env.get(a, self.env[a]))
        return args, kwargs

    def call_function(self, target, args, kwargs):
        # factory ops were traced with the capture device: create on the XLA device instead
        if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type != "xla":
            kwargs = {**kwargs, "device": self.dev}
        if self.rewriter is not None and self.rewriter.involved(self.node):
            return self.rewriter.run(self.node, xla_target(target), args, kwargs)
        return xla_target(target)(*args, **kwargs)

    def _natural(self, node, t):
        """`t` in its node's own shape (a value held in a strided Form is a split view of it)."""
        return self.rewriter.natural(node, t) if self.rewriter is not None else t

    def run_node(self, n):
        self.node = n
        out = super().run_node(n)
        made = self.result_specs.get(n.name)
        if made is not None and isinstance(out, torch.Tensor):   # computed in one layout, kept in another:
            held = out.shape                                     # partir reshards the result right after the op
            out = _constrained(self._natural(n, out), self.mesh, made).reshape(held)
        spec = self.constraints.get(n.name)
        if spec is not None and isinstance(out, torch.Tensor):
            _mark(out, self.mesh, spec)
        return out


def _mark(t, mesh, spec):
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(t, mesh, spec)


def _constrained(t, mesh, spec):
    """A copy of `t` under a sharding constraint (a custom-sharding node even when `t` is device data, where
    mark_sharding would move the data instead)."""
    import torch_xla.distributed.spmd as xs

    x = t.clone()
    xs.annotate_custom_sharding(x, mesh, spec)
    return x


_UNEVEN_FIX = (" For an XLA program that matches it, use sizes the mesh axes divide (pt.partition(..., strict=True) "
               "refuses the others).")


def _shown(values: list) -> str:
    return "; ".join(values[:3]) + (f"; and {len(values) - 3} more" if len(values) > 3 else "")


class XlaBackend(InProcess):
    """The torch-xla SPMD backend (runtime/backend.py's protocol): the captured *global* step runs on XLA tensors,
    state and inputs placed from their partir Sharding, and constraints where partir decided a layout (_Run), so
    XLA's partitioner carries out partir's plan. A held value is one XLA tensor (XLA holds its shards). It runs
    only the plan it was built for (new_programs: its constraints are that plan's); reports: what XLA compiled."""

    new_programs = False

    def __init__(self, plan):
        import torch_xla

        xdev.enable()
        self.plan, self.cap, self.mesh = plan, plan.captured, plan.mesh
        self.groups: dict = {}                 # no process groups: XLA's partitioner emits the collectives
        self.compile = False
        self.device = torch_xla.device()
        self.xmesh = xdev.xs_mesh(plan.mesh)
        g = plan.graph
        self.layouts = {}        # placeholder name -> Sharding
        for node, name in zip(self._placeholders(), self.cap.input_names):
            self.layouts[name] = plan.sharding(g.vid[node])
        self.returned = set(next(n for n in reversed(self.cap.gm.graph.nodes) if n.op == "output").all_input_nodes)
        self.forms = self._forms()
        self.rewriter = Rewriter(self.forms) if self.forms else None
        self.uneven, (self.strided, self.strided_free) = self._uneven(), self._strided()
        self.checked: set = set()     # modes whose program was compared with the plan (_check_layouts)
        self.constraints = self._constraints()
        self.op_specs = self._op_specs()
        self._regather = param_derived(self.cap.gm, plan.lowered().kept_to_backward) \
            if self.cap.mode != FORWARD else frozenset()
        self.modules: dict = {}       # mode -> dump file of its post-partitioning HLO
        self.host_ops: list = []      # aten ops torch-xla ran on the host (see _check_host_ops)
        self._check_draws()

    def _check_draws(self) -> None:
        """Random draws without a host form in kernels.py (torch's generator, as one device draws) come from XLA's
        own generator: say once which, since the step then differs from one device's."""
        from ..rules.tags import draws_random
        from .kernels import OVERRIDES

        ops = sorted({str(n.target) for n in self.cap.gm.graph.nodes if draws_random(n) and n.target not in OVERRIDES})
        if ops:
            warn(f"to_xla: {', '.join(ops)} draw from XLA's generator, not torch's: the step's random values (and so "
                 f"its losses and updates) differ from one device's. A host form for such an op goes in "
                 f"partir_torch/xla/kernels.py (as native_dropout's).", stacklevel=4)

    def _placeholders(self):
        return [n for n in self.cap.gm.graph.nodes if n.op == "placeholder"]

    def _uneven(self) -> list:
        """The values tiled unevenly ("name dim d (size n) over 'axis' (size k)"). XLA's partitioner pads such
        tiles itself, so the step computes the same values; what it moves to do so is checked against partir's plan
        after the first compile of each mode (_check_layouts)."""
        g, out = self.plan.graph, []
        for v in range(len(g.values)):
            for d, (size, axis, _) in self.plan.sharding(v).uneven_dims(g.shapes[v], self.mesh).items():
                out.append(f"{g.name(v)} dim {d} (size {size}) over '{axis}' (size {self.mesh.shape[axis]})")
        return out

    def _forms(self) -> dict:
        """FX node name -> Form, for the values with a strided tiling that XLA holds as a split view (strided.py)."""
        g, out = self.plan.graph, {}
        for node in self.cap.gm.graph.nodes:
            if node.op in ("placeholder", "call_function") and node in g.vid:
                f = form_of(self.plan.sharding(g.vid[node]), g.shapes[g.vid[node]], self.mesh)
                if f is not None:
                    out[node.name] = f
        return out

    def _strided(self) -> tuple:
        """The values with a strided tiling no split view holds ("name dim d over 'axis' in s strided blocks"): those
        XLA holds with that dim whole on those axes (states first; _strided_layout), and those left to GSPMD."""
        g, state, whole, free = self.plan.graph, [], [], []
        for v in range(len(g.values)):
            sh, node = self.plan.sharding(v), g.values[v]
            if node.name in self.forms:
                continue
            for d, axes in xdev.strided_axes(sh).items():
                blocks = " x ".join(str(sh.stride(a)) for a in axes if sh.stride(a) > 1)
                where = f"{g.name(v)} dim {d} over {', '.join(repr(a) for a in axes)} in {blocks} strided blocks"
                (state if node.op == "placeholder" else whole if self._strided_layout(node, sh) else free).append(where)
        return state + whole, free

    def _strided_layout(self, node, sh):
        """The layout a computed strided value is constrained to: device.unstrided where that keeps another axis's
        tiling (eager attention's (B*H) folds stay on 'batch') or where the step returns the value (a new parameter
        or optimizer state, laid out as its state is held); None where it would be replicated or is partial: left to
        GSPMD, which may keep it split its own way (a MoE's (experts, capacity) gradients)."""
        kept = xdev.unstrided(sh)
        return kept if not sh.partial and (kept.tiled_axes() or node in self.returned) else None

    def _check_layouts(self, mode: str) -> None:
        """Once per mode, where XLA runs a layout otherwise than partir's plan: uneven tiles (XLA pads them its own
        way, and where a padded dim meets a reshape it may exchange halos or gather where partir's plan moves
        nothing) and strided tilings (held whole on their axis). Say so once, with the bytes XLA's program moves
        beyond the plan (compare()); uneven tiles only when it does not carry out the plan."""
        fell = sorted(self.rewriter.fallbacks) if self.rewriter is not None else []
        if mode in self.checked:
            return
        self.checked.add(mode)
        cmp = None
        if mode in self.modules:
            from .compare import compare

            cmp = compare(self.plan, parse_collectives(self.hlo_text(mode), self.plan.mesh), host_ops=self.host_ops)
        notes = []
        if self.uneven and not (cmp is not None and cmp.ok):
            notes.append((f"pads the uneven tiles of this plan ({_shown(self.uneven)}) its own way", _UNEVEN_FIX))
        free = f"lays out {_shown(self.strided_free)} as GSPMD chooses" if self.strided_free else ""
        if self.strided:
            notes.append((f"holds the strided tilings of this plan ({_shown(self.strided)}) whole on those axes (a "
                          f"tile assignment cannot split a dim in strided blocks){' and ' + free if free else ''}",
                          ""))
        elif free and not (cmp is not None and cmp.ok):
            notes.append((f"{free} (a tile assignment cannot split a dim in strided blocks)", ""))
        if fell and not (cmp is not None and cmp.ok):
            notes.append((f"runs {', '.join(fell)} on the natural shapes of values it holds as split views (strided "
                          f"tilings)", " Such an op family's rewrite onto the views goes in partir_torch/xla/strided.py."))
        if not notes and cmp is not None and not cmp.ok:     # nothing of the above: say it all the same, once
            notes.append(("partitions this plan otherwise than partir's lowering (its SPMD partitioner chose other "
                          "collectives)", " xprog.compare() prints both programs' collectives per axis."))
        for what, fix in notes:
            if cmp is None:
                warn(f"to_xla: XLA {what}; XLA was started without HLO dumps, so whether its program moves more than "
                     f"partir's plan cannot be checked (import partir_torch.xla before the first XLA tensor is "
                     f"created).", stacklevel=4)
            elif cmp.ok:
                warn(f"to_xla: XLA {what}; its {mode} program still carries out partir's plan.", stacklevel=4)
            else:
                warn(f"to_xla: XLA {what}, and its {mode} program moves more than partir's plan: "
                     f"{cmp.summary_line()}. The values are the same; partir's own runtime runs the plan as "
                     f"printed.{fix}", stacklevel=4)

    def _constraints(self) -> dict:
        """FX node name -> partition spec, for every value whose layout XLA can be told: each value's final
        partir sharding (axes no tactic decided are replicated, as in partir's lowering); a strided value's layout
        as _strided_layout says, if any."""
        g, out = self.plan.graph, {}
        for node in self.cap.gm.graph.nodes:
            if node.op != "call_function" or node not in g.vid:
                continue
            sh = self.plan.sharding(g.vid[node])
            if node.name in self.forms:                        # its split view's spec (None: a pending reduction)
                spec = self.forms[node.name].spec
            else:
                if sh.strides:
                    sh = self._strided_layout(node, sh) or sh  # else partition_spec is None: left to GSPMD
                elif sh.partial and self._reduced_at_every_use(g.vid[node]):
                    sh = Sharding.interned(sh.dims, (), sh.replicated, (), sh.blocks)
                spec = xdev.partition_spec(sh)
            if spec is not None:
                out[node.name] = spec
        return out

    def _reduced_at_every_use(self, v: int) -> bool:
        """Whether partir's lowering reduces partial value v before each of its uses (every user computes on it
        reduced; none keeps it partial, e.g. through a sum; the step does not return it). Such a value is then
        constrained to its reduced layout (its tiled dims kept, every other axis replicated), where partir reduces
        it: left unconstrained, GSPMD computes it tiled on an axis the plan leaves replicated (a weight gradient
        on 'tp' when the operands are replicated there), reduces that tile, and permutes it to the devices of the
        layout its user wants (collective-permutes on groups no mesh axis spans; tests/xla)."""
        from ..lower.lower import op_layouts

        g = self.plan.graph
        node = g.values[v]
        if not g.users[v] or any(u.op == "output" for u in node.users):
            return False
        for i in g.users[v]:
            wants, _ = op_layouts(self.plan.decisions, i)
            for j, w in enumerate(g.ops[i].operands):
                if w == v and (wants[j] is None or wants[j].partial):
                    return False
        return True

    def _op_specs(self) -> tuple:
        """Where partir's lowering reshards, from lower.op_layouts (the layouts each op computes under):
        ({FX node name: {operand node: spec}} for operands the op uses laid out otherwise than their value, and
        {FX node name: spec} for results the op makes in another layout than their value keeps). Constrained
        copies there make XLA reshard at the same op, the same way (e.g. a dispatch einsum computed on local token
        groups and its result exchanged by all_to_all, not the tokens gathered)."""
        from ..lower.lower import op_layouts
        from ..rules.registry import tensor_operands

        g, d, operands, results = self.plan.graph, self.plan.decisions, {}, {}
        spec_of = lambda v: xdev.partition_spec(d.sharding(v))   # noqa: E731
        for i, op in enumerate(g.ops):
            if op.node.op != "call_function":      # ops without a rule too: partir makes their operands whole
                continue
            wants, makes = op_layouts(d, i)
            for a, v, want in zip(tensor_operands(op.node), op.operands, wants):
                spec = xdev.partition_spec(want) if want is not None else None
                if spec is not None and spec != spec_of(v):
                    operands.setdefault(op.node.name, {}).setdefault(a, spec)
            for v, make in zip(op.results, makes):
                spec = xdev.partition_spec(make) if v is not None and make is not None else None
                if spec is not None and spec != spec_of(v):
                    results[g.values[v].name] = spec
        return operands, results

    # -- the Backend protocol -------------------------------------------------------------------------------------
    @property
    def reports(self) -> "XlaReports":
        """What XLA compiled: prog.hlo(), prog.collectives(), prog.compare()."""
        return XlaReports(self)

    def valid(self) -> bool:
        return True

    def program(self, plan):
        """The captured global step (run() interprets it on XLA tensors), with each placeholder's layout."""
        return XlaStep(plan.captured.gm, [self.layouts.get(n) for n in plan.captured.input_names],
                       [None] * len(plan.captured.input_names))

    def shard(self, full: torch.Tensor, sh) -> torch.Tensor:
        """`full` on the XLA devices, laid out as `sh`."""
        x = full.detach().to(self.device)
        f = form_of(sh, tuple(full.shape), self.mesh)
        if f is not None:                     # held as its split view
            x, spec = x.reshape(f.held), f.spec
        else:
            spec = xdev.partition_spec(xdev.unstrided(sh))
        if spec is None:
            raise PartitionError(f"to_xla: a held value is laid out {sh}, a pending reduction, which an XLA tile "
                                 f"assignment cannot express. Reduce it in the step (a partial state value has no "
                                 f"XLA form).")
        if any(spec):
            _mark(x, self.xmesh, spec)
        return x

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self.device)

    def coords(self) -> list:
        return []                 # the global step has no per-rank coordinates

    def run(self, gm, args) -> list:
        import torch_xla

        mode = self.cap.mode
        before = xdev.dumped_modules() if mode not in self.modules and xdev._dump_dir else None
        host_before = _host_op_counts()
        outs = _Run(gm, self.device, self.xmesh, self.constraints, self._regather, self.op_specs,
                    self.rewriter).run(*args)
        outs = self._held_outputs(gm, outs)
        torch_xla.sync()
        if before is not None:
            self._remember_module(mode, before)
        self._check_host_ops(host_before)
        self._check_layouts(mode)
        return list(outs)

    def _held_outputs(self, gm, outs) -> list:
        """The step's outputs as the state holds them (a new parameter in its split view, as shard() places it)
        and the others (loss, gradients) in their own shapes."""
        if self.rewriter is None:
            return list(outs)
        ret = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
        out = []
        for name, node, t in zip(self.cap.output_names, ret, outs):
            f = form_of(self.layouts[name], self.rewriter.shape(node), self.mesh) if name in self.layouts else None
            out.append(t.reshape(f.held if f is not None else self.rewriter.shape(node))
                       if isinstance(t, torch.Tensor) and isinstance(node, fx.Node) else t)
        return out

    def full(self, t, sh, shape) -> torch.Tensor:
        return t.cpu().reshape(shape)          # a split view (strided Form) back to the value's shape

    def local_full(self, sh) -> bool:
        return False                          # a device-to-host transfer (and a sync) per value

    def full_into(self, dest: torch.Tensor, t, sh, shape) -> None:
        dest.copy_(self.full(t, sh, shape))

    def value(self, t, sh, shape) -> torch.Tensor:
        return t.cpu().reshape(shape)

    def rank0(self, t) -> torch.Tensor:
        return t.cpu()

    def _check_host_ops(self, before: dict) -> None:
        """Ops torch-xla ran on the host during this step split it into several XLA programs (hlo() holds one of
        them): name them once (compare() reports them too); kernels.py is where an XLA form goes."""
        new = [op for op, n in _host_op_counts().items() if n > before.get(op, 0) and op not in self.host_ops]
        if new:
            self.host_ops += new
            warn(f"to_xla: torch-xla ran {', '.join(new)} on the host: the step is split into several XLA "
                 f"programs and hlo()/compare() see the largest only. Give the op an XLA form in "
                 f"partir_torch/xla/kernels.py.", stacklevel=3)

    def hlo_text(self, mode: str) -> str:
        """The post-partitioning HLO XLA compiled for `mode` (a key of self.modules)."""
        with open(os.path.join(xdev.dump_dir(), self.modules[mode])) as f:
            return f.read()

    def _remember_module(self, mode: str, before: dict) -> None:
        """The largest module compiled by this step's sync is the step (small ones move data)."""
        new = {f: size for f, size in xdev.dumped_modules().items() if f not in before}
        if new:
            self.modules[mode] = max(new, key=new.get)



@dataclass(frozen=True)
class XlaStep:
    """What XlaBackend.run runs: the global step graph, and each captured placeholder's layout."""

    gm: fx.GraphModule
    input_layouts: list
    local_shapes: list


class XlaReports:
    """What the torch-xla backend compiled (runtime/backend.py's BackendReports), read by the Program that runs on
    it: prog.hlo(), prog.collectives() (XLA's), prog.compare()."""

    def __init__(self, backend: "XlaBackend"):
        self.backend, self.plan, self.cap = backend, backend.plan, backend.cap

    @property
    def host_ops(self) -> list:
        return self.backend.host_ops

    def hlo(self, mode: str | None = None) -> str:
        """The post-partitioning HLO (after XLA's SPMD partitioner) of the step, as XLA compiled it at the first
        call (train_step, or forward / loss_and_grads); runs nothing itself."""
        modules = self.backend.modules
        if not modules:
            raise PartitionError("prog.hlo() of a to_xla() program: run a step first (train_step / prog(...) / "
                                 "loss_and_grads); the HLO is the one XLA compiled for it.")
        if mode is None:
            mode = self.cap.mode if self.cap.mode in modules else next(iter(modules))
        return self.backend.hlo_text(mode)

    def collectives(self) -> list:
        """XlaCollectives of the partitioned HLO: kind, mesh axis, bytes, dtype (fields as prog.collectives())."""
        return parse_collectives(self.hlo(), self.plan.mesh)

    def compare(self, tolerance: float = 0.05):
        """partir's per-device collectives against XLA's, per kind and axis (count and bytes). See compare.py."""
        from .compare import compare

        return compare(self.plan, self.collectives(), tolerance, host_ops=self.host_ops)
