"""The step plan: plain numbers in, plain numbers out, no processes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ddpkit.args.training_args import TrainingArguments
from ddpkit.data.sampler import remaining_positions
from ddpkit.trainer.schedule import (
    SavedSchedule,
    SavedRest,
    Schedule,
    epochs_to_train,
    interval,
    schedule_for,
    plan_steps,
    total_steps,
)

BASE = dict(world_size=2, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=-1,
            num_train_epochs=3, logging_steps=10, eval_steps=0.1, save_steps=500)


def test_epochs_make_the_plan_when_max_steps_is_unset():
    # 41 batches on the fullest rank, 2 per step: 20 full windows and a short one, so 21 steps an epoch.
    plan = plan_steps(batches_per_epoch=41, **BASE)
    assert plan == Schedule(max_steps=63, num_train_epochs=3, logging_steps=10, eval_steps=7, save_steps=500,
                            train_batch_size=8 * 2 * 2,
                            plan_arguments={"max_steps": -1, "num_train_epochs": 3, "steps_per_epoch": 21})


def test_max_steps_wins_over_epochs_and_counts_started_epochs():
    plan = plan_steps(batches_per_epoch=40, **{**BASE, "max_steps": 45})
    assert plan.max_steps == 45
    assert plan.num_train_epochs == 3  # 20 steps an epoch: the third one is started, not finished
    assert plan.eval_steps == 5  # a tenth of 45 steps, rounded up


def test_fractional_epochs_round_the_steps_up():
    plan = plan_steps(batches_per_epoch=10, **{**BASE, "num_train_epochs": 1.25, "gradient_accumulation_steps": 1})
    assert plan.max_steps == 13 and plan.num_train_epochs == 2  # ceil(12.5)


def test_a_resumed_run_keeps_its_plan_on_the_same_world_size():
    saved = SavedSchedule(global_step=30, epoch=1.5, max_steps=60, world_size=2)
    # The data changed size since (41 batches): the saved plan still holds, so the run ends where it would have.
    assert plan_steps(batches_per_epoch=41, **BASE, resumed=saved).max_steps == 60


def test_a_resumed_run_on_another_world_size_replans_the_epochs_left():
    # Saved by 2 ranks 1.5 epochs in; now 1 rank holds twice the batches: 40 steps an epoch, 1.5 epochs left.
    saved = SavedSchedule(global_step=30, epoch=1.5, max_steps=60, world_size=2)
    plan = plan_steps(batches_per_epoch=80, **{**BASE, "world_size": 1}, resumed=saved)
    assert plan.max_steps == 30 + 60
    assert plan.train_batch_size == 8 * 1 * 2
    # Past the epochs asked for (epochs were lowered since): nothing is left to do.
    late = SavedSchedule(global_step=70, epoch=3.5, max_steps=70, world_size=4)
    assert plan_steps(batches_per_epoch=80, **{**BASE, "world_size": 1}, resumed=late).max_steps == 70
    # A state without a plan (written before max_steps was saved) is re-planned too.
    unplanned = SavedSchedule(global_step=30, epoch=1.5, max_steps=0, world_size=2)
    assert plan_steps(batches_per_epoch=40, **BASE, resumed=unplanned).max_steps == 30 + 30


def test_the_rest_of_the_saved_epoch_is_counted_as_this_world_batches_it():
    # 26 samples: 2 ranks x 2 take 7 steps an epoch, 3 ranks x 2 take 5. Saved at step 19, 6 samples of epoch 2
    # left: one batch a rank on 3 ranks, one step; then no epoch is left.
    saved = SavedSchedule(global_step=19, epoch=2 + 20 / 26, max_steps=21, world_size=2, asked=(-1, 3.0),
                      train_batch_size=4, steps_per_epoch=7)
    three = {**BASE, "world_size": 3, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
             "num_train_epochs": 3}
    assert plan_steps(batches_per_epoch=5, **three, resumed=saved).max_steps == 21  # by the fraction: 1 too many
    assert plan_steps(batches_per_epoch=5, **three, resumed=saved, rest=SavedRest(2, 1)).max_steps == 20
    # Epochs after the saved one take this world's steps per epoch; micro-batches left make whole steps.
    assert plan_steps(batches_per_epoch=5, **{**three, "num_train_epochs": 5}, resumed=saved,
                      rest=SavedRest(2, 1)).max_steps == 20 + 2 * 5
    assert plan_steps(batches_per_epoch=5, **{**three, "gradient_accumulation_steps": 2}, resumed=saved,
                      rest=SavedRest(2, 3)).max_steps == 19 + 2
    # A plan that ends inside the saved epoch ends at its fraction, or where the epoch's data ends.
    assert plan_steps(batches_per_epoch=5, **{**three, "num_train_epochs": 2.9}, resumed=saved,
                      rest=SavedRest(2, 1)).max_steps == 20
    assert plan_steps(batches_per_epoch=5, **{**three, "num_train_epochs": 2.8}, resumed=saved,
                      rest=SavedRest(2, 4)).max_steps == 19 + 1


def test_a_resumed_run_asking_for_other_epochs_replans_the_epochs_left():
    saved = SavedSchedule(global_step=30, epoch=1.5, max_steps=60, world_size=2, asked=(-1, 3))
    assert plan_steps(batches_per_epoch=40, **BASE, resumed=saved).max_steps == 60  # asked the same: kept
    assert plan_steps(batches_per_epoch=40, **{**BASE, "num_train_epochs": 5}, resumed=saved).max_steps == 30 + 70
    assert plan_steps(batches_per_epoch=40, **{**BASE, "num_train_epochs": 1}, resumed=saved).max_steps == 30
    by_steps = SavedSchedule(global_step=30, epoch=1.5, max_steps=45, world_size=2, asked=(45, 3))
    assert plan_steps(batches_per_epoch=40, **BASE, resumed=by_steps).max_steps == 60  # now by epochs: 3 of them
    # Planned from the first step, not from the saved epoch fraction: with dataloader_drop_last the fraction
    # stops short of a whole epoch (0.96 after the 12 steps of the first), and 1.04 epochs left would be 13.
    dropped = SavedSchedule(global_step=12, epoch=0.96, max_steps=12, world_size=2, asked=(-1, 1))
    assert plan_steps(batches_per_epoch=24, **{**BASE, "num_train_epochs": 2}, resumed=dropped).max_steps == 24
    # Another step size (here another world size): from the fraction left, and an epoch fraction saved as a float
    # (a third of 15 steps; (1 - 1/3) * 15 is 10.000000000000002) must not plan one step too many.
    third = SavedSchedule(global_step=5, epoch=1 / 3, max_steps=30, world_size=4, asked=(-1, 1))
    assert plan_steps(batches_per_epoch=30, **{**BASE, "num_train_epochs": 1}, resumed=third).max_steps == 15
    # The same world size but another global batch (per-device batch or accumulation changed): re-planned too.
    halved = SavedSchedule(global_step=30, epoch=1.5, max_steps=60, world_size=2, asked=(-1, 3), train_batch_size=64)
    assert plan_steps(batches_per_epoch=80, **BASE, resumed=halved).max_steps == 30 + 60  # 1.5 epochs of 40
    assert plan_steps(batches_per_epoch=40, **BASE, resumed=halved._replace(train_batch_size=32)).max_steps == 60
    # The same global batch, but another number of steps an epoch (dataloader_drop_last, with another world size
    # or accumulation: 10 samples as 1 rank x 2 x 2 steps 3 an epoch, as 2 ranks x 2 x 1 steps 2): re-planned
    dropped = SavedSchedule(global_step=3, epoch=1.0, max_steps=9, world_size=1, asked=(-1, 3), train_batch_size=4,
                        steps_per_epoch=3)
    assert total_steps(2, -1, 3, 2, dropped, train_batch_size=4) == 3 + 2 * 2  # 2 epochs of 2 steps left
    assert total_steps(3, -1, 3, 1, dropped, train_batch_size=4) == 9  # the same steps an epoch: kept
    # max_steps 0 and -1 both mean "unset": the same arguments
    assert plan_steps(batches_per_epoch=40, **{**BASE, "max_steps": 0}, resumed=saved).max_steps == 60


def _drop_last_epoch(n: int, ranks: int, batch: int, accumulation: int, consumed: int = 0) -> tuple[int, int]:
    """(steps, samples) of what is left of an epoch of n samples after `consumed`, as the Trainer takes it with
    dataloader_drop_last: the sampler pads to a multiple of the ranks, each rank's DataLoader drops its short
    batch, and an epoch's last window may be short (a step too)."""
    batches = remaining_positions(n, ranks, consumed) // ranks // batch
    return math.ceil(batches / accumulation), batches * batch * ranks


@pytest.mark.parametrize("step", [6, 9])  # the end of epoch 0 (its 96 samples of 100), 3 steps into epoch 1
@pytest.mark.parametrize("ranks, accumulation", [(3, 1), (2, 2)])  # resumed on 3 ranks, or accumulating 2
def test_a_run_with_dropped_tails_resumed_with_another_step_size_ends_with_the_epochs_asked(step, ranks,
                                                                                           accumulation):
    # 100 samples, batch 8 on 2 ranks: 50 a rank, 6 batches (2 samples a rank dropped), 6 steps an epoch of 96
    # samples; the loop's epoch fraction (consumed / 100) ends each epoch at 0.96, never at a whole epoch.
    n, epochs = 100, 3
    per_epoch, samples = _drop_last_epoch(n, 2, 8, 1)
    done, rest = divmod(step, per_epoch)
    consumed = rest * 16
    saved = SavedSchedule(global_step=step, epoch=done - 1 + samples / n if not rest else done + consumed / n,
                      max_steps=epochs * per_epoch, world_size=2, asked=(-1, epochs), train_batch_size=16,
                      steps_per_epoch=per_epoch)
    # Resumed with another step size and the same epochs asked, the run ends where the epochs end: the rest of
    # the saved epoch, then the whole epochs left, at the new step size (3 ranks: 4 steps an epoch; 2: 3).
    new_per_epoch = _drop_last_epoch(n, ranks, 8, accumulation)[0]
    rest_steps = _drop_last_epoch(n, ranks, 8, accumulation, consumed)[0] if rest else 0
    due = step + rest_steps + (epochs - 1 - done if rest else epochs - done) * new_per_epoch
    plan = plan_steps(batches_per_epoch=new_per_epoch * accumulation, **{**BASE, "world_size": ranks,
                      "gradient_accumulation_steps": accumulation}, resumed=saved)
    assert plan.max_steps == due, (plan.max_steps, due)
    assert (step, ranks, accumulation, due) in {(6, 3, 1, 14), (6, 2, 2, 12), (9, 3, 1, 15), (9, 2, 2, 14)}


def test_the_epochs_done_are_the_saved_fraction_where_the_saved_steps_do_not_count_them():
    # The end of epoch 0 as above (6 steps of 100 samples, 0.96), resumed on 3 ranks (4 steps an epoch).
    saved = SavedSchedule(global_step=6, epoch=0.96, max_steps=18, world_size=2, asked=(-1, 3), train_batch_size=16,
                      steps_per_epoch=6)
    assert total_steps(4, -1, 3, 3, saved, train_batch_size=24) == 6 + 8  # 6 steps of 6: one epoch done
    # Its steps per epoch unknown (an older checkpoint), its total one an earlier resume re-planned (steps of
    # another size before), or its steps past the epoch of its fraction: the fraction, 2.04 epochs of 4 steps.
    for other in (saved._replace(steps_per_epoch=0), saved._replace(max_steps=15), saved._replace(global_step=12)):
        assert total_steps(4, -1, 3, 3, other, train_batch_size=24) == other.global_step + 9, other


def test_max_steps_wins_over_a_resumed_plan():
    saved = SavedSchedule(global_step=30, epoch=1.5, max_steps=60, world_size=2)
    assert plan_steps(batches_per_epoch=40, **{**BASE, "max_steps": 100}, resumed=saved).max_steps == 100


def test_the_epochs_to_train_are_the_plans_or_what_a_resume_on_another_step_size_needs():
    def plan(max_steps, epochs, steps_per_epoch, batch=8):
        return Schedule(max_steps, epochs, 1, 1, 1, batch, {"steps_per_epoch": steps_per_epoch})

    def saved(step, epoch, steps_per_epoch, batch=8):
        return SavedSchedule(step, epoch, 15, 2, None, batch, steps_per_epoch)

    assert epochs_to_train(plan(15, 3, 5)) == 3  # a fresh run: the plan's
    # resumed with the same step size after an epoch ended early (at step 1: epoch 1.4 at step 4): still the
    # plan's 3, as the uninterrupted run (which ends its third epoch early at step 7), not the 4 its steps left fill
    assert epochs_to_train(plan(15, 3, 5), saved(4, 1.4, 5)) == 3
    # 2 ranks (10 steps an epoch) resumed at step 25 (epoch 2.5) on 1 (20 steps, the global batch halved): 35 steps
    # plan 2 epochs, but the third epoch's second half is still to train
    assert epochs_to_train(plan(35, 2, 20, batch=4), saved(25, 2.5, 10)) == 3
    assert epochs_to_train(plan(35, 2, 20), saved(25, 2.5, 0)) == 3  # a state that does not say its step size
    assert epochs_to_train(plan(15, 3, 0)) == 3  # a plan without steps per epoch


def test_no_batch_on_any_rank_is_an_error():
    with pytest.raises(ValueError, match="no batch on any rank"):
        plan_steps(batches_per_epoch=0, **BASE)


def test_saved_plan_reads_trainer_state_with_its_defaults():
    assert SavedSchedule.from_state({"global_step": 4, "epoch": 0.5, "max_steps": 9, "world_size": 2,
                                 "log_history": []}) == SavedSchedule(4, 0.5, 9, 2)
    assert SavedSchedule.from_state({"global_step": 4}) == SavedSchedule(4, 0.0, 0, 1)
    assert SavedSchedule.from_state({"plan_arguments": {"max_steps": 0, "num_train_epochs": 2.5}}).asked == (-1, 2.5)


def test_plan_for_reads_the_training_arguments(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=3,
                             num_train_epochs=2, logging_steps=0.25, eval_steps=7, save_steps=0.5)
    plan = schedule_for(args, batches_per_epoch=31, world_size=2)
    # ceil(31 / 3) = 11 steps an epoch, 22 in all; a quarter is 5.5 -> 6, a half 11.
    assert plan == Schedule(max_steps=22, num_train_epochs=2, logging_steps=6, eval_steps=7, save_steps=11,
                            train_batch_size=4 * 2 * 3,
                            plan_arguments={"max_steps": -1, "num_train_epochs": 2, "steps_per_epoch": 11})


@given(value=st.one_of(st.floats(min_value=1e-6, max_value=0.999), st.integers(min_value=1, max_value=10**6)),
       total=st.integers(min_value=1, max_value=10**6))
def test_interval_is_the_arguments_interval_and_stays_within_the_run(value, total):
    steps = interval(value, total)
    assert steps >= 1 and isinstance(steps, int)
    if value < 1:
        assert steps <= total and steps >= value * total  # a fraction of the run, rounded up
    else:
        assert steps == value
    args = TrainingArguments(output_dir="unused-plan-test", logging_steps=value)
    assert args.interval("logging_steps", total) == steps


@given(batches=st.integers(min_value=1, max_value=10**5), accumulation=st.integers(min_value=1, max_value=64),
       epochs=st.floats(min_value=0.01, max_value=50), world=st.integers(min_value=1, max_value=64))
def test_the_planned_epochs_cover_the_planned_steps(batches, accumulation, epochs, world):
    steps_per_epoch = math.ceil(batches / accumulation)
    steps = total_steps(steps_per_epoch, max_steps=-1, num_train_epochs=epochs, world_size=world)
    plan = plan_steps(batches_per_epoch=batches, world_size=world, per_device_train_batch_size=1,
                      gradient_accumulation_steps=accumulation, max_steps=-1, num_train_epochs=epochs,
                      logging_steps=1, eval_steps=1, save_steps=1)
    assert plan.max_steps == steps >= epochs * steps_per_epoch
    assert (plan.num_train_epochs - 1) * steps_per_epoch < plan.max_steps <= plan.num_train_epochs * steps_per_epoch


def test_evaluation_and_saving_are_due_by_strategy_and_moment():
    from ddpkit.trainer.schedule import due

    assert due("steps", "steps", "step", 10, eval_steps=5, save_steps=4) == (True, False)
    assert due("steps", "steps", "step", 12, eval_steps=5, save_steps=4) == (False, True)
    assert due("epoch", "epoch", "step", 10, eval_steps=5, save_steps=5) == (False, False)
    assert due("epoch", "no", "epoch", 7, eval_steps=5, save_steps=5) == (True, False)
    # the end of a run: evaluate unless this step already was; save unless saving is off
    assert due("steps", "steps", "final", 7, eval_steps=5, save_steps=5) == (True, True)
    assert due("steps", "no", "final", 7, eval_steps=5, save_steps=5, evaluated=True) == (False, False)
    assert due("no", "epoch", "final", 7, eval_steps=5, save_steps=5) == (False, True)


def test_train_data_must_give_every_rank_a_sample():
    import pytest

    from ddpkit.trainer.schedule import check_train_data

    check_train_data([1, 2], world_size=2)
    with pytest.raises(ValueError, match="needs a train_dataset"):
        check_train_data(None, world_size=1)
    with pytest.raises(ValueError, match="1 sample.* 2 processes"):
        check_train_data([1], world_size=2)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(TypeError, match="train_dataset is a Stream, without a length or indexing: ddpkit's Trainer"):
        check_train_data(Stream(), world_size=1)

    class SizedStream(Stream):  # a length, and torch's Dataset's __getitem__: still not dealt out
        def __len__(self):
            return 4

    with pytest.raises(TypeError, match="train_dataset is a SizedStream"):
        check_train_data(SizedStream(), world_size=1)


def test_fractional_eval_and_save_steps_that_round_apart_are_refused_for_the_best_model(tmp_path):
    """0.6 is a multiple of 0.3, but of 7 steps they come to 5 and 3: checkpoint-5 had no evaluation."""
    from ddpkit.args.training_args import TrainingArguments
    from ddpkit.errors import ArgumentError
    from ddpkit.trainer.schedule import schedule_for

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=7, load_best_model_at_end=True,
                             eval_strategy="steps", eval_steps=0.3, save_steps=0.6)
    with pytest.raises(ArgumentError, match="come to 5 and 3 of this run's 7 steps"):
        schedule_for(args, batches_per_epoch=10, world_size=1)
    args.max_steps = 10  # 6 and 3: every checkpoint evaluated
    assert (schedule_for(args, batches_per_epoch=10, world_size=1).save_steps, args.eval_steps) == (6, 0.3)
