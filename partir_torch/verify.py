"""Brute-force numeric verification of tile-mapping rules (DESIGN §5.1; DTensor's strategy_validation idea). It sits
above rules/ and lower/ (it runs ops with localised arguments and the indexed kernels).

For one node of a captured graph: draw real inputs shaped like its operands, run the op whole (the reference),
then for every PASS / REDUCE factor f and split count k: cut every dim whose major factor is f into k contiguous
chunks, run the op once per rank with localised shape arguments, reassemble (concatenate dims that hold f; reduce
results that lack a REDUCE f; compare every rank with the whole where a PASS f is absent), compare. Each linear
mode is checked by splitting its operands into k uneven random parts that reduce to the value. A mismatch is a
WRONG rule; an op without a rule is MISSING. NEED_REP and BLOCKED factors are conservative: counted, not checked.

    report = verify_graph(captured.gm, default_registry())
    print(report)                     # summary, then WRONG and MISSING rows
    assert not report.wrong and not report.missing
"""
from __future__ import annotations

import functools
import math
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from .lower.indexed import IMPLS, SIZED
from .rules.localize import localize_args
from .rules.factors import BLOCKED, NEED_REP, PASS, REDUCE, OpRule
from .rules import tags
from .rules.indexing import structural_zero
from .rules.registry import RuleRegistry, default_registry, result_vals, tensor_operands

WRONG, MISSING, ERROR = "wrong", "missing", "error"
SPLITS = (2, 3)
RTOL = ATOL = 1e-5
_LETTERS = "abcdefghijklmnopqrstuvwxyz"   # factor names, as OpRule prints them

aten = torch.ops.aten
# Ops whose values are undefined or random: only the local shapes and dtypes are compared.
SHAPE_ONLY = tags.ops("uninitialised") | tags.ops("random")
_REDUCERS = {op: functools.partial(functools.reduce, fn)   # elementwise over ranks, dtype kept
             for op, fn in (("sum", torch.add), ("max", torch.maximum), ("min", torch.minimum))}


@dataclass(frozen=True)
class Finding:
    """One failed (WRONG), absent (MISSING) or unrunnable (ERROR) check of one node."""

    kind: str
    op: str
    node: str
    check: str = ""       # "factor b=8 pass k=2" | "linear sum in {0, 1} k=3"
    slot: str = ""        # "result 0"
    error: float = 0.0    # max abs error; inf when shapes differ or the op raised
    detail: str = ""

    def __str__(self):
        err = f" err={self.error:.3g}" if self.kind == WRONG else ""
        parts = [p for p in (self.check, self.slot) if p]
        return f"{self.kind.upper()} {self.op} ({self.node}) {' '.join(parts)}{err} {self.detail}".rstrip()


@dataclass
class Report:
    """What verify_graph checked and found."""

    ops: set = field(default_factory=set)
    nodes: int = 0
    factor_checks: int = 0
    linear_checks: int = 0
    skipped_minor: int = 0                                    # factors held only as a minor factor somewhere
    conservative: Counter = field(default_factory=Counter)    # (op, NEED_REP | BLOCKED) -> factors
    findings: list = field(default_factory=list)

    def of(self, kind: str) -> list:
        return [f for f in self.findings if f.kind == kind]

    wrong = property(lambda self: self.of(WRONG))
    missing = property(lambda self: self.of(MISSING))
    errors = property(lambda self: self.of(ERROR))

    def merge(self, other: "Report") -> "Report":
        for name in ("nodes", "factor_checks", "linear_checks", "skipped_minor"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.ops |= other.ops
        self.conservative.update(other.conservative)
        self.findings += other.findings
        return self

    def count(self, op: str, rule: OpRule, dtypes: list) -> None:
        """Count the checks verify_node runs for `rule`, and the factors it leaves unchecked."""
        self.factor_checks += len(factor_cases(rule))
        self.linear_checks += len(linear_cases(rule, dtypes))
        self.skipped_minor += sum(fac.kind in (PASS, REDUCE) and _held_as_minor(rule, f)
                                  for f, fac in enumerate(rule.factors))
        for fac in rule.factors:
            if fac.kind in (NEED_REP, BLOCKED):
                self.conservative[(op, fac.kind)] += 1

    def __str__(self):
        lines = [f"rules verified: {len(self.ops)} ops, {self.nodes} nodes, {self.factor_checks} factor checks, "
                 f"{self.linear_checks} linear checks, {self.skipped_minor} minor-only factors skipped; "
                 f"{len(self.wrong)} wrong, {len(self.missing)} missing, {len(self.errors)} errors"]
        for title, rows in (("WRONG", self.wrong), ("MISSING", self.missing), ("ERROR", self.errors)):
            if rows:
                lines.append(f"{title}:")
                lines += [f"  {f}" for f in rows]
        if self.conservative:
            cons = sorted(f"{op} {n} {kind}" for (op, kind), n in self.conservative.items())
            lines.append("conservative (never tiled, not checked): " + "; ".join(cons))
        return "\n".join(lines)


# ---- inputs: random, but valid where the op reads indices ------------------------------------------------------
def _arg(node: fx.Node, i: int, name: str):
    return node.args[i] if len(node.args) > i else node.kwargs[name]


def _shape(node: fx.Node, i: int) -> tuple:
    return tuple(node.args[i].meta["val"].shape)


def _along_dim(node: fx.Node) -> int:
    """Size of x's indexed dim, for ops called as op(x, dim, index, ...)."""
    x = _shape(node, 0)
    return x[_arg(node, 1, "dim") % len(x)]


def _index_bound(node: fx.Node, bound: tuple) -> int:
    """The exclusive upper bound of an op's index values (rules/tags.py IndexArg.bound)."""
    kind, *at = bound
    if kind == "rows":
        return _shape(node, at[0])[0]
    if kind == "last":
        return _shape(node, at[0])[-1]
    return _arg(node, *at) if kind == "arg" else _along_dim(node)


# op -> (tensor operand slot of the indices, exclusive upper bound of index values, unique along `dim`)
INDEX_OPERANDS = {op: (index.slot, functools.partial(_index_bound, bound=index.bound), index.unique)
                  for op, index in tags.INDEX_ARGS.items()}
# Ops drawn on positive floats, so that random inputs stay in their domain (no NaN hiding a mismatch).
POSITIVE = tags.ops("positive_domain")


def _indices(node: fx.Node, val: torch.Tensor, bound: int, unique: bool, gen) -> torch.Tensor:
    shape = tuple(val.shape)
    if not unique:
        return torch.randint(0, bound, shape, generator=gen, dtype=val.dtype)
    dim = _arg(node, 1, "dim") % len(shape)   # a random permutation of 0..bound-1 along dim, cut to size
    wide = shape[:dim] + (bound,) + shape[dim + 1:]
    return torch.rand(wide, generator=gen).argsort(dim).narrow(dim, 0, shape[dim]).to(val.dtype)


def _random(val: torch.Tensor, positive: bool, gen) -> torch.Tensor:
    shape = tuple(val.shape)
    if val.dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    if val.is_complex():
        return torch.randn(shape, generator=gen, dtype=val.dtype)
    if not val.is_floating_point():
        return torch.randint(0, 4, shape, generator=gen, dtype=val.dtype)
    x = torch.rand(shape, generator=gen) + 0.5 if positive else torch.randn(shape, generator=gen)
    return x.to(val.dtype)


def make_inputs(node: fx.Node, gen: torch.Generator) -> list:
    """Real random tensors for the node's tensor operand slots, shaped and typed like their meta["val"] (zeros
    for an operand that is zero by construction: a rule may rely on it, see rules/indexing.structural_zero)."""
    slot, bound, unique = INDEX_OPERANDS.get(node.target, (-1, None, False))
    return [_indices(node, a.meta["val"], int(bound(node)), unique, gen) if i == slot
            else torch.zeros(tuple(a.meta["val"].shape), dtype=a.meta["val"].dtype) if structural_zero(a)
            else _random(a.meta["val"], node.target in POSITIVE, gen) for i, a in enumerate(tensor_operands(node))]


# ---- running one node ----------------------------------------------------------------------------------------
def _results(out) -> list:
    return [out] if isinstance(out, torch.Tensor) else [o if isinstance(o, torch.Tensor) else None for o in out]


class _Eager:
    """Stands in for lowering's Emitter: runs each op at once (to verify the indexed kernels of lower/indexed.py)."""

    def call(self, target, *args, kwargs=None, **meta):
        return target(*args, **(kwargs or {}))


def run_node(node: fx.Node, operands: list, in_local: list | None = None, out_local: list | None = None,
             offset: tuple | None = None) -> list:
    """Run node's op with its tensor operand slots replaced by `operands`, shape args localised for the given local
    shapes (None: global shapes). offset=(first position, shard size, dim size): run the op's indexed kernel for that
    shard.
    Returns the per-result-slot tensors (None for non-tensor results)."""
    flat, spec = tree_flatten((node.args, node.kwargs))
    slots = iter(operands)
    flat = [next(slots) if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
            else a.meta.get("val") if isinstance(a, fx.Node) else a for a in flat]
    args, kwargs = tree_unflatten(flat, spec)
    if in_local is not None:
        args, kwargs = localize_args(node, args, kwargs, in_local, out_local)
    if offset is not None:
        impl = IMPLS[node.target]
        size = {"size": offset[2]} if impl in SIZED else {}
        return _results(impl(_Eager(), args, kwargs, torch.tensor(offset[0]), offset[1], **size))
    return _results(node.target(*args, **kwargs))


# ---- comparing -----------------------------------------------------------------------------------------------
def _error(got: torch.Tensor, ref: torch.Tensor, scale: float, shape_only: bool) -> float:
    """0 when got matches ref (fp32: rtol 1e-5, atol 1e-5 * scale; ints and bools exact), else the max abs error."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return math.inf
    if shape_only or got.numel() == 0:
        return 0.0
    if ref.is_complex():                # (real, imaginary) pairs, compared as floats
        got, ref = torch.view_as_real(got), torch.view_as_real(ref)
    if not ref.is_floating_point():
        ok = torch.equal(got, ref)
    else:   # a result in a low-precision dtype is as exact as its rounding (a few ulps)
        tol = max(RTOL, 4 * torch.finfo(ref.dtype).eps)
        ok = torch.allclose(got, ref, rtol=tol, atol=tol * scale, equal_nan=True)
    return 0.0 if ok else float((got.double() - ref.double()).abs().nan_to_num(math.inf).max())


def _scale(ts) -> float:
    """The magnitude the absolute tolerance is relative to: the largest finite value among `ts`."""
    finite = [t[torch.isfinite(t)].abs() for t in ts if t is not None and (t.is_floating_point() or t.is_complex())]
    return max([1e-6] + [float(x.max()) for x in finite if x.numel()])


# ---- factor checks -------------------------------------------------------------------------------------------
def _major_dims(dims, f: int) -> list:
    return [d for d, fs in enumerate(dims) if fs and fs[0] == f]


def _held_as_minor(rule: OpRule, f: int) -> bool:
    return any(f in fs[1:] for _, _, dims in rule.slots() for fs in dims)


def factor_cases(rule: OpRule) -> list:
    """(factor id, k) for every checkable factor: PASS or REDUCE, k divides it, never held as a minor factor."""
    return [(f, k) for f, fac in enumerate(rule.factors) if fac.kind in (PASS, REDUCE) and not _held_as_minor(rule, f)
            for k in SPLITS if fac.size % k == 0]


def _chunk(t: torch.Tensor, dims: list, k: int, r: int) -> torch.Tensor:
    for d in dims:
        n = t.shape[d] // k
        t = t.narrow(d, r * n, n)
    return t.contiguous()


def _local_shape(shape, dims, f: int, k: int):
    """`shape` with every dim whose major factor is f divided by k (slots outside the rule stay whole)."""
    major = set(_major_dims(dims or (), f))
    return None if shape is None else tuple(s // k if d in major else s for d, s in enumerate(shape))


def check_factor(node, rule: OpRule, inputs: list, ref: list, f: int, k: int) -> list:
    """Tile factor f k ways: run per rank on chunks, reassemble, compare with the reference."""
    fac = rule.factors[f]
    check = f"factor {_LETTERS[f] if f < 26 else f}={fac} {fac.kind} k={k}"
    out_shapes = [None if t is None else tuple(t.shape) for t in ref]
    in_local = [_local_shape(x.shape, d, f, k) for x, d in zip(inputs, rule.operands)]
    out_local = [_local_shape(s, d, f, k) for s, d in zip(out_shapes, rule.results)]
    outs = []
    for r in range(k):
        local = [x if d is None else _chunk(x, _major_dims(d, f), k, r) for x, d in zip(inputs, rule.operands)]
        try:
            off = (r * (fac.size // k), fac.size // k, fac.size) if fac.indexed else None
            outs.append(run_node(node, local, in_local, out_local, off))
        except Exception as e:  # noqa: BLE001 - a rank that cannot run is a wrong rule (or a missing localisation)
            return [_finding(WRONG, node, check, "", math.inf, f"rank {r} raised {type(e).__name__}: {e}")]
    return [x for j, dims in enumerate(rule.results) if dims is not None and ref[j] is not None
            for x in _compare_factor(node, fac, check, j, dims, f, [o[j] for o in outs], ref[j], out_local[j])]


def _compare_factor(node, fac, check, j, dims, f, per_rank, ref, local_shape) -> list:
    shape_only = node.target in SHAPE_ONLY
    slot = f"result {j}"
    bad = [tuple(t.shape) for t in per_rank if tuple(t.shape) != tuple(local_shape)]
    if bad:
        return [_finding(WRONG, node, check, slot, math.inf, f"local shape {bad[0]}, expected {local_shape}")]
    major = _major_dims(dims, f)
    if major:
        candidates = [torch.cat(per_rank, dim=major[0])]
    elif fac.kind == REDUCE:
        candidates = [_REDUCERS[fac.reduce_op](per_rank)]
    else:
        candidates = per_rank   # f is absent from this result: every rank must hold it whole
    scale = _scale([ref] + per_rank)
    err = max(_error(c, ref, scale, shape_only) for c in candidates)
    return [_finding(WRONG, node, check, slot, err)] if err > 0 else []


# ---- linear-mode checks --------------------------------------------------------------------------------------
def linear_cases(rule: OpRule, dtypes: list) -> list:
    """(slots, reduce op, k) for every linear mode whose operands are numeric (a partial bool means nothing)."""
    cases = []
    for slots, ops in rule.linear:
        if all(i < len(dtypes) and dtypes[i] != torch.bool for i in slots):
            cases += [(tuple(sorted(slots)), op, k) for op in ops for k in SPLITS]
    return cases


def split_partial(x: torch.Tensor, op: str, k: int, gen: torch.Generator) -> list:
    """k uneven random parts of x that reduce (op) to x: sum -> random parts plus the remainder; max/min -> a random
    owner rank holds each element, the others hold something strictly smaller/larger."""
    def noise(lo, hi):
        if x.is_complex():              # real and imaginary parts each in [lo, hi)
            return torch.rand(x.shape, generator=gen, dtype=x.dtype) * (hi - lo) + complex(lo, lo)
        if x.is_floating_point():
            return (torch.rand(x.shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(x.dtype)
        return torch.randint(int(lo), int(hi) + 1, x.shape, generator=gen, dtype=x.dtype)

    if op == "sum":
        parts = [noise(-2, 2) for _ in range(k - 1)]
        return parts + [x - sum(parts)]
    owner = torch.randint(0, k, x.shape, generator=gen)
    sign = -1 if op == "max" else 1
    return [torch.where(owner == r, x, x + sign * noise(1, 3)) for r in range(k)]


def check_linear(node, rule: OpRule, inputs: list, ref: list, slots: tuple, op: str, k: int, gen) -> list:
    """Operands in `slots` are partial(op) over k ranks, the others replicated: reducing the results must give ref."""
    check = f"linear {op} in {set(slots)} k={k}"
    if op != "sum" and any(isinstance(t, torch.Tensor) and t.is_complex() for t in [*ref, *inputs]):
        return []                      # complex numbers have no order: no partial(max/min) of them exists
    parts = {i: split_partial(inputs[i], op, k, gen) for i in slots}
    try:
        outs = [run_node(node, [parts[i][r] if i in parts else x for i, x in enumerate(inputs)]) for r in range(k)]
    except Exception as e:  # noqa: BLE001
        return [_finding(WRONG, node, check, "", math.inf, f"raised {type(e).__name__}: {e}")]
    found = []
    for j, want in enumerate(ref):
        if want is not None and rule.results[j] is not None:
            per_rank = [o[j] for o in outs]
            scale = _scale([want] + per_rank + [p for i in slots for p in parts[i]])
            err = _error(_REDUCERS[op](per_rank), want, scale, node.target in SHAPE_ONLY)
            found += [_finding(WRONG, node, check, f"result {j}", err)] if err > 0 else []
    return found


# ---- nodes and graphs ----------------------------------------------------------------------------------------
def _finding(kind, node, check="", slot="", error=0.0, detail="") -> Finding:
    return Finding(kind, str(node.target), node.name, check, slot, error, detail.splitlines()[0] if detail else "")


def verify_node(node: fx.Node, rule: OpRule, seed: int = 0) -> list:
    """Every PASS/REDUCE factor (k = 2, 3) and every linear mode of `rule`, checked numerically on `node`."""
    gen = torch.Generator().manual_seed(seed)
    inputs = make_inputs(node, gen)
    try:
        ref = run_node(node, inputs)
    except Exception as e:  # noqa: BLE001 - the inputs drawn do not suit this op: say so, do not judge the rule
        return [_finding(ERROR, node, "reference", "", math.inf, f"{type(e).__name__}: {e}")]
    found = []
    for f, k in factor_cases(rule):
        found += check_factor(node, rule, inputs, ref, f, k)
    for slots, op, k in linear_cases(rule, [x.dtype for x in inputs]):
        found += check_linear(node, rule, inputs, ref, slots, op, k, gen)
    return found


def _pattern(node: fx.Node, rule: OpRule | None):
    """What makes two nodes of one op worth checking separately: the rule's structure (with which split counts
    divide each factor) and the operand and result dtypes."""
    vals = [a.meta["val"] for a in tensor_operands(node)] + result_vals(node)
    dtypes = tuple(str(v.dtype) for v in vals if v is not None)
    if rule is None:
        return (node.target, None, dtypes)
    kinds = tuple((f.kind, f.reduce_op, tuple(f.size % k == 0 for k in SPLITS)) for f in rule.factors)
    return (node.target, str(rule).split(" [")[0], kinds, dtypes, rule.linear)


def _cost(node: fx.Node) -> int:
    return sum(a.meta["val"].numel() for a in tensor_operands(node))


def representative_nodes(gm: fx.GraphModule, registry: RuleRegistry, per_target: int | None = None) -> list:
    """(node, rule or None, why-missing) for the smallest node of each distinct pattern (at most per_target per op;
    None: all)."""
    best: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or not result_vals(node):
            continue
        rule, why = _rule_of(node, registry)
        key = _pattern(node, rule)
        if key not in best or _cost(node) < _cost(best[key][0]):
            best[key] = (node, rule, why)
    chosen, per_op = [], Counter()
    for key, entry in best.items():
        if per_target is None or per_op[key[0]] < per_target:
            per_op[key[0]] += 1
            chosen.append(entry)
    return chosen


def _rule_of(node: fx.Node, registry: RuleRegistry):
    if node.target not in registry:
        return None, "no rule registered"
    rule = registry.build(node)
    if rule is None:
        return None, "the rule returned None for these arguments"
    if len(rule.operands) != len(tensor_operands(node)) or len(rule.results) != len(result_vals(node)):
        return None, (f"the rule has {len(rule.operands)} operand / {len(rule.results)} result slots, the call "
                      f"{len(tensor_operands(node))} / {len(result_vals(node))}")
    return rule, ""


def verify_graph(gm: fx.GraphModule, registry: RuleRegistry | None = None, per_target: int | None = None) -> Report:
    """Verify the rules of every distinct (op, pattern) of `gm` (see representative_nodes)."""
    registry = registry or default_registry()
    report = Report()
    for node, rule, why in representative_nodes(gm, registry, per_target):
        report.ops.add(str(node.target))
        report.nodes += 1
        if rule is None:
            report.findings.append(_finding(MISSING, node, detail=why))
            continue
        report.count(str(node.target), rule, [a.meta["val"].dtype for a in tensor_operands(node)])
        report.findings += verify_node(node, rule)
    return report
