"""One optimizer step of the Trainer over an agreed window of micro-batches.

    share = accumulate(wrapped, window, filler, micro_step, device, fire)   # forward and backward, all but the
    grad_norm = optimizer_step(optimizer, scheduler, params, max_grad_norm, precision, fire)   # last no_sync

`fire(event)` runs the callbacks' events inside a step, with Transformers' names and at its moments:
on_substep_end after each micro-batch but the last, on_pre_optimizer_step after clipping, on_optimizer_step
after the optimizer step (before the schedule and zero_grad).

A window holds this rank's micro-batches and how many every rank runs (`window.micro_steps`, the most any rank
holds): a rank short of data runs `filler` with weight zero, so every rank launches the same all-reduces.
`micro_step(model, batch, weight)` runs one forward and backward and returns this rank's share of the step's loss.

    flos = floating_point_ops(model, batch)             # what one forward and backward on `batch` costs (total_flos)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.trainer import model_io
from ddpkit.trainer.parallelize import ddp_of
from ddpkit.trainer.precision import Precision
from ddpkit.trainer.sharding import clip_grad_norm, wait_for_params
from ddpkit.trainer.step_batches import StepBatches

MicroStep = Callable[[nn.Module, Any, float], torch.Tensor]
Fire = Callable[[str], None]


def _no_events(event: str) -> None:
    pass


def accumulate(wrapped: nn.Module, window: StepBatches, filler: Any, micro_step: MicroStep,
               device: torch.device, fire: Fire = _no_events) -> torch.Tensor:
    """Run the window's micro-steps; gradients are reduced over the ranks on the last one only."""
    wrapped.train()
    ddp = ddp_of(wrapped)  # None in a world of one; under torch_compile, the wrapper inside the compiled module
    share = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(window.micro_steps):
        real = i < len(window.batches)
        batch = window.batches[i] if real else filler
        last = i == window.micro_steps - 1
        with contextlib.nullcontext() if last or ddp is None else ddp.no_sync():
            share += micro_step(wrapped, batch, 1.0 if real else 0.0)
        if not last:
            fire("on_substep_end")
    return share


def optimizer_step(optimizer: torch.optim.Optimizer, scheduler: Any, params: list[nn.Parameter],
                   max_grad_norm: float, precision: Precision, fire: Fire = _no_events) -> float:
    """Clip (over the shards, if any), step, schedule, zero the gradients; the gradient norm before clipping."""
    precision.unscale(optimizer)
    # max_norm=inf measures without clipping (the scale is clamped to 1.0, which leaves the bits unchanged).
    limit = max_grad_norm if max_grad_norm > 0 else float("inf")
    grad_norm = clip_grad_norm(optimizer, params, limit)
    fire("on_pre_optimizer_step")
    stepped = precision.step(optimizer)
    fire("on_optimizer_step")
    if stepped:
        scheduler.step()  # as Transformers: a step fp16 skipped (inf/nan gradients) does not advance the schedule
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def counts_flos(model: nn.Module) -> bool:
    """Whether floating_point_ops can count the model's operations: a Transformers model (num_parameters)."""
    return callable(getattr(model, "num_parameters", None))


def floating_point_ops(model: nn.Module, inputs: Any) -> int:
    """Transformers' Trainer's estimate of one forward and backward: 6 operations per token of the model's main
    input (a forward's multiply and add per weight, twice that in backward) per parameter outside the
    embeddings, whose lookups cost no multiplications; 0 where it cannot tell (no num_parameters, no such input)."""
    tokens = inputs.get(model_io.main_input_name(model)) if isinstance(inputs, Mapping) else None
    if not counts_flos(model) or not isinstance(tokens, torch.Tensor):
        return 0
    return 6 * tokens.numel() * model.num_parameters(exclude_embeddings=True)


def empty_device_cache(device: torch.device) -> None:
    """torch_empty_cache_steps: hand the accelerator's cached, unused memory back (nothing on the CPU)."""
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    empty = getattr(backend, "empty_cache", None)
    if callable(empty):
        empty()


__all__ = ["accumulate", "counts_flos", "empty_device_cache", "floating_point_ops", "optimizer_step", "wait_for_params"]
