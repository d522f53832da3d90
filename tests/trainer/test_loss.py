"""ddpkit.trainer.loss: training_step(model, inputs, num_items_in_batch) is Transformers' seam, one micro-batch's
forward and backward that train() calls on each batch of a step. An override that calls super() trains what the
Trainer trains, bit for bit; one that computes and backpropagates its own loss, as Transformers' subclasses do,
trains it under ddpkit's accumulation (the ranks' reduction on the last micro-batch only) and its returned losses are
logged as Transformers logs them. An override of any other signature is refused when the Trainer is made."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, FixedShards, classification_data, params_of, trainer_args
from helpers.world import run_world


class Uneven(Trainer):
    """Rank 0 reads 10 samples, rank 1 four: rank 1 runs out after the first step and repeats its last batch."""

    def get_train_sampler(self):
        return FixedShards(([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13]), self.world.rank)


class Noting(Uneven):
    """Calls super(), noting each call: (the step it is in, the batch's size, num_items_in_batch, the loss)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.calls.append((self.state.global_step + 1, len(inputs["labels"]), int(num_items_in_batch), loss.item()))
        return loss


class OwnLoss(Trainer):
    """Transformers' usual override: the loss computed, divided over the accumulation and backpropagated here."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        loss = loss / self.args.gradient_accumulation_steps
        loss.backward()
        return loss.detach()


class Tenths(Trainer):
    """Items of three tenths a sample (a weighted mean's weights): counts that are not whole numbers."""

    def count_items(self, batch):
        return 0.3 * len(batch["labels"])


class Summing(Classifier):
    """Divides its summed loss by the num_items_in_batch it is given, as Transformers' causal LMs do."""

    def forward(self, x, labels, num_items_in_batch=None):
        logits = self.net(x)
        if num_items_in_batch is None:
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}
        return {"loss": nn.functional.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch,
                "logits": logits}


class OwnCount(Trainer):
    """A compute_loss of its own that divides by num_items_in_batch (Transformers would train it at 1/world size)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
        return (outputs["loss"], outputs) if return_outputs else outputs["loss"]


class TransformersBody(Trainer):
    """Transformers 5's own training_step, less its accelerator (loss.backward() for accelerator.backward)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if not (self.model_accepts_loss_kwargs and num_items_in_batch is not None):
            loss = loss / self.current_gradient_accumulation_steps
        loss.backward()
        return loss.detach()


def run(world, out, cls, samples, model=Classifier):
    torch.manual_seed(0)
    args = trainer_args(f"{out}/{cls.__name__}{model.__name__}{samples}", per_device_train_batch_size=2,
                        gradient_accumulation_steps=2, num_train_epochs=2)
    trainer = cls(model().double(), args, train_dataset=classification_data(samples))
    trainer.calls = []
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return params_of(trainer.model), losses, trainer.calls


def seams_world(world, out):
    runs = {name: run(world, out, cls, samples) for name, cls, samples in
            (("plain", Uneven, 14), ("noting", Noting, 14), ("plain even", Trainer, 16), ("own", OwnLoss, 16),
             ("tenths", Tenths, 16))}
    for name, cls in (("summing", Trainer), ("transformers", TransformersBody), ("own count", OwnCount)):
        runs[name] = run(world, out, cls, 16, Summing)
    return runs


def test_training_step_overrides_train_as_in_transformers(tmp_path):
    ranks = run_world(seams_world, 2, args=(str(tmp_path),), deadline_s=120)
    for rank, got in enumerate(ranks):
        plain, noting = got["plain"], got["noting"]
        for a, b in zip(plain[0], noting[0]):
            np.testing.assert_array_equal(a, b)  # super()'s training_step is the Trainer's own, filler included
        assert plain[1] == noting[1] and len(plain[1]) == 6
        # One call per micro-batch (2, 2 and 1 a step: rank 0's 5 batches), num_items_in_batch the step's items
        # over both ranks. Rank 1 is out of data after the first step and runs its last batch again, weighed zero.
        steps, sizes, counts, losses = zip(*noting[2])
        assert steps == (1, 1, 2, 2, 3, 4, 4, 5, 5, 6) and sizes == (2,) * 10 and counts == (8, 8, 4, 4, 2) * 2
        fillers = [i for i, loss in enumerate(losses) if loss == 0.0]
        assert fillers == ([] if rank == 0 else [2, 3, 4, 7, 8, 9]), (rank, losses)
        even, own = got["plain even"], got["own"]
        for a, b in zip(even[0], own[0]):  # equal batches: the mean of the means is the mean, to rounding
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
        np.testing.assert_allclose(even[1], own[1], rtol=1e-12)  # logged: the ranks' mean of the returns' sum
        # Counts need not be whole: three tenths a sample is the plain mean, to rounding (not a truncated count)
        for a, b in zip(even[0], got["tenths"][0]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-10)
        np.testing.assert_allclose(got["tenths"][1], even[1], rtol=1e-6)  # (the ranks sum counts in float32)
        # Transformers' own body on a model that divides by num_items_in_batch: compute_loss scales by the world
        # size, as Transformers' does, so it trains and logs the Trainer's own bits (it trained half of them)
        for other in ("transformers", "own count"):  # and a compute_loss of its own gets the factor from train()
            for a, b in zip(got["summing"][0], got[other][0]):
                np.testing.assert_array_equal(a, b)
            assert got["summing"][1] == got[other][1]
        np.testing.assert_allclose(got["summing"][1], even[1], rtol=1e-12)  # the mean, as the model's own mean
    for a, b in zip(ranks[0]["own"][0], ranks[1]["own"][0]):
        np.testing.assert_array_equal(a, b)  # replicas identical


def test_training_step_called_alone_and_overrides_of_another_signature(tmp_path, local_world):
    data = [{**sample, "x": sample["x"].float()} for sample in classification_data(8)]
    trainer = Trainer(Classifier(), trainer_args(tmp_path), train_dataset=data)  # float32
    trainer.model.net[2].p = 0.0  # no dropout: the same loss twice
    batch = next(iter(trainer.get_train_dataloader()))
    returned = trainer.training_step(trainer.model, batch)
    got = [p.grad.clone() for p in trainer.model.parameters()]
    trainer.model.zero_grad()
    want = trainer.compute_loss(trainer.model, batch)
    want.backward()
    assert returned.item() == want.item() and not returned.requires_grad
    assert returned.dtype == want.dtype  # the loss's own, as Transformers' (float64 was the Trainer's accounting)
    for g, p in zip(got, trainer.model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)

    class Window(Trainer):
        def training_step(self, window):
            return super().training_step(window)

    with pytest.raises(TypeError, match=r"training_step\(model, inputs, num_items_in_batch\)"):
        Window(Classifier().double(), trainer_args(tmp_path), train_dataset=classification_data(8))

    class Before446(Trainer):  # Transformers' signature before 4.46: it would fail at the first step
        def training_step(self, model, inputs):
            return super().training_step(model, inputs)

    with pytest.raises(TypeError, match=r"training_step\(model, inputs\): the Trainer calls"):
        Before446(Classifier().double(), trainer_args(tmp_path), train_dataset=classification_data(8))

    class Loose(Trainer):
        def training_step(self, *args, **kwargs):  # passes everything on: accepted
            return super().training_step(*args, **kwargs)

    assert Loose(Classifier().double(), trainer_args(tmp_path), train_dataset=classification_data(8))

    class Nothing(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            super().training_step(model, inputs, num_items_in_batch)

    nothing = Nothing(Classifier().double(), trainer_args(tmp_path, max_steps=1), train_dataset=classification_data(8))
    with pytest.raises(TypeError, match="training_step returned NoneType: it returns the micro-batch's loss"):
        nothing.train()
