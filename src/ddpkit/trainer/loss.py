"""What one micro-batch computes for the Trainer: its loss (the model's, compute_loss_func's or a label-smoothed one),
its share of the step's mean loss, the items and tokens it counts, and its floating-point operations.

A mixin of ddpkit.trainer.trainer.Trainer, whose state it reads: args, world, comm, model, precision, label_smoothing,
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

from ddpkit.distributed.comm import sum_over_ranks
from ddpkit.trainer import model_io
from ddpkit.trainer import optimizer_step as step


class LossMixin:
    _filler_weight: float = 1.0  # 0 while train() runs a filler batch (a rank out of data) through training_step
    _counts_every_rank = False  # while training: num_items_in_batch counts every rank's items (compute_loss)
    _scaled_by_world = False  # compute_loss multiplied its loss by the world size (_micro_step)

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """Transformers': one micro-batch's forward and backward (train() calls it on each batch of a step, the
        gradients reduced over the ranks on the last); a subclass may override it, calling super() or running a
        loss and its backward of its own. Returns the loss detached, scaled as Transformers' is: this rank's share
        of the step's mean loss times the world size, so that the mean over the ranks of what a step's calls
        return, summed, is the step's loss (which train() logs). num_items_in_batch: the items the step's loss
        averages, over every rank and micro-batch (train() passes it); None: this batch's on every rank."""
        model.train()
        items = self.count_items(inputs)  # on the batch as it came (the CPU's): no device sync per micro-step
        if num_items_in_batch is None:
            num_items_in_batch = items * self.world.world_size
        with self._counting_every_rank():
            return self._micro_step(model, self._prepare_inputs(inputs), items, float(num_items_in_batch),
                                    self._filler_weight)

    def _window_micro_step(self, model: nn.Module, batch: Any, global_items: float, weight: float) -> torch.Tensor:
        """training_step on one batch of a step's window: its share of the step's mean loss (float64). weight 0: a
        filler batch, which trains nothing under ddpkit's training_step (an override that computes its own loss
        trains it, as Transformers' even batches train a duplicate)."""
        self._filler_weight = weight
        count = torch.tensor(int(global_items) if float(global_items).is_integer() else global_items)
        try:
            with self._counting_every_rank():
                returned = self.training_step(model, batch, count)
        finally:
            self._filler_weight = 1.0
        if not isinstance(returned, torch.Tensor):
            raise TypeError(f"training_step returned {type(returned).__name__}: it returns the micro-batch's loss as "
                            "a tensor (loss.detach()), as in Transformers")
        return returned.detach().to(torch.float64) / self.world.world_size

    @contextlib.contextmanager
    def _counting_every_rank(self):
        before, self._counts_every_rank = self._counts_every_rank, True
        try:
            yield
        finally:
            self._counts_every_rank = before

    def _micro_step(self, model: nn.Module, inputs: Any, items: int, global_items: float,
                    weight: float) -> torch.Tensor:
        """Backpropagate this batch's share of the step's mean loss times the world size (DDP averages the ranks'
        gradients, but the step's loss is the sum of the ranks' shares: the factor turns that average back into
        the sum); return it detached."""
        global_items = max(global_items, 1.0)
        with self.precision.autocast(), self.compute_loss_context_manager():
            if self._divides_by_count() and model_io.labels_of(inputs) is not None:  # as Transformers
                # The model (or compute_loss_func) divides its summed loss by the count we pass, and compute_loss
                # multiplies it by the world size, as Transformers' does; an override's own compute_loss that
                # does not (which Transformers would train at 1/world size) gets the factor here.
                self._scaled_by_world = False
                loss = self.compute_loss(model, inputs,
                                         num_items_in_batch=torch.tensor(global_items, device=self.world.device))
                loss = loss if self._scaled_by_world else loss * self.world.world_size
            else:
                # A mean over this batch's items times their count is their sum; over the global count it is
                # this batch's share of the step's mean loss, however the items are spread over batches and ranks.
                loss = self.compute_loss(model, inputs) * (items / global_items) * self.world.world_size
        loss = loss * weight  # 0 for the filler batch of a rank that ran out of data
        self.precision.backward(loss)
        return loss.detach()  # in the loss's dtype, as Transformers' (the step's accounting is float64)

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
        sum by, where the model, compute_loss_func or smoothing takes one). In training, where that count is every
        rank's, such a loss is multiplied by the world size, as Transformers' (average_tokens_across_devices)."""
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
        if num_items_in_batch is not None and self._counts_every_rank and self._divides_by_count():
            # Transformers' average_tokens_across_devices: a sum over every rank's count, times the world size, so
            # that DDP's average of the ranks' gradients is the step's. (Evaluation counts this batch's items.)
            loss = loss * self.world.world_size
            self._scaled_by_world = True  # (for _micro_step)
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
    """A training_step override must take Transformers' (model, inputs, num_items_in_batch), as train() passes them:
    refused at once otherwise (Transformers' signature before 4.46, (model, inputs), or ddpkit's earlier one, the
    step's window of micro-batches, would fail at the first step)."""
    try:
        signature = inspect.signature(training_step)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None, None)
    except TypeError as error:
        raise TypeError(f"training_step{signature}: the Trainer calls training_step(model, inputs, "
                        f"num_items_in_batch) on each micro-batch, as Transformers does ({error}); override it with "
                        "that signature (calling super().training_step(model, inputs, num_items_in_batch)), or use a "
                        "callback's on_step_begin / on_step_end for what happens once per optimizer step") from None


__all__ = ["LossMixin", "check_training_step"]
