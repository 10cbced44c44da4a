"""What `example_inputs` means: the step's batch, as the arguments loss_fn takes after the model (or, without a
loss_fn, the model's forward takes).

    example_inputs=(tokens, targets)   # two inputs: loss_fn(model, tokens, targets); train_step(tokens, targets)
    example_inputs=x                   # one tensor is one input: loss_fn(model, x) or model(x); train_step(x)
    example_inputs=batch               # a dict (an HF collator's batch) is one input: loss_fn(model, batch),
                                       # train_step(batch); without a loss_fn the model is called as model(**batch)

Every input is a pytree of tensors (tuples, lists, dicts), named inputs.<i> in flattening order.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

from ..errors import TraceError


def as_batch(example_inputs) -> tuple:
    """The positional inputs of the step: a tensor or a dict is one input (a mapping that is not a dict, such as
    HF's BatchEncoding, is read as a dict), a tuple or a list holds the inputs in order."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, Mapping):
        return (dict(example_inputs),)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(dict(x) if isinstance(x, Mapping) and not isinstance(x, dict) else x for x in example_inputs)
    raise TraceError(f"partition: example_inputs is a {type(example_inputs).__name__}; pass the batch as a tensor, "
                     f"a dict of tensors, or a tuple of them (the arguments loss_fn takes after the model, or the "
                     f"model's forward takes without a loss_fn).")


def check_leaves(batch: tuple) -> list:
    """The batch's tensors in flattening order; a leaf that is not a tensor is refused by its path."""
    flat = tree_flatten_with_path(batch)[0]
    for i, (path, x) in enumerate(flat):
        if not isinstance(x, torch.Tensor):
            raise TraceError(f"partition: example_inputs{keystr(path)} (inputs.{i}) is a {type(x).__name__} "
                             f"{_short_repr(x)}, not a tensor. Pass tensors only, and close over other values in "
                             f"loss_fn (or the model).")
    return [x for _, x in flat]


def forward_kwargs(model, batch: tuple) -> dict | None:
    """Without a loss_fn, a batch that is one dict is the model's keyword arguments (model(**batch), as HF models
    take a tokenizer's or collator's output) when its keys name parameters of forward; a dict none of whose keys
    does is passed whole (model(batch): a forward that takes a dict). None: call model(*batch)."""
    if len(batch) != 1 or not isinstance(batch[0], dict):
        return None
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return batch[0]
    keys = batch[0]
    try:
        sig.bind(**keys)
        return keys
    except TypeError as e:
        if not set(keys) & set(sig.parameters):
            return None
        raise TraceError(f"partition: example_inputs is a dict with keys {sorted(keys)}, passed to "
                         f"{type(model).__name__}.forward{sig} as keyword arguments, which it does not accept "
                         f"({e}). Use its parameter names as keys, or pass a loss_fn (it receives the dict: "
                         f"loss_fn=lambda m, batch: ...).") from None


def _short_repr(x) -> str:
    text = repr(x)
    return f"({text})" if len(text) <= 40 else f"({text[:37]}...)"


def conform(batch: tuple, spec) -> tuple:
    """A call's batch (train_step / eval_step / forward arguments) in the structure the step was captured with:
    mappings read as dicts (an HF BatchEncoding), dict keys in the captured order (pytree flattens a dict in its
    key order, so a batch with its keys in another order would feed the wrong inputs). A batch of another
    structure is refused, naming both."""
    from torch.utils._pytree import tree_flatten

    batch = tuple(dict(x) if isinstance(x, Mapping) and not isinstance(x, dict) else x for x in batch)
    got = tree_flatten(batch)[1]
    if spec is None or got == spec:
        return batch
    ordered = _like(batch, spec)
    if ordered is None or tree_flatten(ordered)[1] != spec:
        raise TraceError(f"the batch has the structure {got}, but the program was captured with {spec}. Pass the "
                         f"same inputs as example_inputs: the same dict keys and nesting, tensors at the leaves.")
    return ordered


def _like(x, spec):
    """x rebuilt in spec's order (dict keys in the captured order), or None where the structure differs."""
    kids = spec.children_specs
    if spec.type is dict:
        if not isinstance(x, dict) or set(x) != set(spec.context):
            return None
        out = {k: _like(x[k], s) for k, s in zip(spec.context, kids)}
        return None if any(v is None for v in out.values()) else out
    if spec.type in (tuple, list):
        if not isinstance(x, (tuple, list)) or len(x) != len(kids):
            return None
        out = [_like(a, s) for a, s in zip(x, kids)]
        return None if any(v is None for v in out) else spec.type(out)
    return x
