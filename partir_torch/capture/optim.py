"""Pure, trace-friendly versions of ``torch.optim.SGD``, ``Adam`` and ``AdamW``.

``functional_optimizer(opt, names)`` reads hyperparameters from a real
optimizer's param groups and returns a :class:`FunctionalOptimizer` whose
``update`` is a pure function of dicts of tensors (no in-place ops, no
``.item()``, no Python branching on tensor values), so it can be traced into
one aten graph together with forward and backward::

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fopt = functional_optimizer(opt, {id(p): n for n, p in model.named_parameters()})
    params = {n: p.detach() for n, p in model.named_parameters()}
    state, step = fopt.init_state(params), fopt.init_step()
    lr = torch.tensor(fopt.lr, dtype=torch.float64)
    params, state = fopt.update(params, grads, state, lr, torch.tensor(step + 1.0))

The update follows torch.optim's single-tensor (``foreach=False``)
implementation operation by operation. Scalars (bias corrections, step size,
``1 - lr * wd``) are computed in float64 from the ``lr``/``step`` tensors and
cast to the parameter dtype, like torch.optim's Python-float path. On CPU the
results are bitwise equal to torch.optim for Adam/AdamW; SGD's final
``param - lr * grad`` may differ by one ulp (torch's ``add_(alpha=)`` is a fused
multiply-add). Pass ``lr`` as a float64 tensor for the closest match: a float32
``lr`` is already rounded (about 1e-7 relative).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import PartitionError


class OptimizerError(PartitionError, NotImplementedError):
    """The optimizer cannot be captured (unsupported kind, foreign or complex parameters)."""

LR = Tensor | dict[str, Tensor] | float
State = dict[str, dict[str, Tensor]]


class FunctionalOptimizer:
    """Functional SGD / Adam / AdamW built from a ``torch.optim`` optimizer.

    Attributes: ``kind`` ("sgd" | "adam" | "adamw") and ``state_names`` (the
    state tensors kept per parameter, in a fixed order). State layout is
    ``state[state_name][fqn] -> Tensor``; the step count is one global scalar.
    Parameters whose torch parameter has ``requires_grad=False``, or whose grad
    is ``None``, are skipped: returned unchanged and given no state.
    """

    def __init__(self, opt: torch.optim.Optimizer, names: dict[int, str]):
        if isinstance(opt, torch.optim.SGD):
            self.kind = "sgd"
        elif isinstance(opt, torch.optim.Adam):  # AdamW subclasses Adam
            decoupled = isinstance(opt, torch.optim.AdamW) or opt.param_groups[0].get(
                "decoupled_weight_decay", False)
            self.kind = "adamw" if decoupled else "adam"
        else:
            raise OptimizerError(
                f"partition: optimizer {type(opt).__name__} is not supported. Supported: torch.optim.SGD (momentum, "
                f"nesterov, weight decay), torch.optim.Adam and torch.optim.AdamW (incl. amsgrad). To add one, write "
                f"its update as a pure function of (param, grad, state) tensors in partir_torch/capture/optim.py "
                f"(FunctionalOptimizer: a kind, its state names, an update) so it traces into the step; or capture "
                f"without an optimizer (prog.loss_and_grads) and update the parameters yourself.")
        self._opt = opt
        self._group: dict[str, int] = {}  # fqn -> param group index
        self._param: dict[str, Tensor] = {}  # fqn -> torch parameter
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if id(p) not in names:
                    raise OptimizerError(f"partition: the optimizer holds a parameter of shape {tuple(p.shape)} that "
                                         f"is not a parameter of the model. Build the optimizer from "
                                         f"model.parameters() of the model you partition.")
                if torch.is_complex(p):
                    raise OptimizerError(f"partition: parameter {names[id(p)]} is complex; the captured optimizers "
                                         f"update real tensors only.")
                self._group[names[id(p)]], self._param[names[id(p)]] = gi, p
        groups = opt.param_groups
        if self.kind == "sgd":
            self.state_names = ("momentum_buffer",) if any(g["momentum"] != 0 for g in groups) else ()
        else:
            amsgrad = ("max_exp_avg_sq",) if any(g["amsgrad"] for g in groups) else ()
            self.state_names = ("exp_avg", "exp_avg_sq") + amsgrad
        self._fixed = {gi: self._fixed_of(gi) for gi in sorted(set(self._group.values()))}

    # ---------------------------------------------------------------- queries
    @property
    def lr(self) -> float:
        """Current learning rate of param group 0 (read live from the optimizer)."""
        return float(self._opt.param_groups[0]["lr"])

    def lrs(self) -> dict[str, float]:
        """Current learning rate of every parameter: fqn -> float."""
        return {f: float(self._opt.param_groups[g]["lr"]) for f, g in self._group.items()}

    def _trainable(self) -> list[str]:
        return [f for f in self._group if self._param[f].requires_grad]

    # ------------------------------------------------ per-step hyperparameters
    def hyper_keys(self) -> list[tuple[int, str]]:
        """(group index, name) of every hyperparameter fed at each step (placeholders ``hparams.<g>.<name>``):
        lr always; weight_decay and SGD's momentum unless 0 at capture (0 turns the term off: a structural choice);
        Adam's beta1 and beta2. Other settings (eps, dampening, nesterov, amsgrad, maximize) are fixed at capture;
        :meth:`hyper_values` refuses a change to them by name."""
        keys = []
        for gi in sorted(set(self._group.values())):
            g = self._opt.param_groups[gi]
            names = ["lr"] + (["weight_decay"] if g["weight_decay"] != 0 else [])
            names += (["momentum"] if g["momentum"] != 0 else []) if self.kind == "sgd" else ["beta1", "beta2"]
            keys += [(gi, n) for n in names]
        return keys

    def _fixed_of(self, gi: int) -> dict:
        g = self._opt.param_groups[gi]
        names = ("dampening", "nesterov", "maximize") if self.kind == "sgd" else ("eps", "amsgrad", "maximize")
        fixed = {n: g.get(n) for n in names}
        for n in ("weight_decay", "momentum"):
            if n in g and g[n] == 0:
                fixed[n] = 0
        return fixed

    def hyper_values(self, opt: torch.optim.Optimizer | None = None) -> dict[tuple[int, str], float]:
        """Current values of :meth:`hyper_keys`, read from the optimizer's param groups (a scheduler's
        writes included). Raises if a setting fixed at capture changed."""
        groups = (opt or self._opt).param_groups
        out = {}
        for gi, name in self.hyper_keys():
            g = groups[gi]
            out[(gi, name)] = float(g["betas"][0 if name == "beta1" else 1]) if name.startswith("beta") \
                else float(g[name])
        for gi, fixed in self._fixed.items():
            for name, was in fixed.items():
                if groups[gi].get(name) != was:
                    raise OptimizerError(
                        f"train_step: param group {gi}'s {name} changed from {was!r} (at partition) to "
                        f"{groups[gi].get(name)!r}. It is fixed in the captured step ("
                        + ("a zero turns its term off" if was == 0 else "only lr, weight_decay, betas and "
                           "momentum are fed at every step") + "): set it before partition().")
        return out

    def names_for(self, fqn: str) -> tuple[str, ...]:
        """State names kept for one parameter (depends on its group)."""
        g = self._opt.param_groups[self._group[fqn]]
        if self.kind == "sgd":
            return ("momentum_buffer",) if g["momentum"] != 0 else ()
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if g["amsgrad"] else ())

    # ------------------------------------------------------------------ state
    def init_state(self, params: dict[str, Tensor]) -> State:
        """Initial state, ``state_name -> fqn -> tensor``.

        Zeros like each parameter (works for meta and FakeTensor params), or a
        copy of ``opt.state`` when the optimizer already holds state for that
        parameter (resume) and ``params[fqn]`` is a real tensor.
        """
        state: State = {n: {} for n in self.state_names}
        for fqn in self._trainable():
            p, old = params[fqn], self._opt.state.get(self._param[fqn], {})
            symbolic = p.is_meta or isinstance(p, FakeTensor)
            for name in self.names_for(fqn):
                src = old.get(name)
                if src is None or symbolic:
                    state[name][fqn] = torch.zeros_like(p, requires_grad=False)
                else:
                    state[name][fqn] = src.detach().to(p.device, p.dtype, copy=True)
        return state

    def init_step(self) -> float:
        """Number of steps already taken (0.0 for a fresh optimizer).

        Adam/AdamW read ``opt.state[p]["step"]``; all trainable parameters must
        agree. ``torch.optim.SGD`` keeps no step count: it returns 1.0 once the
        momentum buffers exist (enough for the first-step rule), else 0.0.
        """
        steps = set()
        for fqn in self._trainable():
            st = self._opt.state.get(self._param[fqn], {})
            if self.kind != "sgd":
                steps.add(float(st["step"]) if "step" in st else 0.0)
            elif self.names_for(fqn):
                steps.add(1.0 if st.get("momentum_buffer") is not None else 0.0)
        if len(steps) > 1:
            raise ValueError(f"parameters have different step counts {sorted(steps)}; "
                             "a functional optimizer keeps a single global step")
        return steps.pop() if steps else 0.0

    def sync_to_torch(self, params: dict[str, Tensor], state: State, step: float) -> None:
        """Write functional params/state back into the optimizer so training can
        resume with ``opt.step()``. Copies into the parameters in place."""
        with torch.no_grad():
            for fqn in self._trainable():
                self._param[fqn].copy_(params[fqn])
                st = self._opt.state[self._param[fqn]]
                for name in self.names_for(fqn):
                    st[name] = state[name][fqn].detach().clone()
                if self.kind != "sgd":
                    st["step"] = torch.tensor(float(step), dtype=torch.float32)

    # ----------------------------------------------------------------- update
    def update(self, params: dict[str, Tensor], grads: dict[str, Tensor | None],
               state: State, lr: LR, step: Tensor | float,
               hparams: dict[tuple[int, str], Tensor] | None = None) -> tuple[dict[str, Tensor], State]:
        """One pure optimizer step; returns ``(new_params, new_state)``.

        ``lr``: either a 0-dim tensor holding param group 0's current lr (other
        groups are scaled by their current ratio ``group_lr / group0_lr``, which
        is what LR schedulers preserve), or a dict ``fqn -> 0-dim tensor``.
        ``step``: 0-dim tensor with the number of THIS update (1 on the first).
        ``hparams``: ``(group, name) -> 0-dim float64 tensor`` for every key of
        :meth:`hyper_keys` (then ``lr`` is ignored): each group's lr, weight
        decay and betas / momentum are inputs of the traced step. Without it,
        hyperparameters other than lr are baked in from each parameter's group.
        """
        step = torch.as_tensor(step).to(torch.float64)
        new_params = dict(params)
        new_state = {n: dict(d) for n, d in state.items()}
        memo: dict = {}  # per-group 0-dim scalar math, traced once per group and dtype
        for fqn in self.updated(grads):
            gi, dtype = self._group[fqn], params[fqn].dtype
            group = self.group_values(gi, hparams)
            key = (gi, dtype, fqn if isinstance(lr, dict) else None)
            if key not in memo:
                memo[key] = self.scalars(group, group["lr"] if hparams is not None else self._lr_for(fqn, lr), step,
                                         dtype)
            st = {n: state[n][fqn] for n in self.names_for(fqn)}
            new_params[fqn], st = self.apply(group, params[fqn], grads[fqn], st, memo[key])
            for n, t in st.items():
                new_state[n][fqn] = t
        return new_params, new_state

    # ------------------------------------- the pieces of update (capture/replicate.py traces them one by one)
    def updated(self, grads: dict) -> list[str]:
        """The parameters an update changes, in the order it updates them: trainable, with a gradient."""
        return [f for f in self._trainable() if grads.get(f) is not None]

    def group_index(self, fqn: str) -> int:
        return self._group[fqn]

    def group_values(self, gi: int, hparams: dict | None) -> dict:
        """Param group gi's settings, the fed hyperparameter tensors (``(group, name) -> tensor``, as float64)
        replacing its values (fixed settings stay)."""
        group = self._opt.param_groups[gi]
        if hparams is not None:
            group = {**group, **{n: t.to(torch.float64) for (g, n), t in hparams.items() if g == gi}}
            if "beta1" in group:
                group["betas"] = (group.pop("beta1"), group.pop("beta2"))
        return group

    def scalars(self, group: dict, lr: Tensor, step: Tensor, dtype: torch.dtype) -> tuple:
        """The 0-dim scalar math shared by a group's parameters of one dtype (tensors, or None where unused)."""
        return (_sgd_scalars if self.kind == "sgd" else _adam_scalars)(group, lr, step, dtype)

    def apply(self, group: dict, param: Tensor, grad: Tensor, st: dict[str, Tensor],
              scalars: tuple) -> tuple[Tensor, dict[str, Tensor]]:
        """One parameter's update: (new param, its new state tensors by name)."""
        return (_sgd if self.kind == "sgd" else _adam)(group, param, grad, st, scalars)

    def _lr_for(self, fqn: str, lr: LR) -> Tensor:
        if isinstance(lr, dict):
            return torch.as_tensor(lr[fqn]).to(torch.float64)
        lr = torch.as_tensor(lr).to(torch.float64)
        lr0 = float(self._opt.param_groups[0]["lr"])
        lr_g = float(self._opt.param_groups[self._group[fqn]]["lr"])
        if lr_g == lr0:
            return lr
        if lr0 == 0:
            raise ValueError("group 0 has lr 0: pass lr as a dict fqn -> tensor")
        return lr * (lr_g / lr0)


def functional_optimizer(opt: torch.optim.Optimizer, names: dict[int, str]) -> FunctionalOptimizer:
    """Build a :class:`FunctionalOptimizer` for ``opt``; ``names`` maps
    ``id(param) -> fqn`` (e.g. ``{id(p): n for n, p in model.named_parameters()}``)."""
    return FunctionalOptimizer(opt, names)


def _sgd_scalars(group: dict, lr: Tensor, step: Tensor, dtype: torch.dtype) -> tuple:
    return lr.to(dtype), step <= 1  # first step: momentum_buffer = grad


def _sgd(group: dict, param: Tensor, grad: Tensor, st: dict[str, Tensor],
         scalars: tuple) -> tuple[Tensor, dict[str, Tensor]]:
    """Mirror of ``torch.optim.sgd._single_tensor_sgd`` for one parameter."""
    (lr, first_step), momentum, wd = scalars, group["momentum"], group["weight_decay"]
    if group["maximize"]:
        grad = -grad
    if _nonzero(wd):
        grad = _add_scaled(grad, param, wd)
    if _nonzero(momentum):
        running = st["momentum_buffer"].mul(_cast(momentum, grad.dtype)).add(grad, alpha=1 - group["dampening"])
        buf = torch.where(first_step, grad, running)
        st = {"momentum_buffer": buf}
        grad = _add_scaled(grad, buf, momentum) if group["nesterov"] else buf
    return torch.addcmul(param, grad, -lr), st  # torch: param.add_(grad, alpha=-lr), a fused multiply-add


def _adam_scalars(group: dict, lr: Tensor, step: Tensor, dtype: torch.dtype) -> tuple:
    """Float64 scalar math of the non-capturable path (Python floats there), cast to dtype."""
    beta1, beta2 = group["betas"]
    bias_correction1 = 1 - torch.pow(beta1, step)
    bias_correction2 = 1 - torch.pow(beta2, step)
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    decoupled = group.get("decoupled_weight_decay", False) and _nonzero(group["weight_decay"])
    decay = (1 - lr * group["weight_decay"]).to(dtype) if decoupled else None  # AdamW
    return decay, bias_correction2_sqrt.to(dtype), (-step_size).to(dtype)


def _adam(group: dict, param: Tensor, grad: Tensor, st: dict[str, Tensor],
          scalars: tuple) -> tuple[Tensor, dict[str, Tensor]]:
    """Mirror of ``torch.optim.adam._single_tensor_adam`` (non-capturable path)."""
    decay, bias_correction2_sqrt, neg_step_size = scalars
    beta1, beta2 = group["betas"]
    wd, eps = group["weight_decay"], group["eps"]
    if group["maximize"]:
        grad = -grad
    if _nonzero(wd):
        if decay is not None:
            param = param * decay  # AdamW: param.mul_(1 - lr * wd)
        else:
            grad = _add_scaled(grad, param, wd)
    exp_avg = torch.lerp(st["exp_avg"], grad, _cast(1 - beta1, grad.dtype))
    if isinstance(beta2, Tensor):   # addcmul(value=c) is ((c * t1) * t2) + self: the same roundings
        exp_avg_sq = st["exp_avg_sq"].mul(_cast(beta2, grad.dtype)).addcmul(grad * _cast(1 - beta2, grad.dtype), grad)
    else:
        exp_avg_sq = st["exp_avg_sq"].mul(beta2).addcmul(grad, grad, value=1 - beta2)
    new = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if group["amsgrad"]:
        new["max_exp_avg_sq"] = torch.maximum(st["max_exp_avg_sq"], exp_avg_sq)
        denom = (new["max_exp_avg_sq"].sqrt() / bias_correction2_sqrt).add(eps)
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add(eps)
    # param.addcdiv_(exp_avg, denom, value=-step_size) == param + (v * exp_avg) / denom
    return param + neg_step_size * exp_avg / denom, new


# Hyperparameters are Python floats (baked) or 0-dim float64 tensors (fed at every step). The tensor forms below
# round exactly like torch.optim's float forms on CPU (checked bitwise in tests/test_training.py): add(alpha=)
# is a fused multiply-add, which addcmul reproduces; a product by a 0-dim tensor cast to the dtype equals the
# product by the Python float.
def _nonzero(x) -> bool:
    return isinstance(x, Tensor) or float(x) != 0


def _cast(x, dtype):
    return x.to(dtype) if isinstance(x, Tensor) else float(x)


def _add_scaled(a: Tensor, b: Tensor, alpha) -> Tensor:
    """a + alpha * b, as a.add(b, alpha=alpha) rounds it."""
    return torch.addcmul(a, b, alpha.to(a.dtype)) if isinstance(alpha, Tensor) else a.add(b, alpha=alpha)
