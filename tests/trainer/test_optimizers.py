"""ddpkit.trainer.optimizers: each `optim` choice builds torch's class with the arguments' hyper-parameters and the weight-decay
groups, also sharded under ZeRO; sgd and adafactor on 2 ranks equal one process on the concatenated batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ddpkit.args.training_args import TrainingArguments
from ddpkit.trainer.optimizers import create_optimizer, optimizer_class
from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, params_of, trainer_args
from helpers.world import run_world


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)


def _groups(optimizer):
    return [(sorted(id(p) for p in g["params"]), g["weight_decay"]) for g in optimizer.param_groups]


class Named(nn.Module):
    """Names and layers Transformers' rule decides by, shapes aside: T5's relative_attention_bias (2-d, no decay),
    CLIP's logit_scale and class_embedding (0-d and 1-d, decayed), an RMSNorm's weight (no decay)."""

    def __init__(self):
        super().__init__()
        self.relative_attention_bias = nn.Embedding(4, 2)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))
        self.class_embedding = nn.Parameter(torch.zeros(3))
        self.final_layer_norm = nn.RMSNorm(3)
        self.ln = nn.Sequential(nn.LayerNorm(3))
        self.out_proj = nn.Linear(3, 3)


def test_weight_decay_is_chosen_by_name_and_layer_as_transformers_chooses(tmp_path):
    from transformers.trainer_pt_utils import get_parameter_names

    model = Named()
    decayed = set(get_parameter_names(model, [nn.LayerNorm], [r"bias", r"layernorm", r"rmsnorm",
                                                               r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]))
    optimizer = create_optimizer(model, TrainingArguments(output_dir=str(tmp_path), weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    got = {g["weight_decay"]: sorted(names[id(p)] for p in g["params"]) for g in optimizer.param_groups}
    assert got[0.1] == sorted(decayed) == ["class_embedding", "logit_scale", "out_proj.weight"], got


CHOICES = [
    ("adamw_torch", None, torch.optim.AdamW, dict(betas=(0.8, 0.95), eps=1e-6, fused=None)),
    ("adamw_torch_fused", None, torch.optim.AdamW, dict(betas=(0.8, 0.95), eps=1e-6, fused=True)),
    ("sgd", None, torch.optim.SGD, dict(momentum=0, nesterov=False)),
    ("sgd", "momentum=0.9,nesterov=true", torch.optim.SGD, dict(momentum=0.9, nesterov=True, dampening=0)),
    ("adafactor", None, torch.optim.Adafactor, dict(beta2_decay=-0.8, d=1.0)),
    ("adafactor", "beta2_decay=-0.5, d=2", torch.optim.Adafactor, dict(beta2_decay=-0.5, d=2.0)),
]


@pytest.mark.parametrize("optim,extra,cls,expected", CHOICES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CHOICES)])
def test_each_choice_builds_its_class_with_the_arguments(optim, extra, cls, expected, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), optim=optim, optim_args=extra, learning_rate=0.03,
                             weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
    model = Net()
    optimizer = create_optimizer(model, args)
    assert type(optimizer) is cls
    assert optimizer_class(args)[0] is cls
    # Weight decay on the weights: biases and norm weights get none.
    matrices = [model.linear.weight]
    vectors = [model.linear.bias, model.norm.weight, model.norm.bias]
    assert _groups(optimizer) == [(sorted(map(id, matrices)), 0.1), (sorted(map(id, vectors)), 0.0)]
    for group in optimizer.param_groups:
        assert group["lr"] == 0.03
        for key, value in expected.items():
            assert group[key] == value, (optim, key)
    loss = model.norm(model.linear(torch.randn(5, 4))).square().sum()
    loss.backward()
    before = model.linear.weight.detach().clone()
    optimizer.step()  # the fused kernel runs on this CPU (torch 2.13 has it there)
    assert not torch.equal(before, model.linear.weight)


def shard_world(world, out):
    """Under ZeRO stage 1 every choice is sharded; adafactor (shape-aware) gets whole parameters."""
    found = {}
    for optim in ("adamw_torch_fused", "sgd", "adafactor"):
        torch.manual_seed(0)
        model = Net()
        args = TrainingArguments(output_dir=out, optim=optim, ddp_zero_stage=1, weight_decay=0.1)
        optimizer = create_optimizer(model, args, world.world_size)
        local = [p for g in optimizer.optim.param_groups for p in g["params"]]
        found[optim] = (type(optimizer).__name__, type(optimizer.optim).__name__,
                        [g["weight_decay"] for g in optimizer.param_groups],
                        [tuple(p.shape) for p in local], optimizer.whole)
    # Transformers' optimizer_cls_and_kwargs: that class with those arguments, sharded the same way.
    given = create_optimizer(Net(), args, world.world_size, (torch.optim.SGD, {"lr": 0.3, "momentum": 0.5}))
    found["given"] = (type(given).__name__, type(given.optim).__name__, given.param_groups[0]["lr"],
                      given.param_groups[0]["momentum"], given.whole)
    return found


def test_under_zero_each_choice_is_sharded_and_adafactor_gets_whole_parameters(tmp_path):
    a, b = run_world(shard_world, 2, args=(str(tmp_path),), deadline_s=60)
    for optim, cls in (("adamw_torch_fused", "AdamW"), ("sgd", "SGD"), ("adafactor", "Adafactor")):
        for rank in (a, b):
            assert rank[optim][:3] == ("ZeroRedundancyOptimizer", cls, [0.1, 0.0]), optim
    # adafactor: each rank's local optimizer holds whole parameters (shapes kept), together all four once.
    assert a["adafactor"][4] and sorted(a["adafactor"][3] + b["adafactor"][3]) == [(3,), (3,), (3,), (3, 4)]
    # elementwise ones: flat slices, each group halved to the element: 12 -> 6 + 6 (decayed), 9 -> 5 + 4.
    assert not a["sgd"][4] and all(len(shape) == 1 for shape in a["sgd"][3] + b["sgd"][3])
    assert [sum(np.prod(s) for s in rank["sgd"][3]) for rank in (a, b)] == [6 + 5, 6 + 4]
    assert a["given"] == b["given"] == ("ZeroRedundancyOptimizer", "SGD", 0.3, 0.5, False)


def test_optimizer_cls_and_kwargs_is_checked_as_transformers_does(tmp_path):
    from ddpkit.trainer.optimizers import given_optimizers

    args = TrainingArguments(output_dir=str(tmp_path))
    for bad in (torch.optim.SGD, (torch.optim.SGD, None), (dict, {}), (torch.optim.SGD, {}, 1), {torch.optim.SGD: {}}):
        with pytest.raises(TypeError, match="optimizer_cls_and_kwargs must be"):
            given_optimizers((None, None), args, 1, bad)
    built = torch.optim.SGD(Net().parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="both optimizers and optimizer_cls_and_kwargs"):
        given_optimizers((built, None), args, 1, (torch.optim.SGD, {"lr": 0.1}))
    assert given_optimizers((None, None), args, 1, (torch.optim.SGD, {"lr": 0.1})) == (None, None)
    assert given_optimizers((None, None), args, 1, [torch.optim.SGD, {"lr": 0.1}]) == (None, None)  # unpacked


# Stage 2 also checks that train() returns with the last step's all-gathers finished (model.parameters() final).
RUNS = (("sgd", "momentum=0.9", 0), ("adafactor", None, 0), ("adafactor", None, 1),
        ("adamw_torch_fused", None, 2))


def optim_world(world, out, batch):
    """Each run on this world; a 2-rank world is compared with a 1-rank one on twice the batch."""
    results = {}
    for optim, extra, stage in RUNS:
        torch.manual_seed(0)
        model = Classifier().double()
        model.net[2].p = 0.0  # dropout masks would differ between 1 and 2 processes
        args = trainer_args(f"{out}/{optim}-{stage}", per_device_train_batch_size=batch, max_steps=4, max_grad_norm=0.5,
                     optim=optim, optim_args=extra, ddp_zero_stage=stage, weight_decay=0.01)
        trainer = Trainer(model, args, train_dataset=classification_data(30))
        trainer.train()
        inner = getattr(trainer.optimizer, "optim", trainer.optimizer)
        results[(optim, stage)] = (params_of(model), [e["loss"] for e in trainer.state.log_history if "loss" in e],
                                   type(inner).__name__)
    return results


def test_two_ranks_equal_one_process_for_sgd_adafactor_and_fused_adamw(tmp_path):
    two = run_world(optim_world, 2, args=(str(tmp_path / "two"), 3), deadline_s=150)
    (one,) = run_world(optim_world, 1, args=(str(tmp_path / "one"), 6), deadline_s=150)
    for optim, _, stage in RUNS:
        (p0, losses, cls), (p1, _, _) = two[0][(optim, stage)], two[1][(optim, stage)]
        truth, truth_losses, truth_cls = one[(optim, stage)]  # one process: stage ignored, the plain optimizer
        assert cls == truth_cls and len(losses) == 4
        for x, y, t in zip(p0, p1, truth):
            np.testing.assert_array_equal(x, y, err_msg=f"{optim} stage {stage}: replicas diverged")
            # float64: the two sums of the ranks' shares differ from one sum in their last bits only.
            np.testing.assert_allclose(x, t, rtol=1e-9, atol=1e-10, err_msg=f"{optim} stage {stage}")
        assert losses == pytest.approx(truth_losses, rel=1e-10, abs=1e-12)
    # The runs differ from each other: the optimizer choice reached the step.
    assert not np.allclose(one[("sgd", 0)][0][0], one[("adafactor", 0)][0][0])
    assert not np.allclose(one[("adafactor", 0)][0][0], one[("adamw_torch_fused", 2)][0][0])


def _resumable(out, optim, extra, stage, resume=None):
    torch.manual_seed(0)
    model = Classifier().double()  # dropout on: the restored RNG gives the same masks
    args = trainer_args(out, per_device_train_batch_size=3, max_steps=6, optim=optim, optim_args=extra,
                 ddp_zero_stage=stage, save_strategy="steps", save_steps=3, weight_decay=0.01)
    Trainer(model, args, train_dataset=classification_data(30)).train(resume_from_checkpoint=resume)
    return params_of(model)


def resume_world(world, out):
    found = {}
    for optim, extra, stage in (("adafactor", None, 1), ("sgd", "momentum=0.9", 2)):
        full = _resumable(f"{out}/{optim}", optim, extra, stage)
        again = _resumable(f"{out}/{optim}-again", optim, extra, stage, resume=f"{out}/{optim}/checkpoint-3")
        found[optim] = (full, again)
    return found


def test_a_run_resumed_with_sgd_or_adafactor_under_zero_is_the_uninterrupted_one_bitwise(tmp_path):
    for rank in run_world(resume_world, 2, args=(str(tmp_path),), deadline_s=120):
        for optim, (full, again) in rank.items():
            for x, y in zip(full, again):
                np.testing.assert_array_equal(x, y, err_msg=optim)  # momentum and row/column statistics restored


@pytest.mark.parametrize("name, kwargs", [("cosine", {"num_cycles": 1.5}), ("cosine_with_restarts", {}),
                                          ("cosine_with_restarts", {"num_cycles": 3}), ("polynomial", {}),
                                          ("polynomial", {"lr_end": 1e-3, "power": 2.0}), ("inverse_sqrt", {}),
                                          ("inverse_sqrt", {"timescale": 7})])
def test_the_schedules_and_their_kwargs_are_transformers(name, kwargs):
    """lr_scheduler_kwargs reach the schedule, whose rates are Transformers' at every step (warmup and past the
    end included)."""
    import transformers

    from ddpkit.trainer.optimizers import get_scheduler

    def rates(make):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        sched, out = make(opt), []
        for _ in range(25):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    ours = rates(lambda opt: get_scheduler(name, opt, 3, 20, kwargs))
    theirs = rates(lambda opt: transformers.get_scheduler(name, opt, num_warmup_steps=3, num_training_steps=20,
                                                          scheduler_specific_kwargs=kwargs))
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)


def clipped_world(world, out):
    """A clip that engages (the default max_grad_norm, 1.0) at stages 0 and 1: the parameters, and every .grad a
    callback reads before the step (after the clip); then optimizers= built outside the Trainer, stages 1 and 2."""
    import ddpkit
    from ddpkit.errors import ArgumentError

    class Grads(ddpkit.TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.seen.append([p.grad.detach().numpy().copy() for p in model.parameters()])

    found = {}
    for stage in (0, 1):
        torch.manual_seed(0)
        model, grads = Classifier().double(), Grads()
        model.net[2].p = 0.0
        args = trainer_args(f"{out}/{stage}", per_device_train_batch_size=2, max_steps=4, max_grad_norm=1.0,
                            ddp_zero_stage=stage, weight_decay=0.1)
        Trainer(model, args, train_dataset=classification_data(32), callbacks=[grads]).train()
        found[stage] = (params_of(model), grads.seen)
    refused = {}
    for stage, make in ((1, torch.optim.AdamW), (2, torch.optim.AdamW),
                        (2, lambda p: ddpkit.ZeroRedundancyOptimizer(p, torch.optim.AdamW)),
                        (1, lambda p: ddpkit.ZeroRedundancyOptimizer(p, torch.optim.AdamW))):
        model = Classifier().double()
        try:
            Trainer(model, trainer_args(f"{out}/given", ddp_zero_stage=stage), train_dataset=classification_data(30),
                    optimizers=(make(model.parameters()), None))
            refused[len(refused)] = "accepted"
        except ArgumentError as exc:
            refused[len(refused)] = str(exc)
    return found, refused


def test_stage_1_clips_as_stage_0_and_an_optimizer_built_outside_is_refused_under_zero(tmp_path):
    """Stage 1's clip is torch's over every .grad (each rank holds them all, averaged): the parameters are stage 0's
    bit for bit and a callback reads the same clipped .grad on every rank (the sharded clip scaled only each rank's
    own slices). An optimizer passed as optimizers= trained unsharded at stage 1 without a word and failed at the
    first backward at stage 2: refused when the Trainer is built, but a ZeroRedundancyOptimizer at stage 1."""
    results = run_world(clipped_world, 2, args=(str(tmp_path),), deadline_s=150)
    for (found, refused), (other, _) in zip(results, results[::-1]):
        for a, b in zip(found[0][0], found[1][0]):
            np.testing.assert_array_equal(a, b)
        for step0, step1, theirs in zip(found[0][1], found[1][1], other[1][1]):
            assert all((a == b).all() and (b == c).all() for a, b, c in zip(step0, step1, theirs))
        assert all(refused[k].startswith(f"ddp_zero_stage: is {s}, which shards the optimizer the Trainer makes")
                   for k, s in ((0, 1), (1, 2), (2, 2))), refused
        assert refused[3] == "accepted", refused
