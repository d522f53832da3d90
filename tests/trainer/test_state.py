"""TrainerState's two checkpoint files without a Trainer: trainer_state.json holds Transformers' fields alone (its
TrainerState.load_from_json raised TypeError on ddpkit's), ddpkit_state.json the rest, and both read back as the
state the run held; the second file is checksummed like every other."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from ddpkit.checkpoint import files as ckpt
from ddpkit.checkpoint import integrity
from ddpkit.distributed.comm import Comm
from ddpkit.distributed.env import single_process_env
from ddpkit.trainer.state import TRANSFORMERS_FIELDS, TrainerState
from helpers.models import flip_inside, small_model

STATE = TrainerState(global_step=6, epoch=1.5, max_steps=8, train_batch_size=16, world_size=2,
                     log_history=[{"loss": 0.5, "step": 6, "epoch": 1.5}], best_metric=0.25, best_global_step=4,
                     loss_since_last_log=1.25, steps_since_last_log=2, train_loss_sum=3.5, train_loss_steps=6,
                     plan_arguments={"max_steps": 8, "num_train_epochs": 3.0, "steps_per_epoch": 4},
                     last_step_log=[0.75, 0.01], should_stop=True)


def test_the_transformers_fields_are_the_installed_transformers_ones():
    transformers = pytest.importorskip("transformers")
    assert set(TRANSFORMERS_FIELDS) == {f.name for f in dataclasses.fields(transformers.TrainerState)}
    assert set(TRANSFORMERS_FIELDS) <= {f.name for f in dataclasses.fields(TrainerState)}


def test_split_gives_transformers_its_fields_and_reads_back_whole(tmp_path):
    transformers = pytest.importorskip("transformers")
    theirs, ours = STATE.split(per_device_train_batch_size=4)
    assert set(theirs) == set(TRANSFORMERS_FIELDS)
    assert set(ours) & set(theirs) == {"train_batch_size"}  # the one field whose meaning differs
    assert (theirs["train_batch_size"], ours["train_batch_size"]) == (4, 16)  # per device; global
    file = tmp_path / "trainer_state.json"
    file.write_text(json.dumps(theirs))
    loaded = transformers.TrainerState.load_from_json(str(file))
    assert (loaded.global_step, loaded.log_history, loaded.best_global_step) == (6, STATE.log_history, 4)
    assert TrainerState.from_dict(json.loads(json.dumps({**theirs, **ours}))) == STATE


def _save(out, step: int) -> str:
    theirs, ours = STATE.split(4)
    return ckpt.save_checkpoint(str(out), step, model=small_model(), trainer_state=theirs, ddpkit_state=ours,
                                sampler_state={"epoch": 1, "seed": 3, "consumed": 24}, comm=Comm(),
                                world=single_process_env())


def test_ddpkit_state_is_read_with_trainer_state_and_checksummed(tmp_path):
    path = _save(tmp_path, 6)
    assert ckpt.load_checkpoint(path).trainer_state == STATE.to_dict()
    assert ckpt.read_trainer_state(path)["train_batch_size"] == 16  # the global batch, which the step plan compares
    assert set(integrity.read_marker(path)["crc32"]) >= {"ddpkit_state.json", "trainer_state.json"}
    flip_inside(os.path.join(path, "ddpkit_state.json"))
    with pytest.raises(ckpt.CheckpointError, match="ddpkit_state.json fails its checksum"):
        ckpt.load_checkpoint(path)
    os.remove(os.path.join(path, "ddpkit_state.json"))
    with pytest.raises(ckpt.CheckpointError, match="ddpkit_state.json is missing"):
        ckpt.load_checkpoint(path)


def test_save_to_json_and_load_from_json_as_transformers(tmp_path):
    """Transformers' pair: every field round-trips; a checkpoint's trainer_state.json loads with the
    ddpkit_state.json beside it read over it (the global batch, the running sums), as a resume reads them."""
    state = TrainerState(global_step=7, epoch=1.5, max_steps=20, train_batch_size=16, world_size=2,
                         log_history=[{"loss": 0.5, "step": 7}], best_metric=0.25, train_loss_sum=3.5)
    state.save_to_json(str(tmp_path / "state.json"))
    assert TrainerState.load_from_json(str(tmp_path / "state.json")) == state
    theirs, ours = state.split(per_device_train_batch_size=8)
    folder = tmp_path / "checkpoint-7"
    folder.mkdir()
    for name, values in (("trainer_state.json", theirs), ("ddpkit_state.json", ours)):
        (folder / name).write_text(json.dumps(values))
    assert TrainerState.load_from_json(str(folder / "trainer_state.json")) == state
    (folder / "ddpkit_state.json").unlink()  # Transformers' own checkpoint: its fields, its meanings
    alone = TrainerState.load_from_json(str(folder / "trainer_state.json"))
    assert (alone.global_step, alone.train_batch_size, alone.train_loss_sum) == (7, 8, 0.0)

