"""Functional SGD/Adam/AdamW (partir_torch.capture.optim) vs torch.optim."""
import pytest
import torch
from torch.func import functionalize
from torch.fx.experimental.proxy_tensor import make_fx

from partir_torch.capture.optim import FunctionalOptimizer, functional_optimizer

F64 = torch.float64
SHAPES = {"w1": (7, 5), "b1": (5,), "w2": (3, 7), "frozen": (4,)}


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = {n: torch.nn.Parameter(torch.randn(s, generator=g)) for n, s in SHAPES.items()}
    ps["frozen"].requires_grad_(False)
    return ps


def random_grads(ps, gen):
    return {n: (torch.randn(p.shape, generator=gen) if p.requires_grad else None)
            for n, p in ps.items()}


def set_grads(ps, grads):
    """Install copies: foreach SGD with nesterov modifies ``p.grad`` in place."""
    for n, p in ps.items():
        p.grad = None if grads[n] is None else grads[n].clone()


def build(ps, ctor, groups=None, **kw):
    """Optimizer over ``ps`` (one group, or explicit groups of names)."""
    if groups is None:
        return ctor(list(ps.values()), **kw)
    return ctor([{"params": [ps[n] for n in names], **g} for names, g in groups], **kw)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def run_both(ctor, kw, groups=None, steps=5, lr_change=None, lr_dtype=F64):
    """Run ``steps`` eager torch.optim steps and the functional equivalent,
    feeding identical random grads; compare params and states each step."""
    ref, fun = make_params(), make_params()
    opt, fun_opt = build(ref, ctor, groups, **kw), build(fun, ctor, groups, **kw)
    fopt = functional_optimizer(fun_opt, {id(p): n for n, p in fun.items()})
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1) if lr_change else None
    params = {n: p.detach().clone() for n, p in fun.items()}
    state, step = fopt.init_state(params), fopt.init_step()
    assert step == 0.0
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = random_grads(ref, gen)
        set_grads(ref, grads)
        opt.step()
        lr = torch.tensor(fopt.lr, dtype=lr_dtype)
        step += 1
        params, state = fopt.update(params, grads, state, lr, torch.tensor(step))
        if sched:  # the scheduler drives the real optimizer; mirror its lrs
            sched.step()
            for g, fg in zip(opt.param_groups, fun_opt.param_groups):
                fg["lr"] = g["lr"]
        for n, p in ref.items():
            close(params[n], p.detach())
            for name in fopt.state_names:
                if n in state[name]:
                    close(state[name][n], opt.state[p][name])
                else:
                    assert name not in opt.state[p]
    assert all("frozen" not in state[name] for name in fopt.state_names)
    return fopt, opt, ref, params, state


SGD, ADAM, ADAMW = torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW
CASES = {
    "sgd_plain": (SGD, dict(lr=0.1)),
    "sgd_momentum": (SGD, dict(lr=0.1, momentum=0.9)),
    "sgd_dampening": (SGD, dict(lr=0.1, momentum=0.9, dampening=0.3)),
    "sgd_nesterov": (SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "sgd_weight_decay": (SGD, dict(lr=0.1, momentum=0.5, weight_decay=0.01)),
    "sgd_maximize": (SGD, dict(lr=0.1, momentum=0.9, maximize=True)),
    "adam_default": (ADAM, dict(lr=1e-2)),
    "adam_weight_decay": (ADAM, dict(lr=1e-2, weight_decay=0.1)),
    "adam_amsgrad": (ADAM, dict(lr=1e-2, amsgrad=True, betas=(0.8, 0.95))),
    "adam_maximize": (ADAM, dict(lr=1e-2, maximize=True)),
    "adamw_default": (ADAMW, dict(lr=1e-2)),
    "adamw_amsgrad": (ADAMW, dict(lr=1e-2, weight_decay=0.05, amsgrad=True)),
}


@pytest.mark.parametrize("foreach", [False, None, True])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_optim(case, foreach):
    ctor, kw = CASES[case]
    fopt, *_ = run_both(ctor, {**kw, "foreach": foreach})
    assert fopt.kind == ctor.__name__.lower()


def test_kinds_and_state_names():
    ps = make_params()
    names = {id(p): n for n, p in ps.items()}
    assert functional_optimizer(SGD(ps.values(), lr=1), names).state_names == ()
    f = functional_optimizer(SGD(ps.values(), lr=1, momentum=0.9), names)
    assert (f.kind, f.state_names) == ("sgd", ("momentum_buffer",))
    f = functional_optimizer(ADAM(ps.values()), names)
    assert (f.kind, f.state_names) == ("adam", ("exp_avg", "exp_avg_sq"))
    f = functional_optimizer(ADAMW(ps.values(), amsgrad=True), names)
    assert (f.kind, f.state_names) == ("adamw", ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
    assert isinstance(f, FunctionalOptimizer) and f.lr == 1e-3


def test_adamw_two_groups_different_weight_decay():
    groups = [(["w1", "w2"], dict(weight_decay=0.1)), (["b1", "frozen"], dict(weight_decay=0.0))]
    run_both(ADAMW, dict(lr=1e-2), groups=groups)


def test_groups_with_different_lr_scale_with_single_tensor_and_dict():
    groups = [(["w1", "w2", "frozen"], dict(lr=1e-2)), (["b1"], dict(lr=3e-2, weight_decay=0.2))]
    fopt, *_ = run_both(ADAMW, {}, groups=groups, lr_change=True)  # single tensor, scaled
    assert fopt.lrs()["b1"] == pytest.approx(3 * fopt.lrs()["w1"])
    # dict form gives the same as the single-tensor form
    ps = make_params()
    f = functional_optimizer(build(ps, SGD, groups, momentum=0.9), {id(p): n for n, p in ps.items()})
    params = {n: p.detach() for n, p in ps.items()}
    grads = random_grads(ps, torch.Generator().manual_seed(3))
    st = f.init_state(params)
    one = torch.tensor(1.0)
    a, _ = f.update(params, grads, st, torch.tensor(1e-2, dtype=F64), one)
    lr_dict = {n: torch.tensor(lr, dtype=F64) for n, lr in f.lrs().items()}
    b, _ = f.update(params, grads, st, lr_dict, one)
    for n in a:
        close(a[n], b[n])


@pytest.mark.parametrize("ctor,kw", [(ADAM, dict(lr=1e-2, weight_decay=0.1)),
                                     (SGD, dict(lr=0.1, momentum=0.9, dampening=0.2))])
def test_lr_change_between_steps(ctor, kw):
    run_both(ctor, kw, lr_change=True, steps=5)


def test_float32_lr_within_tolerance():
    run_both(ADAMW, dict(lr=1e-3, weight_decay=0.01), lr_dtype=torch.float32)


@pytest.mark.parametrize("ctor,kw", [(ADAM, dict(lr=1e-2, amsgrad=True)),
                                     (SGD, dict(lr=0.1, momentum=0.9, dampening=0.5))])
def test_resume_from_torch_state_and_sync_back(ctor, kw):
    ref, fun = make_params(), make_params()
    opt, opt2 = ctor(ref.values(), **kw), ctor(fun.values(), **kw)
    gen, gen2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    def torch_step(ps, o, g):
        set_grads(ps, random_grads(ps, g))
        o.step()
    for _ in range(2):
        torch_step(ref, opt, gen), torch_step(fun, opt2, gen2)
    fopt = functional_optimizer(opt2, {id(p): n for n, p in fun.items()})
    params = {n: p.detach().clone() for n, p in fun.items()}
    state, step = fopt.init_state(params), fopt.init_step()
    assert step == (2.0 if ctor is ADAM else 1.0)
    step = 2.0
    for _ in range(2):
        torch_step(ref, opt, gen)
        step += 1
        params, state = fopt.update(params, random_grads(fun, gen2), state,
                                    torch.tensor(fopt.lr, dtype=F64), torch.tensor(step))
    fopt.sync_to_torch(params, state, step)
    torch_step(ref, opt, gen), torch_step(fun, opt2, gen2)
    for n in ref:
        close(fun[n].detach(), ref[n].detach())
        for k, v in opt.state[ref[n]].items():
            close(opt2.state[fun[n]][k], v)


@pytest.mark.parametrize("ctor,kw", [(ADAMW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
                                     (SGD, dict(lr=0.1, momentum=0.9, dampening=0.1))])
def test_update_traces_pure_and_replays(ctor, kw):
    from torch._subclasses.fake_tensor import FakeTensorMode
    ref, fun = make_params(), make_params()
    opt = ctor(ref.values(), **kw)
    fopt = functional_optimizer(ctor(fun.values(), **kw), {id(p): n for n, p in fun.items()})
    trainable = [n for n, p in fun.items() if p.requires_grad]
    mode = FakeTensorMode()
    fparams = {n: mode.from_tensor(p.detach()) for n, p in fun.items()}
    with mode:
        fstate = fopt.init_state(fparams)
        fgrads = {n: torch.empty_like(fparams[n]) for n in trainable}
        flr, fstep = torch.empty((), dtype=F64), torch.empty(())
    def f(params, grads, state, lr, step):
        return fopt.update(params, grads, state, lr, step)
    gm = make_fx(functionalize(f, remove="mutations"), tracing_mode="fake")(
        fparams, fgrads, fstate, flr, fstep)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets and not [t for t in targets if t.split(".")[1].endswith("_")], targets
    # replay the traced graph on real tensors against eager torch.optim
    params = {n: p.detach().clone() for n, p in fun.items()}
    state = fopt.init_state(params)
    gen = torch.Generator().manual_seed(7)
    for step in range(1, 6):
        grads = random_grads(ref, gen)
        set_grads(ref, grads)
        opt.step()
        grads = {n: grads[n] for n in trainable}
        params, state = gm(params, grads, state, torch.tensor(fopt.lr, dtype=F64),
                           torch.tensor(float(step)))
    for n, p in ref.items():
        close(params[n], p.detach())
        for name in fopt.state_names:
            if n in state[name]:
                close(state[name][n], opt.state[p][name])
