"""NEFTune, Transformers' `neftune_noise_alpha` (Jain et al., 2023, "NEFTune: Noisy Embeddings Improve Instruction
Finetuning"): while the Trainer trains, the model's input embeddings gain uniform noise in [-b, b], b = alpha /
sqrt(sequence length x embedding width), in training mode only (evaluation sees them clean).

    with noisy_embeddings(model, args.neftune_noise_alpha):   # None: nothing changes
        ...                                                    # training; the hook is gone afterwards

The bound is computed as Transformers computes it (a float32 square root), so the noise has the same bits for the
same random state. Each rank draws from its own generator, seeded alike: the same draws on different samples.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ddpkit.errors import ArgumentError


def input_embeddings(model: nn.Module) -> nn.Module:
    """The module whose output the noise goes into: a Transformers model's get_input_embeddings()."""
    found = getattr(model, "get_input_embeddings", None)
    embeddings = found() if callable(found) else None
    if not isinstance(embeddings, nn.Module):
        raise ArgumentError("neftune_noise_alpha", f"needs the model's input embeddings, but {type(model).__name__} "
                                                   "has no get_input_embeddings() returning a module (a Transformers "
                                                   "model has one); add one, or leave neftune_noise_alpha unset")
    return embeddings


def _add_noise(alpha: float):
    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        bound = alpha / torch.sqrt(torch.tensor(output.size(1) * output.size(2)))  # float32, as Transformers'
        return output + torch.zeros_like(output).uniform_(-bound, bound)

    return hook


@contextlib.contextmanager
def noisy_embeddings(model: nn.Module, alpha: float | None) -> Iterator[None]:
    """The noise on `model`'s input embeddings while the block runs; nothing for alpha None."""
    if alpha is None:
        yield
        return
    handle = input_embeddings(model).register_forward_hook(_add_noise(alpha))
    try:
        yield
    finally:
        handle.remove()


__all__ = ["input_embeddings", "noisy_embeddings"]
