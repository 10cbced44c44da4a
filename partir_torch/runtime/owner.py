"""One owner of the weights: the eager module given to partition() and the state a program holds never silently
diverge.

A program takes the module's (and optimizer's) state on its first call that needs it, as local shards. From then
the program owns the weights, and the module tells the truth about them in one of two ways:

- **Write-through** (emulated ranks always; real ranks where every parameter, buffer and optimizer state value is
  whole on each rank, i.e. data parallelism without ZeRO or Megatron): after every call that moves the held state
  (train_step, a forward that updates buffers, load_state_dict) the program writes its state into the eager module
  and optimizer in place (HeldState.write_through: parameters, buffers, optimizer moments and step). Everything
  that reads them then sees the program's current state: model.state_dict(), copy.deepcopy(model),
  torch.save(model), save_pretrained, generate, eager calls, model.fc.weight, optimizer.state_dict(), and a new
  partition() of the module or of a copy. It costs one copy of the state per step, no collective
  (benchmarks/notes/ownership.md).
- **Stale, and said** (real ranks whose state is tiled: writing it back needs a gather, a collective every rank
  must join): the module keeps the older weights, and every read of it we can see raises a PartitionError naming
  prog.export_to (collective) or prog.full_state_dict(): model(...) and any submodule's call, state_dict() of it or
  any submodule (save_pretrained's), copy.deepcopy and pickling (torch.save) of it or any submodule, and the eager
  optimizer's state_dict() and step(). A new program taking the module (partition(), its first call; collective
  on every rank) first writes the older program's state back into it.

An eager edit of the module (an in-place write, nn.init, load_state_dict, an eager optimizer step) is taken at the
program's next call when the module held the program's state before the edit (always, under write-through); an
edit of a stale module raises at the next call (naming prog.import_from to take it, prog.export_to to drop it).

When a second program takes the module's state, the first one is *released*: its steps and evaluations (train_step,
eval_step, forward) and export_to raise naming the program that took it (it would otherwise train on, or overwrite the newer weights);
prog.import_from(model, optimizer) takes the module back (and releases the other).

Edits are found by each tensor's autograd version counter, identity and storage (cheap: no data is read). Writes
through `.data` bypass the version counter (`p.data.mul_(2)`) and are not seen; use `with torch.no_grad():
p.mul_(2)`.
"""
from __future__ import annotations

import contextlib
import copyreg
import functools
import gc
import weakref

import torch

from ..errors import PartitionError

_HOLDERS = weakref.WeakKeyDictionary()      # eager module -> WeakSet of the Owner records of programs holding it
_ROOT = weakref.WeakKeyDictionary()         # module or submodule -> weakref to the module a program holds
_WATCHED = weakref.WeakSet()                 # modules and optimizers with the stale-read hooks registered


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
    state (`seen`; None until the state is taken), whether the state has moved since (`moved_steps`), and whether a
    newer program took the module from it (`released`).

    values: () -> {state name: full tensor} of the held state; write_back: () -> None, the state written into the
    module and optimizer (a gather on real ranks with tiled state); both WeakMethods of the HeldState."""

    def __init__(self, model, values=None, write_back=None, optimizer=None):
        self.model = model
        self.optimizer = optimizer
        self.values = values
        self.write_back = write_back
        self.seen: dict | None = None
        self.moved_steps = 0                 # calls that changed the held state since it last equalled the module
        self.released: str | None = None     # when a newer program took the module, said

    @property
    def ahead(self) -> bool:
        """The program's state differs from the module's (the module is stale)."""
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
        _watch(self.model, self.optimizer)

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
        """Before taking the module's state: a live program ahead of the module writes its state back first (so
        the new program starts from the newest weights; collective on real ranks, where every rank takes the state
        at once), and every other live program holding the module is released."""
        take_over(self.model, what, mine=self)

    def refuse_released(self, what: str) -> None:
        if self.released is not None:
            raise PartitionError(
                f"{what}: this program no longer owns its module: a newer program took the module's weights "
                f"({self.released}), so a step here would train on a copy the module no longer follows, and export_to "
                f"would overwrite the newer program's weights. Use the newer program; or take the module back: "
                f"prog.import_from(model, optimizer) (this program then continues from the module's current "
                f"weights, and the newer one is released).")

    def refuse_edit(self, what: str, edited: list) -> None:
        names = ", ".join(edited[:3]) + (f" and {len(edited) - 3} more" if len(edited) > 3 else "")
        raise PartitionError(
            f"{what}: the eager module's {names} changed after the program took the weights, and the program has "
            f"moved them since ({self.moved_steps} call(s) updated its state), so it owns them: the edit would be "
            f"ignored. Take the edit: prog.import_from(model, optimizer) (the program then continues from the eager "
            f"module and optimizer); or drop it: prog.export_to(model, optimizer) (the eager module gets the "
            f"program's weights). An eager optimizer step, load_state_dict, nn.init or a forward in train mode that "
            f"updates buffers all count as edits.")


def _holders(model) -> list:
    try:
        return list(_HOLDERS.get(model) or ())
    except TypeError:
        return []


def take_over(model, what: str = "partition", mine=None) -> None:
    """`model`'s state is about to be taken (by `mine`'s program, or by a new partition()): programs ahead of the
    module write their state back into it first; with `mine`, every other holder is released. Collective on real
    ranks where a holder's state is tiled (partition() and a program's first call run on every rank)."""
    if model is None:
        return
    others = [h for h in _holders(model) if h is not mine and h.released is None]
    if any(h.ahead for h in others):
        gc.collect()                          # a program dropped by the user may only wait for a collection
        others = [h for h in _holders(model) if h is not mine and h.released is None]
    for h in others:
        held = h.write_back() if h.write_back is not None else None     # the HeldState's method, if it lives
        back = held() if held is not None else None
        if h.ahead and not h.edited() and back is not None:
            back()                            # the module gets the newest weights before anyone takes them
    if mine is None:
        return
    for h in others:
        h.released = f"at {what}"


_INTERNAL = [0]                              # > 0 while partir_torch itself reads a module's state_dict


@contextlib.contextmanager
def internal():
    """partir_torch's own reads of a module (its state_dict keys, a write-back) pass the stale-module checks."""
    _INTERNAL[0] += 1
    try:
        yield
    finally:
        _INTERNAL[0] -= 1


def _watch(model, optimizer=None) -> None:
    """Register the stale-read checks once on `model`, each submodule and `optimizer` (they stay: without a program
    ahead of the module they return at once): calls, state_dict, copy.deepcopy and pickling; the optimizer's
    state_dict and step."""
    ref = weakref.ref(model)
    for m in model.modules():
        _ROOT[m] = ref
        if m in _WATCHED:
            continue
        m.register_forward_pre_hook(_stale_forward)
        m.register_state_dict_pre_hook(_stale_state_dict)
        _reduce_checked(type(m))
        _checked_first(type(m), "save_pretrained")
        _WATCHED.add(m)
    if optimizer is not None and optimizer not in _WATCHED:
        _OPT_ROOT[optimizer] = ref
        optimizer.register_state_dict_pre_hook(_stale_optimizer)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: _stale_optimizer(opt))
        _WATCHED.add(optimizer)


_OPT_ROOT = weakref.WeakKeyDictionary()     # optimizer -> weakref to the module it updates


def _ahead(module) -> list:
    """The live, unreleased programs ahead of the module `module` is (part of): cheap, no tensor is read."""
    if _INTERNAL[0]:
        return []
    ref = _ROOT.get(module)
    root = ref() if ref is not None else None
    if root is None:
        return []
    return [h for h in _holders(root) if h.ahead and h.released is None]


def _stale(module) -> int:
    """How many updates a live program holds beyond the weights of `module` (or of the module it is part of),
    where the module certainly holds stale ones: untouched since the program took them (a module written to since,
    e.g. by model.load_state_dict(prog.full_state_dict()), is let through: telling its values apart would need a
    gather, a collective). Not during a trace (the module's tensors are fakes then)."""
    return max((h.moved_steps for h in _ahead(module) if not h.edited()), default=0)


def _traced(module, args) -> bool:
    """The call is a trace (ours: parameters swapped for fake tensors by functional_call, inputs fake or
    functional), not an eager forward."""
    from torch.utils._pytree import tree_leaves

    p = next(module.parameters(), None)
    leaves = [x for x in tree_leaves(args) if isinstance(x, torch.Tensor)]
    return any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in leaves + ([p] if p is not None else []))


def _refuse(what: str, n: int, would: str) -> None:
    raise PartitionError(
        f"{what}: this module's weights are held by a live program that has updated them {n} time(s) since they "
        f"were last written back, and its state is tiled over real ranks (writing it back is a gather every rank "
        f"must join), so {would}. Write them back first, on every rank: prog.export_to(model, optimizer); or read "
        f"the program's: prog.full_state_dict() (consolidated, model.state_dict()'s keys), prog.state_dict() "
        f"(DCP), prog.forward(*inputs) / prog.eval_step(*batch) on its live state.")


def _stale_forward(module, args) -> None:
    """model(...) (or a submodule's call) of a module that holds stale weights. Our own captures pass."""
    if not _ahead(module) or torch.compiler.is_compiling() or _traced(module, args):
        return
    n = _stale(module)
    if n:
        _refuse(f"{type(module).__name__}(...)", n, "the module would compute with the older weights")


def _stale_state_dict(module, prefix, keep_vars) -> None:
    """model.state_dict() (a checkpoint, save_pretrained) of a module that holds stale weights."""
    if not _ahead(module) or torch.compiler.is_compiling() or _traced(module, ()):
        return
    n = _stale(module)
    if n:
        _refuse(f"{type(module).__name__}.state_dict()", n, "this would save the older weights")


def _stale_optimizer(optimizer) -> None:
    """optimizer.state_dict() / optimizer.step() of the eager optimizer of a module that holds stale weights."""
    ref = _OPT_ROOT.get(optimizer)
    root = ref() if ref is not None else None
    n = _stale(root) if root is not None else 0
    if n:
        _refuse(f"{type(optimizer).__name__}.state_dict() / step()", n,
                "the eager optimizer holds the older moments")


_REDUCERS: dict = {}                         # class -> the copyreg reducer it had before ours (None: none)


def _reduce_checked(cls) -> None:
    """copy.deepcopy and pickle (torch.save) of a module of class `cls` check staleness first (copyreg's dispatch
    table, which both consult before the object's own __reduce_ex__; nothing is stored on the module, so copies
    carry nothing of ours)."""
    if cls in _REDUCERS:
        return
    _REDUCERS[cls] = copyreg.dispatch_table.get(cls)

    def reduce(obj, _cls=cls):
        n = _stale(obj)
        if n:
            _refuse(f"copy.deepcopy / pickle of {_cls.__name__}", n, "the copy would hold the older weights")
        before = _REDUCERS.get(_cls)
        return before(obj) if before is not None else obj.__reduce_ex__(4)

    copyreg.pickle(cls, reduce)


def _checked_first(cls, name: str) -> None:
    """A library's saving method (Hugging Face's save_pretrained writes config.json before it reads state_dict())
    checks staleness before it writes anything: wrapped once where the class hierarchy defines it."""
    home = next((c for c in cls.__mro__ if name in c.__dict__), None)
    fn = home.__dict__[name] if home is not None else None
    if fn is None or not callable(fn) or getattr(fn, "_partir_checked", False):
        return

    @functools.wraps(fn)
    def checked(self, *args, **kwargs):
        n = _stale(self)
        if n:
            _refuse(f"{type(self).__name__}.{name}()", n, "it would save the older weights (nothing was written)")
        return fn(self, *args, **kwargs)

    checked._partir_checked = True
    setattr(home, name, checked)
