"""What the Trainer needs to know of a model's batches and outputs, whatever their shape.

A batch is a mapping of keyword arguments (the Transformers convention), a list or tuple of positional ones, or
one tensor. An output is a loss tensor, a mapping with "loss" (and "logits" or other predictions), a tuple (loss,
logits, ...), or an object with `.loss` (and `.logits`), as Transformers' ModelOutput is.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

IGNORE_INDEX = -100  # the label value torch's cross_entropy and Transformers models skip


def call_model(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)):
        return model(*inputs)
    return model(inputs)


def _loss_field(outputs: Any, shortest_tuple: int) -> Any:
    """Where an output keeps its loss: "loss" of a mapping or an object, the first of a tuple at least
    `shortest_tuple` long."""
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    if isinstance(outputs, (list, tuple)):
        return outputs[0] if len(outputs) >= shortest_tuple else None
    return getattr(outputs, "loss", None)


def loss_of(outputs: Any) -> torch.Tensor:
    loss = outputs if isinstance(outputs, torch.Tensor) else _loss_field(outputs, 1)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("the model returned no scalar loss: return a loss tensor, a dict with 'loss' or an object "
                         "with .loss (give it the labels), or override Trainer.compute_loss")
    return loss.reshape(())


def carried_loss(outputs: Any) -> torch.Tensor | None:
    """The scalar loss an output carries beside its predictions, or None: "loss" of a mapping or an object, the
    first of a tuple of several whose first is a scalar (Transformers' (loss, logits, ...)). A bare tensor is
    the predictions here, never a loss."""
    loss = None if isinstance(outputs, torch.Tensor) else _loss_field(outputs, 2)
    return loss.reshape(()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def logits_of(outputs: Any, with_loss: bool = True) -> torch.Tensor:
    """The logits: "logits" of a mapping or an object, or the element after the loss of a tuple (the first one
    of a tuple without a loss, what a model given no labels returns; a bare tensor without a loss)."""
    if isinstance(outputs, torch.Tensor) and not with_loss:
        return outputs
    if isinstance(outputs, Mapping):
        return outputs["logits"]
    if isinstance(outputs, (list, tuple)):
        return outputs[1 if with_loss else 0]
    logits = getattr(outputs, "logits", None)
    if logits is None:
        raise ValueError("predictions (Trainer.predict, compute_metrics) need logits: return them as 'logits' "
                         "(dict or attribute) or second")
    return logits


def predictions_of(outputs: Any, with_loss: bool = True, ignore_keys: Collection[str] = ()) -> Any:
    """The predictions, as Transformers' prediction_step takes them: every output but the loss, in order, one
    tensor where there is one and a tuple where there are several (a question-answering head's (start_logits,
    end_logits)). Of a mapping (a ModelOutput), the values but "loss" (where the output carries one) and those of
    `ignore_keys`, None left out as a ModelOutput leaves it out; of a tuple, the elements after the loss (all of
    them without one); a bare tensor without a loss; of another object, its .logits (logits_of)."""
    if isinstance(outputs, torch.Tensor) and not with_loss:
        return outputs
    if isinstance(outputs, Mapping):
        skipped = {*ignore_keys, "loss"} if with_loss else set(ignore_keys)
        kept = tuple(value for key, value in outputs.items() if key not in skipped and value is not None)
    elif isinstance(outputs, (list, tuple)):
        kept = tuple(outputs[1 if with_loss else 0:])
    else:
        return logits_of(outputs, with_loss)
    if not kept:
        keys = f" (keys {list(outputs)}, ignore_keys {list(ignore_keys)})" if isinstance(outputs, Mapping) else ""
        raise ValueError(f"the model's output holds no predictions beside its loss{keys}: predict and "
                         "compute_metrics need the logits, or another output")
    return kept[0] if len(kept) == 1 else kept


def per_sample(predictions: Any, samples: int) -> Any:
    """Of several predictions, those with a row per sample (`samples` rows), which ddpkit gathers in dataset order:
    an output of one value a batch (a mixture of experts' auxiliary loss) or of rows per token (its router logits)
    is left out, where Transformers concatenates it batch by batch; one prediction is kept as it is."""
    if not isinstance(predictions, tuple):
        return predictions
    kept = tuple(p for p in predictions if isinstance(p, tuple) or (p.ndim > 0 and p.shape[0] == samples))
    return predictions if not kept else kept[0] if len(kept) == 1 else kept


def ignored_at_inference(model: nn.Module, ignore_keys: Collection[str] | None) -> list[str]:
    """The output keys left out of the predictions: `ignore_keys`, else, as Transformers' prediction_step has
    them, the model config's keys_to_ignore_at_inference (["cache"] for a config without them: the "cache" a
    Transformers 5 model returns in eval mode), none for a model without a config."""
    if ignore_keys is not None:
        return list(ignore_keys)
    config = getattr(model, "config", None)
    return [] if config is None else list(getattr(config, "keys_to_ignore_at_inference", ["cache"]))


def smoothed_loss(outputs: Any, labels: torch.Tensor, epsilon: float, shift: bool = False,
                  count: torch.Tensor | float | None = None) -> torch.Tensor:
    """Label smoothing (Transformers' label_smoothing_factor) on the logits of a model called without labels:
    (1 - epsilon) x the labels' negative log-likelihood + epsilon x the mean over the classes of it, summed over the
    items (labels other than -100; shift: a causal LM's, logits[..., :-1] against labels[..., 1:]) and divided by
    `count` (the global item count), or averaged over the items without one."""
    logits = logits_of(outputs, with_loss=False)
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    negative = -nn.functional.log_softmax(logits, dim=-1)
    target = labels.unsqueeze(-1) if labels.dim() == negative.dim() - 1 else labels
    ignored = target.eq(IGNORE_INDEX)
    picked = negative.gather(-1, target.clamp(min=0)).masked_fill(ignored, 0.0)
    spread = negative.sum(-1, keepdim=True, dtype=torch.float32).masked_fill(ignored, 0.0)  # float32 at least
    items = (~ignored).sum() if count is None else torch.as_tensor(count, device=picked.device)
    # Transformers' LabelSmoother's order of operations, so that the loss is its loss bit for bit on any host.
    return (1 - epsilon) * (picked.sum() / items) + epsilon * (spread.sum() / (items * negative.shape[-1]))


def smoothing_for(model: nn.Module, factor: float) -> float:
    """The label smoothing the Trainer applies: `factor`, but none (with a warning, as Transformers) for a
    multi-label classifier, whose float labels name no class to smooth towards."""
    if factor and getattr(getattr(unwrapped(model), "config", None), "problem_type", None) == \
            "multi_label_classification":
        warnings.warn("label_smoothing_factor is ignored for a multi-label classification model (its labels are "
                      "probabilities, not classes), as Transformers ignores it", UserWarning, stacklevel=3)
        return 0.0
    return factor


def is_causal_lm(model: nn.Module) -> bool:
    """Whether the model is one of Transformers' causal LMs (its class named in the auto mapping), whose label
    smoothing shifts the labels, as Transformers' Trainer decides it."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return type(unwrapped(model)).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def count_tokens(batch: Any, model: nn.Module, how: str, pad_token_id: int | None = None) -> int:
    """The input tokens of a batch, as Transformers' include_num_input_tokens_seen counts them: the elements of the
    model's main input ("all"), or those the attention mask keeps ("non_padding"; else those that are not
    `pad_token_id`, else all); 0 for "no" or a batch without that input."""
    main = batch.get(main_input_name(model)) if isinstance(batch, Mapping) else None
    if how == "no" or not isinstance(main, torch.Tensor):
        return 0
    mask = batch.get("attention_mask")
    if how == "non_padding" and isinstance(mask, torch.Tensor):
        return int(mask.sum())
    if how == "non_padding" and pad_token_id is not None:
        return int((main != pad_token_id).sum())
    return main.numel()


def labels_of(inputs: Any) -> torch.Tensor | None:
    """The batch's "labels" tensor, if it is a mapping that has one."""
    labels = inputs.get("labels") if isinstance(inputs, Mapping) else None
    return labels if isinstance(labels, torch.Tensor) else None


def batch_len(batch: Any) -> int:
    """Samples in the batch: the first dimension of its first tensor that has one."""
    return next((t.shape[0] for t in _tensors(batch) if t.ndim > 0), 1)


def _foreign_mapping(value: Any) -> bool:
    """A Mapping that is not a dict (Transformers' BatchEncoding, which DataCollatorWithPadding returns; a
    UserDict): torch's pytree takes one for a leaf, so its tensors would be neither counted nor moved."""
    return isinstance(value, Mapping) and not isinstance(value, dict)


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    """The batch's tensors in pytree order, those in foreign Mappings included."""
    for leaf in tree_flatten(batch, is_leaf=_foreign_mapping)[0]:
        if _foreign_mapping(leaf):
            yield from _tensors(dict(leaf))
        elif isinstance(leaf, torch.Tensor):
            yield leaf


def count_items(batch: Any, shifted: bool = False) -> int:
    """How many items a batch's mean loss averages: labels other than -100, or else samples. Transformers' rule
    for which labels: the batch's "shift_labels" if it has them, else labels[..., 1:] where the model's loss
    shifts them (`shifted`: position 0 of a row is never a target), else the labels."""
    labels = labels_of(batch)
    if labels is None:
        return batch_len(batch)
    shift = batch.get("shift_labels")
    if isinstance(shift, torch.Tensor):
        labels = shift
    elif shifted:
        labels = labels[..., 1:]
    return int((labels != IGNORE_INDEX).sum())


def main_input_name(model: nn.Module) -> str:
    """The batch key of the model's main input, as Transformers names it: its main_input_name, else input_ids."""
    return getattr(unwrapped(model), "main_input_name", "input_ids")


def unwrapped(model: nn.Module) -> nn.Module:
    """A PEFT model's base model (its forward takes *args, **kwargs and says nothing), as Transformers unwraps it."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def accepts_loss_kwargs(model: nn.Module) -> bool:
    """Whether the model's forward takes num_items_in_batch and divides its summed loss by it: its
    `accepts_loss_kwargs` if it says, else a parameter of that name, or, for a Transformers model, a forward that
    hands its **kwargs (where the count arrives) to self.loss_function, where that is a loss that divides by it
    (_divides_by_count).

    Transformers' Trainer takes any **kwargs of a Transformers model for a yes. But BertForSequenceClassification,
    LlamaForSequenceClassification, a ViT regression, a CTC head and many more take **kwargs and return a mean
    (CrossEntropyLoss(), MSELoss(), a loss_function without the kwargs or one that ignores them): that mean is then
    taken for a share of the global loss, and N ranks with k micro-batches a step train on k x N times a single
    process's loss and gradients. A no is always safe: the count then never reaches the model, whose loss
    functions fall back to their mean, which the Trainer scales by the items itself."""
    model = unwrapped(model)
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    parameters = inspect.signature(model.forward).parameters
    transformers_model = any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)
    return "num_items_in_batch" in parameters or transformers_model and _hands_count_to_loss(type(model).forward) \
        and _divides_by_count(model)


# Transformers' losses that divide their sum by num_items_in_batch whatever the configuration (loss.loss_utils).
COUNTING_LOSSES = ("ForCausalLMLoss", "ForMaskedLMLoss", "ForTokenClassification")


def _divides_by_count(model: nn.Module) -> bool:
    """Whether the model's loss_function divides by the count: a counting loss, without a mixture of experts'
    router loss added (a mean, as Transformers adds it); the sequence classifiers' only for a single-label problem
    named in the config (None is decided from the labels at the call; regression and multi-label take means)."""
    config = getattr(model, "config", None)
    name = getattr(getattr(model, "loss_function", None), "__name__", None)
    if name in COUNTING_LOSSES:
        return not getattr(config, "output_router_logits", False)
    return name == "ForSequenceClassificationLoss" and getattr(config, "problem_type", None) == \
        "single_label_classification"


def _hands_count_to_loss(forward: Any) -> bool:
    """Whether `forward` passes its **kwargs, or num_items_in_batch by name, to a self.loss_function(...) call
    (read from its source; False where there is none to read)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    function = next((node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if function is None or function.args.kwarg is None:
        return False
    rest = function.args.kwarg.arg
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "loss_function":
            if any(kw.arg == "num_items_in_batch" or (kw.arg is None and isinstance(kw.value, ast.Name)
                                                     and kw.value.id == rest) for kw in node.keywords):
                return True
    return False


def loss_shifts_labels(model: nn.Module) -> bool:
    """Whether the model's loss shifts its labels, by Transformers' Trainer rule: its `loss_type` names Transformers'
    causal LM loss, and it is no encoder-decoder (whose targets are unshifted). A GPT2LMHeadModel, whose loss_type
    is None, counts unshifted labels there, so here too."""
    model = unwrapped(model)
    loss_type = getattr(model, "loss_type", None)
    if loss_type is None or getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return loss_type == "ForCausalLM"
    return LOSS_MAPPING.get(loss_type) is ForCausalLMLoss


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch's tensors on `device`, its containers kept (a BatchEncoding stays one, as Transformers moves it)."""
    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)
        if _foreign_mapping(value):
            moved = {key: to_device(item, device) for key, item in value.items()}
            try:
                return type(value)(moved)  # BatchEncoding's and UserDict's constructors take a dict
            except TypeError:
                return moved
        return value

    return tree_map(move, batch, is_leaf=_foreign_mapping)


__all__ = ["IGNORE_INDEX", "accepts_loss_kwargs", "batch_len", "call_model", "carried_loss", "count_items",
           "ignored_at_inference", "labels_of", "logits_of", "loss_of", "loss_shifts_labels", "main_input_name",
           "per_sample", "predictions_of", "to_device"]
