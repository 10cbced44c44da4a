"""One owner of the weights: the eager module given to partition() and the state a program holds never silently
diverge.

A program takes the module's (and optimizer's) state on its first call that needs it, as local shards. From then:

- while the program's state still equals what it took (no step, no buffer update, no load_state_dict since it
  took it, or since export_to / import_from made them equal again), the eager module is the owner: an edit of it
  (an in-place write, nn.init, load_state_dict, an eager optimizer step) is taken again at the next call, so a
  program edited before its first train_step trains from the edit;
- once the program has moved the state (a train_step), the program is the owner: an eager edit raises at its next
  call (naming prog.import_from to take the edit, prog.export_to to overwrite it), and partition() of the module, or
  another program taking the module's state, raises while that program is alive (naming prog.export_to); a module
  that holds the program's values exactly (written back by hand: model.load_state_dict(prog.full_state_dict())) is
  in sync again.

Using the module itself (model(x), model.state_dict()) while a program is ahead of it and it is untouched since
raises too (a forward pre-hook and a state_dict pre-hook registered on the module the first time a program takes
its state), naming export_to.

Edits are found by each tensor's autograd version counter, identity and storage (cheap: no data is read). Writes
through `.data` bypass the version counter (`p.data.mul_(2)`) and are not seen; use `with torch.no_grad():
p.mul_(2)`.
"""
from __future__ import annotations

import contextlib
import gc
import weakref

import torch

from ..errors import PartitionError

_HOLDERS = weakref.WeakKeyDictionary()      # eager module -> WeakSet of the Owner records of programs holding it
_WATCHED = weakref.WeakSet()                 # modules with the stale-forward hook (_stale_forward) registered


def fingerprint(model) -> dict:
    """State name -> what changes when the tensor is written or replaced."""
    out = {}
    for prefix, named in (("params.", model.named_parameters()), ("buffers.", model.named_buffers())):
        for k, t in named:
            out[prefix + k] = (id(t), t._version, t.data_ptr() if t.device.type != "meta" else 0, t.dtype,
                               tuple(t.shape))
    return out


class Owner:
    """What one program's held state knows of its eager module: the module's tensors when they last equalled the
    state (`seen`; None until the state is taken) and whether the state has moved since (`moved_steps`)."""

    def __init__(self, model, values=None):
        self.model = model
        self.values = values                 # () -> {state name: full tensor} of the held state (a WeakMethod)
        self.seen: dict | None = None
        self.moved_steps = 0                 # calls that changed the held state since it last equalled the module

    @property
    def ahead(self) -> bool:
        """The program's state differs from the module's (the program owns the weights)."""
        return self.moved_steps > 0

    def synced(self) -> None:
        """The held state equals the module's now (taken from it, or written back into it)."""
        if self.model is None:
            return
        self.seen = fingerprint(self.model)
        self.moved_steps = 0
        try:
            _HOLDERS.setdefault(self.model, weakref.WeakSet()).add(self)
        except TypeError:                    # a module that cannot be weakly referenced: no cross-program check
            return
        _watch(self.model)

    def moved(self) -> None:
        self.moved_steps += 1

    def edited(self) -> list:
        """The module's state values written or replaced since `synced` (none before the state is taken)."""
        if self.seen is None or self.model is None:
            return []
        now = fingerprint(self.model)
        return sorted(k for k in set(now) | set(self.seen) if now.get(k) != self.seen.get(k))

    def written_back(self) -> bool:
        """The module was edited since `synced` and now holds the program's values exactly (a write-back by hand:
        model.load_state_dict(prog.full_state_dict())); then the two are in sync again. Gathers the held state
        (collective on real ranks): asked only where the answer decides between going on and raising."""
        values = self.values() if self.values is not None else None
        if values is None or not self.edited():
            return False
        full = values()
        mine = {f"params.{k}": t for k, t in self.model.named_parameters()}
        mine.update({f"buffers.{k}": t for k, t in self.model.named_buffers()})
        for n, t in full.items():
            if n.startswith(("params.", "buffers.")):
                m = mine.get(n)
                if m is None or m.shape != t.shape or m.dtype != t.dtype or not torch.equal(m.detach().to(t.device), t):
                    return False
        self.synced()
        return True

    def claim(self, what: str) -> None:
        """Before taking the module's state: no other live program may be ahead of it."""
        check_free(self.model, what, mine=self)

    def refuse_edit(self, what: str, edited: list) -> None:
        names = ", ".join(edited[:3]) + (f" and {len(edited) - 3} more" if len(edited) > 3 else "")
        raise PartitionError(
            f"{what}: the eager module's {names} changed after the program took the weights, and the program has "
            f"moved them since ({self.moved_steps} call(s) updated its state), so it owns them: the edit would be "
            f"ignored. Take the edit: prog.import_from(model, optimizer) (the program then continues from the eager "
            f"module and optimizer); or drop it: prog.export_to(model, optimizer) (the eager module gets the "
            f"program's weights). An eager optimizer step, load_state_dict, nn.init or a forward in train mode that "
            f"updates buffers all count as edits.")


def check_free(model, what: str = "partition", mine=None) -> None:
    """Refuse to take `model`'s state while another live program holds newer weights than the module."""
    if model is None:
        return
    try:
        holders = _HOLDERS.get(model)
    except TypeError:
        return
    ahead = [h for h in (holders or ()) if h is not mine and h.ahead]
    if ahead:
        gc.collect()                          # a program dropped by the user may only wait for a collection
        ahead = [h for h in (_HOLDERS.get(model) or ()) if h is not mine and h.ahead and not h.written_back()]
    if ahead:
        n = max(h.moved_steps for h in ahead)
        raise PartitionError(
            f"{what}: the module's weights are held by a live program that has updated them {n} time(s) since they "
            f"were last written back; this module still holds the older weights, so a new program would silently "
            f"start from them. Write them back first: prog.export_to(model, optimizer), then partition again (the "
            f"new program continues from there); or drop the old program (del prog) to start over from the "
            f"module's weights.")


_INTERNAL = [0]                              # > 0 while partir_torch itself reads a module's state_dict


@contextlib.contextmanager
def internal():
    """partir_torch's own reads of a module's state_dict (its keys) pass the stale-module check."""
    _INTERNAL[0] += 1
    try:
        yield
    finally:
        _INTERNAL[0] -= 1


def _watch(model) -> None:
    """Register the stale-module checks on `model` once (they stay: without a program ahead of the module they do
    nothing): its forward and its state_dict."""
    if model not in _WATCHED:
        model.register_forward_pre_hook(_stale_forward)
        model.register_state_dict_pre_hook(_stale_state_dict)
        _WATCHED.add(model)


def _traced(module, args) -> bool:
    """The call is a trace (ours: parameters swapped for fake tensors by functional_call, inputs fake or
    functional), not an eager forward."""
    from torch.utils._pytree import tree_leaves

    p = next(module.parameters(), None)
    leaves = [x for x in tree_leaves(args) if isinstance(x, torch.Tensor)]
    return any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in leaves + ([p] if p is not None else []))


def _stale(module) -> int:
    """How many updates a live program holds beyond `module`'s weights, where the module certainly holds stale
    ones: untouched since the program took them (a module written to since, e.g. by model.load_state_dict(prog.
    full_state_dict()), is let through: telling its values apart would need a gather, a collective)."""
    stale = [h for h in (_HOLDERS.get(module) or ()) if h.ahead and not h.edited()]
    return max((h.moved_steps for h in stale), default=0)


def _stale_forward(module, args) -> None:
    """model(...) of a module that holds stale weights. Our own captures trace the module and pass."""
    if torch.compiler.is_compiling() or _traced(module, args):
        return
    n = _stale(module)
    if n:
        raise PartitionError(
            f"{type(module).__name__}(...): this module's weights are held by a live program that has updated them "
            f"{n} time(s) since they were last written back, so the module would compute with the older weights. "
            f"Write them back first: prog.export_to(model, optimizer); or run the program: prog.forward(*inputs) / "
            f"prog.eval_step(*batch) on its live state.")


def _stale_state_dict(module, prefix, keep_vars) -> None:
    """model.state_dict() of a module that holds stale weights (a checkpoint, save_pretrained)."""
    if _INTERNAL[0] or torch.compiler.is_compiling() or _traced(module, ()):
        return
    n = _stale(module)
    if n:
        raise PartitionError(
            f"{type(module).__name__}.state_dict(): this module's weights are held by a live program that has "
            f"updated them {n} time(s) since they were last written back, so this would save the older weights. "
            f"Write them back first: prog.export_to(model, optimizer); or save the program's: "
            f"prog.full_state_dict() (consolidated, model.state_dict()'s keys) or prog.state_dict() (DCP).")
