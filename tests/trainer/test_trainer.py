"""The Trainer against single-process truth: accumulation, variable-length batches, uneven data, exact evaluation,
resuming (bitwise with the same world size, sample-exact with another), logs and the loss curve."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.trainer.trainer import Trainer, TrainerCallback
from helpers.models import (
    Classifier,
    FixedShards,
    Tagger,
    accuracy,
    classification_data,
    pad_collate,
    params_of,
    token_data,
    trainer_args,
)
from helpers.world import run_world

# -- equivalence with one process, uneven data, exact evaluation ------------------------------------------------

UNEVEN = ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13])  # rank 1 runs out after the first step


def uneven_truth(data, args):
    """One process, by hand: per-device batch 2, accumulation 2, rank 0's 4 + rank 1's 4 samples, then 4, then 2."""
    torch.manual_seed(0)
    model = Classifier(hidden=16).double()
    model.net[2].p = 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                            eps=args.adam_epsilon, weight_decay=0.0)
    for step in ([0, 1, 2, 3, 10, 11, 12, 13], [4, 5, 6, 7], [8, 9]):
        x = torch.stack([data[i]["x"] for i in step])
        y = torch.stack([data[i]["labels"] for i in step])
        model(x, y)["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad()
    return params_of(model)


def equivalence_world(world, out, batch, accum, uneven):
    """Train the same things on this world; the caller compares a 2-rank world with a 1-rank one."""
    results = {}
    kw = dict(per_device_train_batch_size=batch, gradient_accumulation_steps=accum, max_steps=6, max_grad_norm=0.5)
    # 30 samples, 15 per rank: every epoch ends on a short window (3 samples per rank in 2 batches of 2 and 1).
    torch.manual_seed(0)
    model = Classifier().double()
    model.net[2].p = 0.0  # dropout masks would differ between 1 and 2 processes
    trainer = Trainer(model, trainer_args(f"{out}/cls", **kw), train_dataset=classification_data(30))
    trainer.train()
    results["cls"] = (params_of(model), [e["loss"] for e in trainer.state.log_history if "loss" in e])
    # Variable-length sequences: items (tokens) per rank and per micro-batch differ at every step.
    torch.manual_seed(0)
    model = Tagger().double()
    trainer = Trainer(model, trainer_args(f"{out}/tok", **kw), train_dataset=token_data(30), data_collator=pad_collate)
    trainer.train()
    results["tok"] = (params_of(model), [e["loss"] for e in trainer.state.log_history if "loss" in e])
    # Exact evaluation: 7 samples on 2 ranks (4 + 3), none counted twice.
    trainer = Trainer(model := Classifier().double(), trainer_args(f"{out}/eval", per_device_eval_batch_size=2),
                      eval_dataset=classification_data(7, seed=3), compute_metrics=accuracy)
    metrics = trainer.evaluate()
    results["eval"] = {k: v for k, v in metrics.items() if "runtime" not in k and "per_second" not in k}
    if uneven:

        class UnevenTrainer(Trainer):
            def get_train_sampler(self):
                return FixedShards(UNEVEN, self.world.rank)

        torch.manual_seed(0)
        model = Classifier().double()
        model.net[2].p = 0.0
        args = trainer_args(f"{out}/uneven", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     num_train_epochs=1, max_grad_norm=0.5)
        trainer = UnevenTrainer(model, args, train_dataset=classification_data(14))
        trainer.train()
        results["uneven"] = (params_of(model), trainer.state.global_step, uneven_truth(classification_data(14), args))
    return results


def test_two_ranks_with_accumulation_equal_one_process_on_the_global_batch(tmp_path):
    b, a = 2, 3
    two = run_world(equivalence_world, 2, args=(str(tmp_path / "two"), b, a, True), deadline_s=150)
    (one,) = run_world(equivalence_world, 1, args=(str(tmp_path / "one"), 2 * a * b, 1, False), deadline_s=150)
    for name in ("cls", "tok"):
        (p0, losses0), (p1, _) = two[0][name], two[1][name]
        truth, truth_losses = one[name]
        assert len(losses0) == len(truth_losses) == 6
        for x, y, t in zip(p0, p1, truth):
            np.testing.assert_array_equal(x, y, err_msg=f"{name}: replicas diverged")
            np.testing.assert_allclose(x, t, rtol=1e-9, atol=1e-10, err_msg=f"{name}: not the single-process result")
        assert losses0 == pytest.approx(truth_losses, rel=1e-10, abs=1e-12), name
    for rank in (0, 1):
        assert two[rank]["eval"]["eval_n"] == 7.0
        assert two[rank]["eval"] == pytest.approx(one["eval"], rel=1e-12)
    # Uneven shards: 5 batches on rank 0, 2 on rank 1; the run finishes and equals one process by hand.
    (u0, steps0, truth), (u1, steps1, _) = two[0]["uneven"], two[1]["uneven"]
    assert steps0 == steps1 == 3
    for x, y, t in zip(u0, u1, truth):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_allclose(x, t, rtol=1e-9, atol=1e-10)


# -- resuming ------------------------------------------------------------------------------------------------------


# -- the examples: the main job ------------------------------------------------------------------------------------

def example_world(world, name, argv):
    """An example's main() on this world (it leaves the process group when done, so one example per world)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))
    module = __import__(name)
    return module.main(argv)


def test_examples_train_on_two_processes(tmp_path):
    results = run_world(example_world, 2, deadline_s=150,
                        args=("train_digits", ["--output_dir", f"{tmp_path}/digits", "--disable_tqdm", "true"]))
    digits = results[0]
    chars = run_world(example_world, 2, deadline_s=120, args=("train_chars", [
        "--output_dir", f"{tmp_path}/chars", "--disable_tqdm", "--text_bytes", "30000", "--d_model", "32",
        "--max_steps", "12", "--logging_steps", "1", "--eval_steps", "6", "--gradient_checkpointing",
        "--per_device_train_batch_size", "4"]))[0]
    assert results[1]["eval_accuracy"] == digits["eval_accuracy"] >= 0.95
    files = set(os.listdir(tmp_path / "digits"))
    assert {"loss_curve.png", "metrics.jsonl", "trainer_state.json", "model.safetensors"} <= files
    assert any(name.startswith("checkpoint-") for name in files)
    with open(tmp_path / "chars" / "trainer_state.json") as f:
        losses = [e["loss"] for e in json.load(f)["log_history"] if "loss" in e]
    assert len(losses) == 12 and losses[-1] < losses[0]  # accumulation x gradient checkpointing x 2 ranks
    assert math.isfinite(chars["eval_loss"])


# -- one process: model outputs, logs, errors ------------------------------------------------------------------------

class Output:
    def __init__(self, loss, logits):
        self.loss, self.logits = loss, logits


class ObjectOutput(Classifier):
    def forward(self, x, labels=None, idx=None):
        out = super().forward(x, labels)
        return Output(out["loss"], out["logits"])


class TensorOutput(Classifier):
    def forward(self, x, labels=None, idx=None):
        return super().forward(x, labels)["loss"]


class LogitsOnly(Classifier):
    def forward(self, x, labels=None, idx=None):
        return super().forward(x, labels)["logits"]


class OwnLoss(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = model(inputs["x"])
        loss = F.cross_entropy(logits, inputs["labels"])
        return (loss, {"logits": logits}) if return_outputs else loss


@pytest.mark.parametrize("model_cls,trainer_cls,bf16", [
    (Classifier, Trainer, False), (ObjectOutput, Trainer, False), (TensorOutput, Trainer, False),
    (LogitsOnly, OwnLoss, False), (Classifier, Trainer, True),
])
def test_every_kind_of_model_output_trains(model_cls, trainer_cls, bf16, tmp_path, local_world):
    torch.manual_seed(0)
    model = model_cls()
    data = [{k: v.float() if k == "x" else v for k, v in s.items()} for s in classification_data(40)]
    args = trainer_args(tmp_path, max_steps=6, per_device_train_batch_size=8, bf16=bf16)
    trainer = trainer_cls(model, args, train_dataset=data, eval_dataset=data[:10],
                          compute_metrics=accuracy if model_cls is not TensorOutput else None)
    out = trainer.train()
    assert out.global_step == 6 and math.isfinite(out.training_loss)
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    if model_cls is not TensorOutput:
        assert metrics["eval_n"] == 10


def test_trainer_errors_name_the_problem(tmp_path, local_world):
    from ddpkit.errors import ArgumentError

    data = classification_data(8)
    with pytest.raises(ArgumentError, match="gradient_checkpointing"):
        Trainer(Classifier(), trainer_args(tmp_path, gradient_checkpointing=True), train_dataset=data)
    trainer = Trainer(Classifier().double(), trainer_args(tmp_path, max_steps=2), train_dataset=data)
    with pytest.raises(ArgumentError, match="resume_from_checkpoint"):
        trainer.train(resume_from_checkpoint=True)
    with pytest.raises(ValueError, match="no scalar loss"):
        Trainer(LogitsOnly().double(), trainer_args(tmp_path, max_steps=2), train_dataset=data).train()


def test_a_second_train_call_trains_again_as_in_transformers(tmp_path, local_world):
    """train() again without resuming starts from step 0 on the weights and the optimizer state the first call left,
    with a new schedule (Transformers' Trainer does so): the same bits as a new Trainer given that model and
    optimizer. It used to train 0 steps, silently. The first call's checkpoint of the same step is kept aside."""
    import copy

    def made():
        torch.manual_seed(0)
        model = Classifier().double()
        model.net[2].p = 0.0  # the second Trainer below seeds the RNG again
        return model

    kw = dict(max_steps=3, per_device_train_batch_size=4, lr_scheduler_type="linear", save_strategy="steps",
              save_steps=3)
    model = made()
    trainer = Trainer(model, trainer_args(tmp_path / "twice", **kw), train_dataset=classification_data(24))
    trainer.train()
    after_first, first_log = params_of(model), copy.deepcopy(trainer.state.log_history)
    out = trainer.train()
    assert out.global_step == 3 and [e["step"] for e in trainer.state.log_history if "loss" in e] == [1, 2, 3]
    lrs = [[e["learning_rate"] for e in log if "loss" in e] for log in (first_log, trainer.state.log_history)]
    assert lrs[0] == lrs[1] and lrs[0][0] > lrs[0][-1]  # the linear decay again from the start
    assert len(trainer.state.log_history) == len(first_log)  # the second call's log only
    names = os.listdir(tmp_path / "twice")
    assert "checkpoint-3" in names and len([n for n in names if n.startswith("checkpoint-3.run-")]) == 1

    truth_model = made()
    first = Trainer(truth_model, trainer_args(tmp_path / "first", **kw), train_dataset=classification_data(24))
    first.train()
    np.testing.assert_array_equal(np.concatenate([p.ravel() for p in params_of(truth_model)]),
                                  np.concatenate([p.ravel() for p in after_first]))
    Trainer(truth_model, trainer_args(tmp_path / "second", **kw), train_dataset=classification_data(24),
            optimizers=(first.optimizer, None)).train()
    for got, want, before in zip(params_of(model), params_of(truth_model), after_first):
        np.testing.assert_array_equal(got, want)
        assert not np.array_equal(got, before)


def test_schedules_match_transformers():
    from ddpkit.trainer.trainer import get_scheduler

    def lrs(name):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        sched = get_scheduler(name, opt, warmup_steps=2, total_steps=10)
        out = []
        for _ in range(11):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    assert lrs("linear")[:4] == [0.0, 0.5, 1.0, 0.875] and lrs("linear")[10] == 0.0
    assert lrs("cosine")[2] == 1.0 and lrs("cosine")[6] == pytest.approx(0.5) and lrs("cosine")[10] == 0.0
    assert lrs("constant") == [1.0] * 11
    assert lrs("constant_with_warmup")[:3] == [0.0, 0.5, 1.0] and lrs("constant_with_warmup")[10] == 1.0


class ItemsAware(nn.Module):
    """Divides a summed loss by num_items_in_batch when it is given, as Transformers models do."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(6, 3)

    def forward(self, x, labels=None, num_items_in_batch=None):
        logits = self.net(x)
        if num_items_in_batch is None:
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}
        return {"loss": F.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch, "logits": logits}


class TupleTrainer(Trainer):
    """Batches are (x, labels) tuples: num_items_in_batch cannot reach the model's forward."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(inputs[0], inputs[1])
        return (outputs["loss"], outputs) if return_outputs else outputs["loss"]

    def count_items(self, batch):
        return len(batch[1])


def test_tuple_batches_with_an_items_aware_model_are_normalised(tmp_path, local_world):
    """Accumulating 4 micro-batches of 2 must give the loss and update of one batch of 8."""
    x, y = torch.randn(8, 6, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 3
    data = list(zip(x, y))
    results = []
    for batch, accum in ((8, 1), (2, 4)):
        torch.manual_seed(0)
        model = ItemsAware()
        args = trainer_args(tmp_path / f"b{batch}", per_device_train_batch_size=batch,
                            gradient_accumulation_steps=accum, max_steps=1, learning_rate=0.1,
                            lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, weight_decay=0.0,
                            logging_steps=1, save_strategy="no")
        trainer = TupleTrainer(model, args, train_dataset=data)
        trainer.train()
        results.append((trainer.state.log_history[0]["loss"], params_of(model)))
    (loss_one, params_one), (loss_accum, params_accum) = results
    assert abs(loss_one - loss_accum) < 1e-6, (loss_one, loss_accum)
    for a, b in zip(params_one, params_accum):
        assert np.allclose(a, b, atol=1e-6)


def test_logs_and_evaluation_metrics_carry_the_epoch_as_in_transformers(tmp_path, local_world):
    """on_log gets what log_history holds but the step, and evaluate() returns the epoch with its metrics; before,
    both lacked "epoch"."""
    from ddpkit.trainer.callbacks import TrainerCallback

    class Logs(TrainerCallback):
        seen = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append(dict(logs))

    args = trainer_args(tmp_path, max_steps=2, per_device_train_batch_size=4)
    trainer = Trainer(Classifier().double(), args, train_dataset=classification_data(8),
                      eval_dataset=classification_data(4, seed=1), callbacks=[Logs()])
    assert trainer.evaluate()["epoch"] == 0.0
    trainer.train()
    assert Logs.seen[1:] == [{k: v for k, v in e.items() if k != "step"} for e in trainer.state.log_history]
    assert trainer.evaluate()["epoch"] == 1.0 and "epoch" in Logs.seen[1]


class StopAfter(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == self.step


def test_train_loss_counts_the_last_step_when_a_callback_stops_between_two_logs(tmp_path, local_world):
    """Stopped by a callback after step 3, not a logging step: its loss, summed by no log and no save, is still in
    train_loss (Transformers adds its tr_loss left over at the end too)."""
    def run(name, logging_steps):
        torch.manual_seed(0)
        trainer = Trainer(Classifier().double(), trainer_args(tmp_path / name, max_steps=10,
                                                              logging_steps=logging_steps),
                          train_dataset=classification_data(40), callbacks=[StopAfter(3)])
        out = trainer.train()
        assert out.global_step == 3
        return out.training_loss, [e["loss"] for e in trainer.state.log_history if "loss" in e]

    every_step, losses = run("every", 1)
    assert len(losses) == 3 and every_step == sum(losses) / 3
    assert run("sparse", 5) == (every_step, [])


def test_an_eval_strategy_without_an_eval_dataset_is_refused(tmp_path, local_world):
    """As Transformers at construction: it never evaluated (and load_best_model_at_end kept nothing)."""
    from ddpkit.errors import ArgumentError

    with pytest.raises(ArgumentError, match="eval_strategy: is 'steps' but the Trainer got no eval_dataset"):
        Trainer(Classifier(), trainer_args(tmp_path, eval_strategy="steps"), train_dataset=classification_data(8))


def test_a_compute_loss_override_without_num_items_evaluates(tmp_path, local_world):
    """Evaluation passed num_items_in_batch=None to every compute_loss, so an override written without it (as
    training calls it) trained and then failed at its first evaluate()."""

    class Mine(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False):
            return super().compute_loss(model, inputs, return_outputs)

    trainer = Mine(Classifier().double(), trainer_args(tmp_path, max_steps=1, per_device_train_batch_size=4),
                   train_dataset=classification_data(8), eval_dataset=classification_data(4, seed=1))
    trainer.train()
    assert math.isfinite(trainer.evaluate()["eval_loss"])
