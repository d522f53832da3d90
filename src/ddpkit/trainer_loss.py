"""What one micro-batch computes for the Trainer: its loss (the model's, compute_loss_func's or a label-smoothed one),
its share of the step's mean loss, the items and tokens it counts, and its floating-point operations.

A mixin of ddpkit.trainer.Trainer, whose state it reads: args, world, comm, model, precision, label_smoothing,
model_accepts_loss_kwargs, compute_loss_func, processing_class, _loss_shifts_labels, _counts_flos, current_flos.
Transformers' rule for the count: a model that takes num_items_in_batch (or a loss computed here) divides a sum by
the global count it is given; any other returns a mean over its batch, which is scaled by the batch's share of the
global count. Either way N ranks x accumulation equal one process on the whole global batch.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from . import model_io, step
from .comm import sum_over_ranks


class LossMixin:
    _filler_weight: float = 1.0  # 0 while train() runs a filler batch (a rank out of data) through training_step

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """Transformers': one micro-batch's forward and backward (train() calls it on each batch of a step, the
        gradients reduced over the ranks on the last); a subclass may override it, calling super() or running a
        loss and its backward of its own. Returns the loss detached, scaled as Transformers' is: this rank's share
        of the step's mean loss times the world size, so that the mean over the ranks of what a step's calls
        return, summed, is the step's loss (which train() logs). num_items_in_batch: the items the step's loss
        averages, over every rank and micro-batch (train() passes it); None: this batch's on every rank."""
        model.train()
        world_size = self.world.world_size
        items = self.count_items(inputs)  # on the batch as it came (the CPU's): no device sync per micro-step
        global_items = items * world_size if num_items_in_batch is None else float(num_items_in_batch)
        share = self._micro_step(model, self._prepare_inputs(inputs), items, global_items, self._filler_weight)
        return share * world_size

    def _window_micro_step(self, model: nn.Module, batch: Any, global_items: float, weight: float) -> torch.Tensor:
        """training_step on one batch of a step's window: its share of the step's mean loss (float64). weight 0: a
        filler batch, which trains nothing under ddpkit's training_step (an override that computes its own loss
        trains it, as Transformers' even batches train a duplicate)."""
        self._filler_weight = weight
        try:
            returned = self.training_step(model, batch, torch.tensor(int(global_items)))
        finally:
            self._filler_weight = 1.0
        if not isinstance(returned, torch.Tensor):
            raise TypeError(f"training_step returned {type(returned).__name__}: it returns the micro-batch's loss as "
                            "a tensor (loss.detach()), as in Transformers")
        return returned.detach().to(torch.float64) / self.world.world_size

    def _micro_step(self, model: nn.Module, inputs: Any, items: int, global_items: float,
                    weight: float) -> torch.Tensor:
        global_items = max(global_items, 1.0)
        with self.precision.autocast(), self.compute_loss_context_manager():
            if self._divides_by_count() and model_io.labels_of(inputs) is not None:  # as Transformers
                # The model (or compute_loss_func) divides its summed loss by the count we pass: already its share.
                share = self.compute_loss(model, inputs,
                                          num_items_in_batch=torch.tensor(global_items, device=self.world.device))
            else:
                # A mean over this batch's items times their count is their sum; over the global count it is
                # this batch's share of the step's mean loss, however the items are spread over batches and ranks.
                share = self.compute_loss(model, inputs) * (items / global_items)
        share = share * weight  # 0 for the filler batch of a rank that ran out of data
        # DDP averages gradients over the ranks, but the step's loss is the *sum* of the ranks' shares:
        # multiplying by the world size first turns that average back into the sum.
        self.precision.backward(share * self.world.world_size)
        return share.detach().to(torch.float64)

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> Any:
        """Transformers 5's: nothing, as the autocast (bf16, fp16) is the Trainer's own, around compute_loss
        (Transformers' is accelerate's, around the model's forward); a subclass may return a context of its own."""
        return contextlib.nullcontext()

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """Transformers': an ExitStack of the contexts compute_loss runs under, in training and in prediction_step:
        the Trainer's autocast (entered again inside the one training and prediction_step hold, so that a subclass's
        own prediction_step that calls the model under this context gets it too, as accelerate's wrapped forward
        gives it there) and autocast_smart_context_manager's, if any; a subclass extends it as there:
        `stack = super().compute_loss_context_manager(); stack.enter_context(mine); return stack`."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.precision.autocast())
        own = self.autocast_smart_context_manager()
        if not isinstance(own, contextlib.nullcontext):
            stack.enter_context(own)
        return stack

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | None = None):
        """The model's loss on `inputs`: the mean over the batch's items (see count_items), or, _loss_of_its_own,
        its own of the outputs of the model called without the labels (num_items_in_batch: the count it divides a
        sum by, where the model, compute_loss_func or smoothing takes one)."""
        labels, smoothing = None, self.label_smoothing
        if self._loss_of_its_own() and isinstance(inputs, Mapping) and "labels" in inputs:
            inputs = dict(inputs)
            labels = inputs.pop("labels")
        if num_items_in_batch is not None and isinstance(inputs, Mapping) and self.model_accepts_loss_kwargs:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        outputs = model_io.call_model(model, inputs)
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif labels is not None:  # label_smoothing_factor
            loss = model_io.smoothed_loss(outputs, labels, smoothing, model_io.is_causal_lm(self.model),
                                          num_items_in_batch)
        else:
            loss = model_io.loss_of(outputs)
        return (loss, outputs) if return_outputs else loss

    def _divides_by_count(self) -> bool:
        """Whether compute_loss's loss is a sum over the num_items_in_batch it is given (the model's, or its own)."""
        return self.model_accepts_loss_kwargs or self._loss_of_its_own()

    def _loss_of_its_own(self) -> bool:
        """Whether compute_loss computes the loss itself (compute_loss_func, label smoothing), from the outputs."""
        return self.compute_loss_func is not None or self.label_smoothing > 0

    def _count_tokens(self, batch: Any) -> int:
        return model_io.count_tokens(batch, self.model, self.args.include_num_input_tokens_seen,
                                     getattr(self.processing_class, "pad_token_id", None))

    def count_items(self, batch: Any) -> int:
        """How many items the batch's mean loss averages: labels other than -100 (shifted for a causal LM, as
        Transformers counts them; see model_io.count_items), or else samples."""
        return model_io.count_items(batch, shifted=self._loss_shifts_labels)

    def floating_point_ops(self, inputs: Any) -> int:
        """The floating-point operations of one forward and backward on `inputs`, Transformers' estimate (see
        step.floating_point_ops); override it for another (a subclass that does is always counted)."""
        return step.floating_point_ops(self.model, inputs)

    def store_flos(self) -> None:
        """Add every rank's operations since the last call to state.total_flos; on every rank alike (one
        all-reduce, none where nothing is counted), before a checkpoint's trainer_state.json and the final log."""
        if self._counts_flos:
            self.state.total_flos += sum_over_ranks(self.comm, [self.current_flos], "total_flos", self.world.device)[0]
        self.current_flos = 0.0


def check_training_step(training_step: Any) -> None:
    """A training_step override must take Transformers' (model, inputs, num_items_in_batch=None): refused at once
    otherwise (one of ddpkit's earlier signature, the step's window of micro-batches, would fail at the first step)."""
    try:
        taken = inspect.signature(training_step).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_POSITIONAL for p in taken):
        return
    if sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in taken) < 2:
        raise TypeError(f"training_step{inspect.signature(training_step)}: the Trainer calls training_step(model, "
                        "inputs, num_items_in_batch) on each micro-batch, as Transformers does; override it with "
                        "that signature (calling super().training_step(model, inputs, num_items_in_batch)), or use a "
                        "callback's on_step_begin / on_step_end for what happens once per optimizer step")


__all__ = ["LossMixin", "check_training_step"]
