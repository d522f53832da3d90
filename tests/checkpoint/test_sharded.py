"""ZeRO checkpoints (ddpkit.checkpoint.sharded): a run saved under any stage and world size resumes under any other
one with the uninterrupted loss curve, by hand and in the Trainer."""

from __future__ import annotations

import errno
import io
import os
import shutil
import types
import warnings

import pytest
import torch
from torch import nn

from helpers import models
from helpers.models import flip_inside
from helpers.world import run_world

GLOBAL = 6  # samples per step, split evenly over 1, 2 or 3 ranks
RESUME_STEPS, SAVE_AT = 5, 3


def resume_run(world, stage, folder, load):
    """Train RESUME_STEPS AdamW steps of one global batch each (stage 0: DDP + AdamW; 1: + ZeRO; 2: zero_stage=2),
    saving a checkpoint after SAVE_AT, or start from that checkpoint; the full-batch loss after each step."""
    import ddpkit
    from ddpkit.checkpoint.files import load_checkpoint, save_checkpoint
    from ddpkit.checkpoint.folders import find_latest_checkpoint

    torch.manual_seed(0)
    module = models.make("transformer")
    model = ddpkit.DistributedDataParallel(module, bucket_cap_mb=0.002, zero_stage=2 if stage == 2 else 0)
    groups = [{"params": [p for p in module.parameters() if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in module.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, eps=1e-4) if stage == 0 else \
        ddpkit.ZeroRedundancyOptimizer(groups, torch.optim.AdamW, lr=1e-3, eps=1e-4)
    start = 0
    if load:
        start = load_checkpoint(find_latest_checkpoint(folder), model=module, optimizer=opt, world=world).step
    share = GLOBAL // world.world_size
    curve = {}
    for step in range(start, RESUME_STEPS):
        x, y = models.batch("transformer", GLOBAL, seed=step)
        opt.zero_grad()
        lo = world.rank * share
        models.loss("transformer", model, x[lo:lo + share], y[lo:lo + share], world.rank, step).backward()
        opt.step()
        if stage:
            opt.wait_for_params()
        with torch.no_grad():
            probe_x, probe_y = models.batch("transformer", GLOBAL, seed=999)
            curve[step] = models.loss("transformer", module, probe_x, probe_y, 0, step).item()
        if not load and step + 1 == SAVE_AT:
            save_checkpoint(folder, step + 1, model=module, optimizer=opt, trainer_state={"global_step": step + 1},
                            comm=ddpkit.Comm.for_group(), world=world)
    files = sorted(os.listdir(find_latest_checkpoint(folder)))
    return curve, files


@pytest.mark.parametrize("saved, resumed", [((2, 2), (3, 1)), ((3, 1), (1, 0)), ((2, 2), (2, 0)),
                                            ((1, 0), (2, 2))])
def test_resume_across_stages_and_world_sizes(tmp_path, saved, resumed):
    (n_saved, stage_saved), (n_resumed, stage_resumed) = saved, resumed
    folder = str(tmp_path)
    whole, files = run_world(resume_run, n_saved, args=(stage_saved, folder, False), deadline_s=180)[0]
    if stage_saved:  # each rank wrote its slice; nobody wrote the whole state
        assert [f for f in files if f.startswith("optimizer")] == [f"optimizer_shard_{r}.pt" for r in range(n_saved)]
    results = run_world(resume_run, n_resumed, args=(stage_resumed, folder, True), deadline_s=180)
    for rank, (curve, _) in enumerate(results):
        assert sorted(curve) == list(range(SAVE_AT, RESUME_STEPS))
        for step, loss in curve.items():
            # Another world size sums the gradient average in another order: float32 rounding, relative 1e-6.
            assert abs(loss - whole[step]) <= 1e-6 * max(1.0, abs(whole[step])), \
                f"rank {rank} step {step}: {loss} resumed, {whole[step]} uninterrupted"


class Scaled(nn.Module):
    """A 0-dim parameter (CLIP's logit_scale) beside a weight: its optimizer state is 0-dim too."""

    def __init__(self):
        super().__init__()
        self.lin, self.logit_scale = nn.Linear(4, 6), nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.lin(x) * self.logit_scale


def plain_then_zero(world, folder, stage, optimizer, load):
    """4 steps of `optimizer` on the same batch on every rank (so any world computes one process's numbers),
    saved after 2 by a plain optimizer, or resumed from there under ZeRO `stage`: the parameters at the end."""
    import ddpkit
    from ddpkit.checkpoint.files import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    module = Scaled()
    model = ddpkit.DistributedDataParallel(module, zero_stage=2 if stage == 2 else 0)
    make = getattr(torch.optim, optimizer)
    opt = make(module.parameters(), lr=0.01) if stage == 0 else \
        ddpkit.ZeroRedundancyOptimizer(module.parameters(), make, lr=0.01)
    if load:
        load_checkpoint(os.path.join(folder, "checkpoint-2"), model=module, optimizer=opt, world=world)
    for step in range(2 if load else 0, 4):
        opt.zero_grad()
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        opt.step()
        if step == 1 and not load:
            save_checkpoint(folder, 2, model=module, optimizer=opt, trainer_state={"global_step": 2},
                            comm=ddpkit.Comm.for_group(), world=world)
    if stage:
        opt.wait_for_params()
    return [p.detach().reshape(-1).tolist() for p in module.parameters()]


@pytest.mark.parametrize("optimizer, stage", [("AdamW", 1), ("AdamW", 2), ("Adafactor", 1)])
def test_a_plain_checkpoint_resumes_under_zero_with_0_dim_and_factored_state(tmp_path, optimizer, stage):
    """The whole state's per-element tensors are told by the parameters' shapes: a 0-dim parameter's state was
    left 0-dim (the first step failed on shape [] against [1]), and Adafactor's factored statistics were taken
    for per-element ones (built from uninitialised memory; the first step failed)."""
    (whole,) = run_world(plain_then_zero, 1, args=(str(tmp_path), 0, optimizer, False), deadline_s=60)
    for rank, got in enumerate(run_world(plain_then_zero, 2, args=(str(tmp_path), stage, optimizer, True),
                                         deadline_s=60)):
        for a, b in zip(got, whole):
            assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-6, (rank, a, b)


class Plain(nn.Module):
    """test_trainer's classifier without dropout, so that one rank and two draw the same computation."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x, labels=None, idx=None):
        logits = self.net(x)
        return {"loss": None if labels is None else torch.nn.functional.cross_entropy(logits, labels),
                "logits": logits}


def trainer_run(world, out, stage, resume, accumulation):
    """The Trainer with ddp_zero_stage=stage: 6 AdamW steps of a global batch of 8, clipped, saved every 2."""
    from ddpkit import Trainer
    from helpers.models import classification_data, trainer_args

    torch.manual_seed(0)
    model = Plain().double()
    args = trainer_args(out, per_device_train_batch_size=2, gradient_accumulation_steps=accumulation, max_steps=6,
                 save_strategy="steps", save_steps=2, max_grad_norm=0.1, ddp_zero_stage=stage,
                 ddp_replica_check_steps=1)
    trainer = Trainer(model, args, train_dataset=classification_data(32))
    trainer.train(resume_from_checkpoint=resume)
    return [(e["step"], e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


def test_trainer_stages_resume_across_stages_and_world_sizes(tmp_path):
    out = str(tmp_path)
    stage2 = run_world(trainer_run, 2, args=(f"{out}/z2", 2, None, 2), deadline_s=150)[0]
    stage0 = run_world(trainer_run, 2, args=(f"{out}/z0", 0, None, 2), deadline_s=150)[0]
    # Resumed from stage 2's sharded checkpoint at step 4: one rank, stage 0, the same global batch of 8.
    (one,) = run_world(trainer_run, 1, args=(f"{out}/one", 0, f"{out}/z2/checkpoint-4", 4), deadline_s=150)
    # And stage 1 on two ranks from stage 0's whole optimizer.pt at step 2.
    stage1 = run_world(trainer_run, 2, args=(f"{out}/z1", 1, f"{out}/z0/checkpoint-2", 2), deadline_s=150)[0]
    assert [s for s, _, _ in stage2] == list(range(1, 7))
    assert min(norm for _, _, norm in stage0) > 0.1, "the test must clip"
    for label, run, first in (("stage 0", stage0, 1), ("1 rank from stage 2", one, 5), ("stage 1", stage1, 3)):
        got = {step: (loss, norm) for step, loss, norm in run if step >= first}  # before: the saved history
        assert sorted(got) == list(range(first, 7)), label
        for step, loss, norm in stage2[first - 1:]:
            # float64; another world size or a sharded norm sums in another order: rounding only.
            assert abs(got[step][0] - loss) <= 1e-9 * abs(loss) and abs(got[step][1] - norm) <= 1e-9 * norm, \
                f"{label}, step {step}: {got[step]} against stage 2's uninterrupted {(loss, norm)}"
    files = os.listdir(f"{out}/z2/checkpoint-4")
    assert "optimizer.pt" not in files and {"optimizer_shard_0.pt", "optimizer_shard_1.pt"} <= set(files)


def channels_last_run(world, folder):
    """ConvBN in channels_last (conv2.weight is not contiguous; conv1.weight, one channel in, still is): stage 1
    against DDP + AdamW, bitwise, the consolidated state torch's, and its sharded checkpoint loaded into a
    contiguous model on the same ranks; stage 2 refuses such parameters, clearly, on every rank."""
    import ddpkit
    from ddpkit.checkpoint.files import load_checkpoint, save_checkpoint

    runs = []
    for sharded in (False, True):
        torch.manual_seed(0)
        module = models.make("convbn").to(memory_format=torch.channels_last)
        model = ddpkit.DistributedDataParallel(module)
        opt = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1) \
            if sharded else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(3):
            x, y = models.micro("convbn", step, 0, world.world_size, 2)[world.rank]
            opt.zero_grad()
            models.loss("convbn", model, x, y, world.rank, step).backward()
            opt.step()
        runs.append((module, model, opt))
    (plain, _, adamw), (module, model, zero) = runs
    out = {"bitwise": all(torch.equal(a, b) for a, b in zip(plain.parameters(), module.parameters())),
           "whole units": sorted(unit.plan.whole for unit in zero.units),
           "strided": [not p.is_contiguous() for p in module.parameters()]}
    zero.consolidate_state_dict(to=0)
    if world.rank == 0:
        mine, theirs = zero.state_dict()["state"], adamw.state_dict()["state"]
        out["state"] = mine.keys() == theirs.keys() and all(torch.equal(mine[i][k], v) for i, s in theirs.items()
                                                            for k, v in s.items())
    save_checkpoint(folder, 3, model=module, optimizer=zero, trainer_state={"global_step": 3},
                    comm=ddpkit.Comm.for_group(), world=world)
    torch.manual_seed(1)
    contiguous = models.make("convbn")
    loaded = ddpkit.ZeroRedundancyOptimizer(contiguous.parameters(), torch.optim.AdamW, lr=1e-2)
    load_checkpoint(os.path.join(folder, "checkpoint-3"), model=contiguous, optimizer=loaded, world=world)
    loaded.consolidate_state_dict(to=0)
    if world.rank == 0:
        again = loaded.state_dict()["state"]
        out["loaded"] = all(torch.equal(again[i][k], v) for i, s in adamw.state_dict()["state"].items()
                            for k, v in s.items())
    with pytest.raises(ValueError, match=r"zero_stage=2 needs contiguous parameters, and 'conv2.weight'"):
        ddpkit.DistributedDataParallel(models.make("convbn").to(memory_format=torch.channels_last), zero_stage=2)
    return out


def test_channels_last_parameters_step_whole_and_checkpoint_across_layouts(tmp_path):
    results = run_world(channels_last_run, 2, args=(str(tmp_path),), deadline_s=120)
    for rank, got in enumerate(results):
        assert got["bitwise"], f"rank {rank}: stage 1 differs from AdamW on channels_last parameters"
        assert got["whole units"] == [False, True] and sum(got["strided"]) == 1, got
    assert results[0]["state"] and results[0]["loaded"], results[0]


def resave_before_first_step(world, folder):
    """Stage 2 loads at its first step; a save before it (the Trainer's epoch save of a resumed run that ends
    at once, a resume into a new output_dir) must write the loaded state again, not empty shards over it."""
    import ddpkit
    from ddpkit.checkpoint.files import load_checkpoint, save_checkpoint
    from ddpkit.checkpoint.sharded import shard_files

    def build():
        torch.manual_seed(0)
        module = models.make("mlp")
        model = ddpkit.DistributedDataParallel(module, bucket_cap_mb=0.001, zero_stage=2)
        return module, model, ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)

    def step(model, opt, index):
        x, y = models.micro("mlp", index, 0, world.world_size, 2)[world.rank]
        opt.zero_grad()
        models.loss("mlp", model, x, y, world.rank, index).backward()
        opt.step()
        opt.wait_for_params()

    comm = ddpkit.Comm.for_group()
    module, model, opt = build()
    for index in range(3):
        step(model, opt, index)
        if index == 1:
            save_checkpoint(folder, 2, model=module, optimizer=opt, trainer_state={}, comm=comm, world=world)
    count = sum(len(torch.load(f, weights_only=True)["pieces"]) for f in shard_files(f"{folder}/checkpoint-2"))
    again, wrapped, resumed = build()
    load_checkpoint(f"{folder}/checkpoint-2", model=again, optimizer=resumed, world=world)
    save_checkpoint(folder, 2, model=again, optimizer=resumed, trainer_state={}, comm=comm, world=world)
    recount = sum(len(torch.load(f, weights_only=True)["pieces"]) for f in shard_files(f"{folder}/checkpoint-2"))
    step(wrapped, resumed, 2)
    # The same through load_state_dict of a whole state dict (a plain AdamW's, one local step on every rank).
    plain = torch.optim.AdamW(models.make("mlp").parameters(), lr=1e-2)
    for p in (p for group in plain.param_groups for p in group["params"]):
        p.grad = torch.ones_like(p)
    plain.step()
    _, _, fresh = build()
    fresh.load_state_dict(plain.state_dict())
    held = len(fresh.shard_state())  # before the first step: this rank's 1/N of the pieces
    return count, recount, all(torch.equal(a, b) for a, b in zip(module.parameters(), again.parameters())), held


def test_a_save_before_stage_2s_first_step_keeps_the_loaded_state(tmp_path):
    results = run_world(resave_before_first_step, 2, args=(str(tmp_path),), deadline_s=120)
    for count, recount, same, _ in results:
        assert count > 0 and recount == count, (count, recount)
        assert same, "the resumed step differs from the uninterrupted one"
    assert sum(held for *_, held in results) == len(list(models.make("mlp").parameters())), results


def _failing_save(error):
    """torch.save failing with error() when it writes a file, as on a full disk (pickling a tensor for a collective
    goes through torch.save into a BytesIO, and still works)."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, io.BytesIO):
            return real(obj, f, *args, **kwargs)
        raise error()
    return save


def _stepped_zero(world):
    """The MLP under DDP with a ZeroRedundancyOptimizer after one step (Adam moments in every shard)."""
    import ddpkit

    torch.manual_seed(0)
    module = models.make("mlp")
    model = ddpkit.DistributedDataParallel(module)
    zero = ddpkit.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    x, y = models.micro("mlp", 0, 0, world.world_size, 2)[world.rank]
    models.loss("mlp", model, x, y, world.rank, 0).backward()
    zero.step()
    return module, zero


def failing_and_corrupt_saves(world, folder):
    """Saves that fail as a full disk makes them fail: rank 0's files (DDP's path), one rank's ZeRO shard, every
    rank's shard through torch's own error; then a shard file corrupted without a change of size. What every
    rank is told, what is left, what loads."""
    import ddpkit
    from ddpkit.checkpoint.files import save_checkpoint
    from ddpkit.errors import CheckpointError

    module, zero = _stepped_zero(world)
    comm = ddpkit.Comm.for_group()

    def save(step, optimizer):
        try:
            save_checkpoint(folder, step, model=module, optimizer=optimizer, trainer_state={"global_step": step},
                            comm=comm, world=world)
        except CheckpointError as exc:
            return str(exc)

    disk_full = _failing_save(lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))  # the file system's answer
    # torch writing to a path itself reports a full disk as its own error, without an errno.
    torch_failed = _failing_save(lambda: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos"))

    def low_space(path):  # 1 MiB free
        return types.SimpleNamespace(free=2 ** 20)

    told = {"first": save(1, zero)}
    for what, step, optimizer, patches in (
            ("rank 0's files", 2, torch.optim.AdamW(module.parameters()),
             [(torch, "save", disk_full)] if world.rank == 0 else []),
            ("rank 1's shard", 3, zero, [(torch, "save", disk_full)] if world.rank == 1 else []),
            ("every shard", 4, zero, [(torch, "save", torch_failed), (shutil, "disk_usage", low_space)])):
        with pytest.MonkeyPatch.context() as patch:
            for target, name, value in patches:
                patch.setattr(target, name, value)
            told[what] = save(step, optimizer)
    told["left"] = sorted(os.listdir(folder))
    told["fifth"] = save(5, zero)
    return {**told, **_corrupt_shard(world, folder, comm)}


def _corrupt_shard(world, folder, comm):
    """Rank 1's shard of checkpoint-5 corrupted without a change of size: what finding and loading it say."""
    from ddpkit.checkpoint import integrity
    from ddpkit.checkpoint.files import load_checkpoint
    from ddpkit.checkpoint.folders import find_latest_checkpoint
    from ddpkit.errors import CheckpointError

    told = {"marked": sorted(integrity.read_marker(f"{folder}/checkpoint-5")["crc32"])}
    if world.rank == 0:
        flip_inside(f"{folder}/checkpoint-5/optimizer_shard_1.pt")
    comm.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        told["latest"] = find_latest_checkpoint(folder)
    told["warned"] = [str(w.message) for w in caught]
    _, fresh = _stepped_zero(world)
    for how, together in (("named", None), ("named together", comm)):  # alone, every shard; together, shared out
        try:
            load_checkpoint(f"{folder}/checkpoint-5", model=models.make("mlp"), optimizer=fresh, world=world,
                            comm=together)
        except CheckpointError as exc:
            told[how] = str(exc)
    load_checkpoint(told["latest"], model=models.make("mlp"), optimizer=fresh, world=world)
    # Another optimizer's sharded state: named at the load, not a KeyError inside torch at the first step.
    import ddpkit

    sgd = ddpkit.ZeroRedundancyOptimizer(ddpkit.DistributedDataParallel(models.make("mlp")).parameters(),
                                         torch.optim.SGD, lr=0.1)
    try:
        load_checkpoint(told["latest"], optimizer=sgd, world=world)
    except CheckpointError as exc:
        told["sgd"] = str(exc)
    return told


def test_sharded_saves_name_a_full_disk_and_a_corrupt_shard_on_every_rank(tmp_path):
    folder = str(tmp_path)
    full = (f"could not write checkpoint {folder}/checkpoint-{{}}: no space left on device: the file system of "
            f"{folder} is full (or the disk quota there is used up). The older checkpoints were kept")
    for told in run_world(failing_and_corrupt_saves, 2, args=(folder,), deadline_s=120):
        assert told["first"] is None and told["fifth"] is None, told
        assert told["rank 0's files"].startswith("rank 0 " + full.format(2)), told["rank 0's files"]
        assert told["rank 1's shard"].startswith("rank 1 " + full.format(3)), told["rank 1's shard"]
        assert told["every shard"].startswith("ranks 0, 1 " + full.format(4)), told["every shard"]
        assert told["left"] == ["checkpoint-1"], told["left"]  # no debris, the older checkpoint kept
        assert {"optimizer_shard_0.pt", "optimizer_shard_1.pt"} <= set(told["marked"]), told["marked"]
        assert told["latest"] == f"{folder}/checkpoint-1"
        assert len(told["warned"]) == 1 and "checkpoint-5: optimizer_shard_1.pt fails its checksum" in \
            told["warned"][0], told["warned"]
        # Every rank names it: checking alone, or sharing the shards out (each reads every world_size-th one).
        for how in ("named", "named together"):
            assert "checkpoint-5 cannot be loaded: optimizer_shard_1.pt fails its checksum" in told[how], told
        assert "another optimizer than this ZeroRedundancyOptimizer: its param groups lack dampening, momentum" \
            in told.get("sgd", ""), told
