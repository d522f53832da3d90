"""The Trainer: a data-parallel training loop with the Transformers Trainer's surface.

    python examples/train_digits.py --output_dir out                              # one process
    torchrun --nproc_per_node=2 examples/train_digits.py --output_dir out         # two processes, one machine
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_endpoint=host0:29500 train.py   # two nodes

    trainer = Trainer(model, TrainingArguments(output_dir="out"), train_dataset, eval_dataset,
                      compute_metrics=accuracy)
    trainer.train()                       # or train(resume_from_checkpoint=True) for the newest checkpoint
    trainer.evaluate()
    trainer.save_model()

One optimizer step ("window") on every rank: take up to gradient_accumulation_steps micro-batches, agree with one
all-reduce on the global item count and on how many micro-batches each rank holds, run that many forward and
backward passes (all but the last under no_sync; a rank short of data repeats a batch with weight zero, so the
collectives still match and uneven data never hangs), clip, step. The loss is normalised by the global number of
items (labels other than -100, or samples), so N ranks x accumulation equal one process on the whole global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
import random
import struct
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.data import DataLoader, Dataset, default_collate

from . import checkpoint
from .args import ArgumentError, TrainingArguments
from .comm import Comm, init_process_group
from .ddp import DistributedDataParallel
from .env import DistEnv
from .zero_trainer import apply_zero, clip_grad_norm, zero_ddp_kwargs
from .sampler import DistributedSampler

IGNORE_INDEX = -100  # the label value torch's cross_entropy and Transformers models skip
METRICS_FILE = "metrics.jsonl"
LOSS_CURVE_FILE = "loss_curve.png"


class EvalPrediction(NamedTuple):
    """What compute_metrics receives: every evaluation sample once, in dataset order."""

    predictions: np.ndarray
    label_ids: np.ndarray | None


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (every device) in this process."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def get_scheduler(name: str, optimizer: torch.optim.Optimizer, warmup_steps: int,
                  total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The Transformers schedules: a linear warmup from 0, then linear or cosine decay to 0, or constant."""

    def factor(step: int) -> float:
        if name != "constant" and step < warmup_steps:
            return step / max(1, warmup_steps)
        if name in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if name == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # cosine: half a period, 1 -> 0

    if name not in ("linear", "cosine", "constant", "constant_with_warmup"):
        raise ArgumentError("lr_scheduler_type", f"unknown schedule {name!r}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclasses.dataclass
class TrainerState:
    """Progress of a run, saved as trainer_state.json (the Transformers field names)."""

    global_step: int = 0  # optimizer steps taken
    epoch: float = 0.0
    max_steps: int = 0
    num_train_epochs: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int = 0  # global samples per optimizer step
    world_size: int = 1
    log_history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    best_metric: float | None = None
    best_model_checkpoint: str | None = None
    total_flos: float = 0.0
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    should_stop: bool = False  # the ranks agreed to stop early (SIGTERM)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainerState:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


@dataclasses.dataclass
class _Window:
    """What the ranks agreed on for one optimizer step."""

    batches: list[Any]  # this rank's micro-batches (maybe fewer than the others', maybe none)
    items: float  # global items: the loss of the step is their mean
    samples: int  # global samples
    micro_steps: int  # forward/backward passes every rank runs: the most batches any rank holds
    stop: bool = False  # some rank got SIGTERM: every rank stops after this step


class Trainer:
    """Trains `model` on `train_dataset` with `args` on every process of the world the launcher started.

    The model returns a loss (a tensor, a dict with "loss", or an object with `.loss`) that is the mean over the
    items of its batch; override `compute_loss` to compute it otherwise, and `count_items` when that mean is over
    something other than the labels that are not -100 (or the samples, without labels).
    """

    def __init__(self, model: nn.Module, args: TrainingArguments, train_dataset: Dataset | None = None,
                 eval_dataset: Dataset | None = None, data_collator: Callable | None = None,
                 compute_metrics: Callable[[EvalPrediction], dict[str, float]] | None = None,
                 optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None)):
        self.args = args
        self.world: DistEnv = init_process_group(backend=args.ddp_backend, timeout=args.ddp_timeout,
                                                 stall_seconds=args.ddp_stall_seconds)
        self.comm = Comm.for_group()
        self._stop_requested = False  # set by SIGTERM; the ranks agree on it at the next optimizer step
        self._resumed_from: str | None = None  # the checkpoint named in the arguments: never rotated away
        set_seed(args.seed)
        if args.gradient_checkpointing:
            _enable_gradient_checkpointing(model)
        self.model = model.to(self.world.device)
        self.model_wrapped = self._wrap_model(self.model)
        self.model_accepts_loss_kwargs = "num_items_in_batch" in inspect.signature(model.forward).parameters
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.data_collator = data_collator or default_collate
        self.compute_metrics = compute_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.state = TrainerState(world_size=self.world.world_size, is_world_process_zero=self.world.is_main,
                                  is_local_process_zero=self.world.is_local_main)
        self._tb_writer = None
        self._last_batch = None

    # -- setup -----------------------------------------------------------------------------------------------------
    def _wrap_model(self, model: nn.Module) -> nn.Module:
        if self.world.world_size == 1:
            return model
        cuda = self.world.device.type == "cuda"
        return DistributedDataParallel(model, device_ids=[self.world.device.index] if cuda else None,
                                       find_unused_parameters=self.args.find_unused_parameters,
                                       broadcast_buffers=self.args.broadcast_buffers,
                                       bucket_cap_mb=self.args.ddp_bucket_cap_mb,
                                       **zero_ddp_kwargs(self.args.ddp_zero_stage))

    def get_train_sampler(self) -> DistributedSampler:
        return DistributedSampler(self.train_dataset, num_replicas=self.world.world_size, rank=self.world.rank,
                                  shuffle=True, seed=_data_seed(self.args), drop_last=False)

    def get_train_dataloader(self, sampler, epoch: int = 0) -> DataLoader:
        # Its own generator, seeded per epoch: creating an iterator must not draw from the global RNG, or a run
        # resumed mid-epoch (which creates one more iterator) would drift from the uninterrupted one.
        generator = torch.Generator().manual_seed(_data_seed(self.args) + epoch)
        return DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size, sampler=sampler,
                          collate_fn=self.data_collator, num_workers=self.args.dataloader_num_workers,
                          drop_last=self.args.dataloader_drop_last, generator=generator,
                          pin_memory=self.world.device.type == "cuda")

    def create_optimizer(self) -> torch.optim.Optimizer:
        """AdamW; biases and norm weights (every parameter of fewer than 2 dimensions) get no weight decay."""
        if self.optimizer is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": self.args.weight_decay},
                      {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
            stage = self.args.ddp_zero_stage if self.world.world_size > 1 else 0
            self.optimizer = apply_zero([g for g in groups if g["params"]], stage, torch.optim.AdamW,
                                        lr=self.args.learning_rate, eps=self.args.adam_epsilon,
                                        betas=(self.args.adam_beta1, self.args.adam_beta2))
        return self.optimizer

    def create_scheduler(self, total_steps: int) -> Any:
        if self.lr_scheduler is None:
            self.lr_scheduler = get_scheduler(self.args.lr_scheduler_type, self.optimizer,
                                              self.args.warmup_steps_for(total_steps), total_steps)
        return self.lr_scheduler

    def _plan(self, loader: DataLoader, resumed: TrainerState | None) -> None:
        """Fill in max_steps, epochs and the logging/eval/save intervals of self.state."""
        args = self.args
        # Ranks may hold different numbers of batches; every rank takes as many steps as the fullest one.
        batches = torch.tensor([len(loader)], dtype=torch.float64, device=self.world.device)
        self.comm.all_reduce(batches, what="batches per epoch", op=torch.distributed.ReduceOp.MAX)
        steps_per_epoch = math.ceil(int(batches.item()) / args.gradient_accumulation_steps)
        if steps_per_epoch == 0:
            raise ValueError("the training data gives no batch on any rank")
        if args.max_steps > 0:
            max_steps = args.max_steps
        elif resumed is not None and resumed.max_steps and resumed.world_size == self.world.world_size:
            max_steps = resumed.max_steps  # the same plan, so the resumed run is the uninterrupted one
        elif resumed is not None:
            # Another world size: a step covers another number of samples, so the steps left are re-planned from
            # the epochs left (the learning-rate schedule is stretched or shrunk to the new total).
            left = max(0.0, args.num_train_epochs - resumed.epoch)
            max_steps = resumed.global_step + math.ceil(left * steps_per_epoch)
        else:
            max_steps = math.ceil(args.num_train_epochs * steps_per_epoch)
        state = self.state
        state.max_steps = max_steps
        state.num_train_epochs = math.ceil(max_steps / steps_per_epoch)
        state.logging_steps = args.interval("logging_steps", max_steps)
        state.eval_steps = args.interval("eval_steps", max_steps)
        state.save_steps = args.interval("save_steps", max_steps)
        state.train_batch_size = args.train_batch_size(self.world.world_size)

    # -- training --------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train for max_steps (or num_train_epochs); call it on every rank.

        resume_from_checkpoint: a checkpoint folder, or True for the newest in output_dir; None: the args' value.
        """
        if self.train_dataset is None:
            raise ValueError("Trainer.train needs a train_dataset")
        if len(self.train_dataset) < self.world.world_size:
            raise ValueError(f"the train_dataset has {len(self.train_dataset)} sample(s) but {self.world.world_size} "
                             "processes train on it: every rank needs at least one sample of its own. Start fewer "
                             "processes (--nproc-per-node) or use more data")
        resume = self.args.resume_from_checkpoint if resume_from_checkpoint is None else resume_from_checkpoint
        if self.world.restart > 0:
            # Restarted by the launcher (--max-restarts): continue from the newest checkpoint, if there is one,
            # unless the checkpoint asked for is newer (never go back to redo work done since).
            latest = checkpoint.find_latest_checkpoint(self.args.output_dir)
            named = resume if isinstance(resume, str) and os.path.isdir(resume) else None
            if latest is not None and (named is None or checkpoint.checkpoint_step(latest) >
                                       (checkpoint.checkpoint_step(named) or -1)):
                resume = latest
        resume_path = self._resume_path(resume)
        named = self.args.resume_from_checkpoint
        self._resumed_from = named if isinstance(named, str) else None
        sampler = self.get_train_sampler()
        self._plan(self.get_train_dataloader(sampler), _read_state(resume_path) if resume_path else None)
        self.create_optimizer()
        self.create_scheduler(self.state.max_steps)
        sampler_state = self._resume(resume_path) if resume_path else None
        self._open_reporters()
        run = _Run(self.state, self.world, disabled=not self.world.is_main or bool(self.args.disable_tqdm))
        epoch = sampler_state["epoch"] if sampler_state else 0
        with _stop_on_sigterm(self):
            while self.state.global_step < self.state.max_steps:
                resumed = sampler_state if sampler_state is not None and sampler_state["epoch"] == epoch else None
                if not self._train_epoch(sampler, epoch, resumed, run):
                    break  # max_steps reached inside the epoch, or every rank agreed to stop
                epoch += 1
                sampler.set_epoch(epoch)  # a checkpoint written now resumes at the start of the next epoch
                self._maybe_evaluate_and_save(sampler, step_end=False)
            run.bar.close()
            if self.state.should_stop:
                # SIGTERM: one checkpoint at the exact next sample, then a clean return (the script exits 0).
                # Still inside the handler: a second SIGTERM must not kill the save half-way.
                if not self._checkpoint_exists(self.state.global_step):
                    self._save_checkpoint(sampler)
                self._finish_reports()
                return TrainOutput(self.state.global_step, run.loss_sum / max(1, run.clock.steps),
                                   {"stopped": 1.0})
        self._maybe_evaluate_and_save(sampler, step_end=False, final=True)
        metrics = {"train_runtime": run.clock.elapsed(), "train_samples_per_second": run.clock.rate(),
                   "train_steps_per_second": run.clock.steps_rate(),
                   "train_loss": run.loss_sum / max(1, run.clock.steps), "total_flos": 0.0}
        self.log(metrics)
        self._finish_reports()
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _resume(self, path: str) -> dict | None:
        """Load the checkpoint's weights, optimizer, scheduler, progress and RNG; its sampler position."""
        loaded = checkpoint.load_checkpoint(path, model=self.model, optimizer=self.optimizer,
                                            scheduler=self.lr_scheduler, world=self.world)
        self.state.global_step = loaded.trainer_state["global_step"]
        self.state.log_history = loaded.trainer_state.get("log_history", [])
        checkpoint.set_rng_state(loaded.rng_state)  # last: nothing may draw from it before the next step
        return loaded.sampler_state

    def _train_epoch(self, sampler, epoch: int, resumed: dict | None, run: _Run) -> bool:
        """Steps until every rank is out of this epoch's data (True) or max_steps is reached (False)."""
        sampler.set_epoch(epoch)
        sampler.consumed = 0
        if resumed is not None:
            sampler.load_state_dict(resumed)  # the first step after the checkpoint's last sample
        consumed = sampler.consumed
        # A checkpoint taken after the epoch's last step resumes to an empty rest of it: every real sample
        # (consumed >= N) was handed out. The ranks still meet in _next_window, as in the uninterrupted run.
        finished = resumed is not None and consumed >= len(self.train_dataset)
        batches = iter(()) if finished else iter(self.get_train_dataloader(sampler, epoch))
        while self.state.global_step < self.state.max_steps:
            window = self._next_window(batches)
            if window.micro_steps == 0:
                return True  # every rank is out of data
            step_loss, grad_norm = self.training_step(window)
            consumed += window.samples
            sampler.consumed = consumed  # what was trained on, whatever the loader prefetched
            self.state.global_step += 1
            self.state.epoch = epoch + min(1.0, consumed / max(1, len(self.train_dataset)))
            self._after_step(run, step_loss, grad_norm, window.samples)
            self._maybe_check_replicas()
            self._maybe_evaluate_and_save(sampler, step_end=True)  # as the uninterrupted run would, first
            if window.stop:
                self.state.should_stop = True
                return False
        return False

    def _maybe_check_replicas(self) -> None:
        every = self.args.ddp_replica_check_steps
        if every and self.state.global_step % every == 0 and isinstance(self.model_wrapped, DistributedDataParallel):
            self.model_wrapped.check_replicas(f"replica check at step {self.state.global_step}")

    def _after_step(self, run: _Run, step_loss: torch.Tensor, grad_norm: float, samples: int) -> None:
        run.tr_loss += step_loss
        run.clock.tick(samples)
        step = self.state.global_step
        if step % self.state.logging_steps == 0 or step == self.state.max_steps:
            # Each rank holds its share of every step's mean loss: their sum is the global mean, exactly.
            loss = self._sum_over_ranks(run.tr_loss) / (step - run.logged_at)
            run.loss_sum += loss * (step - run.logged_at)
            run.tr_loss.zero_()
            run.logged_at = step
            self.log({"loss": loss, "grad_norm": grad_norm, "learning_rate": self._learning_rate(),
                      "samples_per_second": run.clock.lap()})
        last = self._last_loss()
        shown = "-" if math.isnan(last) else f"{last:.4f}"  # nothing logged yet
        run.bar.set_postfix_str(f"loss={shown} samples/s={run.clock.rate():.0f}", refresh=False)
        run.bar.update(1)

    def _next_window(self, batches: Iterator) -> _Window:
        """Up to gradient_accumulation_steps micro-batches, and what every rank holds, from one all-reduce."""
        taken = []
        for _ in range(self.args.gradient_accumulation_steps):
            try:
                taken.append(next(batches))
            except StopIteration:
                break
        world = self.world.world_size
        # [ranks asked to stop, global items, global samples, batches of rank 0, ..., batches of rank N-1];
        # float64 counts exactly. The stop flag rides along, so agreeing on SIGTERM costs no extra collective.
        counts = torch.zeros(3 + world, dtype=torch.float64, device=self.world.device)
        counts[0] = float(self._stop_requested)
        counts[1] = float(sum(self.count_items(b) for b in taken))
        counts[2] = float(sum(_batch_len(b) for b in taken))
        counts[3 + self.world.rank] = len(taken)
        self.comm.all_reduce(counts, what="items and batches of this optimizer step")
        counts = counts.tolist()
        if taken:
            self._last_batch = taken[-1]
        return _Window(taken, counts[1], int(counts[2]), int(max(counts[3:])), stop=counts[0] > 0)

    def training_step(self, window: _Window) -> tuple[torch.Tensor, float]:
        """One optimizer step over the window; this rank's share of the step's mean loss, and the grad norm."""
        model = self.model_wrapped
        model.train()
        filler = window.batches[-1] if window.batches else self._filler()
        share = torch.zeros((), dtype=torch.float64, device=self.world.device)
        for i in range(window.micro_steps):
            real = i < len(window.batches)
            batch = window.batches[i] if real else filler
            last = i == window.micro_steps - 1
            with contextlib.nullcontext() if last or model is self.model else model.no_sync():
                share += self._micro_step(model, batch, window.items, weight=1.0 if real else 0.0)
        # max_norm=inf measures without clipping (the scale is clamped to 1.0, which leaves the bits unchanged).
        limit = self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")
        grad_norm = clip_grad_norm(self.optimizer, list(self.model.parameters()), limit)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return share, grad_norm

    def _micro_step(self, model: nn.Module, batch: Any, global_items: float, weight: float) -> torch.Tensor:
        inputs = self._prepare_inputs(batch)
        global_items = max(global_items, 1.0)
        with self._autocast():
            if self.model_accepts_loss_kwargs and isinstance(inputs, Mapping):  # the keyword reaches the model
                # The model divides its summed loss by the count we pass: its loss is already its share.
                share = self.compute_loss(model, inputs, num_items_in_batch=torch.tensor(global_items))
            else:
                # A mean over this batch's items times their count is their sum; over the global count it is
                # this batch's share of the step's mean loss, however the items are spread over batches and ranks.
                share = self.compute_loss(model, inputs) * (self.count_items(inputs) / global_items)
        share = share * weight  # 0 for the filler batch of a rank that ran out of data
        # DDP averages gradients over the ranks, but the step's loss is the *sum* of the ranks' shares:
        # multiplying by the world size first turns that average back into the sum.
        (share * self.world.world_size).backward()
        return share.detach().to(torch.float64)

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | None = None):
        """The model's loss on `inputs`: the mean over the batch's items (see count_items)."""
        if num_items_in_batch is not None and isinstance(inputs, Mapping):
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        outputs = _call(model, inputs)
        loss = _loss_of(outputs)
        return (loss, outputs) if return_outputs else loss

    def count_items(self, batch: Any) -> int:
        """How many items the batch's mean loss averages: labels other than -100, or else samples."""
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        if isinstance(labels, torch.Tensor):
            return int((labels != IGNORE_INDEX).sum())
        return _batch_len(batch)

    def _filler(self) -> Any:
        """A batch for a rank that never had one: the first sample of the dataset (weighted zero anyway)."""
        if self._last_batch is None:
            self._last_batch = self.data_collator([self.train_dataset[0]])
        return self._last_batch

    def _prepare_inputs(self, batch: Any) -> Any:
        device = self.world.device
        return tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)

    def _autocast(self):
        if self.args.bf16:
            return torch.autocast(device_type=self.world.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _sum_over_ranks(self, share: torch.Tensor) -> float:
        total = share.clone()
        self.comm.all_reduce(total, what="logged loss")
        return total.item()

    def _learning_rate(self) -> float:
        return self.lr_scheduler.get_last_lr()[0]

    def _last_loss(self) -> float:
        for entry in reversed(self.state.log_history):
            if "loss" in entry:
                return entry["loss"]
        return float("nan")

    # -- evaluation, saving, resuming ------------------------------------------------------------------------------
    def _maybe_evaluate_and_save(self, sampler, step_end: bool, final: bool = False) -> None:
        args, state = self.args, self.state
        step = state.global_step
        if step_end:
            evaluate = args.eval_strategy == "steps" and step % state.eval_steps == 0
            save = args.save_strategy == "steps" and step % state.save_steps == 0
        elif final:
            evaluate = args.eval_strategy != "no" and not self._logged("eval_loss", step)
            save = args.save_strategy != "no" and not self._checkpoint_exists(step)
        else:
            evaluate, save = args.eval_strategy == "epoch", args.save_strategy == "epoch"
        if evaluate and self.eval_dataset is not None:
            self.evaluate()
        if save:
            self._save_checkpoint(sampler)

    def _logged(self, key: str, step: int) -> bool:
        return any(key in e and e.get("step") == step for e in self.state.log_history)

    def _checkpoint_exists(self, step: int) -> bool:
        """Whether checkpoint-<step> is written, as rank 0 sees it: every rank must take the same decision,
        also on nodes that do not share a file system (saving is a collective)."""
        here = os.path.isdir(self._checkpoint_dir(step)) if self.world.is_main else None
        return bool(self.comm.broadcast_object(here, src=0, what=f"checkpoint-{step} exists?"))

    def _checkpoint_dir(self, step: int) -> str:
        return os.path.join(self.args.output_dir, f"{checkpoint.PREFIX}-{step}")

    def _save_checkpoint(self, sampler) -> str:
        return checkpoint.save_checkpoint(
            self.args.output_dir, self.state.global_step, model=self.model, optimizer=self.optimizer,
            scheduler=self.lr_scheduler, trainer_state=self.state.to_dict(), sampler_state=sampler.state_dict(),
            comm=self.comm, world=self.world, save_total_limit=self.args.save_total_limit,
            keep=(self._resumed_from,) if self._resumed_from else ())

    def _resume_path(self, resume: str | bool | None) -> str | None:
        if resume in (None, False):
            return None
        if resume is True or resume in ("true", "True", "latest"):
            path = checkpoint.find_latest_checkpoint(self.args.output_dir)
            if path is None:
                raise ArgumentError("resume_from_checkpoint", f"no checkpoint found in {self.args.output_dir}")
            return path
        return str(resume)

    def evaluate(self, eval_dataset: Dataset | None = None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss (and compute_metrics) over every evaluation sample exactly once; call it on every rank."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer.evaluate needs an eval_dataset")
        start = time.perf_counter()
        # Rank r takes samples r, r+N, r+2N, ...: no padding, so no sample is counted twice.
        mine = list(range(self.world.rank, len(dataset), self.world.world_size))
        # Its own generator: evaluating must not draw from the global RNG that training's dropout uses.
        loader = DataLoader(dataset, batch_size=self.args.per_device_eval_batch_size, sampler=mine,
                            collate_fn=self.data_collator, num_workers=self.args.dataloader_num_workers,
                            generator=torch.Generator().manual_seed(_data_seed(self.args)))
        model = self.model
        was_training = model.training
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.world.device)  # [loss x items, items]
        predictions, labels = [], []
        with torch.no_grad(), self._autocast():
            for batch in loader:
                inputs = self._prepare_inputs(batch)
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
                items = self.count_items(inputs)
                totals += torch.tensor([loss.double().item() * items, items], dtype=torch.float64,
                                       device=totals.device)
                if self.compute_metrics is not None:
                    predictions.append(_logits_of(outputs).float().cpu().numpy())
                    if isinstance(inputs, Mapping) and isinstance(inputs.get("labels"), torch.Tensor):
                        labels.append(inputs["labels"].cpu().numpy())
        model.train(was_training)
        self.comm.all_reduce(totals, what=f"{metric_key_prefix} loss")
        metrics = {f"{metric_key_prefix}_loss": totals[0].item() / max(totals[1].item(), 1.0)}
        if self.compute_metrics is not None:
            metrics.update({f"{metric_key_prefix}_{k}": v for k, v in self._gather_metrics(mine, predictions, labels)
                            .items()})
        runtime = time.perf_counter() - start
        metrics[f"{metric_key_prefix}_runtime"] = runtime
        metrics[f"{metric_key_prefix}_samples_per_second"] = len(dataset) / max(runtime, 1e-9)
        self.log(metrics)
        return metrics

    def _gather_metrics(self, mine: list[int], predictions: list, labels: list) -> dict[str, float]:
        local = (mine, np.concatenate(predictions) if predictions else None,
                 np.concatenate(labels) if labels else None)
        shards = self.comm.all_gather_object(local, what="evaluation predictions")
        order = np.argsort(np.concatenate([np.asarray(s[0], dtype=np.int64) for s in shards]))
        preds = np.concatenate([s[1] for s in shards if s[1] is not None])[order]
        label_ids = np.concatenate([s[2] for s in shards if s[2] is not None])[order] if labels else None
        return {k: float(v) for k, v in self.compute_metrics(EvalPrediction(preds, label_ids)).items()}

    def save_model(self, output_dir: str | None = None) -> None:
        """model.safetensors and training_args.json into output_dir, from rank 0; call it on every rank."""
        output_dir = output_dir or self.args.output_dir
        if self.world.is_main:
            os.makedirs(output_dir, exist_ok=True)
            checkpoint.save_weights(self.model, os.path.join(output_dir, checkpoint.MODEL_FILE))
            checkpoint.write_json(os.path.join(output_dir, "training_args.json"), self.args.to_dict())
        self.comm.barrier("save_model", self.world.device)

    # -- logging -----------------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float]) -> None:
        """Record a log entry (the Transformers log_history format) and, on rank 0, write it everywhere."""
        entry = {**logs, "epoch": round(self.state.epoch, 4), "step": self.state.global_step}
        self.state.log_history.append(entry)
        if not self.world.is_main:
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, METRICS_FILE), "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        if self._tb_writer is not None:
            for key, value in logs.items():
                if isinstance(value, (int, float)):
                    self._tb_writer.add_scalar(key if key.startswith("eval_") else f"train/{key}", value,
                                               self.state.global_step)

    def _open_reporters(self) -> None:
        if not self.world.is_main or "tensorboard" not in self.args.reporters or self._tb_writer is not None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            warnings.warn("report_to asks for tensorboard, which is not installed (pip install tensorboard); "
                          "logging to metrics.jsonl only", RuntimeWarning, stacklevel=3)
            return
        self._tb_writer = SummaryWriter(log_dir=os.path.join(self.args.output_dir, "runs"))

    def _finish_reports(self) -> None:
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
        if self.world.is_main:
            checkpoint.write_json(os.path.join(self.args.output_dir, checkpoint.TRAINER_STATE_FILE),
                                  self.state.to_dict())
            points = [(e["step"], e["loss"]) for e in self.state.log_history if "loss" in e]
            if points:
                write_loss_curve(os.path.join(self.args.output_dir, LOSS_CURVE_FILE), points)


# -- helpers ---------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _stop_on_sigterm(trainer: Trainer) -> Iterator[None]:
    """While training, SIGTERM asks for a stop instead of killing the process; the ranks agree at the next step."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ask(signum, frame):
        trainer._stop_requested = True

    previous = signal.signal(signal.SIGTERM, ask)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _data_seed(args: TrainingArguments) -> int:
    return args.seed if args.data_seed is None else args.data_seed


def _read_state(path: str) -> TrainerState:
    with open(os.path.join(path, checkpoint.TRAINER_STATE_FILE), encoding="utf-8") as f:
        return TrainerState.from_dict(json.load(f))


def _enable_gradient_checkpointing(model: nn.Module) -> None:
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ArgumentError("gradient_checkpointing", f"{type(model).__name__} has no gradient_checkpointing_enable()"
                                                      "; add one (torch.utils.checkpoint) or drop the flag")
    enable()


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)):
        return model(*inputs)
    return model(inputs)


def _loss_of(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        loss = outputs
    elif isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    elif isinstance(outputs, (list, tuple)):
        loss = outputs[0] if outputs else None
    else:
        loss = getattr(outputs, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("the model returned no scalar loss: return a loss tensor, a dict with 'loss' or an object "
                         "with .loss (give it the labels), or override Trainer.compute_loss")
    return loss.reshape(())


def _logits_of(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, Mapping):
        return outputs["logits"]
    if isinstance(outputs, (list, tuple)):
        return outputs[1]
    logits = getattr(outputs, "logits", None)
    if logits is None:
        raise ValueError("compute_metrics needs logits: return them as 'logits' (dict or attribute) or second")
    return logits


def _batch_len(batch: Any) -> int:
    leaves, _ = tree_flatten(batch)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.ndim > 0:
            return leaf.shape[0]
    return 1


class _Clock:
    """Global samples per second: over the whole run (rate) and since the last lap."""

    def __init__(self):
        self.start = self.mark = time.perf_counter()
        self.total = self.since_mark = self.steps = 0

    def tick(self, samples: int) -> None:
        self.total += samples
        self.since_mark += samples
        self.steps += 1

    def rate(self) -> float:
        return self.total / max(self.elapsed(), 1e-9)

    def lap(self) -> float:
        now = time.perf_counter()
        rate = self.since_mark / max(now - self.mark, 1e-9)
        self.mark, self.since_mark = now, 0
        return rate

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def steps_rate(self) -> float:
        return self.steps / max(self.elapsed(), 1e-9)


class _Run:
    """The bookkeeping of one train() call: the loss since the last log, the clock and the progress bar."""

    def __init__(self, state: TrainerState, world: DistEnv, disabled: bool):
        self.tr_loss = torch.zeros((), dtype=torch.float64, device=world.device)
        self.logged_at = state.global_step
        self.loss_sum = 0.0
        self.clock = _Clock()
        self.bar = _progress_bar(state, disabled)


class _NoBar:
    def set_postfix(self, *a, **k): ...
    def set_postfix_str(self, *a, **k): ...
    def update(self, *a, **k): ...
    def close(self): ...


def _progress_bar(state: TrainerState, disabled: bool):
    if disabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=state.max_steps, initial=state.global_step, desc="train", unit="step", dynamic_ncols=True)


# -- the loss curve: a PNG without plotting libraries -----------------------------------------------------------------
# matplotlib would add ~50 MB of dependencies for one picture; a line plot needs only zlib and a tiny font.

_GLYPHS = {  # 3x5 pixels, rows top to bottom
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    "+": "000010111010000", "e": "000111111100111",
}


def write_png(path: str, pixels: np.ndarray) -> None:
    """An RGB uint8 array (height, width, 3) as a PNG file."""
    height, width, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))  # filter type 0 on every row

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits per channel, truecolour
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))


def _text(img: np.ndarray, x: int, y: int, text: str, scale: int = 2) -> None:
    for ch in text:
        glyph = _GLYPHS.get(ch)
        if glyph is not None:
            for i, bit in enumerate(glyph):
                if bit == "1":
                    gy, gx = y + (i // 3) * scale, x + (i % 3) * scale
                    img[max(gy, 0):gy + scale, max(gx, 0):gx + scale] = 0
        x += 4 * scale


def write_loss_curve(path: str, points: list[tuple[int, float]], width: int = 640, height: int = 400) -> None:
    """A line plot of loss against step, with the axis ranges written at the corners."""
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    left, right, top, bottom = 70, width - 20, 20, height - 40
    steps = np.array([p[0] for p in points], dtype=np.float64)
    losses = np.array([p[1] for p in points], dtype=np.float64)
    lo, hi = float(np.nanmin(losses)), float(np.nanmax(losses))
    hi = hi if hi > lo else lo + 1.0
    s0, s1 = float(steps.min()), float(steps.max())
    s1 = s1 if s1 > s0 else s0 + 1.0
    xs = left + (steps - s0) / (s1 - s0) * (right - left)
    ys = bottom - (losses - lo) / (hi - lo) * (bottom - top)
    img[top:bottom + 1, left] = img[bottom, left:right + 1] = (120, 120, 120)  # axes
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for t in np.linspace(0.0, 1.0, n + 1):
            x, y = round(x0 + t * (x1 - x0)), round(y0 + t * (y1 - y0))
            img[max(y - 1, 0):y + 1, max(x - 1, 0):x + 1] = (31, 119, 180)
    if len(xs) == 1:
        img[int(ys[0]) - 2:int(ys[0]) + 3, int(xs[0]) - 2:int(xs[0]) + 3] = (31, 119, 180)
    _text(img, 4, top, f"{hi:.3g}")
    _text(img, 4, bottom - 10, f"{lo:.3g}")
    _text(img, left, bottom + 10, f"{int(s0)}")
    label = f"{int(s1)}"
    _text(img, right - 8 * len(label), bottom + 10, label)
    write_png(path, img)


__all__ = ["EvalPrediction", "TrainOutput", "Trainer", "TrainerState", "get_scheduler", "set_seed",
           "write_loss_curve"]
