"""The resume policy on checkpoint folders: which one a run resumes from, and which rotation must keep."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from ddpkit import integrity
from ddpkit.args import ArgumentError
from ddpkit.resume import choose_checkpoint, protected_checkpoints, read_trainer_state


def _checkpoints(out, *steps):
    """Finished checkpoint folders: weights, trainer_state.json and the completion marker written last."""
    for step in steps:
        folder = out / f"checkpoint-{step}"
        os.makedirs(folder)
        save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        marker = integrity.manifest(str(folder), ["model.safetensors", "trainer_state.json"], step)
        (folder / integrity.MARKER_FILE).write_text(json.dumps(marker))
    return [str(out / f"checkpoint-{step}") for step in steps]


def test_a_first_attempt_resumes_from_what_it_is_asked(tmp_path):
    two, ten = _checkpoints(tmp_path, 2, 10)
    os.makedirs(tmp_path / ".tmp-checkpoint-12-abcd")  # a killed save: never a candidate
    assert choose_checkpoint(None, str(tmp_path)) is None
    assert choose_checkpoint(False, str(tmp_path)) is None
    for newest in (True, "true", "True", "latest"):
        assert choose_checkpoint(newest, str(tmp_path)) == ten
    assert choose_checkpoint(two, str(tmp_path)) == two  # an older one, asked for by name


def test_newest_without_any_checkpoint_names_the_argument(tmp_path):
    with pytest.raises(ArgumentError, match="resume_from_checkpoint.*no checkpoint found"):
        choose_checkpoint(True, str(tmp_path / "empty"))
    # A restart with nothing saved yet still fails the same way when the newest was asked for...
    with pytest.raises(ArgumentError):
        choose_checkpoint(True, str(tmp_path / "empty"), restart=1)
    # ...and starts afresh when nothing was asked for.
    assert choose_checkpoint(None, str(tmp_path / "empty"), restart=1) is None


def test_a_restart_never_goes_back_past_the_newest_checkpoint(tmp_path):
    two, six = _checkpoints(tmp_path, 2, 6)
    other = tmp_path / "elsewhere"
    (later,) = _checkpoints(other, 9)
    assert choose_checkpoint(None, str(tmp_path), restart=1) == six  # nothing asked: the newest
    assert choose_checkpoint(two, str(tmp_path), restart=1) == six  # the named one is older: continue
    assert choose_checkpoint(later, str(tmp_path), restart=1) == later  # the named one is newer: keep it
    assert choose_checkpoint(two, str(tmp_path), restart=0) == two  # the first attempt does as it is told


def test_rotation_keeps_the_named_checkpoint_only(tmp_path):
    (two,) = _checkpoints(tmp_path, 2)
    assert protected_checkpoints(two) == (two,)
    assert protected_checkpoints(True) == () and protected_checkpoints(None) == ()
    assert read_trainer_state(two) == {"global_step": 2}
