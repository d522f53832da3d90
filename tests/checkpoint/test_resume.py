"""Resuming: the policy on checkpoint folders (which one a run resumes from, which rotation must keep), and Trainer
runs resumed on the same world size (bitwise) and on another one (every sample once, every epoch covered)."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ddpkit.checkpoint import integrity
from ddpkit.checkpoint import run_ids as runs
from ddpkit.checkpoint.files import write_json
from ddpkit.checkpoint.resume import choose_checkpoint, protected_checkpoints, read_trainer_state
from ddpkit.errors import ArgumentError, CheckpointError
from ddpkit.trainer.trainer import Trainer
from helpers.models import Classifier, classification_data, params_of, trainer_args
from helpers.world import run_world


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


# -- Trainer runs resumed -------------------------------------------------------------------------------------------
class Recorder(Trainer):
    """Notes (step about to be taken, epoch, sample ids) for every training micro-batch."""

    seen: list

    def get_train_sampler(self):
        self.seen = []
        self.sampler = super().get_train_sampler()
        return self.sampler

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            self.seen.append((self.state.global_step + 1, self.sampler.epoch, inputs["idx"].tolist()))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _resumable_run(out_dir, resume=None, max_steps=8, n=26, save_steps=3, logging_steps=1):
    torch.manual_seed(0)
    model = Classifier().double()  # dropout on: the restored RNG must give the same masks
    args = trainer_args(out_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=max_steps,
                 save_strategy="steps", save_steps=save_steps, lr_scheduler_type="cosine", warmup_steps=2,
                 logging_steps=logging_steps)
    trainer = Recorder(model, args, train_dataset=classification_data(n))
    train_loss = trainer.train(resume_from_checkpoint=resume).training_loss
    logs = [(e["step"], e["loss"], e["grad_norm"], e["learning_rate"]) for e in trainer.state.log_history
            if "loss" in e]
    return logs, params_of(model), trainer.seen, train_loss


def _mean_loss(logs):
    """The mean of logged step losses (logging_steps=1), added in step order as the Trainer adds them."""
    return sum(loss for _, loss, _, _ in logs) / len(logs)


def test_a_checkpoint_renamed_by_hand_resumes_when_named(tmp_path, local_world):
    full = _resumable_run(str(tmp_path / "full"), max_steps=6)
    os.rename(tmp_path / "full" / "checkpoint-3", tmp_path / "best_run")  # mv out/checkpoint-3 best_run
    logs, params, seen, _ = _resumable_run(str(tmp_path / "again"), resume=str(tmp_path / "best_run"), max_steps=6)
    assert min(step for step, _, _ in seen) == 4 and logs == full[0], "not resumed at step 3, or not bitwise"
    assert all(np.array_equal(a, b) for a, b in zip(params, full[1]))


def test_a_checkpoint_that_does_not_say_where_its_data_stood_is_refused(tmp_path, local_world):
    """A folder without sampler_state.json (a Transformers Trainer's checkpoint, or one copied in part, its marker
    not yet there either) would restart the epoch at sample 0 at its step: refused, naming the file."""
    _resumable_run(str(tmp_path / "full"), max_steps=3)
    folder = tmp_path / "full" / "checkpoint-3"
    for name in (integrity.MARKER_FILE, "sampler_state.json"):
        os.remove(folder / name)
    with pytest.raises(CheckpointError, match="has no sampler_state.json"):
        _resumable_run(str(tmp_path / "again"), resume=str(folder), max_steps=6)


def resume_same_world(world, out):
    full = _resumable_run(f"{out}/full")
    from3 = _resumable_run(f"{out}/from3", resume=f"{out}/full/checkpoint-3")  # mid epoch 0
    from6 = _resumable_run(f"{out}/from6", resume=f"{out}/full/checkpoint-6")  # mid epoch 1
    newest = _resumable_run(f"{out}/full", resume=True, max_steps=10)  # True: the newest, checkpoint-8
    # Logs every 4 steps, checkpoints at 3 and 6: each resume starts between two logs, and its first logged loss
    # must still cover the 4 steps the uninterrupted run's covers.
    sparse = [_resumable_run(f"{out}/sparse", logging_steps=4)]
    sparse += [_resumable_run(f"{out}/sparse{k}", resume=f"{out}/sparse/checkpoint-{k}", logging_steps=4)
               for k in (3, 6)]
    # Resumed where max_steps ends: no step runs, and the save it makes must carry the data position on.
    done = _resumable_run(f"{out}/done", resume=f"{out}/full/checkpoint-6", max_steps=6)
    positions = [(json.loads(open(f"{out}/{run}/checkpoint-6/sampler_state.json").read()),
                  json.loads(open(f"{out}/{run}/checkpoint-6/trainer_state.json").read())["epoch"])
                 for run in ("full", "done")]
    return full, from3, from6, newest, sorted(os.listdir(f"{out}/full/checkpoint-3")), sparse, positions, done[3]


def test_resume_with_the_same_world_size_is_bitwise(tmp_path):
    results = run_world(resume_same_world, 2, args=(str(tmp_path),), deadline_s=150)
    for full, from3, from6, newest, files, sparse, positions, done_loss in results:
        assert positions[0] == positions[1] and positions[0][0]["consumed"] > 0, positions
        assert [entry[0] for entry in sparse[0][0]] == [4, 8]
        for resumed in sparse[1:]:
            assert resumed[0] == sparse[0][0], "a resumed run logged another loss than the uninterrupted one"
            assert resumed[3] == sparse[0][3], "train_loss: the mean over the resumed steps only?"
        logs, params, _, train_loss = full
        assert [entry[0] for entry in logs] == list(range(1, 9))
        assert train_loss == _mean_loss(logs)
        for resumed in (from3, from6):
            assert resumed[0] == logs  # loss, grad norm and learning rate of every step, bit for bit
            assert resumed[3] == train_loss, "train_loss: the mean over the resumed steps only?"
            for x, y in zip(resumed[1], params):
                np.testing.assert_array_equal(x, y)
        assert newest[0][:8] == logs and [entry[0] for entry in newest[0][8:]] == [9, 10]
        assert newest[3] == _mean_loss(newest[0])  # steps 1-8 from the checkpoint, 9 and 10 trained
        assert done_loss == _mean_loss(logs[:6])  # no step trained: the checkpoint's 6
        assert {seen[0] for seen in newest[2]} == {9, 10}
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "sampler_state.json", "trainer_state.json",
                "ddpkit_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= set(files)
    # The checkpoints the resumes above went on from load in Transformers too (ddpkit's fields are beside them).
    import transformers

    saved = transformers.TrainerState.load_from_json(str(tmp_path / "full" / "checkpoint-6" / "trainer_state.json"))
    assert saved.global_step == 6 and saved.train_batch_size == 2  # per device; ddpkit's is 2 ranks x 2 x 2
    assert [(e["step"], e["loss"], e["grad_norm"], e["learning_rate"]) for e in saved.log_history] == logs[:6]
    assert read_trainer_state(str(tmp_path / "full" / "checkpoint-6"))["train_batch_size"] == 8


def _as_before(folder):
    """Checkpoint `folder` as the ddpkit before ddpkit_state.json wrote it: every field in trainer_state.json (the
    global batch as train_batch_size, none of the Transformers fields it did not have), its marker remade."""
    with open(folder / "trainer_state.json") as f:
        state = json.load(f)
    with open(folder / "ddpkit_state.json") as f:
        state.update(json.load(f))
    for name in ("num_input_tokens_seen", "is_hyper_param_search", "trial_name", "trial_params"):
        del state[name]
    write_json(str(folder / "trainer_state.json"), state)
    os.remove(folder / "ddpkit_state.json")
    marker = integrity.read_marker(str(folder))
    names = [n for n in os.listdir(folder) if n != integrity.MARKER_FILE]
    sums = {n: integrity.file_crc32(str(folder / n)) for n in names}
    write_json(str(folder / integrity.MARKER_FILE), {**integrity.manifest(str(folder), names, marker["step"], sums),
                                                     "run": marker["run"]})
    return state


def test_a_checkpoint_of_the_previous_format_resumes_as_before(tmp_path, local_world):
    """A checkpoint with no ddpkit_state.json (ddpkit's fields in trainer_state.json) resumes bitwise as the
    uninterrupted run: the loss since the last log (checkpoint-3 falls between the logs at 4 and 8), train_loss,
    and the global batch the step plan compares."""
    full = _resumable_run(str(tmp_path / "full"), logging_steps=4)
    old = _as_before(tmp_path / "full" / "checkpoint-3")
    assert old["steps_since_last_log"] == 3 and old["train_batch_size"] == 4
    assert read_trainer_state(str(tmp_path / "full" / "checkpoint-3")) == old
    logs, params, seen, train_loss = _resumable_run(str(tmp_path / "again"), resume=str(tmp_path / "full" /
                                                                                     "checkpoint-3"), logging_steps=4)
    assert min(step for step, _, _ in seen) == 4 and [entry[0] for entry in logs] == [4, 8]
    assert (logs, train_loss) == (full[0], full[3])
    assert all(np.array_equal(a, b) for a, b in zip(params, full[1]))


def resume_across_worlds(world, out, resume, max_steps):
    logs, _, seen, train_loss = _resumable_run(f"{out}/w{world.world_size}", resume=resume, max_steps=max_steps,
                                               n=24, save_steps=2)
    return seen, logs, train_loss


def _ids(seen, epoch, before=None, after=None):
    return [i for step, e, ids in seen if e == epoch and (before is None or step < before)
            and (after is None or step > after) for i in ids]


def test_resume_with_another_world_size_skips_and_repeats_nothing(tmp_path):
    out = str(tmp_path)
    # 24 samples; 2 ranks x batch 2 x accumulation 2 = 8 per step (3 steps an epoch), 1 rank: 4 (6 an epoch).
    two = run_world(resume_across_worlds, 2, args=(out, None, 12), deadline_s=120)
    (one,) = run_world(resume_across_worlds, 1, args=(out, f"{out}/w2/checkpoint-4", 12), deadline_s=120)
    again = run_world(resume_across_worlds, 2, args=(out, f"{out}/w1/checkpoint-10", 12), deadline_s=120)
    with open(f"{out}/w2/checkpoint-4/sampler_state.json") as f:
        assert json.load(f)["epoch"] == 1  # checkpoint-4 is one step into epoch 1: 8 of its samples done
    with open(f"{out}/w1/checkpoint-10/sampler_state.json") as f:
        assert json.load(f)["epoch"] == 2  # 4 steps of 4 finish epoch 1, 2 more are 8 samples into epoch 2
    # train_loss is the mean over the run's 12 steps, those trained on the other world size included: each run's
    # log_history holds every step's loss, the checkpoint's steps with it.
    for rank in (*two, one, *again):
        logs, train_loss = rank[1], rank[2]
        assert [entry[0] for entry in logs] == list(range(1, 13))
        assert train_loss == pytest.approx(_mean_loss(logs), rel=1e-12), "train_loss of the resumed steps only?"
    assert one[1][:4] == two[0][1][:4] and again[0][1][:10] == one[1][:10]
    seen_two = [entry for rank in two for entry in rank[0]]
    seen_again = [entry for rank in again for entry in rank[0]]
    one = one[0]
    epoch1 = _ids(seen_two, 1, before=5) + _ids(one, 1)
    epoch2 = _ids(one, 2, before=11) + _ids(seen_again, 2)
    assert sorted(epoch1) == list(range(24)), "epoch 1 across 2 -> 1 ranks"
    assert sorted(epoch2) == list(range(24)), "epoch 2 across 1 -> 2 ranks"
    assert {step for step, _, _ in one} == set(range(5, 13))
    assert {step for step, _, _ in seen_again} == {11, 12}
    assert len(_ids(seen_again, 2)) == 16 and not _ids(seen_again, 3)


def epochs_across_worlds(world, out, resume):
    torch.manual_seed(0)
    args = trainer_args(f"{out}/w{world.world_size}", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                 num_train_epochs=2, save_strategy="steps", save_steps=2)
    trainer = Recorder(Classifier().double(), args, train_dataset=classification_data(24))
    trainer.train(resume_from_checkpoint=resume)
    return trainer.seen, trainer.state.global_step


def test_training_by_epochs_resumed_on_another_world_size_covers_every_epoch(tmp_path):
    """2 ranks x 2 x 2 = 8 samples a step (6 steps for 2 epochs of 24); resumed on 1 rank (4 a step) after
    step 2, the run must still cover the rest of both epochs: 32 more samples, not the 4 steps the first
    plan had left."""
    out = str(tmp_path)
    two = run_world(epochs_across_worlds, 2, args=(out, None), deadline_s=120)
    assert two[0][1] == 6
    ((seen, last_step),) = run_world(epochs_across_worlds, 1, args=(out, f"{out}/w2/checkpoint-2"), deadline_s=120)
    assert last_step == 10
    first_part = [i for rank in two for step, epoch, ids in rank[0] if step <= 2 for i in ids]
    epoch0 = [i for step, epoch, ids in seen if epoch == 0 for i in ids] + first_part
    epoch1 = [i for step, epoch, ids in seen if epoch == 1 for i in ids]
    assert sorted(epoch0) == list(range(24)) and sorted(epoch1) == list(range(24))


def dropped_tails_across_worlds(world, out, resume):
    torch.manual_seed(0)
    args = trainer_args(f"{out}/w{world.world_size}", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        num_train_epochs=2, save_strategy="epoch", dataloader_drop_last=True)
    trainer = Recorder(Classifier().double(), args, train_dataset=classification_data(22))
    trainer.train(resume_from_checkpoint=resume)
    return trainer.seen, trainer.state.global_step


def test_dropped_tails_resumed_on_another_world_size_end_with_the_epochs_asked(tmp_path):
    """22 samples, 2 ranks x 2 x 2 with dataloader_drop_last: 5 batches a rank (a sample each dropped), 3 steps an
    epoch, whose fraction ends at 20/22. Resumed after epoch 0 on 1 rank (11 batches, 6 steps an epoch), the run
    ends with epoch 1 at step 9, not a step into a third epoch (2 - 20/22 epochs left would be 7 steps)."""
    out = str(tmp_path)
    two = run_world(dropped_tails_across_worlds, 2, args=(out, None), deadline_s=120)
    assert two[0][1] == 6
    ((seen, last_step),) = run_world(dropped_tails_across_worlds, 1, args=(out, f"{out}/w2/checkpoint-3"),
                                     deadline_s=120)
    assert last_step == 9 and {epoch for _, epoch, _ in seen} == {1}, (last_step, seen)
    assert sorted(i for _, _, ids in seen for i in ids) == list(range(22))


def small_rest_across_worlds(world, out, resume):
    torch.manual_seed(0)
    args = trainer_args(f"{out}/w{world.world_size}", per_device_train_batch_size=2, num_train_epochs=3,
                        save_strategy="steps", save_steps=19)
    trainer = Recorder(Classifier().double(), args, train_dataset=classification_data(26))
    trainer.train(resume_from_checkpoint=resume)
    return trainer.seen, trainer.state.global_step, trainer.state.epoch


def test_a_rest_of_an_epoch_smaller_than_a_step_is_one_step_on_another_world_size(tmp_path):
    """26 samples, 2 ranks x 2: 7 steps an epoch, 21 for 3 epochs; checkpoint-19 leaves 6 samples of epoch 2,
    one step of 3 ranks x 2. The run ends there, at step 20 and epoch 3.0: its epoch fraction (0.23 of 5 steps,
    rounded up to 2) would have trained a step into a fourth epoch."""
    out = str(tmp_path)
    two = run_world(small_rest_across_worlds, 2, args=(out, None), deadline_s=120)
    assert two[0][1:] == (21, 3.0)
    three = run_world(small_rest_across_worlds, 3, args=(out, f"{out}/w2/checkpoint-19"), deadline_s=120)
    assert [rank[1:] for rank in three] == [(20, 3.0)] * 3
    assert {(step, epoch) for rank in three for step, epoch, _ in rank[0]} == {(20, 2)}
    first = [i for rank in two for step, epoch, ids in rank[0] if epoch == 2 and step <= 19 for i in ids]
    assert sorted(first + [i for rank in three for _, _, ids in rank[0] for i in ids]) == list(range(26))


def tail_dropped_at_a_save(world, out, resume):
    torch.manual_seed(0)
    args = trainer_args(f"{out}/w{world.world_size}", per_device_train_batch_size=4, num_train_epochs=2,
                        save_strategy="steps", save_steps=3, dataloader_drop_last=True)
    trainer = Recorder(Classifier().double(), args, train_dataset=classification_data(40))
    trainer.train(resume_from_checkpoint=resume)
    return trainer.seen, trainer.state.global_step, trainer.state.epoch


def test_a_save_at_the_end_of_an_epoch_with_a_dropped_tail_resumes_at_the_next_epoch(tmp_path):
    """40 samples on 3 ranks x 4 with dataloader_drop_last: 3 steps an epoch train 36, 4 are dropped. Resumed on 1
    rank from checkpoint-3 (the epoch's last step), the dropped 4 made one more batch of epoch 0, which the
    uninterrupted run never trains: the step that takes the last batch now marks the epoch's end."""
    out = str(tmp_path)
    three = run_world(tail_dropped_at_a_save, 3, args=(out, None), deadline_s=120)
    assert three[0][1:] == (6, 2.0)
    ((seen, last_step, epoch),) = run_world(tail_dropped_at_a_save, 1, args=(out, f"{out}/w3/checkpoint-3"),
                                            deadline_s=120)
    assert {e for _, e, _ in seen} == {1} and (last_step, epoch) == (3 + 10, 2.0), (last_step, epoch, seen)


def more_epochs(world, out):
    """One epoch, then the same run resumed asking for two (its second epoch must be trained, not skipped), then
    resumed again asking for two: nothing is left, and rank 0 says so."""
    def launch(epochs, resume=None):
        torch.manual_seed(0)
        args = trainer_args(out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                            num_train_epochs=epochs, save_strategy="epoch")
        trainer = Recorder(Classifier().double(), args, train_dataset=classification_data(24))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train(resume_from_checkpoint=resume)
        return ([step for step, _, _ in trainer.seen], trainer.state.global_step,
                [str(w.message) for w in caught if "nothing is left to train" in str(w.message)])

    return launch(1), launch(2, resume=True), launch(2, resume=True)


def test_a_resume_asking_for_more_epochs_trains_them(tmp_path):
    for rank, (first, second, third) in enumerate(run_world(more_epochs, 2, args=(str(tmp_path),), deadline_s=120)):
        assert first[1] == 3 and sorted(set(first[0])) == [1, 2, 3]  # 24 samples, 8 a step: 3 steps an epoch
        assert sorted(set(second[0])) == [4, 5, 6] and second[1] == 6, second
        assert third[0] == [] and third[1] == 6
        assert len(third[2]) == (1 if rank == 0 else 0), third[2]  # the warning, on rank 0 only
        assert not first[2] and not second[2]


def restarted_with_a_named_checkpoint(world, out):
    """The launcher restarted the job (TORCHELASTIC_RESTART_COUNT=1) whose arguments name an older checkpoint:
    it must continue from the newest one, not redo the steps since, and rotation must have kept the named one."""
    torch.manual_seed(0)
    args = trainer_args(f"{out}/run", per_device_train_batch_size=2, max_steps=8, save_strategy="steps", save_steps=2,
                 save_total_limit=1, resume_from_checkpoint=f"{out}/run/checkpoint-2")
    trainer = Recorder(Classifier().double(), args, train_dataset=classification_data(24))
    trainer.train()
    return trainer.seen, trainer.world.restart


def first_run(world, out):
    args = trainer_args(f"{out}/first", per_device_train_batch_size=2, max_steps=2, save_strategy="steps", save_steps=2)
    Trainer(Classifier().double(), args, train_dataset=classification_data(24)).train()


def test_a_restart_continues_from_the_newest_checkpoint(tmp_path):
    import shutil

    out = str(tmp_path)
    run_world(first_run, 2, args=(out,), deadline_s=120)
    # The first attempt of the job, resumed from run/checkpoint-2, got to checkpoint-6 before failing.
    os.makedirs(f"{out}/run")
    for step in (2, 6):
        shutil.copytree(f"{out}/first/checkpoint-2", f"{out}/run/checkpoint-{step}")
        with open(f"{out}/run/checkpoint-{step}/trainer_state.json") as f:
            state = json.load(f)
        state["global_step"] = step
        with open(f"{out}/run/checkpoint-{step}/trainer_state.json", "w") as f:
            json.dump(state, f)
        folder = f"{out}/run/checkpoint-{step}"  # a forged checkpoint needs a marker that matches its files
        names = [n for n in os.listdir(folder) if n != integrity.MARKER_FILE]
        write_json(os.path.join(folder, integrity.MARKER_FILE), {**integrity.manifest(folder, names, step),
                                                                 "run": "job"})
    runs.mark_current(f"{out}/run", "job", f"{out}/run/checkpoint-2")  # as the first attempt recorded its run
    results = run_world(restarted_with_a_named_checkpoint, 2, args=(out,), deadline_s=120,
                        env={"TORCHELASTIC_RESTART_COUNT": "1"})
    for seen, restart in results:
        assert restart == 1
        assert min(step for step, _, _ in seen) == 7, "the restart went back before the newest checkpoint"
    # save_total_limit=1 rotated the others away, but never the checkpoint the arguments name
    kept = sorted(name for name in os.listdir(f"{out}/run") if name.startswith("checkpoint-"))
    assert kept == ["checkpoint-2", "checkpoint-8"], kept
