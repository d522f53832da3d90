"""ddpkit.trainer_data: the Trainer's loaders under Transformers' signatures, get_train_dataloader(),
get_eval_dataloader(eval_dataset=None) and get_test_dataloader(test_dataset), which scripts call and subclasses
override (ddpkit's took a sampler and indices: an override with Transformers' signature crashed train()). An
override that hands a rank other samples than ddpkit dealt it fails clearly, on every rank, instead of mixing
the predictions up."""

from __future__ import annotations

import pytest
import torch

from conftest import Classifier, classification_data, run_world, trainer_args

from ddpkit.trainer import Trainer


class Counting(Trainer):
    made: list[str] = []

    def get_train_dataloader(self):
        type(self).made.append("train")
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None):
        type(self).made.append("eval")
        return super().get_eval_dataloader(eval_dataset)


def test_the_loaders_take_transformers_arguments_and_overrides_are_used(tmp_path, local_world):
    sets = {"a": classification_data(5, seed=1), "b": classification_data(3, seed=2)}
    args = trainer_args(tmp_path, per_device_train_batch_size=4, per_device_eval_batch_size=2, num_train_epochs=2,
                        eval_strategy="epoch")
    trainer = Counting(Classifier().double(), args, train_dataset=classification_data(8), eval_dataset=sets)
    assert sum(len(b["labels"]) for b in trainer.get_train_dataloader()) == 8
    assert [len(b["labels"]) for b in trainer.get_eval_dataloader("a")] == [2, 2, 1]
    assert sum(len(b["labels"]) for b in trainer.get_test_dataloader(sets["b"])) == 3
    Counting.made.clear()
    trainer.train()
    # the plan's look at the data, then each epoch's loader; each epoch's evaluation of both sets
    assert Counting.made == ["train", "train", "eval", "eval", "train", "eval", "eval"], Counting.made
    with pytest.raises(KeyError, match="it has"):
        trainer.get_eval_dataloader("c")


def whole_set_world(world, out):
    class Whole(Trainer):
        def get_test_dataloader(self, test_dataset):
            return torch.utils.data.DataLoader(test_dataset, batch_size=2, collate_fn=self.data_collator)

    trainer = Whole(Classifier().double(), trainer_args(out, per_device_eval_batch_size=2))
    try:
        trainer.predict(classification_data(6))
    except ValueError as exc:
        return str(exc)
    return None


def test_an_override_that_gives_a_rank_other_samples_fails_on_every_rank(tmp_path):
    for told in run_world(whole_set_world, 2, args=(str(tmp_path),), deadline_s=60):
        assert told is not None and "rank 0 predicted 6 samples where ddpkit dealt it 4" in told, told
        assert "keep super()'s sampler" in told
