"""The Trainer's default collator and remove_unused_columns, against Transformers' default_data_collator and
RemoveColumnsCollator; a Trainer on tokenizer-style samples (lists of ints, a "label" key, a text column)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddpkit.trainer.collator import default_data_collator, without_unused_columns
from helpers.models import Classifier, trainer_args


def samples():
    return [{"input_ids": [i, i + 1, i + 2], "mask": np.ones(3, dtype=np.int64), "label": i % 2, "text": "t",
             "none": None, "score": torch.tensor(0.5 * i)} for i in range(3)]


def test_the_default_collator_stacks_as_transformers_does():
    from transformers import default_data_collator as transformers_collator

    # Transformers' dtype rule: "label" by the value itself (a bool is an int; a list of labels, multi-label, is
    # float), "label_ids" by its first element.
    labels = [[0, 1, 1], np.array([1, 0, 0]), True, 1, 0.5, torch.tensor(1), torch.tensor(1.5)]
    label_ids = [[1, 2], [True, False], [0.5, 1.0], torch.tensor([1, 2])]
    for features in (samples(), *([{"x": [0.5, 1.5], "label": v}, {"x": [2.5, 3.5], "label": v}] for v in labels),
                     *([{"x": [0.5, 1.5], "label_ids": v}, {"x": [2.5, 3.5], "label_ids": v}] for v in label_ids)):
        ours, theirs = default_data_collator(features), transformers_collator(features)
        assert sorted(ours) == sorted(theirs)
        for key in theirs:
            assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    batch = default_data_collator(samples())
    assert batch["input_ids"].shape == (3, 3) and batch["labels"].tolist() == [0, 1, 0]
    assert "text" not in batch and "none" not in batch and "label" not in batch
    pairs = [(torch.ones(2), 1), (torch.zeros(2), 0)]  # not mappings: torch's default_collate
    x, y = default_data_collator(pairs)
    assert x.shape == (2, 2) and y.tolist() == [1, 0]


def test_unused_columns_are_dropped_before_collating():
    model = Classifier()  # forward(x, labels=None, idx=None)
    features = [{"x": torch.ones(6), "label": 1, "sentence": "a", "other": 3} for _ in range(2)]
    batch = without_unused_columns(default_data_collator, model)(features)
    assert sorted(batch) == ["labels", "x"]
    kept = without_unused_columns(default_data_collator, model, label_names=["other"])(features)
    assert sorted(kept) == ["labels", "other", "x"]
    with pytest.raises(ValueError, match="remove_unused_columns=False"):
        without_unused_columns(default_data_collator, model)([{"y": 1}])


def text_data(n):
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(6, generator=g).tolist(), "label": i % 3, "sentence": f"sample {i}",
             "other": i} for i in range(n)]


def test_a_trainer_trains_on_lists_with_a_label_key_and_text(tmp_path, local_world):
    """Before: default_collate made a list of 6 tensors of "x", left "label" as it was and passed "other" on."""
    from ddpkit.trainer.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(Classifier(), trainer_args(tmp_path / "kept", max_steps=2, per_device_train_batch_size=4),
                      train_dataset=text_data(8), eval_dataset=text_data(4))
    assert np.isfinite(trainer.train().training_loss) and np.isfinite(trainer.evaluate()["eval_loss"])
    assert trainer.predict(text_data(5)).label_ids.tolist() == [0, 1, 2, 0, 1]
    # remove_unused_columns=False passes every key on (but text, which the collator drops), as in Transformers.
    whole = Trainer(Classifier(), trainer_args(tmp_path / "all", max_steps=1, remove_unused_columns=False),
                    train_dataset=text_data(8))
    with pytest.raises(TypeError, match="other"):
        whole.train()


def test_a_peft_style_wrapper_keeps_its_base_models_columns():
    """A PEFT model's forward takes (*args, **kwargs): the base model's forward decides, as in Transformers."""

    class Peft(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = Classifier()

        def get_base_model(self):
            return self.base

        def forward(self, *args, **kwargs):
            return self.base(*args, **kwargs)

    batch = without_unused_columns(default_data_collator, Peft())([{"x": torch.ones(6), "label": 1, "note": 2}])
    assert sorted(batch) == ["labels", "x"]
