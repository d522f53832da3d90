"""The Trainer: a data-parallel training loop with the Transformers Trainer's surface.

    python examples/train_digits.py --output_dir out                              # one process
    torchrun --nproc_per_node=2 examples/train_digits.py --output_dir out         # two processes, one machine
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=host0:29500 train.py  # two nodes

    trainer = Trainer(model, TrainingArguments(output_dir="out"), train_dataset=train, eval_dataset=test,
                      compute_metrics=accuracy)   # Transformers' arguments, in its order
    trainer.train()                       # or train(resume_from_checkpoint=True) for the newest checkpoint
    trainer.evaluate()
    trainer.save_model()

One optimizer step ("window") on every rank: take up to gradient_accumulation_steps micro-batches, agree with one
all-reduce on the global item count and on how many micro-batches each rank holds, run that many forward and
backward passes (all but the last under no_sync; a rank short of data repeats a batch with weight zero, so the
collectives still match and uneven data never hangs), clip, step. The loss is normalised by the global number of
items (labels other than -100, or samples), so N ranks x accumulation equal one process on the whole global batch.

Its parts live beside it in ddpkit.trainer, whose docstring lists them; every collective is a Comm agreement.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ddpkit.args.training_args import TrainingArguments, trainer_arguments
from ddpkit.checkpoint import resume
from ddpkit.checkpoint import run_ids as runs
from ddpkit.checkpoint.rng_state import set_seed
from ddpkit.distributed.comm import Comm, max_over_ranks
from ddpkit.world import init_process_group
from ddpkit.distributed.env import DistEnv
from ddpkit.errors import ArgumentError
from ddpkit.timeline.recorder import attach_timeline
from ddpkit.trainer import eval_gather as evaluation
from ddpkit.trainer import model_io
from ddpkit.trainer import optimizer_step as step
from ddpkit.trainer import optimizers as optim
from ddpkit.trainer.batch_metrics import check_compute_metrics
from ddpkit.trainer.best_model import BestModel
from ddpkit.trainer.callbacks import Agreement, CallbackHandler, TrainerCallback, TrainerControl
from ddpkit.trainer.checkpoints import Saves, saved_processor
from ddpkit.trainer.collator import check_collator, default_collator
from ddpkit.trainer.data_loaders import DataMixin
from ddpkit.trainer.evaluate import EvaluationMixin
from ddpkit.trainer.loop import TrainingLoop, saved_rest
from ddpkit.trainer.loss import LossMixin, check_training_step
from ddpkit.trainer.neftune import noisy_embeddings
from ddpkit.trainer.parallelize import model_from, prepare_model
from ddpkit.trainer.precision import Precision
from ddpkit.trainer.reporting import Progress, Reporter, write_loss_curve
from ddpkit.trainer.results import ResultsMixin
from ddpkit.trainer.running_loss import RunningLoss
from ddpkit.trainer.schedule import SavedSchedule, check_train_data, epochs_to_train, schedule_for
from ddpkit.trainer.state import EvalLoopOutput, EvalPrediction, PredictionOutput, TrainerState, TrainOutput
from ddpkit.trainer.step_batches import StopRequest, StepBatches

get_scheduler = optim.get_scheduler


class Trainer(DataMixin, LossMixin, EvaluationMixin, ResultsMixin):
    """Trains `model` on `train_dataset` with `args` on every process of the world the launcher started.

    The model returns a loss (a tensor, a dict with "loss", or an object with `.loss`) that is the mean over the
    items of its batch; override `compute_loss` to compute it otherwise, and `count_items` when that mean is over
    something other than the labels that are not -100 (or the samples, without labels).
    """

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None,
                 data_collator: Callable | None = None, train_dataset: Dataset | None = None,
                 eval_dataset: Dataset | None = None, processing_class: Any = None,
                 model_init: Callable[..., nn.Module] | None = None, compute_loss_func: Callable | None = None,
                 compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None = None,
                 callbacks: list[TrainerCallback] | None = None,
                 optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
                 optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
                 preprocess_logits_for_metrics: Callable | None = None):
        # Transformers' arguments, in its order (data_collator third); model_init's model: here, after the seed, and
        # anew at every train() call (as Transformers' train() makes it)
        self.args = args = trainer_arguments(args)
        check_collator(data_collator)
        check_training_step(self.training_step)
        self.world: DistEnv = init_process_group(backend=args.ddp_backend, timeout=args.ddp_timeout,
                                                 device_type="cpu" if args.use_cpu else None,
                                                 stall_seconds=args.ddp_stall_seconds)
        self.comm = Comm.for_group()
        # SIGTERM or the first Ctrl-C set it while training; the ranks agree on it at the next window.
        self._stop = StopRequest(announce=self.world.is_main)
        self._loss = RunningLoss(nan_inf_filter=args.logging_nan_inf_filter)
        set_seed(args.seed, args.full_determinism)
        self.timeline = attach_timeline(self.comm, args.ddp_timeline_steps, args.output_dir)  # before DDP: see it
        self.model_init = model_init
        self._take_model(model_from(model, model_init, optimizers))
        self.precision = Precision.for_args(args, self.world.device, self.comm)
        self.current_flos = 0.0  # this rank's floating-point operations since store_flos summed them (total_flos)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        if args.eval_strategy != "no" and eval_dataset is None:  # as Transformers: it would never evaluate
            raise ArgumentError("eval_strategy", f"is {args.eval_strategy!r} but the Trainer got no eval_dataset; "
                                "pass one, or set eval_strategy to 'no'")
        self.data_collator = data_collator or default_collator(processing_class)  # Transformers' rules (collator.py)
        self.processing_class = processing_class  # a tokenizer, say: saved into checkpoints and by save_model
        check_compute_metrics(args.batch_eval_metrics, compute_metrics)
        self.compute_metrics = compute_metrics
        # Transformers': loss = compute_loss_func(outputs, labels, num_items_in_batch=...), the model given no labels;
        # compute_metrics gets preprocess_logits_for_metrics(logits, labels) of each batch instead of its logits.
        self.compute_loss_func, self.preprocess_logits_for_metrics = compute_loss_func, preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optim.given_optimizers(optimizers, args, self.world.world_size,
                                                                   optimizer_cls_and_kwargs)
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs  # what create_optimizer makes, else args.optim
        self._made_scheduler = False  # create_scheduler made lr_scheduler: each train() call makes it anew
        self.state = self._new_state()
        self.reporter = Reporter(args.output_dir, args.reporters, is_main=self.world.is_main)
        self._last_batch = None
        self.best = BestModel.for_args(args)
        self.saves = Saves(args, self.comm, self.world, self.best, saved_processor(processing_class, data_collator))
        self.callback_handler, self.control = CallbackHandler(callbacks), TrainerControl()
        self._agreement = Agreement(self.comm, self.world.device)  # rank 0's control, on every rank (callbacks.py)
        self._fire("on_init_end")

    def _take_model(self, model: nn.Module) -> None:
        """The model to train, made ready (wrap.prepare_model), and what the Trainer reads off it once."""
        args = self.args
        self.model, self.model_wrapped = prepare_model(model, args, self.world)
        self.model_accepts_loss_kwargs = model_io.accepts_loss_kwargs(self.model)  # as Transformers' Trainer
        self.label_smoothing = model_io.smoothing_for(self.model, args.label_smoothing_factor)  # 0: none
        self._loss_shifts_labels = model_io.loss_shifts_labels(self.model)  # its items: labels[..., 1:]
        # What prediction_step takes for labels, and whether a batch without them has a loss (Transformers' rules)
        self.label_names = evaluation.label_names_of(self.model, args.label_names)
        self.can_return_loss = evaluation.can_return_loss(self.model)
        own_count = type(self).floating_point_ops is not Trainer.floating_point_ops  # a subclass's: counted
        self._counts_flos = own_count or step.counts_flos(self.model)  # the same on every rank: store_flos's all-reduce

    # -- callbacks -------------------------------------------------------------------------------------------------
    def add_callback(self, callback: Any) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: Any) -> Any:
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: Any) -> None:
        self.callback_handler.remove_callback(callback)

    def _fire(self, event: str, **kwargs: Any) -> None:
        self.callback_handler.objects = {"model": self.model, "optimizer": self.optimizer,
                                         "lr_scheduler": self.lr_scheduler, "train_dataloader": None,
                                         "eval_dataloader": None, "processing_class": self.processing_class}
        self.control = self.callback_handler.call(event, self.args, self.state, self.control, **kwargs)

    # -- setup -----------------------------------------------------------------------------------------------------
    def create_optimizer(self) -> torch.optim.Optimizer:
        """args.optim, or optimizer_cls_and_kwargs's; biases and norms get no weight decay (Transformers' rule:
        optim.no_decay)."""
        if self.optimizer is None:
            self.optimizer = optim.create_optimizer(self.model, self.args, self.world.world_size,
                                                    self.optimizer_cls_and_kwargs)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Transformers': args.lr_scheduler_type's schedule over num_training_steps, of `optimizer` (default the
        Trainer's), unless the Trainer has one."""
        if self.lr_scheduler is None:
            self.lr_scheduler = get_scheduler(self.args.lr_scheduler_type, optimizer or self.optimizer,
                                              self.args.warmup_steps_for(num_training_steps), num_training_steps,
                                              self.args.lr_scheduler_kwargs)
            self._made_scheduler = True
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """Transformers': create_optimizer, then create_scheduler over num_training_steps."""
        self.create_optimizer()
        self.create_scheduler(num_training_steps)

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        """Transformers': the names of the parameters weight decay applies to (all but biases' and norms')."""
        return optim.decay_parameter_names(model)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: TrainingArguments, model: nn.Module | None = None) -> tuple[type, dict]:
        """Transformers': args.optim's class and keyword arguments (weight decay aside: set per param group)."""
        return optim.optimizer_class(args)

    def _new_state(self) -> TrainerState:
        return TrainerState(world_size=self.world.world_size, is_world_process_zero=self.world.is_main,
                            is_local_process_zero=self.world.is_local_main)

    def _start_afresh(self) -> None:
        """What every train() call starts from, as in Transformers' Trainer: a new TrainerState (step 0, no logs)
        and running loss, no stop asked (an earlier call's Ctrl-C or SIGTERM ended that call), and a new
        learning-rate schedule where the Trainer made the last one (a schedule passed in `optimizers` is the
        caller's); the model's weights and the optimizer, with its state, go on. A resume then replaces them with
        the checkpoint's."""
        self.state, self.current_flos = self._new_state(), 0.0
        self._loss = RunningLoss(nan_inf_filter=self.args.logging_nan_inf_filter)
        # The last steps whose loss was logged and which the schedule evaluated: the same on every rank, where
        # log_history need not be (a subclass's own evaluate may log on rank 0 only, as Transformers' QA trainer).
        self._loss_logged_step = self._evaluated_step = -1
        self._stop.reset()
        if self._made_scheduler:
            self.lr_scheduler, self._made_scheduler = None, False

    def _call_key(self) -> str:
        """What this train() call trains, so that a restarted script that skips a stage it finished before
        continues each call's own run (runs.call_slot): the model, the data's size and the plan's arguments."""
        a = self.args
        return runs.call_key(type(self.model).__name__, sum(p.numel() for p in self.model.parameters()),
                             len(self.train_dataset), a.max_steps, a.num_train_epochs, a.learning_rate,
                             a.per_device_train_batch_size, a.gradient_accumulation_steps, a.lr_scheduler_type, a.seed)

    def _plan(self, loader: DataLoader, resume_path: str | None) -> None:
        """Fill in max_steps, epochs and the logging/eval/save intervals of self.state."""
        # Ranks may hold different numbers of batches; every rank takes as many steps as the fullest one.
        batches = int(max_over_ranks(self.comm, len(loader), "batches per epoch", self.world.device))
        saved = SavedSchedule.from_state(resume.read_trainer_state(resume_path)) if resume_path else None
        rest = saved_rest(self, loader, resume.read_sampler_state(resume_path)) if resume_path else None
        plan = schedule_for(self.args, batches, self.world.world_size, saved, rest)
        for name, value in plan._asdict().items():
            setattr(self.state, name, value)
        self._epochs = epochs_to_train(plan, saved)  # the epochs the loop may start (an early-ended one counts)
        # (Not on a restart: a restarted script's train() call that had finished takes up its last checkpoint.)
        if saved is not None and saved.global_step >= plan.max_steps and self.world.is_main and not self.world.restart:
            warnings.warn(f"the checkpoint is at step {saved.global_step}, where this run's plan ends (max_steps "
                          f"{plan.max_steps}): nothing is left to train. To train on, raise --max_steps or "
                          "--num_train_epochs", RuntimeWarning, stacklevel=4)

    # -- training --------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train for max_steps (or num_train_epochs); call it on every rank.

        resume_from_checkpoint: a checkpoint folder, or True for the newest in output_dir; None: the args' value.
        """
        check_train_data(self.train_dataset, self.world.world_size)
        if self.model_init is not None:  # as Transformers: each call trains a fresh model of model_init's, seeded
            set_seed(self.args.seed, self.args.full_determinism)
            self._take_model(model_from(None, self.model_init))
            self.optimizer, self.lr_scheduler, self._made_scheduler = None, None, False
        lock = resume.claim_output_dir(self.args.output_dir, self.comm, self.world.is_main)
        try:
            with noisy_embeddings(self.model, self.args.neftune_noise_alpha):  # NEFTune: while training only
                output = self._train(resume_from_checkpoint)
            step.wait_for_params(self.optimizer)  # stage 2 leaves the last step's all-gathers in flight: finish them
            return output
        finally:
            self._train_sampler = None  # a later get_train_dataloader() reads a whole epoch, not this run's rest
            lock.release()

    def _train(self, resume_from_checkpoint: str | bool | None) -> TrainOutput:
        self._start_afresh()
        asked = self.args.resume_from_checkpoint if resume_from_checkpoint is None else resume_from_checkpoint
        choice = resume.begin_run(asked, self.args.output_dir, self.world, self.comm, key=self._call_key())
        resume_path = choice.path
        self.saves.start(choice.run)
        self.saves.keep = resume.protected_checkpoints(self.args.resume_from_checkpoint)
        self._train_sampler = sampler = self.get_train_sampler()
        loader = self.get_train_dataloader()  # one for the run, iterated every epoch (TrainingLoop)
        self._plan(loader, resume_path)
        self.create_optimizer()
        self.create_scheduler(self.state.max_steps)
        sampler_state = self._resume(resume_path) if resume_path else None
        if sampler_state is not None:  # now, not at the loop's first epoch: a run that steps no more saves it too
            sampler.load_state_dict(sampler_state)
        self.reporter.open(self.state.log_history, continues=resume_path is not None and choice.behind is None)
        bar = self.reporter.progress_bar(self.state.max_steps, self.state.global_step, bool(self.args.disable_tqdm))
        run = Progress(bar)
        self._agreement.start(self.callback_handler)
        self.control.should_training_stop = False
        self._fire("on_train_begin")
        self._agreement.settle(self.control, "train begin")
        if self.args.eval_on_start:  # as Transformers: after on_train_begin, before the first step
            self.evaluate()
        with self._stop:
            TrainingLoop(self, sampler, loader, run).run(sampler_state)
            run.bar.close()
            if self.state.should_stop:
                # SIGTERM or Ctrl-C: one checkpoint at the exact next sample, then a clean return (exit 0).
                # Still inside the handler: a second SIGTERM must not kill the save half-way. A save this step
                # made already was the stop's, whole (_save_checkpoint): one save, one on_save per step.
                if not self.saves.exists(self.state.global_step):
                    self._save_checkpoint(sampler)
                self._finish_reports()
                train_loss = self._loss.train_loss(self.comm, self.world)  # total_flos: stored by the save
                metrics = {**run.summary(train_loss), "total_flos": self.state.total_flos, "stopped": 1.0}
                return TrainOutput(self.state.global_step, train_loss, metrics)
        self._maybe_evaluate_and_save(sampler, final=True)
        resume.end_run(self.args.output_dir, self.world, choice, self.state.global_step)
        step.wait_for_params(self.optimizer)  # stage 2's last all-gathers: in the logged weights, not over the best
        self.store_flos()
        metrics = {**run.summary(self._loss.train_loss(self.comm, self.world)), "total_flos": self.state.total_flos}
        self.log(metrics)  # before the best is loaded, as in Transformers: on_log sees the weights training left
        self.saves.load_best(self.model, self.state)
        self._finish_reports()
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _resume(self, path: str) -> dict | None:
        """Load the checkpoint's weights, optimizer, scheduler, progress and RNG; its sampler position."""
        resume.check_whole(path)
        trainer_state, sampler_state = resume.restore(path, model=self.model, optimizer=self.optimizer,
                                                      scheduler=self.lr_scheduler, world=self.world,
                                                      scaler=self.precision.scaler, comm=self.comm)
        self.state.resume_from(trainer_state)
        self._loss_logged_step = self.state.last_logged_step("loss")  # the checkpoint's history: every rank's
        self._evaluated_step = self.state.last_logged_step(self._evaluation_key())
        if self.state.best_model_checkpoint:  # renamed aside by a later run's save of its step, perhaps
            self.state.best_model_checkpoint = self.saves.own(self.state.best_model_checkpoint)
        if self.args.restore_callback_states_from_checkpoint:
            self.callback_handler.restore_states(trainer_state.get("stateful_callbacks", {}))
        self._loss = RunningLoss.resumed(trainer_state, self.args.logging_nan_inf_filter)  # as if never interrupted
        return sampler_state

    def _training_window(self, window: StepBatches) -> tuple[torch.Tensor, float]:
        """One optimizer step over the window (training_step on each of its micro-batches); this rank's share of
        the step's mean loss, and the grad norm."""
        filler = window.batches[-1] if window.batches else self._filler()
        self.current_gradient_accumulation_steps = window.micro_steps  # Transformers': this step's micro-batches

        def micro_step(model: nn.Module, batch: Any, weight: float) -> torch.Tensor:
            return self._window_micro_step(model, batch, window.items, weight)

        share = step.accumulate(self.model_wrapped, window, filler, micro_step, self.world.device, self._fire)
        grad_norm = step.optimizer_step(self.optimizer, self.lr_scheduler, list(self.model.parameters()),
                                        self.args.max_grad_norm, self.precision, self._fire)
        if self._counts_flos:  # this rank's own batches: a filler batch (weight zero) trains nothing
            self.current_flos += sum(float(self.floating_point_ops(batch)) for batch in window.batches)
        every = self.args.torch_empty_cache_steps
        if every and (self.state.global_step + 1) % every == 0:  # the step this window makes (as Transformers')
            step.empty_device_cache(self.world.device)
        return share, grad_norm

    def _filler(self) -> Any:
        """A batch for a rank that never had one: the first sample of the dataset (weighted zero anyway)."""
        if self._last_batch is None:
            self._last_batch = self._collate()([self.train_dataset[0]])
        return self._last_batch

    def _prepare_inputs(self, batch: Any) -> Any:
        return model_io.to_device(batch, self.world.device)

    def _learning_rate(self) -> float:
        return self.lr_scheduler.get_last_lr()[0]

    # -- evaluation, saving ----------------------------------------------------------------------------------------
    def _save_checkpoint(self, sampler) -> str:
        self._loss.settle_now(self.comm, self.world, "loss before a checkpoint")
        self._loss.save_into(self.state)
        self.store_flos()
        # The control as Transformers saves it, mid-save: should_save still set (ddpkit clears it before saving)
        saving = dataclasses.replace(self.control, should_save=True)
        self.state.stateful_callbacks = self.callback_handler.export_states(saving)
        # save_only_model: weights and progress, no optimizer; but a stop's checkpoint is only there to resume from
        whole = self.state.should_stop or not self.args.save_only_model
        folder = self.saves.save(self.state, model=self.model, optimizer=self.optimizer if whole else None,
                                 scheduler=self.lr_scheduler if whole else None, sampler_state=sampler.state_dict(),
                                 scaler=self.precision.scaler if whole else None, rng=whole)
        self._fire("on_save")
        return folder

    def save_model(self, output_dir: str | None = None) -> None:
        """The model (a Transformers model's save_pretrained files, else model.safetensors), processing_class (a
        tokenizer's files) and training_args.json into output_dir, from rank 0 (saves.save_model); not a collective:
        call it on every rank or on rank 0 alone, as with Transformers' Trainer."""
        self.saves.save_model(self.model, output_dir or self.args.output_dir, self.args.to_dict())

    # -- logging -----------------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float]) -> None:
        """Record a log entry (the Transformers log_history format) and, on rank 0, write it everywhere. As in
        Transformers, `logs` gains the epoch (so evaluate()'s metrics have it) and on_log gets it so."""
        logs["epoch"] = round(self.state.epoch, 4)
        if self.args.include_num_input_tokens_seen != "no":  # as Transformers: in every log
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        entry = {**logs, "step": self.state.global_step}
        self.state.log_history.append(entry)
        self.reporter.write(entry)
        self._fire("on_log", logs=logs)

    def _finish_reports(self) -> None:
        self._fire("on_train_end")
        self.reporter.close(self.state.log_history)
        self.saves.write_final_state(self.state)


__all__ = ["EvalLoopOutput", "EvalPrediction", "PredictionOutput", "TrainOutput", "Trainer", "TrainerCallback",
           "TrainerControl", "TrainerState", "get_scheduler", "set_seed", "write_loss_curve"]
