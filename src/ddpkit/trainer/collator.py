"""How the Trainer turns samples into a batch when it is given no data_collator, and which keys of a sample reach
the model: Transformers' default_data_collator and its remove_unused_columns, in ddpkit's words.

    batch = default_data_collator([{"input_ids": [1, 2, 3], "label": 1}, ...])   # {"input_ids": (n, 3), "labels": (n,)}
    collate = without_unused_columns(default_data_collator, model, label_names=None)  # drops what forward cannot take

Samples that are not mappings (tuples, tensors) go to torch's default_collate, as before. Given a tokenizer or a
feature extractor as processing_class, the Trainer pads with it instead (default_collator), as Transformers' does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import default_collate

from ddpkit.trainer.model_io import unwrapped

LABEL_KEYS = ("label", "label_ids")  # the datasets conventions; the batch names them "labels", as models expect


def default_data_collator(features: Sequence[Any]) -> Any:
    """Mapping samples: each key of the first sample stacked into a tensor (lists of ints become a long tensor of
    shape (n, length), not default_collate's list of per-position tensors), "label" or "label_ids" renamed
    "labels", string and None values left out (the first sample decides), as Transformers' default collator.
    Anything else: torch's default_collate."""
    if not features or not isinstance(features[0], Mapping):
        return default_collate(features)
    first, batch = features[0], {}
    label_key = next((k for k in LABEL_KEYS if first.get(k) is not None), None)
    if label_key is not None:
        batch["labels"] = _labels([f[label_key] for f in features], by_first_element=label_key == "label_ids")
    for key, value in first.items():
        if key in LABEL_KEYS or value is None or isinstance(value, str):
            continue
        batch[key] = _stacked([f[key] for f in features])
    return batch


def default_collator(processing_class: Any = None) -> Callable[[Sequence[Any]], Any]:
    """The Trainer's collator when it is given none: Transformers' DataCollatorWithPadding for a tokenizer or a
    sequence feature extractor (samples of unequal lengths padded by it), else default_data_collator."""
    if processing_class is not None:
        import transformers

        if isinstance(processing_class, (transformers.PreTrainedTokenizerBase, transformers.SequenceFeatureExtractor)):
            return transformers.DataCollatorWithPadding(processing_class)
    return default_data_collator


def check_collator(data_collator: Any) -> None:
    """A TypeError for a data_collator that is not a function (a dataset passed where Transformers' Trainer takes
    the collator: its third positional argument)."""
    if data_collator is not None and not callable(data_collator):
        raise TypeError(f"data_collator is a {type(data_collator).__name__}, not a function of a list of samples. "
                        "As in Transformers, the Trainer's arguments are (model, args, data_collator, train_dataset, "
                        "eval_dataset, ...): pass the datasets by name, Trainer(model, args, train_dataset=..., "
                        "eval_dataset=...)")


def _labels(values: list[Any], by_first_element: bool) -> torch.Tensor:
    """Labels as a tensor, with Transformers' dtype rule: "label" by the value itself (an integer or a bool: long;
    anything else, a list of labels too (multi-label), float), "label_ids" by its first element."""
    first = values[0]
    if isinstance(first, torch.Tensor) and (first.ndim or by_first_element):
        return torch.stack(values)  # (a tensor of several labels under "label": Transformers fails; stacked here)
    head = first.item() if isinstance(first, torch.Tensor) else first
    if by_first_element and len(head):
        head = head[0]
    dtype = torch.long if isinstance(head, (int, np.integer)) else torch.float  # bool is an int, there too
    rows = [v.item() if isinstance(v, torch.Tensor) else v for v in values]
    return torch.tensor(np.asarray(rows) if isinstance(first, np.ndarray) else rows, dtype=dtype)


def _stacked(values: list[Any]) -> Any:
    if isinstance(values[0], torch.Tensor):
        return torch.stack(values)
    if isinstance(values[0], np.ndarray):
        return torch.from_numpy(np.stack(values))
    if isinstance(values[0], (int, float, bool, np.number, list, tuple)):
        return torch.tensor(values)  # Python floats become float32, as Transformers makes them
    return default_collate(values)  # a nested mapping, say: torch's rules for that key alone


def forward_columns(model: nn.Module, label_names: Sequence[str] | None = None) -> set[str]:
    """The keys a sample may keep: the parameters of model.forward by name, "label" and "label_ids" (the default
    collator renames them) and label_names, as Transformers keeps them: a **kwargs is a parameter called "kwargs"
    and keeps no other key, and "labels" stays only where forward takes it or label_names names it (a
    compute_loss that reads labels the model does not take needs label_names=["labels"] there too)."""
    # A PEFT model's forward takes (*args, **kwargs): its base model's says what the samples may hold, as there.
    return set(inspect.signature(unwrapped(model).forward).parameters) | set(LABEL_KEYS) | set(label_names or ())


def without_unused_columns(collate: Callable, model: nn.Module,
                           label_names: Sequence[str] | None = None) -> Callable:
    """`collate` on samples whose mapping keys the model's forward does not take are dropped first (samples that
    are not mappings pass whole), as Transformers' RemoveColumnsCollator; raises naming the keys when a sample
    would keep none."""
    return UsedColumns(collate, forward_columns(model, label_names), type(model).__name__)


class UsedColumns:
    """without_unused_columns' collator: an object, not a closure, so that loader workers started by spawn or
    forkserver (dataloader_multiprocessing_context) can unpickle it."""

    def __init__(self, collate: Callable, keep: Collection[str], model_name: str):
        self.collate, self.keep, self.model_name = collate, frozenset(keep), model_name

    def __call__(self, features: Sequence[Any]) -> Any:
        kept = []
        for feature in features:
            if isinstance(feature, Mapping):
                used = {k: v for k, v in feature.items() if k in self.keep}
                if feature and not used:
                    raise ValueError(f"no key of the samples ({', '.join(map(str, feature))}) is an argument of "
                                     f"{self.model_name}.forward ({', '.join(sorted(self.keep))}); rename them, or "
                                     "set remove_unused_columns=False to pass them all")
                feature = used
            kept.append(feature)
        return self.collate(kept)


__all__ = ["UsedColumns", "check_collator", "default_collator", "default_data_collator", "forward_columns",
           "without_unused_columns"]
