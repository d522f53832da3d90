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

from ddpkit.checkpoint import files as checkpoint
from ddpkit.checkpoint import folders
from ddpkit.checkpoint import integrity
from ddpkit.checkpoint import run_ids as runs
from ddpkit.checkpoint.resume import choose_run
from ddpkit.errors import ArgumentError
from ddpkit.trainer.callbacks import TrainerCallback
from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, params_of, trainer_args
from helpers.world import run_world


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


def test_a_restart_takes_up_only_a_run_its_own_launch_recorded(tmp_path):
    out = str(tmp_path)
    (a6,) = _checkpoints(tmp_path, "a", 6)
    runs.mark_current(out, "a", None, job="launch-1")  # an earlier launch's run
    # launch 2's first attempt failed before recording a run: its restart starts afresh, not from a's checkpoint
    choice = choose_run(None, out, restart=1, job="launch-2")
    assert choice.path is None and choice.run != "a" and choice.others == (a6,)
    assert choose_run(None, out, restart=1, job="launch-1").path == a6  # launch 1's restart: its own run
    assert choose_run(None, out, restart=1, job=None).path == a6  # a launcher that names no launch: as before
    assert choose_run(True, out, restart=1, job="launch-2").path == a6  # asked for the newest, it gets it


def test_each_train_call_of_a_restarted_script_takes_up_its_own_run(tmp_path):
    """A script that trains twice into one output_dir (pretraining, then fine-tuning) restarts as a whole: its
    first call continues the first call's run, its second the second's, never both the run recorded last."""
    out = str(tmp_path)
    (a6,) = _checkpoints(tmp_path, "a", 6)
    (b8,) = _checkpoints(tmp_path, "b", 8)
    assert runs.call_index(out, "L", 0) == 0
    runs.mark_current(out, "a", None, job="L", attempt=0, call=0)
    assert runs.call_index(out, "L", 0) == 1  # the same attempt's next call
    runs.mark_current(out, "b", None, job="L", attempt=0, call=1)
    assert runs.current_run(out) == "b" and runs.current_run(out, "L") == "a" and runs.current_run(out, "L", 1) == "b"
    # restart 1: the count starts again, each call taking its own run
    assert runs.call_index(out, "L", 1) == 0
    first = choose_run(None, out, restart=1, job="L", call=0)
    assert (first.path, first.run) == (a6, "a"), first
    runs.mark_current(out, first.run, first.path, job="L", attempt=1, call=0)
    assert runs.call_index(out, "L", 1) == 1 and runs.current_run(out, "L", 1) == "b"  # call 1's run is kept
    second = choose_run(None, out, restart=1, job="L", call=1)
    assert (second.path, second.run) == (b8, "b"), second
    runs.mark_current(out, second.run, second.path, job="L", attempt=1, call=1)
    # a third call that no earlier attempt reached starts as a first try would; another launch counts afresh
    assert runs.current_run(out, "L", 2) is None and choose_run(None, out, 1, "L", 2).run not in ("a", "b")
    assert runs.call_index(out, "M", 1) == 0 and runs.current_run(out, "M") is None
    runs.mark_current(out, "c", None, job="M")
    assert json.load(open(os.path.join(out, runs.RUN_FILE)))["calls"] == ["c"]
    # a run file written before calls were listed names the first call's run only
    with open(os.path.join(out, runs.RUN_FILE), "w") as f:
        json.dump({"run": "a", "job": "L", "resumed_from": None}, f)
    assert runs.current_run(out, "L", 0) == "a" and runs.current_run(out, "L", 1) is None
    assert runs.call_index(out, "L", 0) == 0


def test_a_corrupt_newest_checkpoint_is_skipped_and_the_run_continued_not_branched(tmp_path):
    out = str(tmp_path)
    a4, a6 = _checkpoints(tmp_path, "a", 4, 6)
    runs.mark_current(out, "a", None)
    with open(os.path.join(a6, "model.safetensors"), "r+b") as f:
        f.truncate(10)
    with pytest.warns(RuntimeWarning, match="skipping the corrupt checkpoint"):
        choice = choose_run(True, out)
    assert choice.path == a4 and choice.run == "a" and choice.behind is None, choice
    with open(os.path.join(a4, "model.safetensors"), "r+b") as f:
        f.truncate(10)
    with pytest.warns(RuntimeWarning), pytest.raises(ArgumentError, match="each of its 2 checkpoint.s. is corrupt"):
        choose_run(True, out)


def test_the_best_checkpoint_renamed_aside_by_a_later_run_is_found_by_its_own(tmp_path):
    from types import SimpleNamespace

    from ddpkit.trainer.checkpoints import Saves

    out = str(tmp_path)
    (b4,) = _checkpoints(tmp_path, "b", 4)
    os.rename(b4, f"{b4}.run-a")  # what run b's save did to run a's checkpoint-4
    _checkpoints(tmp_path, "b", 4)
    saves = Saves(SimpleNamespace(output_dir=out, save_total_limit=None, per_device_train_batch_size=1), None, None)
    saves.run = "a"
    assert saves.own(b4) == f"{b4}.run-a"
    saves.run = "b"
    assert saves.own(b4) == b4
    saves.run = None  # a Saves told of no run: paths as they are
    assert saves.own(b4) == b4


def rank_0_cannot_choose(world, out):
    """What every rank raises when rank 0 meets an error choosing (before ddpkit, rank 1 waited for the
    broadcast until the timeout when rank 0 raised and lived on)."""
    import errno
    import time

    from ddpkit.checkpoint.resume import begin_run
    from ddpkit.distributed.comm import Comm

    told = {}
    os.makedirs(f"{out}/not-a-checkpoint", exist_ok=True)
    for case, resume in (("not a checkpoint", f"{out}/not-a-checkpoint"), ("full disk", None)):
        if case == "full disk" and world.rank == 0:
            runs.mark_current = lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left"))
        began = time.monotonic()
        try:
            begin_run(resume, f"{out}/out", world, Comm.for_group())
            told[case] = "no error"
        except Exception as exc:  # noqa: BLE001 - the type and the words are the result
            told[case] = (type(exc).__name__, str(exc), time.monotonic() - began)
    return told


def test_every_rank_raises_what_rank_0_met_choosing_the_checkpoint(tmp_path):
    for told in run_world(rank_0_cannot_choose, 2, args=(str(tmp_path),), deadline_s=60, collective_timeout_s=20):
        kind, text, took = told["not a checkpoint"]
        assert kind == "FileNotFoundError" and "is not a finished checkpoint folder" in text and took < 10, told
        kind, text, took = told["full disk"]
        assert kind == "OSError" and "no space left on device" in text and took < 10, told


def test_rotation_and_a_same_step_save_keep_other_runs_checkpoints(tmp_path):
    out = str(tmp_path)
    a4, a6 = _checkpoints(tmp_path, "a", 4, 6)
    b2, b3 = _checkpoints(tmp_path, "b", 2, 3)
    assert folders.rotate_checkpoints(out, 1, keep=(b3,), run="b") == [b2]
    assert os.path.isdir(a4) and os.path.isdir(a6)
    assert folders.rotate_checkpoints(out, 1) == [b3, a4]  # without a run: every checkpoint counts, as before
    # run b publishes its own checkpoint-6: run a's is renamed aside, and stays loadable by its new name's marker
    tmp = str(tmp_path / ".tmp-checkpoint-6-x")
    os.makedirs(tmp)
    checkpoint._publish(tmp, a6, run="b")
    aside = f"{a6}.run-a"
    assert os.path.isdir(aside) and folders.checkpoint_run(aside) == "a" and not integrity.problems(aside)
    assert os.path.isdir(a6) and folders.list_checkpoints(out) == []  # the new one has no marker here
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


def _train(out, max_steps, restart=0, save_steps=2, job=None, callbacks=None, **kw):
    torch.manual_seed(0)
    model = Classifier().double()
    args = trainer_args(out, per_device_train_batch_size=2, max_steps=max_steps, save_strategy="steps",
                        save_steps=save_steps, save_total_limit=2, **kw)
    trainer = Steps(model, args, train_dataset=classification_data(24), callbacks=callbacks)
    trainer.steps = []
    # what the launcher's TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_RUN_ID tell a (restarted) worker
    trainer.world = dataclasses.replace(trainer.world, restart=restart, job=job)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return trainer.steps, params_of(model), [str(w.message) for w in caught]


def two_runs_in_one_folder(world, out):
    first = _train(out, max_steps=6)  # run a: checkpoint-4 and -6 kept
    # run b, afresh in the same folder: checkpoint-3, and its final save at step 4, where run a has one too
    second = _train(out, max_steps=4, save_steps=3)
    # b's restart, asking for 6 steps: it must take up b's checkpoint-4, not a's -6 (nor b's -3, had its final
    # save been skipped for a's checkpoint-4)
    restarted = _train(out, max_steps=6, restart=1, save_steps=3)
    straight = _train(f"{out}-straight", max_steps=6, save_steps=3)  # b uninterrupted, for the weights
    return first, second, restarted, straight, sorted(os.listdir(out))


def test_a_second_run_in_the_same_output_dir_loses_nothing_and_resumes_its_own(tmp_path):
    out = str(tmp_path / "out")
    results = run_world(two_runs_in_one_folder, 2, args=(out,), deadline_s=150)
    for first, second, restarted, straight, names in results:
        assert first[0][-1] == 6 and second[0][-1] == 4
        assert restarted[0] == [5, 6], "the restart did not continue its own run from its checkpoint-4"
        for got, want in zip(restarted[1], straight[1]):
            np.testing.assert_array_equal(got, want)
    warned = results[0][1][2]  # rank 0 says what happens to run a's checkpoints when run b starts
    assert any("checkpoint(s) of earlier runs" in w and "checkpoint-6" in w for w in warned), warned
    # b's checkpoint-4 and -6 (its -3 rotated away), a's checkpoint-4 and -6 renamed aside by b's saves of those
    names = [n for n in results[0][4] if n.startswith("checkpoint")]
    a = names[1].split(".run-")[-1]
    assert names == ["checkpoint-4", f"checkpoint-4.run-{a}", "checkpoint-6", f"checkpoint-6.run-{a}"], names
    assert _run_of(out, "checkpoint-4") == _run_of(out, "checkpoint-6") == runs.current_run(out) != a
    assert _run_of(out, f"checkpoint-4.run-{a}") == _run_of(out, f"checkpoint-6.run-{a}") == a


def _run_of(out, name):
    return folders.checkpoint_run(os.path.join(out, name))


class Crash(TrainerCallback):
    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise RuntimeError("crash")


def test_a_restarted_script_that_trains_twice_continues_each_call_in_its_own_run(tmp_path, local_world):
    """Pretraining (run a), then fine-tuning (run b) into one output_dir, by one launch (job L); b crashes after its
    checkpoint-4. The restarted script's first call takes up a's checkpoint-4 (nothing left to train), not b's, which
    was recorded last; its second call continues b from b's checkpoint-4."""
    out = str(tmp_path / "out")
    a = _train(out, max_steps=4, job="L")
    with pytest.raises(RuntimeError, match="crash"):
        _train(out, max_steps=6, job="L", learning_rate=0.02, callbacks=[Crash(5)])
    again_a = _train(out, max_steps=4, job="L", restart=1)
    again_b = _train(out, max_steps=6, job="L", restart=1, learning_rate=0.02)
    straight_b = _train(f"{out}-straight", max_steps=6, learning_rate=0.02)
    assert again_a[0] == [] and again_b[0] == [5, 6], (again_a[0], again_b[0])
    assert not any("nothing is left to train" in w for w in again_a[2]), again_a[2]  # a finished call: no news
    for got, want in zip(again_a[1], a[1]):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(again_b[1], straight_b[1]):
        np.testing.assert_array_equal(got, want)
    # a's restart found its checkpoint-4 renamed aside by b's save and wrote no other (b's stays in place)
    a_id = _run_of(out, "checkpoint-4.run-" + runs.current_run(out, "L", 0))
    names = sorted(n for n in os.listdir(out) if n.startswith("checkpoint"))
    assert names == ["checkpoint-2.run-" + a_id, "checkpoint-4", "checkpoint-4.run-" + a_id, "checkpoint-6"], names


def _pretrain_then_continue(out, restart, crash_at=None, limit=None):
    """A script whose second train() call resumes the first's checkpoint-6 (so continues its run) to step 10."""
    torch.manual_seed(0)
    model = Classifier().double()
    crash = Crash(None)
    trainer = Steps(model, trainer_args(out, per_device_train_batch_size=2, max_steps=6, save_strategy="steps",
                                        save_steps=3, save_total_limit=limit), train_dataset=classification_data(24),
                    callbacks=[crash])
    trainer.world = dataclasses.replace(trainer.world, restart=restart, job="L")
    trainer.steps = []
    trainer.train()
    first = (trainer.steps, params_of(model))
    trainer.args.max_steps, crash.at, trainer.steps = 10, crash_at, []
    sixth = os.path.join(out, "checkpoint-6")  # rotated away by the second call under save_total_limit=1
    trainer.train(resume_from_checkpoint=sixth if os.path.isdir(sixth) else True)
    return first, (trainer.steps, params_of(model))


def test_a_restarted_call_resumes_where_it_ended_not_from_a_later_call_of_its_run(tmp_path, local_world):
    """The second call continues the first's run and crashes after its checkpoint-9: the restarted first call
    ends on its own step-6 weights (what the script saves between the calls), not on the second's step 9."""
    out = str(tmp_path / "out")
    straight = _pretrain_then_continue(f"{out}-straight", 0)
    with pytest.raises(RuntimeError, match="crash"):
        _pretrain_then_continue(out, 0, crash_at=10)
    first, second = _pretrain_then_continue(out, 1)
    assert first[0] == [] and second[0] == [10], (first[0], second[0])
    for got, want in zip(first[1] + second[1], straight[0][1] + straight[1][1]):
        np.testing.assert_array_equal(got, want)
    # save_total_limit=1: only the second call's checkpoint-9 is left, so the first call trains again from its
    # start, and its rotation must leave that checkpoint (past its steps) for the second call to resume
    with pytest.raises(RuntimeError, match="crash"):
        _pretrain_then_continue(f"{out}-limited", 0, crash_at=10, limit=1)
    first, second = _pretrain_then_continue(f"{out}-limited", 1, limit=1)
    assert first[0] == [1, 2, 3, 4, 5, 6] and second[0] == [10], (first[0], second[0])
    for got, want in zip(first[1] + second[1], straight[0][1] + straight[1][1]):
        np.testing.assert_array_equal(got, want)


def test_a_restarted_script_that_skips_a_finished_stage_continues_the_stage_it_runs(tmp_path, local_world):
    """The restarted script sees its pretraining done and runs only the fine-tuning: that call, the first of its
    attempt, continues the fine-tuning's run (known by what it trains), not the pretraining's, first recorded."""
    out = str(tmp_path / "out")
    _train(out, max_steps=4, job="L")
    with pytest.raises(RuntimeError, match="crash"):
        _train(out, max_steps=6, job="L", learning_rate=0.02, callbacks=[Crash(5)])
    again = _train(out, max_steps=6, job="L", restart=1, learning_rate=0.02)
    straight = _train(f"{out}-straight", max_steps=6, learning_rate=0.02)
    assert again[0] == [5, 6], again[0]
    for got, want in zip(again[1], straight[1]):
        np.testing.assert_array_equal(got, want)
    # a call no earlier attempt made, in a restarted attempt: a new record, past the two
    assert runs.call_slot(out, "L", 0, "another") == 2 and runs.call_slot(out, "L", 1, None) == 1
