"""DistributedDataParallel against single-process truth, on 1, 2 and 3 gloo ranks.

Truth: one process holding the whole global batch computes the mean over ranks of each rank's shard loss
(for plain models that is the loss of the concatenated batch). Gradients must agree to 1e-5, parameters after
several optimizer steps too, and the replicas must be bitwise identical across ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from helpers import models
from helpers.models import assert_close_grads, fingerprint, grads_of
from helpers.world import run_world

TOL = 1e-5
SHARD = 4  # samples per rank
STEPS = 4


def train_against_truth(world, name, ddp_kwargs):
    import ddpkit

    torch.manual_seed(0)
    model = models.make(name)
    ref = copy.deepcopy(model)
    ddp = ddpkit.DistributedDataParallel(model, **ddp_kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    r, n = world.rank, world.world_size
    for step in range(STEPS):
        x, y = models.batch(name, SHARD * n, seed=100 + step)
        opt.zero_grad()
        ref_opt.zero_grad()
        models.loss(name, ddp, x[r * SHARD:(r + 1) * SHARD], y[r * SHARD:(r + 1) * SHARD], r, step).backward()
        models.truth_step(name, ref, x, y, n, step, SHARD)
        assert_close_grads(grads_of(ddp.module), grads_of(ref), f"{name} step {step}")
        opt.step()
        ref_opt.step()
    for (pname, p), q in zip(ddp.module.named_parameters(), ref.parameters()):
        err = (p - q).abs().max().item()
        assert err <= TOL, f"{name}: parameter {pname} differs after {STEPS} steps by {err:.3g}"
    early = None if ddp.reducer is None else (ddp.reducer.launched_during_backward, len(ddp.reducer.buckets))
    return {"fingerprint": fingerprint(ddp.module), "plan": ddp.bucket_plan, "early": early}


def _set_eager(numel: int | None) -> None:
    """Gradients of at least `numel` elements take the copy-in-the-hook path (None: the default threshold)."""
    import ddpkit.engine.reducer

    if numel is not None:
        ddpkit.engine.reducer.EAGER_NUMEL = numel


def many_models(world, ddp_kwargs, eager_numel=None):
    _set_eager(eager_numel)
    return {name: train_against_truth(world, name, ddp_kwargs)
            for name in ("mlp", "convbn", "transformer", "branchy")}


def _assert_replicas_identical(results):
    for name in results[0]:
        prints = {res[name]["fingerprint"] for res in results}
        assert len(prints) == 1, f"{name}: replicas differ across ranks"
        plans = [res[name]["plan"] for res in results]
        assert all(plan == plans[0] for plan in plans), f"{name}: ranks built different bucket plans"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_single_process_truth(world_size):
    # A tiny bucket cap puts the parameters into many buckets, so overlap and ordering are exercised.
    results = run_world(many_models, world_size, args=({"bucket_cap_mb": 0.002},))
    _assert_replicas_identical(results)
    if world_size > 1:
        assert len(results[0]["mlp"]["plan"]) > 1
        for name in ("mlp", "convbn", "transformer"):
            # Every parameter is used, so every bucket is launched while backward is still running.
            launched, total = results[0][name]["early"]
            assert launched == total, f"{name}: only {launched} of {total} buckets overlapped backward"
        assert results[0]["transformer"]["early"][1] > 1


def test_truth_with_flags():
    """find_unused_parameters, gradient_as_bucket_view and the default bucket size, on two ranks."""
    for kwargs, eager in (({"find_unused_parameters": True, "bucket_cap_mb": 0.002}, None),
                          ({"gradient_as_bucket_view": True, "bucket_cap_mb": 0.002}, None),
                          ({}, None),
                          # every gradient copied in its hook, also into bucket views and with unused parameters
                          ({"bucket_cap_mb": 0.002}, 0),
                          ({"gradient_as_bucket_view": True, "find_unused_parameters": True}, 0)):
        _assert_replicas_identical(run_world(many_models, 2, args=(kwargs, eager)))


# -- the cases where torch's DDP is silently wrong ---------------------------------------------------------------
class Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(6, 6)
        self.layer = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x, uses=2):
        h = self.inp(x)
        for _ in range(uses):  # one layer run several times, each under reentrant checkpointing
            h = checkpoint(lambda t: torch.tanh(self.layer(t)), h, use_reentrant=True)
        return self.head(h)


def _unused_first_then_two_backwards(r, n, report):
    """(a) a parameter unused in the first iteration, default flags; (b) two forwards, then two separate
    backward() calls."""
    import ddpkit

    torch.manual_seed(1)
    model = models.Branchy()
    ref = copy.deepcopy(model)
    ddp = ddpkit.DistributedDataParallel(model, bucket_cap_mb=0.0005)
    for step in range(3):
        x, y = models.batch("branchy", SHARD * n, seed=step)
        for p in list(ddp.parameters()) + list(ref.parameters()):
            p.grad = None
        models.loss("branchy", ddp, x[r * SHARD:(r + 1) * SHARD], y[r * SHARD:(r + 1) * SHARD], r, step).backward()
        models.truth_step("branchy", ref, x, y, n, step, SHARD)
        assert_close_grads(grads_of(ddp.module), grads_of(ref), f"(a) step {step}")
    assert ddp.module.late_branch.weight.grad is not None
    assert ddp.module.never.weight.grad is None
    report["a"] = fingerprint(ddp.module)

    torch.manual_seed(2)
    model = models.MLP()
    ref = copy.deepcopy(model)
    ddp = ddpkit.DistributedDataParallel(model, bucket_cap_mb=0.002)
    for step in range(3):
        x1, y1 = models.batch("mlp", SHARD * n, seed=10 + step)
        x2, y2 = models.batch("mlp", SHARD * n, seed=20 + step)
        for p in list(ddp.parameters()) + list(ref.parameters()):
            p.grad = None
        mine = slice(r * SHARD, (r + 1) * SHARD)
        loss1 = models.loss("mlp", ddp, x1[mine], y1[mine], r, 0)
        loss2 = models.loss("mlp", ddp, x2[mine], y2[mine], r, 0)
        loss1.backward()
        loss2.backward()
        models.truth_step("mlp", ref, x1, y1, n, 0, SHARD)
        models.truth_step("mlp", ref, x2, y2, n, 0, SHARD)
        assert_close_grads(grads_of(ddp.module), grads_of(ref), f"(b) step {step}")
    report["b"] = fingerprint(ddp.module)


def _layer_run_twice(r, n, report):
    """(c) one layer run twice under reentrant activation checkpointing; then a backward that uses the layer
    more often than the first iteration did must fail in that iteration, never reduce a stale bucket silently."""
    import ddpkit

    torch.manual_seed(3)
    model = Checkpointed()
    ref = copy.deepcopy(model)
    ddp = ddpkit.DistributedDataParallel(model, bucket_cap_mb=0.0002)
    for step in range(3):
        g = torch.Generator().manual_seed(30 + step)
        x, y = torch.randn(SHARD * n, 6, generator=g), torch.randint(0, 2, (SHARD * n,), generator=g)
        for p in list(ddp.parameters()) + list(ref.parameters()):
            p.grad = None
        mine = slice(r * SHARD, (r + 1) * SHARD)
        torch.nn.functional.cross_entropy(ddp(x[mine]), y[mine]).backward()
        truth = sum(torch.nn.functional.cross_entropy(ref(x[k * SHARD:(k + 1) * SHARD]),
                                                      y[k * SHARD:(k + 1) * SHARD]) for k in range(n))
        (truth / n).backward()
        assert_close_grads(grads_of(ddp.module), grads_of(ref), f"(c) step {step}")
    report["c"] = fingerprint(ddp.module)
    x = torch.randn(SHARD, 6)
    try:
        ddp(x, uses=3).sum().backward()
        report["c_changed"] = "no error"
    except RuntimeError as exc:
        report["c_changed"] = str(exc)


def silent_cases(world, eager_numel=None):
    _set_eager(eager_numel)
    report = {}
    _unused_first_then_two_backwards(world.rank, world.world_size, report)
    _layer_run_twice(world.rank, world.world_size, report)
    return report


@pytest.mark.parametrize("eager_numel", [None, 0])
def test_cases_where_torch_is_silently_wrong(eager_numel):
    results = run_world(silent_cases, 2, args=(eager_numel,))
    for case in "abc":
        assert results[0][case] == results[1][case], f"case ({case}): replicas diverged"
    for res in results:
        # Buckets of 0.0002 MB (210 bytes) in ready order: head (56 bytes) then layer (168) close bucket 0 at 224
        # bytes, inp is bucket 1. The second use completes layer's count, so bucket 0 launches before the third
        # use arrives (the first checkpoint's inner backward runs last): every rank must raise, naming the layer.
        late = ("received gradient number 3 in this backward pass after its bucket was already reduced; in the "
                "first iteration it received 2.")
        assert res["c_changed"].startswith(("parameter 'layer.weight' " + late, "parameter 'layer.bias' " + late)), \
            res["c_changed"]


# -- accumulation, buffers, init, model checks --------------------------------------------------------------------
def accumulation_and_buffers(world):
    import ddpkit

    _set_eager(0)  # the gradients accumulated under no_sync are copied by the hook of the synced backward
    r, n = world.rank, world.world_size
    mine = slice(r * SHARD, (r + 1) * SHARD)
    out = {}
    for mode in ("no_sync", "flag"):
        torch.manual_seed(4)
        model = models.MLP()
        ref = copy.deepcopy(model)
        ddp = ddpkit.DistributedDataParallel(model, bucket_cap_mb=0.002)
        for step in range(2):
            for p in list(ddp.parameters()) + list(ref.parameters()):
                p.grad = None
            micro = [models.batch("mlp", SHARD * n, seed=40 + 3 * step + k) for k in range(3)]
            for k, (x, y) in enumerate(micro):
                last = k == len(micro) - 1
                if mode == "no_sync" and not last:
                    with ddp.no_sync():
                        models.loss("mlp", ddp, x[mine], y[mine], r, 0).backward()
                else:
                    ddp.require_backward_grad_sync = last
                    models.loss("mlp", ddp, x[mine], y[mine], r, 0).backward()
                if not last:  # still local: each rank holds only its own shard's gradient
                    out.setdefault(f"{mode}_local", []).append(ddp.module.net[0].weight.grad.sum().item())
                models.truth_step("mlp", ref, x, y, n, 0, SHARD)
            assert_close_grads(grads_of(ddp.module), grads_of(ref), f"accumulation ({mode}) step {step}")
        out[mode] = fingerprint(ddp.module)

    # Init broadcast: every rank builds its model from another seed; rank 0's weights win.
    torch.manual_seed(100 + r)
    model = models.ConvBN()
    with torch.no_grad():
        model.bn1.running_mean.fill_(float(r))
    ddp = ddpkit.DistributedDataParallel(model)
    out["init"] = fingerprint(ddp.module, buffers=True)
    # Buffers: each rank's running statistics drift apart in its own forward; at the start of every forward
    # after a synchronised one, with grad or (the first evaluation after training) without, they are rank 0's.
    seen = []
    handle = ddp.module.register_forward_pre_hook(lambda mod, args: seen.append(mod.bn1.running_mean.clone()))
    for step in range(2):
        x, _ = models.batch("convbn", SHARD, seed=50 + step + 10 * r)
        ddp(x).sum().backward()
    with torch.no_grad():
        ddp.module.bn1.running_mean.add_(float(r))  # the first forward without grad after training: rank 0's
        ddp(x)
        ddp.module.bn1.running_mean.add_(float(r))  # the next one keeps each rank's own, as torch's
        ddp(x)
    handle.remove()
    out["buffers_seen"] = [t.tolist() for t in seen]
    return out


def test_accumulation_buffers_and_init():
    results = run_world(accumulation_and_buffers, 2)
    a, b = results
    for mode in ("no_sync", "flag"):
        assert a[mode] == b[mode], f"{mode}: replicas diverged"
        assert a[f"{mode}_local"] != b[f"{mode}_local"], f"{mode}: gradients were synchronised inside no_sync"
    assert a["init"] == b["init"]
    assert a["buffers_seen"][:3] == b["buffers_seen"][:3]
    assert a["buffers_seen"][3] != b["buffers_seen"][3]


# -- regressions found in review ----------------------------------------------------------------------------------
class Gated(torch.nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.gate = torch.nn.Parameter(torch.ones(width))

    def forward(self, x, use_gate=True):
        h = self.lin(x)
        return h * self.gate if use_gate else h


def _worst(pairs):
    return max((p.grad - q.grad).abs().max().item() for p, q in pairs if q.grad is not None)


def _two_wrappers_in_one_backward(r, n, mine, errors):
    """The inner one's gate used on rank 0 only: their collectives must pair up."""
    import ddpkit

    torch.manual_seed(0)
    a, b = Gated(), Gated()
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    outer, inner = ddpkit.DistributedDataParallel(a), ddpkit.DistributedDataParallel(b)
    for step in range(3):
        for p in [*a.parameters(), *b.parameters(), *ref_a.parameters(), *ref_b.parameters()]:
            p.grad = None
        x = torch.randn(2 * n, 4, generator=torch.Generator().manual_seed(step))
        inner(outer(x[mine]), use_gate=r == 0).sum().backward()
        (sum(ref_b(ref_a(x[2 * k:2 * k + 2]), use_gate=k == 0).sum() for k in range(n)) / n).backward()
        errors[f"two wrappers step {step}"] = _worst(zip([*a.parameters(), *b.parameters()],
                                                         [*ref_a.parameters(), *ref_b.parameters()]))


def _checkpointed(n, mine, errors):
    """find_unused_parameters with reentrant checkpointing (the walk cannot see inside the checkpoint); then
    gradient_as_bucket_view with a gradient large enough to be divided in its hook, accumulated twice; then an
    in-place change to the wrapper's output, as torch's wrapper allows."""
    import ddpkit

    torch.manual_seed(1)
    model = Checkpointed()
    ref = copy.deepcopy(model)
    ddp = ddpkit.DistributedDataParallel(model, find_unused_parameters=True, bucket_cap_mb=0.0001)
    for step in range(3):
        x = torch.randn(2 * n, 6, generator=torch.Generator().manual_seed(10 + step))
        for p in [*model.parameters(), *ref.parameters()]:
            p.grad = None
        ddp(x[mine]).sum().backward()
        (sum(ref(x[2 * k:2 * k + 2]).sum() for k in range(n)) / n).backward()
        errors[f"find_unused + reentrant step {step}"] = _worst(zip(model.parameters(), ref.parameters()))

    _set_eager(0)
    torch.manual_seed(2)
    model = Checkpointed()
    ref = copy.deepcopy(model)
    ddp = ddpkit.DistributedDataParallel(model, gradient_as_bucket_view=True)
    for step, uses in enumerate((1, 2, 2)):
        x = torch.randn(2 * n, 6, generator=torch.Generator().manual_seed(20 + step))
        ddp.zero_grad(set_to_none=False)
        ref.zero_grad(set_to_none=False)
        ddp(x[mine], uses=uses).sum().backward()
        (sum(ref(x[2 * k:2 * k + 2], uses=uses).sum() for k in range(n)) / n).backward()
        errors[f"bucket view, uses {uses}, step {step}"] = _worst(zip(model.parameters(), ref.parameters()))
    _set_eager(1 << 15)

    out = ddp(torch.randn(2, 6))
    out /= 2.0
    out.sum().backward()


def _failed_backward_then_no_sync(r, errors):
    """A backward that raised must not leave its parameter uses behind (a parameter no rank uses stays None);
    no_sync is decided at forward time, as in torch."""
    import ddpkit

    torch.manual_seed(3)
    model = models.Branchy()
    ddp = ddpkit.DistributedDataParallel(model)
    x, y = models.batch("branchy", 2, seed=0)
    models.loss("branchy", ddp, x, y, 0, step=1).backward()  # learning window; late_branch used
    try:
        x_failing = x.clone().requires_grad_()  # its gradient comes last: after the branches' hooks ran
        x_failing.register_hook(lambda g: (_ for _ in ()).throw(MemoryError("simulated OOM")))
        models.loss("branchy", ddp, x_failing, y, 0, step=1).backward()
    except MemoryError:
        pass
    ddp.zero_grad(set_to_none=True)
    models.loss("branchy", ddp, x, y, 0, step=0).backward()  # late_branch unused on every rank
    errors["late_branch grad after a failed backward"] = model.late_branch.weight.grad

    torch.manual_seed(4)
    model = models.MLP()
    ddp = ddpkit.DistributedDataParallel(model)
    x, y = models.batch("mlp", 2, seed=30 + r)
    for forward_inside in (True, False):
        ddp.zero_grad(set_to_none=True)
        if forward_inside:
            with ddp.no_sync():
                loss = models.loss("mlp", ddp, x, y, r, 0)
            loss.backward()
        else:
            loss = models.loss("mlp", ddp, x, y, r, 0)
            with ddp.no_sync():
                loss.backward()
        errors[f"no_sync forward inside={forward_inside}"] = model.net[0].weight.grad.sum().item()


def review_regressions(world):
    r, n = world.rank, world.world_size
    mine = slice(2 * r, 2 * r + 2)
    errors = {}
    _two_wrappers_in_one_backward(r, n, mine, errors)
    _checkpointed(n, mine, errors)
    _failed_backward_then_no_sync(r, errors)
    return errors


def test_review_regressions():
    a, b = run_world(review_regressions, 2)
    for key, value in a.items():
        if key.startswith(("two wrappers", "find_unused", "bucket view")):
            assert value <= TOL and b[key] <= TOL, f"{key}: off by {value:.3g} / {b[key]:.3g}"
    assert a["late_branch grad after a failed backward"] is None
    assert a["no_sync forward inside=True"] != b["no_sync forward inside=True"], "no_sync forward synchronised"
    assert a["no_sync forward inside=False"] == b["no_sync forward inside=False"], "synced forward did not sync"
