"""The order of a training run: epochs, the steps within them, and what follows each step (the callbacks' events,
the logged loss, the replica check, scheduled evaluations and saves, a stop).

    TrainingLoop(trainer, sampler, loader, progress).run(sampler_state)   # inside Trainer.train, under its stop handler

It is the Trainer's own loop, split from it: it reads and writes the trainer's state, and leaves how each thing is
done (training_step, evaluate, saving, log) to the trainer, whose methods a subclass may override.

A step ends in this order on every rank alike: on_step_end, then the control the callbacks set is taken from rank
0 (callbacks.Agreement), then the loss is logged when due or asked (and, when it was, the control on_log left is
taken from rank 0 again), then evaluation and save when due or asked, then the loop stops when a rank was
signalled (window.stop) or a callback asked (should_training_stop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ddpkit.distributed.comm import max_over_ranks
from ddpkit.timeline.recorder import DATA_WAIT
from ddpkit.trainer import model_io
from ddpkit.trainer.parallelize import ddp_of
from ddpkit.trainer.reporting import Progress
from ddpkit.trainer.schedule import SavedRest, flow
from ddpkit.trainer.step_batches import StepBatches, agree_on_window, take_batches

if TYPE_CHECKING:
    from ddpkit.trainer.trainer import Trainer


class TrainingLoop:
    def __init__(self, trainer: Trainer, sampler: Any, loader: Any, progress: Progress):
        """sampler: the run's train sampler; loader: the run's get_train_dataloader(), iterated every epoch."""
        self.trainer, self.sampler, self.loader, self.progress = trainer, sampler, loader, progress

    def run(self, sampler_state: dict | None) -> None:
        """Epochs until max_steps, the plan's epochs (one a callback ended early counts, as in Transformers), a stop
        every rank agreed on, or a callback's should_training_stop. Every epoch but one a signal stopped ends with
        on_epoch_end and what the epoch strategy schedules, the last one too."""
        t = self.trainer
        epoch = sampler_state["epoch"] if sampler_state else 0
        while t.state.global_step < t.state.max_steps and epoch < t._epochs and not t.control.should_training_stop:
            resumed = sampler_state if sampler_state is not None and sampler_state["epoch"] == epoch else None
            t.control.should_epoch_stop = False
            t._fire("on_epoch_begin")
            ended = self.epoch(epoch, resumed)
            if t.state.should_stop:
                break  # SIGTERM or Ctrl-C: the epoch goes on when the stop's checkpoint is resumed
            if ended:
                epoch += 1
                self.sampler.set_epoch(epoch)  # a checkpoint written now resumes at the start of the next epoch
            self.set_flow("epoch")
            t._fire("on_epoch_end")
            t._agreement.settle(t.control, "epoch end")
            # logging_strategy "epoch" (or a callback's should_log): the loss since the last log, before the
            # epoch's evaluation, as Transformers logs, evaluates and saves; never twice for one step.
            # The last step's grad_norm and learning rate (state.last_step_log: a resumed run's is its checkpoint's)
            if t.control.should_log and t.state.last_step_log and t._loss_logged_step != t.state.global_step:
                self.log_loss(*t.state.last_step_log)
            t.control.should_log = False
            t._maybe_evaluate_and_save(self.sampler)
            if not ended:
                break  # max_steps reached inside the epoch, or a callback stopped training

    def epoch(self, epoch: int, resumed: dict | None) -> bool:
        """Steps until every rank is out of this epoch's data or a callback ends the epoch (True), or until
        max_steps is reached or training stops (False)."""
        t, sampler = self.trainer, self.sampler
        sampler.set_epoch(epoch)
        sampler.consumed = 0
        if resumed is not None:
            sampler.load_state_dict(resumed)  # the first step after the checkpoint's last sample
        consumed = sampler.consumed
        # A checkpoint taken after the epoch's last step resumes to an empty rest of it: every real sample
        # (consumed >= N) was handed out. The ranks still meet in next_window, as in the uninterrupted run.
        finished = resumed is not None and consumed >= len(t.train_dataset)
        loader = None if finished else self.loader
        if loader is not None:
            t.begin_epoch(loader, epoch)
        batches = iter(()) if loader is None else iter(loader)
        # dataloader_drop_last ends the epoch's data short of its last samples: the step that takes the fullest
        # rank's last batch marks the epoch's end in `consumed`, so that its checkpoint resumes to an empty rest on
        # any world size (on fewer ranks the dropped tail would make one more batch, which this run never trains).
        left = None
        if t.args.dataloader_drop_last:
            left = int(max_over_ranks(t.comm, 0 if loader is None else len(loader), "batches of this epoch",
                                      t.world.device))
        while t.state.global_step < t.state.max_steps:
            t.control.should_save = t.control.should_evaluate = t.control.should_log = False
            window = self.next_window(batches)
            if window.micro_steps == 0:
                return True  # every rank is out of data
            t._fire("on_step_begin")  # as Transformers: once the step's data is in (none: no step, no event)
            learning_rate = t._learning_rate()  # the rate this step uses: Transformers logs it, not the next one
            step_loss, grad_norm = t._training_window(window)
            consumed += window.samples
            if left is not None:
                left -= window.micro_steps
                consumed = max(consumed, len(t.train_dataset)) if left <= 0 else consumed
            sampler.consumed = consumed  # what was trained on, whatever the loader prefetched
            t.state.global_step += 1
            t.state.num_input_tokens_seen += window.tokens
            t.state.epoch = epoch + min(1.0, consumed / max(1, len(t.train_dataset)))
            self.set_flow("step")
            t._fire("on_step_end")
            t._agreement.settle(t.control, f"step {t.state.global_step}")
            self.after_step(step_loss, grad_norm, window.samples, learning_rate)
            t.state.should_stop = window.stop  # a scheduled save of this step is the stop's: it says so
            t._maybe_evaluate_and_save(sampler)  # as the uninterrupted run would, first
            if window.stop or t.control.should_training_stop:
                return False
            if t.control.should_epoch_stop:
                return True
        return False

    def set_flow(self, moment: str) -> None:
        """Transformers' DefaultFlowCallback, before the callbacks' on_step_end or on_epoch_end: the log,
        evaluation and save the schedule asks for (plan.flow), and after the last step should_training_stop, set
        in the control, where the callbacks see them and may change them; the Trainer acts on the control."""
        t = self.trainer
        log, evaluate, save = flow(t.args, t.state, moment)
        control = t.control
        control.should_log, control.should_evaluate = control.should_log or log, control.should_evaluate or evaluate
        control.should_save = control.should_save or save
        if moment == "step" and t.state.global_step >= t.state.max_steps:
            control.should_training_stop = True

    def next_window(self, batches: Any) -> StepBatches:
        """The next window of this rank's micro-batches, agreed with the other ranks (one all-reduce)."""
        t = self.trainer
        taken = t.timeline.timed(DATA_WAIT, "data", take_batches, batches, t.args.gradient_accumulation_steps)
        if taken:
            t._last_batch = taken[-1]
        window = agree_on_window(t.comm, t.world, taken, items=sum(t.count_items(b) for b in taken),
                                 samples=sum(model_io.batch_len(b) for b in taken), stop=t._stop.requested,
                                 loss=t._loss.carried(), tokens=sum(t._count_tokens(b) for b in taken))
        t._loss.settle(window.previous_loss)
        return window

    def log_loss(self, grad_norm: float, learning_rate: float) -> None:
        """Log the mean loss since the last log (summed over the ranks), with the last step's norm and rate."""
        t = self.trainer
        t._loss.settle_now(t.comm, t.world, "logged loss")
        t._loss_logged_step = t.state.global_step
        t.log({"loss": t._loss.take_log(), "grad_norm": grad_norm, "learning_rate": learning_rate,
               "samples_per_second": self.progress.clock.lap()})
        t._agreement.settle(t.control, f"the log of step {t.state.global_step}")  # what on_log asked is rank 0's too

    def after_step(self, step_loss: torch.Tensor, grad_norm: float, samples: int, learning_rate: float) -> None:
        """The progress bar, the logged loss (when due, or asked by a callback) and the replica check."""
        t, run = self.trainer, self.progress
        run.step(samples)
        t._loss.step(step_loss)  # this rank's share; summed over the ranks with the next window
        step = t.state.global_step
        logging = t.control.should_log  # the schedule's (set_flow) or a callback's, rank 0's
        t.control.should_log = False
        t.state.last_step_log = [grad_norm, learning_rate]
        if logging:
            self.log_loss(grad_norm, learning_rate)
        run.show(t.state.last_logged("loss"), logged=logging)
        every = t.args.ddp_replica_check_steps
        ddp = ddp_of(t.model_wrapped)  # torch_compile: the wrapper inside the compiled module
        if every and step % every == 0 and ddp is not None:
            ddp.check_replicas(f"replica check at step {step}")


def saved_rest(trainer: Trainer, loader: Any, sampler_state: dict | None) -> SavedRest | None:
    """Where a checkpoint stands in its epoch, as this run's world batches what is left of it (for the plan): the
    run's loader, its sampler moved to the saved position (as the loop moves it). None when the checkpoint does
    not say, or the sampler cannot resume. Call it on every rank (one collective)."""
    t, sampler = trainer, getattr(loader, "sampler", None)
    if sampler_state is None or not hasattr(sampler, "load_state_dict"):
        return None
    sampler.set_epoch(sampler_state["epoch"])
    sampler.load_state_dict(sampler_state)
    # A checkpoint taken after the epoch's last step resumes to an empty rest of it (TrainingLoop.epoch).
    finished = sampler_state["consumed"] >= len(t.train_dataset)
    left = 0 if finished else len(loader)
    return SavedRest(int(sampler_state["epoch"]),
                     int(max_over_ranks(t.comm, left, "batches left of the saved epoch", t.world.device)))


__all__ = ["TrainingLoop", "saved_rest"]
