"""What DistributedDataParallel's forward does with its inputs and outputs besides running the module: the inputs
moved to the device of `device_ids` (`move_to`), and the tensors found in an output (`tensors_in`), whose graph
nodes open the reducer's BackwardPass when backward starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_unflatten


def tensors_in(output: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors of a forward's output: pytree's, those in dataclass fields (as torch's wrapper finds) and, a
    few levels down, in a plain object's attributes (torch's finds none there; armed, their backward passes
    are told from one through the bare module)."""
    found = []
    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for field in dataclasses.fields(leaf):
                found += tensors_in(getattr(leaf, field.name), depth)
        elif depth < 2 and hasattr(leaf, "__dict__") and not isinstance(leaf, (type, nn.Module)):
            found += tensors_in(list(vars(leaf).values()), depth + 1)
    return found


def move_to(obj: Any, device: torch.device) -> Any:
    """The inputs on `device`; a PackedSequence moves as a whole (its batch_sizes stay on the CPU, as torch's)."""
    def is_leaf(x: Any) -> bool:
        return isinstance(x, PackedSequence)

    flat, spec = tree_flatten(obj, is_leaf=is_leaf)
    return tree_unflatten([t.to(device, non_blocking=True) if isinstance(t, (torch.Tensor, PackedSequence)) else t
                           for t in flat], spec)


__all__ = ["move_to", "tensors_in"]
