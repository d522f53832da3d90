"""CUDA and NCCL paths; they skip on machines without GPUs (CI has none), and run on a GPU machine.

    python -m pytest -q tests/test_cuda.py      # on a machine with 1 GPU (world of one) or 2+ GPUs (NCCL)
"""

from __future__ import annotations

import copy

import pytest
import torch

import models
from spawn import run_world

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                               reason="needs 2 CUDA GPUs for NCCL")


@needs_cuda
def test_device_ids_move_inputs_and_keep_outputs_on_the_device():
    import ddpkit

    model = models.MLP().cuda(0)
    ddp = ddpkit.DistributedDataParallel(model, device_ids=[0])
    x, y = models.batch("mlp", 4, 0)  # on the CPU: the wrapper moves it
    out = ddp(x)
    assert out.device == torch.device("cuda", 0)
    torch.nn.functional.cross_entropy(out, y.cuda()).backward()
    assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters())
    with pytest.raises(ValueError, match="device_ids"):
        ddpkit.DistributedDataParallel(models.MLP().cuda(0), device_ids=[0, 1])


def nccl_truth(world):
    import ddpkit

    torch.cuda.set_device(world.rank)
    device = torch.device("cuda", world.rank)
    r, n, shard = world.rank, world.world_size, 4
    torch.manual_seed(0)
    model = models.TinyTransformer().to(device)
    ref = copy.deepcopy(model)
    ddp = ddpkit.DistributedDataParallel(model, device_ids=[world.rank], bucket_cap_mb=0.002)
    stream = torch.cuda.Stream()
    worst = 0.0
    for step in range(3):
        x, y = models.batch("transformer", shard * n, seed=step)
        x, y = x.to(device), y.to(device)
        for p in list(ddp.parameters()) + list(ref.parameters()):
            p.grad = None
        with torch.cuda.stream(stream):  # a side stream: collectives must order with the current stream
            models.loss("transformer", ddp, x[r * shard:(r + 1) * shard], y[r * shard:(r + 1) * shard], r,
                        0).backward()
        torch.cuda.current_stream().wait_stream(stream)
        truth = sum(models.loss("transformer", ref, x[k * shard:(k + 1) * shard], y[k * shard:(k + 1) * shard],
                                k, 0) for k in range(n)) / n
        truth.backward()
        for p, q in zip(ddp.module.parameters(), ref.parameters()):
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    torch.cuda.synchronize()
    return worst, torch.cat([p.detach().flatten() for p in ddp.module.parameters()]).sum().item()


@needs_two
def test_nccl_truth():
    # CUDA cannot be used in a forked child once the parent has touched it: spawn the ranks.
    results = run_world(nccl_truth, 2, backend="nccl", start_method="spawn")
    for worst, _ in results:
        assert worst <= 1e-4, worst
    assert results[0][1] == results[1][1]

