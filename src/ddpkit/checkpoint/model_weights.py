"""A model's weights as one safetensors file, written and read back into the same model.

    save_weights_file(model, "out/model.safetensors")
    load_weights_file(model, "out/model.safetensors", device="cpu")   # strict: every weight, nothing else

Tied weights (one tensor under several names: an embedding and the output layer) are stored once, under the
first of their names in sorted order, the others recorded in the file's metadata; this is what safetensors'
save_model writes, so files load either way. Unlike save_model, weights that are different views of one
buffer (ZeroRedundancyOptimizer(parameters_as_bucket_view=True) makes every parameter a view of one flat
buffer, as do flat-parameter tricks) are saved too, each as its own values (safetensors refuses a storage that
no single name covers), and are loaded back into those views in place: the model keeps its layout.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def _tied_groups(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names that are the same tensor (the same memory, shape, strides and dtype), each group sorted; a tensor
    of no elements is never tied (it has no memory to share)."""
    groups: dict[Any, list[str]] = defaultdict(list)
    for name, tensor in state.items():
        key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride()) \
            if tensor.numel() and tensor.device.type != "meta" else name
        groups[key].append(name)
    return [sorted(names) for names in groups.values()]


def save_weights_file(model: torch.nn.Module, path: str, metadata: dict[str, str] | None = None) -> None:
    state = model.state_dict()
    metadata = dict(metadata or {})
    kept: dict[str, torch.Tensor] = {}
    for names in _tied_groups(state):
        kept[names[0]] = state[names[0]]
        for other in names[1:]:
            metadata.setdefault(other, names[0])
    users: dict[Any, int] = defaultdict(int)  # kept tensors per storage
    for tensor in kept.values():
        if tensor.numel():
            users[(tensor.device, tensor.untyped_storage().data_ptr())] += 1
    out = {}
    for name, tensor in kept.items():
        shared = tensor.numel() and users[(tensor.device, tensor.untyped_storage().data_ptr())] > 1
        # A view's own copy on the host, where the file is written from anyway (not a second model on a GPU)
        out[name] = tensor.detach().to("cpu", copy=True).contiguous() if shared else tensor.contiguous()
    save_file(out, path, metadata=metadata or None)


def load_weights_file(model: torch.nn.Module, path: str, device: str = "cpu", strict: bool = True) \
        -> tuple[list[str], list[str]]:
    """Copy the file's weights into the model's own tensors; (missing, unexpected) names. strict: a RuntimeError
    naming them (and torch's own for a weight of another shape)."""
    saved = load_file(path, device=device)
    state = model.state_dict()
    missing = []
    for names in _tied_groups(state):
        if not any(name in saved for name in names):
            missing += names
    unexpected = sorted(name for name in saved if name not in state)
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {type(model).__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(missing))
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected)
        raise RuntimeError(error)
    model.load_state_dict({name: tensor for name, tensor in saved.items() if name in state}, strict=False)
    return sorted(missing), unexpected
