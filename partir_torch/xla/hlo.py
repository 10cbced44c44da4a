"""Collectives of a post-partitioning HLO module, mapped back to the mesh axes of a pt.Mesh.

XLA prints a collective as one instruction, e.g.

    %all-gather.3 = f32[64,32]{1,0} all-gather(f32[32,32]{1,0} %p), channel_id=2,
        replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={0}, use_global_device_ids=true

Replica groups come either listed ({{0,2},{1,3}}) or in the iota form `[G,S]<=[dims]T(perm)`: the device ids
0..n-1 laid out as `dims`, transposed by `perm`, read as G groups of S. With `use_global_device_ids` (or a
channel id under SPMD) the ids are devices of the mesh, which are the mesh's ranks in row-major order here (the
XlaBackend builds its xs.Mesh over device ids 0..n-1), so a group's axes are the mesh axes its members differ on.

XLA's CPU pipeline has no reduce-scatter creator (GPU and TPU pipelines turn an all-reduce whose result each device
only dynamic-slices into a reduce-scatter): `parse_collectives` does the same reading, also where the result
passes through copies, transposes and reshapes (moves on the device) before the slice. It evaluates the slice
offsets per device (partition-id tables and scalar arithmetic) to find the axes the slice varies on: those axes
are a reduce_scatter of the all-reduce's bytes; the group's other axes an all_reduce of the slice. An all-reduce
over several axes is read as one all_reduce per axis of the same bytes (how partir lowers such a reduction). Sums of
all-reduced values over the same groups (reached through reshapes, transposes, copies, converts and scalings by a
constant, each with a single user) are read as one all-reduce of the sum: XLA's all-reduce reassociation, which
the GPU and TPU pipelines run after the algebraic simplifier, and what partir does by keeping a partial value
partial through a sum; a sum each device then only slices reads as one reduce_scatter. Where both summands
also pass the same collective-permute, the sum is read as one all-reduce then that permute (the permutes stay
listed: collective_permute has no partir counterpart).

Bytes follow the convention of partir's CollectiveRecord (nccl-tests): all_reduce and all_to_all: the operand,
all_gather: the result, reduce_scatter: the operand; collective_permute: the operand.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..mesh import Mesh

# HLO opcode -> the kind names partir's records use
KINDS = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
         "all-to-all": "all_to_all", "collective-permute": "collective_permute"}

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
DTYPE_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64", "s32": "int32",
               "s64": "int64", "pred": "bool", "u8": "uint8", "s8": "int8"}

# `%name = <result shape> <opcode>(<operands>), attrs`; async forms (-start) count once, their -done not at all
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
                    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"\b(?P<dt>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
# operand references (operands may be printed as bare names: their shapes are looked up)
_REF = re.compile(r"%([\w.\-]+)")


@dataclass(frozen=True)
class XlaCollective:
    """One collective of XLA's per-device program; the fields partir's CollectiveRecord has where they apply."""

    kind: str          # all_reduce | all_gather | reduce_scatter | all_to_all | collective_permute
    axis: str          # mesh axis; several axes joined by '+' (major to minor); '?' if the groups fit no axes
    group_size: int
    nbytes: int        # see the module docstring
    dtype: str
    node: str          # the HLO instruction's name
    tactic: str = ""   # XLA's program does not know the tactic; compare() matches by kind and axis
    groups: tuple = ()

    def __str__(self):
        return f"{self.kind}[{self.axis}x{self.group_size}] {self.nbytes}B {self.dtype} ({self.node})"


def _shape_bytes(text: str) -> tuple[int, str]:
    """Bytes of an HLO shape (an array or a tuple of arrays) and the dtype of its first array."""
    total, first = 0, ""
    for m in _ARRAY.finditer(text):
        dt = m.group("dt")
        if dt not in DTYPE_BYTES:
            continue
        dims = [int(x) for x in m.group("dims").split(",") if x]
        total += math.prod(dims) * DTYPE_BYTES[dt]
        first = first or DTYPE_NAMES.get(dt, dt)
    return total, first


def _balanced(text: str, start: int) -> str:
    """The text inside the bracket pair that opens at text[start] ('(' or '{')."""
    close = {"(": ")", "{": "}"}[text[start]]
    depth = 0
    for i in range(start, len(text)):
        if text[i] == text[start]:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
    return text[start + 1:]


def parse_replica_groups(line: str, n_devices: int) -> list:
    """The replica groups of a collective's line as lists of device ids (one group of all devices if absent).
    collective-permute has source_target_pairs instead: each pair is returned as a group."""
    m = re.search(r"source_target_pairs=\{", line)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", _balanced(line, m.end() - 1))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:   # iota form
        g, s = int(m.group(1)), int(m.group(2))
        dims = [int(x) for x in m.group(3).split(",")]
        perm = [int(x) for x in m.group(4).split(",")] if m.group(4) else list(range(len(dims)))
        ids = _iota_transposed(dims, perm)
        return [ids[i * s:(i + 1) * s] for i in range(g)]
    m = re.search(r"replica_groups=\{", line)
    if m:
        body = _balanced(line, m.end() - 1)
        groups = [[int(x) for x in grp.split(",") if x.strip()] for grp in re.findall(r"\{([\d,\s]*)\}", body)]
        if groups and any(groups):
            return groups
    return [list(range(n_devices))]


def _iota_transposed(dims: list, perm: list) -> list:
    """iota(prod(dims)) reshaped to dims, transposed by perm, flattened."""
    strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
    out_dims = [dims[p] for p in perm]
    out = []
    for flat in range(math.prod(dims)):
        idx, rem = [], flat
        for d in reversed(out_dims):
            idx.append(rem % d)
            rem //= d
        idx.reverse()
        out.append(sum(idx[k] * strides[perm[k]] for k in range(len(perm))))
    return out


def axes_of_groups(groups: list, mesh: Mesh) -> str:
    """The mesh axes the members of every group differ on ('+'-joined in mesh order), '?' when the groups are not
    the sub-meshes of a set of axes (then the group size is not the product of those axes' sizes)."""
    n = mesh.size
    varying: set = set()
    for grp in groups:
        if any(d >= n for d in grp):
            return "?"
        coords = [mesh.coordinate(d) for d in grp]
        varying |= {a for a in mesh.axes if len({c[a] for c in coords}) > 1}
    axes = [a for a in mesh.axes if a in varying]
    if not axes:
        return "-"          # groups of one device: no communication
    if any(len(grp) != math.prod(mesh.shape[a] for a in axes) for grp in groups):
        return "?"
    return "+".join(axes)


@dataclass
class _Instr:
    name: str
    shape: str
    op: str
    operands: list
    line: str


_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>[\w\-]+)\(")


def _instructions(lines: list) -> dict:
    out = {}
    for line in lines:
        m = _LINE.match(line)
        if m is None:
            continue
        operands = _balanced(line, m.end() - 1)
        out[m.group("name")] = _Instr(m.group("name"), m.group("shape"), m.group("op"), _REF.findall(operands), line)
    return out


_SCALAR_OPS = {"add": lambda a, b: a + b, "subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b,
               "divide": lambda a, b: int(a / b) if b else 0, "maximum": max, "minimum": min}


def _eval_index(ins: dict, name: str, pid: int, depth: int = 0):
    """The value of a scalar integer instruction on partition `pid` (slice offsets are computed from partition-id
    through constant tables and scalar arithmetic); None when it depends on anything else."""
    i = ins.get(name)
    if i is None or depth > 24:
        return None
    args = lambda: [_eval_index(ins, o, pid, depth + 1) for o in i.operands]   # noqa: E731
    if i.op in ("partition-id", "replica-id"):
        return pid
    if i.op == "constant":
        vals = [int(float(v)) for v in re.findall(r"-?\d+(?:\.\d+)?", i.line.split("constant(", 1)[1].split(")")[0])]
        return vals if "[]" not in i.shape.split("{")[0] else (vals[0] if vals else None)
    if i.op in ("reshape", "convert", "bitcast", "copy"):
        v = args()[0]
        return v[0] if isinstance(v, list) and len(v) == 1 else v
    if i.op == "dynamic-slice":
        table, *idx = args()
        return [table[idx[0]]] if isinstance(table, list) and idx and isinstance(idx[0], int) and \
            0 <= idx[0] < len(table) else None
    if i.op in _SCALAR_OPS:
        a = args()
        return None if any(not isinstance(v, int) for v in a) else _SCALAR_OPS[i.op](*a)
    if i.op == "clamp":
        lo, v, hi = args()
        return None if None in (lo, v, hi) else max(lo, min(v, hi))
    return None


def _users(ins: dict) -> dict:
    out: dict = {}
    for i in ins.values():
        for o in set(i.operands):
            out.setdefault(o, []).append(i.name)
    return out


def _local_chain_end(ins: dict, users_of: dict, name: str) -> str:
    """The end of the chain of single users of `name` that only move its elements on the device (copies,
    transposes, reshapes, bitcasts: how a constrained weight gradient comes out of the partitioner, e.g. all-reduce,
    transpose, copy, dynamic-slice); `name` itself when there is none. A slice at the end of such a chain keeps the
    same share of the all-reduced elements as a slice of the all-reduce itself."""
    at = name
    while len(users_of.get(at, ())) == 1:
        u = ins.get(users_of[at][0])
        if u is None or u.op not in ("copy", "transpose", "reshape", "bitcast") or u.operands[:1] != [at]:
            break
        at = u.name
    return at


def _scatter_axes(ins: dict, users_of: dict, ar: _Instr, groups: list, mesh: Mesh, start: str = ""):
    """If every user of all-reduce `ar` (or of the end of its _local_chain_end; `start`: the last add of a sum it is
    reassociated into, whose slices are then read) dynamic-slices it alike, the mesh axes (within the group) along
    which the slice offsets vary, when the slice is the share of the value they split it in; else None."""
    end = _local_chain_end(ins, users_of, start or ar.name)
    users = [ins[u] for u in users_of.get(end, ())]
    if not users or any(u.op != "dynamic-slice" or u.operands[0] != end for u in users) or \
            len({u.shape.split("{")[0] for u in users}) != 1:
        return None
    offsets = {}
    for d in groups[0]:
        offsets[d] = tuple(_eval_index(ins, o, d) for u in users[:1] for o in u.operands[1:])
        if any(not isinstance(v, int) for v in offsets[d]):
            return None
    coords = {d: mesh.coordinate(d) for d in groups[0]}
    axes = [a for a in mesh.axes if len({coords[d][a] for d in groups[0]}) > 1 and
            any(offsets[d] != offsets[e] for d in groups[0] for e in groups[0]
                if all(coords[d][b] == coords[e][b] for b in mesh.axes if b != a))]
    if not axes or _elements(users[0].shape) * math.prod(mesh.shape[a] for a in axes) != _elements(ar.shape):
        return None
    return axes


def _elements(shape: str) -> int:
    m = _ARRAY.search(shape)
    return math.prod(int(x) for x in m.group("dims").split(",") if x) if m else 0


_PASS = ("reshape", "bitcast", "copy", "convert", "transpose")


def _source(ins: dict, users: dict, name: str) -> tuple:
    """Walk up from an add's operand through single-user reshapes/transposes/copies/converts, scalings by a
    constant and collective-permutes; returns (where it stops, the permutations passed)."""
    perms = []
    while name in ins and len(users.get(name, ())) == 1:
        i = ins[name]
        if i.op in _PASS:
            name = i.operands[0]
        elif i.op == "collective-permute":
            perms.append(re.search(r"source_target_pairs=\{.*?\}\}", i.line).group(0))
            name = i.operands[0]
        elif i.op == "multiply" and len(i.operands) == 2 and any(
                ins.get(o) is not None and ins[o].op in ("broadcast", "constant") and
                (ins[o].op == "constant" or ins.get(ins[o].operands[0], _Instr("", "", "", [], "")).op == "constant")
                for o in i.operands):
            name = next(o for o in i.operands if ins.get(o) is None or ins[o].op not in ("broadcast", "constant"))
        else:
            break
    return name, tuple(perms)


def _reassociated(ins: dict, users: dict) -> dict:
    """all-reduce name -> the first all-reduce of the sum it is reassociated into (see the module docstring); and each
    add of such a sum -> that all-reduce."""
    rep: dict = {}            # all-reduce or add name -> representative all-reduce
    groups = {n: re.search(r"replica_groups=(\S+?)(?:, [a-z_]+=|$)", i.line) for n, i in ins.items()
              if i.op == "all-reduce"}
    for n, i in ins.items():
        if i.op == "all-reduce" and len(users.get(n, ())) == 1:
            rep[n] = n
        elif i.op == "add" and len(i.operands) == 2:
            (a, pa), (b, pb) = (_source(ins, users, o) for o in i.operands)
            ra, rb = rep.get(a), rep.get(b)
            if ra is None or rb is None or ra == rb or pa != pb:    # the same permutation on both sides only
                continue
            ga, gb = groups.get(ra), groups.get(rb)
            if ga is None or gb is None or ga.group(1) != gb.group(1):
                continue
            for k, v in list(rep.items()):
                if v == rb:
                    rep[k] = ra
            rep[n] = ra
    return {n: r for n, r in rep.items() if n in groups or ins[n].op == "add"}


def parse_collectives(hlo_text: str, mesh: Mesh) -> list:
    """XlaCollectives of an HLO module's text, in program order (every computation of the module)."""
    out = []
    lines = hlo_text.splitlines()
    ins = _instructions(lines)
    shapes = {name: i.shape for name, i in ins.items()}
    users = _users(ins)
    merged = _reassociated(ins, users)
    sum_end = {r: n for n, r in merged.items() if ins[n].op == "add"}   # program order: the last add of each sum
    for line in lines:
        m = _INSTR.match(line)
        if m is None:
            continue
        kind = KINDS[m.group("op")]
        res_bytes, dtype = _shape_bytes(m.group("shape"))
        operands = _balanced(line, m.end() - 1)
        op_bytes, op_dtype = _shape_bytes(operands)
        if op_bytes == 0:    # operands printed as names
            op_bytes, op_dtype = _shape_bytes(" ".join(shapes.get(r, "") for r in _REF.findall(operands)))
        if m.group("shape").startswith("(") and kind in ("all_gather", "collective_permute") and \
                "-start(" in line:
            res_bytes //= 2   # async start returns (operand, result): count the result only
        nbytes = res_bytes if kind == "all_gather" else op_bytes
        groups = parse_replica_groups(line, mesh.size)
        axis = axes_of_groups(groups, mesh)
        name = m.group("name")
        if kind == "all_reduce" and merged.get(name, name) != name:
            continue               # summed into an earlier all-reduce's value: reassociated into that one
        if kind == "all_reduce" and name in ins and axis not in ("?", "-"):
            scatter = _scatter_axes(ins, users, ins[name], groups, mesh, sum_end.get(name, ""))
            if scatter:        # all-reduce + dynamic-slice: reduce_scatter on the slice's axes, then the rest
                k = math.prod(mesh.shape[a] for a in scatter)
                out.append(XlaCollective("reduce_scatter", "+".join(scatter), k, nbytes, dtype or op_dtype, name,
                                         groups=tuple(tuple(g) for g in groups)))
                for a in (a for a in axis.split("+") if a not in scatter):
                    out.append(XlaCollective("all_reduce", a, mesh.shape[a], nbytes // k, dtype or op_dtype, name,
                                             groups=tuple(tuple(g) for g in groups)))
                continue
        if kind == "all_reduce" and "+" in axis:   # over several axes at once: one all_reduce per axis, as partir
            for a in axis.split("+"):               # lowers it (each moves the same bytes)
                out.append(XlaCollective(kind, a, mesh.shape[a], nbytes, dtype or op_dtype, name,
                                         groups=tuple(tuple(g) for g in groups)))
            continue
        size = len(groups[0]) if kind != "collective_permute" else \
            math.prod(mesh.shape[a] for a in axis.split("+")) if axis not in ("?", "-") else 0
        out.append(XlaCollective(kind, axis, size, nbytes, dtype or op_dtype, name,
                                 groups=tuple(tuple(g) for g in groups)))
    return out
