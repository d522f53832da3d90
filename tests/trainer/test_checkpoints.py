"""ddpkit.trainer.checkpoints: which checkpoints a run has, as the final and the stop's save ask it. A corrupt checkpoint of the
run's own (a resume skipped it and trained its steps again) is no reason to skip a save: the run would end with
its last steps in no checkpoint, and the next resume would go back again. Rotation that cannot delete an old
checkpoint keeps it, with a warning, and the run goes on (Transformers ignores the error)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from ddpkit.checkpoint import folders as checkpoint_dir
from ddpkit.checkpoint import integrity
from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, trainer_args


def _run(out, **kw):
    torch.manual_seed(0)
    args = trainer_args(out, per_device_train_batch_size=4, max_steps=6, save_strategy="steps", save_steps=4, **kw)
    trainer = Trainer(Classifier().double(), args, train_dataset=classification_data(24))
    trainer.train()
    return trainer


def _flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 8)  # inside the last tensor's data: the header still parses
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_the_final_save_replaces_a_corrupt_checkpoint_of_the_run(tmp_path, local_world):
    first = _run(tmp_path)
    last = str(tmp_path / "checkpoint-6")
    weights = {k: v.clone() for k, v in first.model.state_dict().items()}
    _flip_a_byte(os.path.join(last, "model.safetensors"))
    assert integrity.problems(last)
    with pytest.warns(RuntimeWarning, match="skipping the corrupt checkpoint"):
        again = _run(tmp_path, resume_from_checkpoint=True)  # from checkpoint-4, steps 5 and 6 once more
    assert again.state.global_step == 6
    assert integrity.problems(last) == []
    saved = load_file(os.path.join(last, "model.safetensors"))
    for name, value in weights.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0)
    assert again.saves.exists(6) and again.saves.exists(4) and not again.saves.exists(5)
    # The same Trainer again, the same run resumed: what its last call wrote is no proof of what the disk holds.
    _flip_a_byte(os.path.join(last, "model.safetensors"))
    with pytest.warns(RuntimeWarning, match="skipping the corrupt checkpoint"):
        again.train(resume_from_checkpoint=True)
    assert integrity.problems(last) == []


def test_a_checkpoint_rotation_cannot_delete_stays_and_the_run_goes_on(tmp_path, local_world, monkeypatch):
    def refuse(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(checkpoint_dir, "_retire", refuse)
    with pytest.warns(RuntimeWarning, match="could not delete the old checkpoint .*checkpoint-4"):
        trainer = _run(tmp_path, save_total_limit=1)
    assert trainer.state.global_step == 6
    assert {"checkpoint-4", "checkpoint-6"} <= set(os.listdir(tmp_path))  # a limit of 1 could not delete 4
    assert integrity.problems(str(tmp_path / "checkpoint-6")) == []


def test_checkpoints_and_save_model_hold_the_training_arguments_as_transformers_writes_them(tmp_path, local_world):
    """training_args.bin: the TrainingArguments, torch.save'd, in every checkpoint (in its marker's checksums) and
    in save_model's folder, as Transformers' Trainer writes it (scripts torch.load it back)."""
    trainer = _run(tmp_path)
    trainer.save_model(str(tmp_path / "final"))
    for folder in ("checkpoint-4", "checkpoint-6", "final"):
        args = torch.load(tmp_path / folder / "training_args.bin", weights_only=False)
        assert type(args) is type(trainer.args) and args.to_dict() == trainer.args.to_dict(), folder
    assert "training_args.bin" in integrity.read_marker(str(tmp_path / "checkpoint-4"))["crc32"]

