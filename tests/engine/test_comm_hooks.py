"""Comm hooks on ddpkit's wrapper: ours and torch's default hooks, against single-process truth on 2 ranks."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import models
from helpers.models import fingerprint
from helpers.world import run_world

SHARD = 4  # samples per rank
TOL = 1e-5


def comm_hooks(world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks

    import ddpkit
    from ddpkit.engine import comm_hooks as hooks

    r, n = world.rank, world.world_size
    mine = slice(r * SHARD, (r + 1) * SHARD)
    errors = {}
    for label, state, hook, tol in (("allreduce", None, hooks.allreduce_hook, TOL),
                                    ("fp16", None, hooks.fp16_compress_hook, 2e-3),
                                    ("bf16", None, hooks.bf16_compress_hook, 2e-2),
                                    ("torch_allreduce", None, torch_hooks.allreduce_hook, TOL)):
        torch.manual_seed(5)
        model = models.MLP()
        ref = copy.deepcopy(model)
        ddp = ddpkit.DistributedDataParallel(model, bucket_cap_mb=0.002)
        ddp.register_comm_hook(state, hook)
        worst = 0.0
        for step in range(2):
            x, y = models.batch("mlp", SHARD * n, seed=60 + step)
            for p in list(ddp.parameters()) + list(ref.parameters()):
                p.grad = None
            models.loss("mlp", ddp, x[mine], y[mine], r, 0).backward()
            models.truth_step("mlp", ref, x, y, n, 0, SHARD)
            for p, q in zip(ddp.module.parameters(), ref.parameters()):
                worst = max(worst, ((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item())
        assert worst <= tol, f"{label}: relative error {worst:.3g} over {tol}"
        errors[label] = (worst, fingerprint(ddp.module))
        with pytest.raises(RuntimeError, match="can only be called once"):
            ddp.register_comm_hook(None, hook)
    return errors


def test_comm_hooks():
    a, b = run_world(comm_hooks, 2)
    for label in a:
        assert a[label][1] == b[label][1], f"{label}: replicas diverged"
    assert a["fp16"][0] > 0, "fp16 compression changed nothing: the hook did not run"


def _never_completes(state, bucket):
    return torch.futures.Future()  # nobody ever sets it: a hook stuck as PowerSGD's can be on gloo


def hook_that_never_completes(world):
    import time

    import ddpkit

    ddp = ddpkit.DistributedDataParallel(torch.nn.Linear(4, 4))
    ddp.register_comm_hook(None, _never_completes)
    began = time.monotonic()
    try:
        ddp(torch.ones(2, 4)).sum().backward()
    except Exception as exc:  # noqa: BLE001 - the type and the words are the result
        return type(exc).__name__, str(exc), time.monotonic() - began
    return "no error", "", time.monotonic() - began


def test_a_hook_future_that_never_completes_times_out_as_a_collective_would():
    """A future has no timeout of its own: waited for without one, the backward hung for ever."""
    for kind, text, took in run_world(hook_that_never_completes, 2, collective_timeout_s=4, stall_seconds=0,
                                      deadline_s=60):
        assert "Timed out after 4 s" in text and "comm_hook (bucket 0, backward 1)" in text, (kind, text)
        assert took < 20, took


def _wrong_size(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer()[:3])
    return future


def hook_of_the_wrong_size(world):
    import ddpkit

    ddp = ddpkit.DistributedDataParallel(torch.nn.Linear(4, 4))
    ddp.register_comm_hook(None, _wrong_size)
    with pytest.raises(RuntimeError, match="comm hook returned a tensor of 3 elements for bucket 0, which holds 20"):
        ddp(torch.ones(2, 4)).sum().backward()
    return True


def test_a_hook_result_of_the_wrong_size_is_named():
    """It failed inside the copy back ("refer to a single memory location"), naming neither the hook nor the size."""
    assert run_world(hook_of_the_wrong_size, 2, deadline_s=60) == [True, True]
