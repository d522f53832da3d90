"""How the Trainer runs a step's arithmetic: in float32, or under bf16 autocast.

    precision = Precision.for_args(args, device)
    with precision.autocast():
        loss = model(batch)
    precision.backward(loss)                     # the loss as it is: bf16 needs no scaling
    precision.step(optimizer)

Forward (and evaluation) run under `autocast()`; backward and the optimizer step go through `backward` and
`step`, so that a precision that scales the loss (fp16's gradient scaler) can do so in one place.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class Precision:
    def __init__(self, device: torch.device, dtype: torch.dtype | None = None):
        self.device = device
        self.dtype = dtype  # None: float32, no autocast

    @classmethod
    def for_args(cls, args: Any, device: torch.device) -> "Precision":
        return cls(device, torch.bfloat16 if args.bf16 else None)

    def autocast(self) -> Any:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping: the gradients as the loss made them (nothing to undo without scaling)."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


__all__ = ["Precision"]
