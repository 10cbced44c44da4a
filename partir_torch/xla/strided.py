"""Strided tilings carried out on XLA: a value tiled in strided blocks is held and computed as a split view.

A dim of size n tiled in s strided blocks on an axis (Megatron's packed q|k|v, c_attn's weight [d, 3d] tiled
{model:s3}: each rank holds its slice of q, of k and of v; eager attention's (B*H) folds {batch, model:sH}) has no
XLA tile assignment. The row-major view with that dim split as (s, n/s) has one: [d, 3, d] tiled on its last dim
(the axes before the strided one tile the s blocks). XlaBackend holds and computes such a value in that view, its
Form, and runs the step's ops that touch one rewritten to the views (Rewriter), so XLA's partitioner never sees a
strided layout:

    mm(x (N, d), W [d, 3d])          ->  einsum("nk,kst->nst", x, W as (d, 3, d))      # (N, 3, d), tiled on t
    split(y (B, T, 3d), d, dim=2)    ->  the (B, T, 3, d) view cut on its 3 blocks
    bmm(q (B*H, T, hd), k^T)         ->  einsum over (B, H, T, hd) views: batch tiles B, model tiles H

Every view of a value is a reshape of it, so an op without a rewrite here runs on the natural shapes and computes
the same values (XLA then moves what that costs; program.py's warning names it).
"""
from __future__ import annotations

import math
import operator
import string
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..rules.pointwise import RANDOM, rules as pointwise_rules
from ..rules import tags

aten = torch.ops.aten


@dataclass(frozen=True)
class Form:
    """How XLA holds a value with a strided tiling: its shape, each dim as (n,) or split (s, n/s), and the partition
    spec over the split dims (None for a pending reduction: GSPMD keeps it as it computes it)."""

    shape: tuple
    split: tuple
    spec: tuple | None

    @property
    def held(self) -> tuple:
        """The shape XLA holds: the split dims in a row."""
        return tuple(f for fs in self.split for f in fs)


def form_of(sh, shape, mesh) -> Form | None:
    """The Form of a strided layout, or None (no strided dim, or one the split view cannot tile plainly: several
    strided axes on a dim, axes tiling within the strided pieces, uneven tiles).

    >>> from partir_torch import Mesh, Sharding
    >>> form_of(Sharding(dims=((), ("model",)), strides=(("model", 3),)), (32, 96), Mesh({"model": 2}))
    Form(shape=(32, 96), split=((32,), (3, 32)), spec=(None, None, 'model'))
    """
    if not sh.strides or sh.blocks:
        return None
    split, axes_of = [], []
    for n, axes in zip(shape, sh.dims):
        strided = [a for a in axes if sh.stride(a) > 1]
        if not strided:
            split.append((n,))
            axes_of.append(axes)
            continue
        a, s = axes[-1], sh.stride(axes[-1])
        major = math.prod(mesh.shape[b] for b in axes[:-1])
        if strided != [a] or n % s or s % major or (n // s) % mesh.shape[a]:
            return None
        split.append((s, n // s))
        axes_of += [axes[:-1], (a,)]
    spec = None if sh.partial else tuple(None if not x else x[0] if len(x) == 1 else tuple(x) for x in axes_of)
    return Form(tuple(shape), tuple(split), spec)


def _flat(split) -> tuple:
    return tuple(f for fs in split for f in fs)


def _start(split, d: int) -> int:
    """The index of dim d's first factor in the held shape."""
    return sum(len(fs) for fs in split[:d])


def _aligned(shape, split, operand_shape) -> tuple:
    """A broadcast operand's held shape next to a result (shape, split): its dims right-aligned to the result's,
    each split as the result's dim, size-1 dims as ones."""
    off = len(shape) - len(operand_shape)
    return tuple(f for j, m in enumerate(operand_shape)
                 for f in (split[off + j] if m == shape[off + j] else (1,) * len(split[off + j])))


# natural einsum of the matmul family (capital letters; each is split as the forms around it split its dim)
MATMUL = tags.MATMUL_DIMS
VIEWS = tags.ops("reshape") | tags.ops("squeeze")
POINTWISE = frozenset(pointwise_rules()) - frozenset(RANDOM)


def _own(t):
    """A view made here as a value of its own (as kernels.xla_target runs view ops as their `_copy` forms): torch-xla
    regenerates a view from its base where it is used, which can drop the sharding annotation placed on it."""
    return t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t


def _zip_map(nodes, values, fn):
    """fn(node, value) for each FX node of an op's args and the value fetched for it; the rest as it is."""
    if isinstance(nodes, fx.Node):
        return fn(nodes, values)
    if isinstance(nodes, (list, tuple)):
        return type(values)(_zip_map(a, v, fn) for a, v in zip(nodes, values))
    return values


class Rewriter:
    """Runs the ops of the captured graph that touch a value held in a Form (run): rewritten onto the split views
    where an op family has a row below, else on the natural shapes (`fallbacks` names those ops)."""

    def __init__(self, forms: dict):
        self.forms = forms           # FX node name -> Form
        self.fallbacks: set = set()  # op names run on the natural shapes

    def involved(self, n) -> bool:
        return n.name in self.forms or any(a.name in self.forms for a in n.all_input_nodes)

    @staticmethod
    def shape(node) -> tuple:
        return tuple(node.meta["val"].shape)

    def held(self, node) -> tuple:
        """The shape `node`'s value is held in."""
        f = self.forms.get(node.name)
        return f.held if f is not None else self.shape(node)

    def split(self, node, t) -> tuple:
        """How tensor `t`, the value of `node`, is split now (its Form, or its natural shape)."""
        f = self.forms.get(node.name)
        return f.split if f is not None and tuple(t.shape) == f.held else tuple((m,) for m in self.shape(node))

    def natural(self, node, t):
        return t.reshape(self.shape(node)) if isinstance(t, torch.Tensor) and t.dim() != len(self.shape(node)) else t

    def run(self, n, fn, args, kwargs):
        rewrite = REWRITES.get(n.target)
        if rewrite is None and n.target in POINTWISE:
            rewrite = Rewriter.pointwise
        out = rewrite(self, n, fn, args, kwargs) if rewrite is not None else None
        out = out if out is not None else self.fallback(n, fn, args, kwargs)
        return type(out)(_own(o) for o in out) if isinstance(out, (list, tuple)) else _own(out)

    def fallback(self, n, fn, args, kwargs):
        """The op on the natural shapes; its results reshaped to how they are held."""
        self.fallbacks.add(str(n.target))
        args, kwargs = _zip_map((n.args, n.kwargs), (args, kwargs), self.natural)
        out = fn(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return out.reshape(self.held(n))
        if isinstance(out, (tuple, list)):
            users = {u.args[1]: u for u in n.users if u.target is operator.getitem}
            return type(out)(o.reshape(self.held(users[i])) if isinstance(o, torch.Tensor) and i in users else o
                             for i, o in enumerate(out))
        return out

    def getitem(self, n, fn, args, kwargs):
        return fn(*args, **kwargs)           # the producer made each item in its held shape

    def view(self, n, fn, args, kwargs):
        return args[0].reshape(self.held(n))  # row-major order is the same in every split of a value

    def pointwise(self, n, fn, args, kwargs):
        """Elementwise ops on the result's split: each tensor operand reshaped to it, broadcast dims as ones."""
        f = self.forms.get(n.name)
        if f is None:
            return None
        args, kwargs = _zip_map((n.args, n.kwargs), (args, kwargs), lambda a, t: t.reshape(
            _aligned(f.shape, f.split, self.shape(a))) if isinstance(t, torch.Tensor) else t)
        return fn(*args, **kwargs)

    def expand(self, n, fn, args, kwargs):
        """expand: the operand aligned to the result's split (broadcast dims as ones), expanded to its held shape."""
        f = self.forms.get(n.name)
        split = f.split if f is not None else tuple((m,) for m in self.shape(n))
        x = self.natural(n.args[0], args[0])
        return x.reshape(_aligned(self.shape(n), split, self.shape(n.args[0]))).expand(_flat(split))

    def permute(self, n, fn, args, kwargs):
        """t / transpose / permute: the held dims of each natural dim move together."""
        x, a = args[0], n.args[0]
        nd = len(self.shape(a))
        if n.target == aten.t.default:
            perm = list(range(nd))[::-1]
        elif n.target == aten.transpose.int:
            perm = list(range(nd))
            i, j = args[1] % nd, args[2] % nd
            perm[i], perm[j] = perm[j], perm[i]
        else:
            perm = [d % nd for d in args[1]]
        sp = self.split(a, x)
        held = [_start(sp, d) + k for d in perm for k in range(len(sp[d]))]
        return x.permute(held).reshape(self.held(n))

    def matmul(self, n, fn, args, kwargs):
        """mm / bmm / addmm as an einsum over the split views: a dim split anywhere is split in every operand."""
        bias = None
        if n.target == aten.addmm.default:
            if kwargs or len(args) > 3:          # beta / alpha
                return None
            bias, args, nodes = args[0], args[1:], n.args[1:]
        else:
            nodes = n.args
        eqs = MATMUL[n.target]
        letters: dict = {}
        for eq, sp in zip(eqs, [self.split(a, t) for a, t in zip(nodes, args)] +
                          [self.forms[n.name].split if n.name in self.forms else ()]):
            for letter, fs in zip(eq, sp):
                if len(fs) > 1:
                    if letters.setdefault(letter, fs) != fs:
                        return None
        names = iter(string.ascii_lowercase)
        sub = {c: "".join(next(names) for _ in letters.get(c, (0,))) for c in sorted(set("".join(eqs)))}
        split = lambda eq, shape: tuple(letters.get(c, (m,)) for c, m in zip(eq, shape))   # noqa: E731
        views = [t.reshape(_flat(split(eq, self.shape(a)))) for eq, a, t in zip(eqs, nodes, args)]
        y = torch.einsum(",".join("".join(sub[c] for c in eq) for eq in eqs[:2]) + "->" +
                         "".join(sub[c] for c in eqs[2]), *views)
        if bias is not None:
            out = split(eqs[2], self.shape(n))
            y = y + bias.reshape(_aligned(self.shape(n), out, self.shape(n.args[0])))
        return y.reshape(self.held(n))

    def split_op(self, n, fn, args, kwargs):
        """split / split_with_sizes: a split dim is cut on whole blocks of its minor factor."""
        x, a = args[0], n.args[0]
        shape, sp = self.shape(a), self.split(a, x)
        dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % len(shape)
        if n.target == aten.split.Tensor:
            sizes = [min(args[1], shape[dim] - i) for i in range(0, shape[dim], args[1])]
        else:
            sizes = list(args[1])
        unit = sp[dim][-1] if len(sp[dim]) > 1 else 1
        if any(c % unit for c in sizes):
            return None
        pieces = torch.split(x, [c // unit for c in sizes], _start(sp, dim))
        users = {u.args[1]: u for u in n.users if u.target is operator.getitem}
        return [p.reshape(self.held(users[i])) if i in users else p for i, p in enumerate(pieces)]

    def cat(self, n, fn, args, kwargs):
        """cat on the result's split: each operand split as the result, its blocks on the cat dim's first factor."""
        f = self.forms.get(n.name)
        if f is None or kwargs:
            return None
        dim = (args[1] if len(args) > 1 else 0) % len(f.shape)
        unit = f.split[dim][-1] if len(f.split[dim]) > 1 else 1
        pieces = []
        for a, t in zip(n.args[0], args[0]):
            m = self.shape(a)[dim]
            if m % unit:
                return None
            split = list(f.split)
            split[dim] = (m // unit, unit) if unit > 1 else (m,)
            pieces.append(t.reshape(_flat(split)))
        return torch.cat(pieces, _start(f.split, dim))

    def sum_dims(self, n, fn, args, kwargs):
        """sum over dims: over every factor of each (kept as ones, then reshaped to the result's held shape)."""
        x, a = args[0], n.args[0]
        if not args[1] or "keepdim" in kwargs:
            return None
        sp = self.split(a, x)
        dims = [_start(sp, d % len(sp)) + k for d in args[1] for k in range(len(sp[d % len(sp)]))]
        return fn(x, dims, True, *args[3:], **kwargs).reshape(self.held(n))


REWRITES = {op: Rewriter.view for op in VIEWS}
REWRITES.update({op: Rewriter.matmul for op in MATMUL})
REWRITES.update({
    operator.getitem: Rewriter.getitem, aten.expand.default: Rewriter.expand,
    aten.t.default: Rewriter.permute, aten.transpose.int: Rewriter.permute, aten.permute.default: Rewriter.permute,
    aten.split.Tensor: Rewriter.split_op, aten.split_with_sizes.default: Rewriter.split_op,
    aten.cat.default: Rewriter.cat, aten.sum.dim_IntList: Rewriter.sum_dims,
})
