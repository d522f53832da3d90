"""Runs that share an output_dir stay apart: a restart resumes only its own run's checkpoints, rotation retires
only its own, and a checkpoint of another run that a save would replace is renamed aside, never lost."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest import Classifier, classification_data, params_of, run_world, trainer_args

from ddpkit import checkpoint, integrity, runs
from ddpkit.args import ArgumentError
from ddpkit.resume import choose_run
from ddpkit.trainer import Trainer


def _checkpoints(out, run, *steps):
    """Finished checkpoint folders of run `run` (None: an older ddpkit's, whose marker names no run)."""
    for step in steps:
        folder = out / f"checkpoint-{step}"
        os.makedirs(folder)
        save_file({"w": torch.full((2,), float(step))}, str(folder / "model.safetensors"))
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        marker = integrity.manifest(str(folder), ["model.safetensors", "trainer_state.json"], step)
        (folder / integrity.MARKER_FILE).write_text(json.dumps(marker if run is None else {**marker, "run": run}))
    return [str(out / f"checkpoint-{step}") for step in steps]


def test_a_restart_resumes_only_its_own_runs_checkpoints(tmp_path):
    out = str(tmp_path)
    _, a6 = _checkpoints(tmp_path, "a", 4, 6)
    runs.mark_current(out, "b", None)  # run b started afresh here, and failed before its first save
    choice = choose_run(None, out, restart=1)
    assert choice.path is None and choice.run == "b", choice  # not run a's newer checkpoint-6
    (b2,) = _checkpoints(tmp_path, "b", 2)
    assert choose_run(None, out, restart=1).path == b2
    assert choose_run(True, out, restart=0).path == b2  # "the newest": the current run's, though a's step is higher
    assert choose_run(a6, out, restart=1).path == a6  # named, and newer than the run's own newest: as before
    # No run file (an older ddpkit's folder): a restart continues the newest checkpoint, of whatever run
    os.remove(os.path.join(out, runs.RUN_FILE))
    choice = choose_run(None, out, restart=1)
    assert choice.path == a6 and choice.run == "a"


def test_a_launch_continues_or_branches_off_the_run_it_resumes(tmp_path):
    out = str(tmp_path)
    a4, a6 = _checkpoints(tmp_path, "a", 4, 6)
    fresh = choose_run(None, out)
    assert fresh.path is None and fresh.run not in ("a", None) and fresh.others == (a4, a6)
    assert choose_run(a6, out) == choose_run(a6, out, restart=0)
    continued = choose_run(a6, out)
    assert continued.run == "a" and continued.others == () and continued.behind is None
    branch = choose_run(a4, out)  # older than the run's newest here: a run of its own, a's checkpoints kept
    assert branch.path == a4 and branch.run != "a" and branch.behind == a6 and branch.others == (a4, a6)
    (legacy,) = _checkpoints(tmp_path / "old", None, 3)
    assert choose_run(legacy, out).run not in (None, "a")
    with pytest.raises(ArgumentError, match="no checkpoint found"):
        choose_run(True, str(tmp_path / "empty"))


def test_rotation_and_a_same_step_save_keep_other_runs_checkpoints(tmp_path):
    out = str(tmp_path)
    a4, a6 = _checkpoints(tmp_path, "a", 4, 6)
    b2, b3 = _checkpoints(tmp_path, "b", 2, 3)
    assert checkpoint.rotate_checkpoints(out, 1, keep=(b3,), run="b") == [b2]
    assert os.path.isdir(a4) and os.path.isdir(a6)
    assert checkpoint.rotate_checkpoints(out, 1) == [b3, a4]  # without a run: every checkpoint counts, as before
    # run b publishes its own checkpoint-6: run a's is renamed aside, and stays loadable by its new name's marker
    tmp = str(tmp_path / ".tmp-checkpoint-6-x")
    os.makedirs(tmp)
    checkpoint._publish(tmp, a6, run="b")
    aside = f"{a6}.run-a"
    assert os.path.isdir(aside) and checkpoint.checkpoint_run(aside) == "a" and not integrity.problems(aside)
    assert os.path.isdir(a6) and checkpoint.list_checkpoints(out) == []  # the new one has no marker here
    again = str(tmp_path / ".tmp-checkpoint-6-y")
    os.makedirs(again)
    checkpoint._publish(again, a6, run=None)  # no run: replaced, as before
    assert sorted(os.listdir(out)) == ["checkpoint-6", "checkpoint-6.run-a"]


# -- Trainer runs sharing an output_dir ------------------------------------------------------------------------------
class Steps(Trainer):
    """Notes the step about to be taken for every training micro-batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            self.steps.append(self.state.global_step + 1)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _train(out, max_steps, restart=0, **kw):
    torch.manual_seed(0)
    model = Classifier().double()
    args = trainer_args(out, per_device_train_batch_size=2, max_steps=max_steps, save_strategy="steps", save_steps=2,
                        save_total_limit=2, **kw)
    trainer = Steps(model, args, classification_data(24))
    trainer.steps = []
    if restart:  # what the launcher's TORCHELASTIC_RESTART_COUNT tells a restarted worker
        trainer.world = dataclasses.replace(trainer.world, restart=restart)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return trainer.steps, params_of(model), [str(w.message) for w in caught]


def two_runs_in_one_folder(world, out):
    first = _train(out, max_steps=6)  # run a: checkpoint-4 and -6 kept
    second = _train(out, max_steps=2)  # run b, afresh in the same folder: checkpoint-2, then it "fails"
    restarted = _train(out, max_steps=4, restart=1)  # b's restart: must take up b's checkpoint-2, not a's -6
    straight = _train(f"{out}-straight", max_steps=4)  # b uninterrupted, for the weights
    return first, second, restarted, straight, sorted(os.listdir(out))


def test_a_second_run_in_the_same_output_dir_loses_nothing_and_resumes_its_own(tmp_path):
    out = str(tmp_path / "out")
    results = run_world(two_runs_in_one_folder, 2, args=(out,), deadline_s=150)
    for first, second, restarted, straight, names in results:
        assert first[0][-1] == 6 and second[0] == [1, 2]
        assert restarted[0] == [3, 4], "the restart did not continue its own run from checkpoint-2"
        for got, want in zip(restarted[1], straight[1]):
            np.testing.assert_array_equal(got, want)
    warned = results[0][1][2]  # rank 0 says what happens to run a's checkpoints when run b starts
    assert any("checkpoint(s) of an earlier run" in w and "checkpoint-6" in w for w in warned), warned
    # a's checkpoint-6 untouched, a's checkpoint-4 renamed aside by b's save of step 4, b's own two kept
    names = [n for n in results[0][4] if n.startswith("checkpoint")]
    assert names == ["checkpoint-2", "checkpoint-4", "checkpoint-4.run-" + _run_of(out, "checkpoint-6"),
                     "checkpoint-6"], names
    assert _run_of(out, "checkpoint-2") == _run_of(out, "checkpoint-4") == runs.current_run(out)
    assert _run_of(out, "checkpoint-6") != runs.current_run(out)


def _run_of(out, name):
    return checkpoint.checkpoint_run(os.path.join(out, name))
