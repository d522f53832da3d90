"""CUDA and NCCL paths; they skip on machines without GPUs (CI has none), and run on a GPU machine.

    python -m pytest -q tests/gpu/test_cuda.py      # on a machine with 1 GPU (world of one) or 2+ GPUs (NCCL)
"""

from __future__ import annotations

import copy
import math
import os
import re
import threading
import time

import pytest
import torch

from helpers import models
from helpers.world import run_world

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
        stream.wait_stream(torch.cuda.current_stream())  # the inputs, the grads cleared, the init broadcast
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


@needs_cuda
def test_a_device_event_says_from_another_thread_when_the_stream_has_run():
    from ddpkit.distributed.collective import device_event

    torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles queued on the current stream
    completed = device_event(torch.device("cuda", 0))
    seen = []
    thread = threading.Thread(target=lambda: seen.append(completed()))  # as the stall inspector's thread asks
    thread.start()
    thread.join()
    torch.cuda.synchronize()
    assert seen == [False] and completed()


def nccl_stall(world, away_s):
    """Rank 1 stays away; rank 0's all-reduce returns at once (NCCL's wait only orders the stream) and rank 0
    blocks in .item(), where the inspector never saw a wait before."""
    import ddpkit

    torch.cuda.set_device(world.rank)
    comm = ddpkit.Comm.for_group()
    comm.all_reduce(torch.ones(1, device="cuda"), "warm-up")  # NCCL's communicator is made (blocking) here
    torch.cuda.synchronize()
    if world.rank == 1:
        time.sleep(away_s)  # the culprit
    total = torch.ones(4, device="cuda")
    began = time.monotonic()
    comm.all_reduce(total, "metrics")
    returned = time.monotonic() - began
    value = total.sum().item()
    return returned, time.monotonic() - began, value


@needs_two
def test_a_stalled_nccl_collective_is_explained_long_before_the_timeout(capfd):
    (returned, blocked, value), _ = run_world(nccl_stall, 2, args=(8,), backend="nccl", start_method="spawn",
                                              collective_timeout_s=60, stall_seconds=2, deadline_s=180)
    assert returned < 1 and blocked > 6 and value == 8.0, (returned, blocked, value)
    err = capfd.readouterr().err
    assert re.search(r"\[ddpkit rank 0\] rank 0 has waited [2-4] s in collective #\d+ all_reduce \(metrics\), "
                     r"which cuda:0 has not completed", err), err
    assert "ranks that never arrived: [1]" in err and "time.sleep(away_s)" in err, err


def fp16_trainer(world, out, stage):
    """fp16 on CUDA in the Trainer: float16 autocast, the CUDA GradScaler, skips agreed over NCCL, scaler.pt."""
    from ddpkit.checkpoint.files import load_checkpoint
    from ddpkit.trainer.precision import AgreedGradScaler
    from ddpkit.trainer.trainer import Trainer
    from helpers.models import Classifier, classification_data, trainer_args

    torch.cuda.set_device(world.rank)
    torch.manual_seed(0)
    model = Classifier()
    data = [{**sample, "x": sample["x"].float()} for sample in classification_data(48)]
    args = trainer_args(f"{out}/run", fp16=True, max_steps=6, save_strategy="steps", save_steps=3,
                 per_device_train_batch_size=4, ddp_zero_stage=stage)
    trainer = Trainer(model, args, train_dataset=data)
    trainer.train()
    restored = AgreedGradScaler("cuda", init_scale=1.0)
    load_checkpoint(f"{out}/run/checkpoint-6", scaler=restored, world=world)
    return {"dtype": str(trainer.precision.dtype), "scale": trainer.precision.scaler.get_scale(),
            "restored": restored.get_scale(), "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "params": [p.detach().cpu().double().sum().item() for p in model.parameters()],
            "files": os.listdir(f"{out}/run/checkpoint-6")}


def _check_fp16(results):
    for got in results:
        assert got["dtype"] == "torch.float16" and "scaler.pt" in got["files"]
        assert got["scale"] <= 65536.0 and got["restored"] == got["scale"]
        assert len(got["losses"]) == 6 and all(math.isfinite(loss) for loss in got["losses"])
    assert all(got["params"] == results[0]["params"] and got["scale"] == results[0]["scale"] for got in results)


@needs_cuda
def test_fp16_trains_on_one_gpu_and_checkpoints_its_scale(tmp_path):
    _check_fp16(run_world(fp16_trainer, 1, args=(str(tmp_path), 0), backend="nccl", start_method="spawn"))


@needs_two
def test_fp16_under_zero_stage_2_on_two_gpus_skips_alike(tmp_path):
    _check_fp16(run_world(fp16_trainer, 2, args=(str(tmp_path), 2), backend="nccl", start_method="spawn",
                          deadline_s=300))


def nccl_zero(world, out, stage):
    """ZeRO on NCCL (stage 1: ZeroRedundancyOptimizer over a plain DDP; stage 2: zero_stage=2, NCCL's native
    reduce-scatter): 3 AdamW steps with a no_sync micro-batch and a branch only rank 0 uses, against ddpkit's DDP
    with the unsharded AdamW; then the consolidated state, and a sharded checkpoint loaded into a fresh optimizer."""
    import ddpkit
    from ddpkit.checkpoint.files import load_checkpoint, save_checkpoint

    torch.cuda.set_device(world.rank)
    device, r, n, shard = torch.device("cuda", world.rank), world.rank, world.world_size, 3
    runs = {}
    for kind in ("plain", "zero"):
        torch.manual_seed(0)
        ddp = ddpkit.DistributedDataParallel(models.Branchy().to(device), device_ids=[r],
                                             zero_stage=2 if kind == "zero" and stage == 2 else 0)
        opt = (ddpkit.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
               if kind == "zero" else torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.1))
        for step in range(3):
            opt.zero_grad()
            for micro, (x, y) in enumerate(models.micro("branchy", step, m, n, shard)[r] for m in range(2)):
                loss = models.loss("branchy", ddp, x.to(device), y.to(device), r, step) / 2
                if micro == 0:
                    with ddp.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            opt.step()
        runs[kind] = (ddp, opt)
    (plain, plain_opt), (zero, zero_opt) = runs["plain"], runs["zero"]
    worst = max((p - q).abs().max().item() for p, q in zip(plain.module.parameters(), zero.module.parameters()))
    zero_opt.consolidate_state_dict(to=0)
    whole = zero_opt.state_dict() if r == 0 else None
    state_worst = 0.0 if whole is None else max(
        (a - plain_opt.state_dict()["state"][i][key].cpu()).abs().max().item()
        for i, entry in whole["state"].items() for key, a in entry.items() if key in ("exp_avg", "exp_avg_sq"))
    save_checkpoint(out, 3, model=zero.module, trainer_state={"global_step": 3}, optimizer=zero_opt,
                    comm=ddpkit.Comm.for_group(), world=world)
    fresh = ddpkit.ZeroRedundancyOptimizer(zero.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    if stage == 2:  # stage 2's shards are known after a backward: one, then the load lands at the first step
        models.loss("branchy", zero, *[t.to(device) for t in models.micro("branchy", 9, 0, n, shard)[r]], r,
                    9).backward()
    load_checkpoint(f"{out}/checkpoint-3", optimizer=fresh, world=world)
    if stage == 2:
        fresh.step()  # the deferred load happens first; compare the states it loaded, not this step's
    torch.cuda.synchronize()
    mine = {(i, a, b): {k: v.cpu() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}
            for i, a, b, s in zero_opt.shard_state()}
    loaded = {(i, a, b): {k: v.cpu() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}
              for i, a, b, s in fresh.shard_state()}
    same = stage == 2 or all(torch.equal(mine[key][k], loaded[key][k]) for key in mine for k in mine[key])
    return worst, state_worst, same, sorted(mine) == sorted(loaded)


@needs_two
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_on_nccl_matches_the_unsharded_optimizer_and_round_trips(tmp_path, stage):
    for worst, state_worst, same, ranges in run_world(nccl_zero, 2, args=(str(tmp_path), stage), backend="nccl",
                                                      start_method="spawn", deadline_s=300):
        # stage 1 steps the same averaged gradients: bitwise; stage 2's reduce-scatter sums in NCCL's order
        assert worst <= (0.0 if stage == 1 else 1e-5), worst
        assert state_worst <= (0.0 if stage == 1 else 1e-5), state_worst
        assert same and ranges
