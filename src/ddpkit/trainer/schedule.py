"""The step plan of a training run: how many optimizer steps, how many epochs, and the intervals between logs,
evaluations and saves, from plain numbers.

    plan = plan_steps(batches_per_epoch=40, world_size=2, per_device_train_batch_size=8,
                      gradient_accumulation_steps=2, max_steps=-1, num_train_epochs=3,
                      logging_steps=10, eval_steps=0.1, save_steps=500)
    plan.max_steps    # 60: 20 steps an epoch, 3 epochs

batches_per_epoch is the most micro-batches any rank holds in one epoch (the caller agrees on it over the ranks):
every rank takes as many optimizer steps as the fullest one, a rank short of data filling in with zero-weight
batches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch.utils.data

from ddpkit.errors import ArgumentError


class SavedSchedule(NamedTuple):
    """What a checkpoint's trainer_state.json says about the run it was written by."""

    global_step: int
    epoch: float
    max_steps: int
    world_size: int
    asked: tuple[int, float] | None = None  # (max_steps, num_train_epochs) the plan was made from; None: unknown
    train_batch_size: int = 0  # global samples per optimizer step; 0: unknown (the world size stands in)
    steps_per_epoch: int = 0  # 0: unknown

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> SavedSchedule:
        """From trainer_state.json's fields (absent ones take TrainerState's defaults)."""
        asked = state.get("plan_arguments") or {}
        return cls(state.get("global_step", 0), state.get("epoch", 0.0), state.get("max_steps", 0),
                   state.get("world_size", 1),
                   _asked(asked.get("max_steps", -1), asked.get("num_train_epochs", 0)) if asked else None,
                   state.get("train_batch_size", 0), asked.get("steps_per_epoch", 0))


class SavedRest(NamedTuple):
    """Where the checkpoint stands in its epoch, seen from the resuming run: the epoch (counted from 0) and the
    micro-batches of it left to the fullest rank of this run's world (its sampler and loader at the saved
    position)."""

    epoch: int
    batches: int


def _asked(max_steps: int, num_train_epochs: float) -> tuple[int, float]:
    """The arguments a plan is made from, as compared: every max_steps <= 0 means "unset"."""
    return (max_steps if max_steps > 0 else -1, float(num_train_epochs))


class Schedule(NamedTuple):
    """The plan, by its TrainerState field names."""

    max_steps: int
    num_train_epochs: int  # epochs started, the last one maybe in part
    logging_steps: int
    eval_steps: int
    save_steps: int
    train_batch_size: int  # global samples per optimizer step
    plan_arguments: dict[str, Any]  # what it was made from (max_steps, num_train_epochs, steps_per_epoch): SavedSchedule


def interval(value: float, total_steps: int) -> int:
    """An interval in optimizer steps: a value below 1 is that fraction of total_steps (at least 1 step)."""
    return max(1, math.ceil(value * total_steps)) if value < 1 else int(value)


def total_steps(steps_per_epoch: int, max_steps: int, num_train_epochs: float, world_size: int,
                resumed: SavedSchedule | None = None, train_batch_size: int = 0, rest: SavedRest | None = None,
                accumulation: int = 1) -> int:
    """max_steps when it is set (> 0), else the steps num_train_epochs take, given the run resumed from (and
    where it stands in its epoch, `rest`, for a re-plan; accumulation: micro-batches per step)."""
    if max_steps > 0:
        return max_steps
    if resumed is None:
        return math.ceil(num_train_epochs * steps_per_epoch)
    # A step covers as many samples as the saved run's did (the same global batch or, for a state that does not
    # say, the same world size), and an epoch as many steps (dataloader_drop_last drops another tail otherwise).
    same_step = (resumed.train_batch_size == train_batch_size if resumed.train_batch_size and train_batch_size
                 else resumed.world_size == world_size) and resumed.steps_per_epoch in (0, steps_per_epoch)
    if same_step and resumed.max_steps and resumed.asked in (None, _asked(max_steps, num_train_epochs)):
        # The saved total, not one computed again: a run resumed earlier on another world size re-planned it.
        return resumed.max_steps  # the same plan, so the resumed run is the uninterrupted one
    if same_step and resumed.asked is not None and resumed.max_steps == _planned(resumed.asked, steps_per_epoch):
        # Other arguments (more epochs, or epochs where max_steps planned it) on a plan made from the first step
        # with these steps per epoch: planned from the first step again. (Not from the saved epoch fraction,
        # which counts samples: short of a whole epoch inside its last step when dataloader_drop_last drops a tail.)
        return max(resumed.global_step, math.ceil(num_train_epochs * steps_per_epoch))
    # Another step size, or a plan an earlier resume on another world size made: the steps left are re-planned
    # from the epochs left; the learning-rate schedule is stretched or shrunk to the new total. round(): an
    # epoch fraction saved as a float must not turn 10 steps into 11 ((1 - 1/3) * 15 is 10.000000000000002).
    left = max(0.0, num_train_epochs - _epochs_done(resumed))
    by_fraction = math.ceil(round(left * steps_per_epoch, 6))
    if rest is None:
        return resumed.global_step + by_fraction
    # The saved epoch's rest is counted exactly, as this world batches it: its fraction of this world's steps
    # per epoch overcounts a rest smaller than a batch (6 samples left of 26 are one step of 3 ranks x 2, not
    # 0.23 x 5 rounded up to 2, which would train into a fourth epoch of three).
    this_epoch = math.ceil(rest.batches / accumulation)
    after = num_train_epochs - (rest.epoch + 1)  # epochs after the saved one
    if after < 0:  # the plan ends inside the saved epoch: at its fraction, or where its data ends
        return resumed.global_step + min(this_epoch, by_fraction)
    return resumed.global_step + this_epoch + math.ceil(round(after * steps_per_epoch, 6))


def _planned(asked: tuple[int, float], steps_per_epoch: int) -> int:
    """The total a plan from the first step makes of these arguments, with these steps per epoch."""
    return asked[0] if asked[0] > 0 else math.ceil(asked[1] * steps_per_epoch)


def _epochs_done(resumed: SavedSchedule) -> float:
    """The epochs the saved run trained: counted in its steps where they all had its saved steps per epoch (its
    plan was made from the first step with them, and the steps fall in the epoch its fraction is in), else its
    epoch fraction. The fraction counts samples, and with dataloader_drop_last an older ddpkit's never reached a
    whole epoch: 100 samples in batches of 8 on 2 ranks ended each epoch at 0.96, and 2.04 epochs left of 3
    would plan a step of a fourth. (The step that ends an epoch's data now marks it whole: TrainingLoop.epoch.)"""
    per_epoch, fraction = resumed.steps_per_epoch, resumed.epoch
    if not per_epoch or resumed.asked is None or resumed.max_steps != _planned(resumed.asked, per_epoch):
        return fraction
    steps = resumed.global_step / per_epoch
    return steps if math.floor(fraction) <= steps <= math.floor(fraction) + 1 else fraction


def plan_steps(*, batches_per_epoch: int, world_size: int, per_device_train_batch_size: int,
               gradient_accumulation_steps: int, max_steps: int, num_train_epochs: float, logging_steps: float,
               eval_steps: float, save_steps: float, resumed: SavedSchedule | None = None,
               rest: SavedRest | None = None) -> Schedule:
    """The plan of a run (see the module's docstring); resumed: the plan of the checkpoint it resumes from, and
    rest where that checkpoint stands in its epoch (what this world has left of it; None: not known)."""
    # An epoch's last window may hold fewer than gradient_accumulation_steps micro-batches: it is a step too.
    steps_per_epoch = math.ceil(batches_per_epoch / gradient_accumulation_steps)
    if steps_per_epoch == 0:
        raise ValueError("the training data gives no batch on any rank")
    batch = per_device_train_batch_size * world_size * gradient_accumulation_steps
    steps = total_steps(steps_per_epoch, max_steps, num_train_epochs, world_size, resumed, batch, rest,
                        gradient_accumulation_steps)
    return Schedule(max_steps=steps, num_train_epochs=math.ceil(steps / steps_per_epoch),
                    logging_steps=interval(logging_steps, steps), eval_steps=interval(eval_steps, steps),
                    save_steps=interval(save_steps, steps), train_batch_size=batch,
                    plan_arguments={"max_steps": max_steps, "num_train_epochs": num_train_epochs,
                                    "steps_per_epoch": steps_per_epoch})


def schedule_for(args: Any, batches_per_epoch: int, world_size: int, resumed: SavedSchedule | None = None,
             rest: SavedRest | None = None) -> Schedule:
    """plan_steps with the numbers of a TrainingArguments (or anything with those attributes)."""
    plan = plan_steps(batches_per_epoch=batches_per_epoch, world_size=world_size,
                      per_device_train_batch_size=args.per_device_train_batch_size,
                      gradient_accumulation_steps=args.gradient_accumulation_steps, max_steps=args.max_steps,
                      num_train_epochs=args.num_train_epochs, logging_steps=args.logging_steps,
                      eval_steps=args.eval_steps, save_steps=args.save_steps, resumed=resumed, rest=rest)
    if getattr(args, "load_best_model_at_end", False) and args.save_strategy == "steps" and \
            plan.save_steps % plan.eval_steps:
        # Fractions that are multiples (0.6 of 0.3) may round up to steps that are not (5 and 3 of 7 steps).
        raise ArgumentError("load_best_model_at_end", f"needs every checkpoint evaluated, but save_steps "
                            f"{args.save_steps} and eval_steps {args.eval_steps} come to {plan.save_steps} and "
                            f"{plan.eval_steps} of this run's {plan.max_steps} steps; give them in steps")
    return plan


def due(eval_strategy: str, save_strategy: str, moment: str, step: int, eval_steps: int, save_steps: int,
        evaluated: bool = False) -> tuple[bool, bool]:
    """(evaluate, save) at `moment`: "step" (after an optimizer step), "epoch" (after an epoch) or "final" (after
    the last step, when the run would otherwise end unevaluated or unsaved; `evaluated`: this step already was).
    At "final" a save is due only if no checkpoint of `step` exists yet, which the caller checks on rank 0. Under
    save_strategy best none is ever due here: the caller saves after an evaluation that gave a new best."""
    if moment == "step":
        return (eval_strategy == "steps" and step % eval_steps == 0,
                save_strategy == "steps" and step % save_steps == 0)
    if moment == "final":
        return eval_strategy != "no" and not evaluated, save_strategy in ("steps", "epoch")
    return eval_strategy == "epoch", save_strategy == "epoch"


def flow(args: Any, state: Any, moment: str) -> tuple[bool, bool, bool]:
    """(log, evaluate, save): what Transformers' DefaultFlowCallback asks for at a step's end ("step") or an epoch's
    ("epoch"), which the Trainer sets in the control before the callbacks' event, so that they see it and may
    change it. At the last step, under the "steps" strategies, an evaluation and a save too, and (ddpkit's) a log
    under logging_strategy "steps"; eval_delay holds evaluations back (in steps, or epochs under "epoch")."""
    step = state.global_step
    evaluate, save = due(args.eval_strategy, args.save_strategy, moment, step, state.eval_steps, state.save_steps)
    if moment == "epoch":
        return args.logging_strategy == "epoch", evaluate and args.eval_delay <= state.epoch, save
    last = step >= state.max_steps
    log = (step == 1 and args.logging_first_step) or (args.logging_strategy == "steps" and
                                                       (step % state.logging_steps == 0 or last))
    evaluate = (evaluate or (last and args.eval_strategy == "steps")) and args.eval_delay <= step
    return log, evaluate, save or (last and args.save_strategy == "steps")


def epochs_to_train(plan: Schedule, resumed: SavedSchedule | None = None) -> int:
    """The epochs (counted from the first) a run may start: the plan's, as Transformers' Trainer bounds its epoch
    loop, so that an epoch a callback ended early (should_epoch_stop) counts as one, also in a run resumed with
    the same steps per epoch. Resumed on another step size (or from a state that does not say), the run may need
    more: those its steps left take from the saved epoch fraction."""
    steps_per_epoch = plan.plan_arguments.get("steps_per_epoch", 0)
    if resumed is None or steps_per_epoch <= 0 or (resumed.steps_per_epoch == steps_per_epoch and
                                                   resumed.train_batch_size == plan.train_batch_size):
        return plan.num_train_epochs
    left = plan.max_steps - resumed.global_step
    return max(plan.num_train_epochs, math.ceil(round(resumed.epoch + left / steps_per_epoch, 6)))


def check_sized(dataset: Any, role: str) -> None:
    """Fail clearly on a dataset without a length (an IterableDataset, a generator), which the Trainer cannot deal
    out: it gives every rank its own samples, each once, and resumes at the exact next one."""
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)  # (torch's Dataset base has __getitem__)
    if iterable or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(f"the {role} is a {type(dataset).__name__}, without a length or indexing: ddpkit's Trainer "
                        "deals a map-style dataset's samples over the ranks, each once, and resumes at the exact "
                        "next sample. Give it one (a list of the samples, a datasets.Dataset, or a Dataset with "
                        "__len__ and __getitem__); an IterableDataset cannot be dealt so")


def check_train_data(dataset: Any, world_size: int) -> None:
    """Fail clearly when there is no training data, not a map-style dataset, or less than one sample per rank."""
    if dataset is None:
        raise ValueError("Trainer.train needs a train_dataset")
    check_sized(dataset, "train_dataset")
    if len(dataset) < world_size:
        raise ValueError(f"the train_dataset has {len(dataset)} sample(s) but {world_size} processes train on "
                         "it: every rank needs at least one sample of its own. Start fewer processes "
                         "(--nproc-per-node) or use more data")


__all__ = ["check_sized", "check_train_data", "due", "epochs_to_train", "flow", "SavedSchedule", "SavedRest", "Schedule",
           "interval", "schedule_for", "plan_steps", "total_steps"]
