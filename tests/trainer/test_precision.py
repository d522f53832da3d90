"""ddpkit.trainer.precision: fp16's gradient scaler under data parallelism, on the CPU (torch.amp.GradScaler("cpu")).

A power-of-two loss scale is exact in binary floating point: scaling the loss and unscaling the gradients leaves
them bitwise as they were (without overflow), so a scaled run equals the unscaled one bit for bit, step for step,
apart from the steps it skips. The CUDA path (Precision.for_args with fp16) is tests/gpu/test_cuda.py's.
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch
from torch import nn

from ddpkit.args.training_args import TrainingArguments
from ddpkit.errors import ArgumentError
from ddpkit.trainer.callbacks import TrainerCallback
from ddpkit.trainer.precision import AgreedGradScaler, Precision, ScaledPrecision
from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, params_of, trainer_args
from helpers.world import run_world

N = 16  # elements of the one parameter; under ZeRO rank 0 owns [0, 8), rank 1 [8, 16)
HUGE = 3e38  # near float32's max: times any loss scale > 1.2 its gradient overflows to inf


def test_for_args_picks_the_precision_and_refuses_fp16_off_cuda():
    cpu = torch.device("cpu")
    assert Precision.for_args(TrainingArguments(), cpu).dtype is None
    bf16 = Precision.for_args(TrainingArguments(bf16=True), cpu)
    assert bf16.dtype is torch.bfloat16 and bf16.scaler is None
    with bf16.autocast():
        assert torch.nn.functional.linear(torch.ones(1, 2), torch.ones(3, 2)).dtype is torch.bfloat16
    # Arguments made where CUDA is visible, a process that trains on the CPU: still the clear error.
    with pytest.raises(ArgumentError, match="fp16: needs a CUDA device.*on a CPU use bf16"):
        Precision.for_args(types.SimpleNamespace(fp16=True, bf16=False), cpu)


class Spike(nn.Module):
    """loss = sum(w * x) + sum(w^2): the gradient of w[k] is x[k] + 2 w[k], so x picks where an inf appears."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, N))

    def forward(self, x):
        return (self.w * x).sum() + self.w.square().sum()


def _inputs(rank, step):
    x = torch.randn(N, generator=torch.Generator().manual_seed(10 * step + rank))
    if step == 1 and rank == 1:
        x[N - 1] = HUGE  # in rank 1's shard only: rank 0's own gradients stay finite
    return x


def _run(world, stage, scaled):
    import ddpkit
    from ddpkit.trainer import optimizer_step as steps

    torch.manual_seed(0)
    model = Spike()
    ddp = ddpkit.DistributedDataParallel(model, **({"zero_stage": 2} if stage == 2 else {}))
    params = list(model.parameters())
    optimizer = ddpkit.ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=0.1) if stage else \
        torch.optim.AdamW(params, lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    scaler = AgreedGradScaler("cpu", comm=ddpkit.Comm.for_group(), init_scale=2.0 ** 10, growth_interval=2)
    # dtype None: no autocast, so that the scaled run can equal the unscaled one bit for bit.
    precision = ScaledPrecision(world.device, scaler, dtype=None) if scaled else Precision(world.device)
    trace = []
    for step in range(4):
        if step == 1 and not scaled:
            continue  # the truth: the step the scaler must skip is never taken
        precision.backward(ddp(_inputs(world.rank, step)))
        norm = steps.optimizer_step(optimizer, scheduler, params, 1.0, precision)  # clips: unscaled first
        steps.wait_for_params(optimizer)
        trace.append({"w": model.w.detach().clone().numpy(), "norm": norm, "lr": scheduler.get_last_lr()[0],
                      "scale": scaler.get_scale() if scaled else None, "skipped": scaler.skipped if scaled else None,
                      "found_here": scaler.found_here if scaled else None})
    return trace


def skip_world(world):
    return {stage: (_run(world, stage, True), _run(world, stage, False)) for stage in (0, 1, 2)}


def test_an_inf_gradient_on_one_rank_skips_the_step_on_every_rank_and_halves_the_scale():
    a, b = run_world(skip_world, 2, deadline_s=90)
    for stage in (0, 1, 2):
        (scaled, truth), (scaled_b, _) = a[stage], b[stage]
        assert [t["skipped"] for t in scaled] == [t["skipped"] for t in scaled_b] == [False, True, False, False]
        # The scale: 1024, halved by the skip, doubled after growth_interval=2 clean steps, on both ranks.
        assert [t["scale"] for t in scaled] == [t["scale"] for t in scaled_b] == [1024.0, 512.0, 512.0, 1024.0]
        for x, y in zip(scaled, scaled_b):
            np.testing.assert_array_equal(x["w"], y["w"], err_msg=f"stage {stage}: replicas parted")
        np.testing.assert_array_equal(scaled[1]["w"], scaled[0]["w"])  # skipped: nothing moved
        # Every step taken equals the unscaled run bitwise (unscaled before clipping: the norms match too),
        # and the schedule advanced only with the steps taken.
        taken = [scaled[0], scaled[2], scaled[3]]
        for got, want in zip(taken, truth):
            np.testing.assert_array_equal(got["w"], want["w"], err_msg=f"stage {stage}")
            assert got["norm"] == want["norm"] and got["lr"] == want["lr"]
        assert scaled[1]["lr"] == scaled[0]["lr"] and not np.isfinite(scaled[1]["norm"])
    # Under plain DDP the averaged gradients are the same everywhere; under ZeRO only rank 1's shard held the inf,
    # so a rank-local decision would have stepped rank 0 and skipped rank 1.
    # At stage 1 every rank checks the whole .grad (averaged: the inf is everywhere); at stage 2 only its shard.
    for stage in (0, 1):
        assert a[stage][0][1]["found_here"] and b[stage][0][1]["found_here"], stage
    assert not a[2][0][1]["found_here"] and b[2][0][1]["found_here"]


def _by_hand(world, stage, scaler_class):
    """torch's AMP recipe written by hand, the scaler's comm left at its default: scale, backward, unscale_,
    clip (torch's clip_grad_norm_ over model.parameters(), or the optimizer's over the shards at stage 2), step,
    update. Returns per step the weights, the norm and the scale, or the error raised."""
    import ddpkit

    torch.manual_seed(0)
    model = Spike()
    ddp = ddpkit.DistributedDataParallel(model, **({"zero_stage": 2} if stage == 2 else {}))
    opt = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1) if stage else \
        torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = scaler_class("cpu", init_scale=2.0 ** 10, growth_interval=2)
    trace = []
    try:
        for step in range(4):
            scaler.scale(ddp(_inputs(world.rank, step))).backward()
            scaler.unscale_(opt)
            norm = opt.clip_grad_norm_(1.0) if stage == 2 else torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            trace.append((model.w.detach().clone().numpy(), float(norm), scaler.get_scale()))
    except RuntimeError as error:
        return str(error), model.w.detach().clone().numpy()
    return trace


def by_hand_world(world):
    return {(stage, scaler.__name__): _by_hand(world, stage, scaler)
            for stage in (0, 1, 2) for scaler in (torch.amp.GradScaler, AgreedGradScaler) if (stage, scaler) != (0, 0)}


def test_torchs_recipe_by_hand_under_each_stage_with_the_default_comm():
    a, b = run_world(by_hand_world, 2, deadline_s=90, collective_timeout_s=20)
    truth = a[0, "GradScaler"]
    assert [t[2] for t in truth] == [1024.0, 512.0, 512.0, 1024.0]  # step 1 skipped, on every rank
    for key in ((0, "AgreedGradScaler"), (1, "GradScaler"), (1, "AgreedGradScaler"), (2, "AgreedGradScaler")):
        for rank, got in enumerate((a[key], b[key])):
            assert [t[2] for t in got] == [t[2] for t in truth], (key, rank)
            for (w, norm, _), (w_true, norm_true, _) in zip(got, truth):
                # Unscaled whole before torch's clip reads it (stage 1: not only this rank's slice); the ranks agree
                # on the skip without being told their group (ZeRO's own); one element's sum of two is exact.
                if key[0] == 2:
                    # Stage 2's norm sums the shards' squares, torch's takes each tensor's norm with a vectorised
                    # kernel whose order depends on the host's CPU: the norms, so the clip coefficients, agree to
                    # 1e-6, and weights clipped by them to 1e-6 (AdamW divides most of the difference out).
                    np.testing.assert_allclose(w, w_true, rtol=1e-6, atol=1e-6, err_msg=f"{key} rank {rank}")
                else:
                    np.testing.assert_array_equal(w, w_true, err_msg=f"{key} rank {rank}")
                assert np.isclose(norm, norm_true, rtol=1e-6 if key[0] == 2 else 0, atol=0) or not (
                    np.isfinite(norm) or np.isfinite(norm_true)), (key, norm, norm_true)
    # torch's own scaler cannot see stage 2's shards (no .grad): refused at its first step, nothing stepped.
    for error, w in (a[2, "GradScaler"], b[2, "GradScaler"]):
        assert "ddpkit.AgreedGradScaler" in error and "zero_stage=2" in error, error
        np.testing.assert_array_equal(w, Spike().w.detach().numpy())


class ScaleTrace(Trainer):
    """fp16 on the CPU: the Trainer's own loop with a CPU GradScaler; notes the scale after every step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.precision = ScaledPrecision(self.world.device, AgreedGradScaler("cpu", comm=self.comm,
                                                                             init_scale=2.0 ** 19, growth_interval=2))
        self.scales = []
        trainer = self

        class Noting(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                trainer.scales.append((state.global_step, trainer.precision.scaler.get_scale()))

        self.add_callback(Noting())


def _fp16_run(out, resume=None):
    torch.manual_seed(0)
    model = Classifier()  # float32: its Linear layers run in float16 under the autocast
    args = trainer_args(out, per_device_train_batch_size=4, max_steps=8, save_strategy="steps", save_steps=4,
                 lr_scheduler_type="linear")
    data = [{**sample, "x": sample["x"].float()} for sample in classification_data(40)]
    trainer = ScaleTrace(model, args, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume)
    return trainer.scales, params_of(model), trainer.lr_scheduler.last_epoch, sorted(os.listdir(f"{out}/checkpoint-8"))


def trainer_world(world, out):
    return _fp16_run(f"{out}/full"), _fp16_run(f"{out}/resumed", resume=f"{out}/full/checkpoint-4")


def test_fp16_in_the_trainer_skips_alike_and_resumes_with_the_saved_scale(tmp_path):
    a, b = run_world(trainer_world, 2, args=(str(tmp_path),), deadline_s=120)
    (scales, params, scheduled, files), (resumed_scales, resumed_params, resumed_scheduled, _) = a
    assert scales == b[0][0] and resumed_scales == b[1][0]
    for x, y, z in zip(params, b[0][1], resumed_params):
        np.testing.assert_array_equal(x, y)  # replicas identical
        np.testing.assert_array_equal(x, z)  # the resumed run is the uninterrupted one, bit for bit
    # 2**19 times a gradient overflows float16's 65504 in backward: the first steps are skipped and halve it.
    values = [s for _, s in scales]
    skipped = sum(1 for before, after in zip([2.0 ** 19, *values], values) if after < before)
    assert values[0] == 2.0 ** 18 and 1 <= skipped < 6 and max(values) > min(values[1:])
    assert scheduled == 8 - skipped  # the schedule moved with the steps taken only
    assert "scaler.pt" in files
    # Resumed with a fresh scaler at 2**19: the saved scale came back (the fresh one would skip again).
    assert resumed_scales == scales[4:] and resumed_scheduled == scheduled
