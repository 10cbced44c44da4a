"""The model's outputs as the flat tensors a traced step returns, and back.

Containers are taken apart as torch's pytree does (tuples, lists, dicts, and the classes libraries register: HF's
ModelOutput). A leaf that is an object, such as the KV cache HF causal LMs return by default (`use_cache=True`:
a DynamicCache whose layers hold `keys` and `values`), is taken apart by its attributes: its tensors become
outputs of the step, everything else (ints, flags, dtypes, devices) is kept in a template, and each call rebuilds a
new object of the same class around the tensors it returned. Nothing is registered with pytree: flattening the
user's objects elsewhere in the process is left as it was.

    leaves, spec = flatten_outputs(model(tokens))   # logits, then each layer's keys and values
    out = spec.unflatten(leaves)                    # the same ModelOutput, its cache a new DynamicCache
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import TraceError


class _Slot:
    """Where a tensor of a taken-apart object goes."""

    def __repr__(self) -> str:
        return "<tensor>"


_SLOT = _Slot()


@dataclass(frozen=True)
class _Obj:
    """An object rebuilt without calling its __init__: a new instance of `cls` with these attributes."""

    cls: type
    attrs: tuple                     # (name, template) per attribute, in the object's order


@dataclass(frozen=True)
class _Seq:
    kind: type                       # list, tuple, or a namedtuple class
    items: tuple


@dataclass(frozen=True)
class _Map:
    kind: type                       # dict or OrderedDict
    items: tuple                     # (key, template)


@dataclass(frozen=True)
class OutputSpec:
    """The structure of the model's outputs: torch's pytree spec, with the templates of the object leaves."""

    tree: object                     # pytree TreeSpec; an object leaf is one leaf in it
    objects: tuple                   # (leaf index in `tree`, template, number of tensors, class name) per object
    num_leaves: int                  # the flat outputs of the step (the tensors of object leaves included)

    def unflatten(self, flat) -> object:
        flat = list(flat)
        if len(flat) != self.num_leaves:
            raise ValueError(f"OutputSpec.unflatten: {len(flat)} values for {self.num_leaves} outputs")
        objects = {i: (template, n) for i, template, n, _ in self.objects}
        leaves, k = [], 0
        for i in range(self.tree.num_leaves):
            template, n = objects.get(i, (None, 1))
            leaves.append(flat[k] if template is None else _rebuild(template, iter(flat[k:k + n])))
            k += n
        return tree_unflatten(leaves, self.tree)

    def objects_note(self) -> str:
        """'DynamicCache (8 tensors)' per object leaf: what the step returns beyond the tensors the user sees."""
        return ", ".join(f"{name} ({n} tensors)" for _, _, n, name in self.objects)


def flatten_outputs(out) -> tuple[list, OutputSpec]:
    """The outputs' tensors in order (an object leaf's tensors in its attribute order), and their structure."""
    leaves, tree = tree_flatten(out)
    flat, objects = [], []
    for i, x in enumerate(leaves):
        if _is_object(x):
            start = len(flat)
            template = _take_apart(x, flat, f"output {i} ({type(x).__name__})", set())
            objects.append((i, template, len(flat) - start, type(x).__name__))
        else:
            flat.append(x)
    return flat, OutputSpec(tree, tuple(objects), len(flat))


_PLAIN = (int, float, bool, str, bytes, type(None), type, torch.dtype, torch.device)


def _is_object(x) -> bool:
    return not isinstance(x, (torch.Tensor,) + _PLAIN)


def _attributes(x) -> dict:
    """An object's attributes: its __dict__, or the slots it fills."""
    if hasattr(x, "__dict__"):
        return vars(x)
    slots = [s for c in type(x).__mro__ for s in getattr(c, "__slots__", ())]
    return {s: getattr(x, s) for s in slots if hasattr(x, s)}


def _take_apart(x, flat: list, where: str, seen: set):
    """The template of `x`; its tensors appended to `flat`. Objects and containers holding no tensor are kept as
    they are (a config the cache refers to), objects holding tensors are rebuilt, and a tensor hidden where the
    template cannot reach it (an object without __dict__, a container subclass) is refused by its path."""
    if isinstance(x, torch.Tensor):
        flat.append(x)
        return _SLOT
    if not _holds_tensors(x, set()):
        return x
    if id(x) in seen:
        raise TraceError(f"partition: the model's {where} refers to itself; its tensors cannot be returned by the "
                         f"traced step. Return tensors (for an HF model: use_cache=False).")
    seen = seen | {id(x)}
    if type(x) in (list, tuple) or (isinstance(x, tuple) and hasattr(x, "_fields")):
        return _Seq(type(x), tuple(_take_apart(v, flat, f"{where}[{i}]", seen) for i, v in enumerate(x)))
    if type(x) in (dict, OrderedDict):
        return _Map(type(x), tuple((k, _take_apart(v, flat, f"{where}[{k!r}]", seen)) for k, v in x.items()))
    if hasattr(x, "__dict__") and not isinstance(x, (list, tuple, dict, set, frozenset)):
        return _Obj(type(x), tuple((k, _take_apart(v, flat, f"{where}.{k}", seen)) for k, v in vars(x).items()))
    raise TraceError(f"partition: the model's {where} is a {type(x).__name__} holding tensors that the traced step "
                     f"cannot return (not a list, tuple, dict or an object with a __dict__). Return tensors from "
                     f"forward (for an HF model: use_cache=False).")


def _holds_tensors(x, seen: set) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if id(x) in seen or isinstance(x, _PLAIN):
        return False
    seen.add(id(x))
    if isinstance(x, (list, tuple, set, frozenset)):
        return any(_holds_tensors(v, seen) for v in x)
    if isinstance(x, dict):
        return any(_holds_tensors(v, seen) for v in x.values())
    if isinstance(x, torch.nn.Module):          # a module the output refers to: its parameters are not outputs
        return False
    return any(_holds_tensors(v, seen) for v in _attributes(x).values())


def _rebuild(template, tensors):
    if template is _SLOT:
        return next(tensors)
    if isinstance(template, _Obj):
        obj = template.cls.__new__(template.cls)
        for k, v in template.attrs:
            obj.__dict__[k] = _rebuild(v, tensors)
        return obj
    if isinstance(template, _Seq):
        items = [_rebuild(v, tensors) for v in template.items]
        return template.kind(*items) if hasattr(template.kind, "_fields") else template.kind(items)
    if isinstance(template, _Map):
        return template.kind((k, _rebuild(v, tensors)) for k, v in template.items)
    return template
