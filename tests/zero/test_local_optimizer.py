"""The local optimizer's options: foreach where it computes the loop's bits, the loop everywhere else."""

from __future__ import annotations

import itertools

import pytest
import torch

import ddpkit
from ddpkit.zero.local_optimizer import FOREACH_CLASSES, foreach_tensors, runs_foreach

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
OPTIONS = [dict(amsgrad=a, maximize=m, weight_decay=w)
           for a, m, w in itertools.product((False, True), (False, True), (0.0, 0.1))]


def _steps(cls, options, foreach, dtype, steps=4):
    """A few steps on tensors of several shapes (one of a single element), with fresh gradients each step."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=g, dtype=dtype).requires_grad_() for shape in ((7,), (3, 5), (300,), (1,))]
    opt = cls(params, lr=1e-2, foreach=foreach, **options)
    grads_kept = True
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
        before = [p.grad.clone() for p in params]
        opt.step()
        grads_kept &= all(torch.equal(b, p.grad) for b, p in zip(before, params))
    return params, opt.state_dict()["state"], grads_kept


@pytest.mark.parametrize("cls", FOREACH_CLASSES, ids=lambda c: c.__name__)
def test_foreach_is_chosen_only_where_it_computes_the_loops_bits(cls):
    chosen = []
    for options, dtype in itertools.product(OPTIONS, DTYPES):
        tensors = [torch.zeros(3, dtype=dtype)]
        if not runs_foreach(cls, {"foreach": None, **options}, foreach_tensors(tensors)):
            continue
        chosen.append(dtype)
        loop, loop_state, loop_kept = _steps(cls, options, False, dtype)
        fast, fast_state, fast_kept = _steps(cls, options, True, dtype)
        where = f"{cls.__name__} {options} {dtype}"
        assert all(torch.equal(a, b) for a, b in zip(loop, fast)), where
        assert all(torch.equal(loop_state[i][k], fast_state[i][k]) for i in loop_state for k in loop_state[i]), where
        assert loop_kept and fast_kept, where  # neither path writes into the .grad it reads
    assert set(chosen) == {torch.float32, torch.float64}  # and for every option


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).to(dtype)


def _train(model, opt, steps=3):
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1), dtype=next(model.parameters()).dtype)
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_the_sharded_step_runs_foreach_where_chosen_and_keeps_the_callers_options():
    """One process (no process group): a world of one, whose shard is every parameter."""
    cases = {  # name: (optimizer class, its options, parameter dtype, the local optimizer's foreach)
        "adamw": (torch.optim.AdamW, {"weight_decay": 0.1}, torch.float32, True),
        "adam float64": (torch.optim.Adam, {"amsgrad": True}, torch.float64, True),
        "foreach=False kept": (torch.optim.AdamW, {"foreach": False}, torch.float32, False),
        "bfloat16 loops": (torch.optim.AdamW, {}, torch.bfloat16, None),
        "sgd loops": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, torch.float32, None),
        "tensor lr loops": (torch.optim.Adam, {"lr": torch.tensor(1e-2)}, torch.float32, None),
    }
    for name, (cls, options, dtype, local_foreach) in cases.items():
        options = {"lr": 1e-2, **options}
        plain_model, sharded_model = _model(dtype), _model(dtype)
        plain = _train(plain_model, cls(plain_model.parameters(), **options))
        zero = ddpkit.ZeroRedundancyOptimizer(sharded_model.parameters(), cls, **options)
        sharded = _train(sharded_model, zero)
        assert all(torch.equal(a, b) for a, b in zip(plain, sharded)), name
        assert [g["foreach"] for g in zero.optim.param_groups] == [local_foreach], name
        assert zero.param_groups[0]["foreach"] == options.get("foreach"), name  # what the caller sees
        assert zero.state_dict()["param_groups"][0]["foreach"] == options.get("foreach"), name


def test_a_factory_gets_whole_parameters_and_bad_classes_are_refused():
    """torch's class takes any callable that builds an optimizer; ddpkit's gives it whole parameters (it is not
    known to step elementwise) and the same result as the optimizer it builds."""
    import functools

    for factory, whole in ((lambda params, **kw: torch.optim.SGD(params, momentum=0.9, **kw), True),
                           (functools.partial(torch.optim.AdamW, betas=(0.8, 0.9)), False)):  # AdamW's rules
        plain_model, sharded_model = _model(), _model()
        plain = _train(plain_model, factory(plain_model.parameters(), lr=1e-2))
        zero = ddpkit.ZeroRedundancyOptimizer(sharded_model.parameters(), factory, lr=1e-2)
        sharded = _train(sharded_model, zero)
        assert zero.whole == whole and all(torch.equal(a, b) for a, b in zip(plain, sharded)), factory
    for bad in (42, int):
        with pytest.raises(TypeError, match="optimizer_class must be"):
            ddpkit.ZeroRedundancyOptimizer(_model().parameters(), bad, lr=0.1)
    with pytest.raises(ValueError, match="LBFGS"):
        ddpkit.ZeroRedundancyOptimizer(_model().parameters(), functools.partial(torch.optim.LBFGS), lr=0.1)


class _SubAdamW(torch.optim.AdamW):
    """Not torch's own class: its step runs once for all units, and takes the closure (torch's hands it over)."""


class _KeywordSGD(torch.optim.SGD):
    """torch's test_step_with_kwargs' optimizer: a step keyword of its own; records the closure it was given."""

    def step(self, closure=None, calls=None):
        super().step()
        calls.append(closure)


def test_the_closure_is_handed_to_the_wrapped_step():
    """step(closure) runs the closure inside the wrapped step, whose backward makes new .grad (the ones set
    before are wrong on purpose): the same parameters and losses as the unsharded optimizer. torch's
    test_step_with_kwargs calls step(0, calls=...): the 0 reaches the wrapped step as it came."""
    models = [_model(), _model()]
    opts = [_SubAdamW(models[0].parameters(), lr=0.1),
            ddpkit.ZeroRedundancyOptimizer(models[1].parameters(), _SubAdamW, lr=0.1)]
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    losses = [[], []]
    for model, opt, seen in zip(models, opts, losses):
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.full_like(p, 7.0)

            def closure(model=model, opt=opt):
                opt.zero_grad(set_to_none=True)
                loss = model(x).square().sum()
                loss.backward()
                return loss

            seen.append(opt.step(closure).item())
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    assert losses[0] == losses[1] and len(set(losses[0])) == 3, losses
    calls = []
    ddpkit.ZeroRedundancyOptimizer([torch.ones(2, requires_grad=True)], _KeywordSGD, lr=0.1).step(0, calls=calls)
    assert calls == [0]
