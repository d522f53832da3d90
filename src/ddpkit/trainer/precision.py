"""How the Trainer runs a step's arithmetic: in float32, under bf16 autocast, or fp16 with a gradient scaler.

    precision = Precision.for_args(args, world.device, comm)
    with precision.autocast():
        loss = model(batch)
    precision.backward(loss)                     # fp16: the loss times the scale; bf16 needs no scaling
    precision.unscale(optimizer)                 # the gradients as the loss made them, before clipping
    stepped = precision.step(optimizer)          # fp16: False when inf/nan gradients made every rank skip

Forward (and evaluation) run under `autocast()`; backward and the optimizer step go through `backward`,
`unscale` and `step`, so that fp16's loss scaling lives here alone. `precision.scaler` (None without fp16) is
what checkpoints save and restore.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ddpkit.distributed.comm import Comm, max_over_ranks
from ddpkit.errors import ArgumentError
from ddpkit.trainer.sharding import agreeing_comm, step_gradients


class Precision:
    scaler: torch.amp.GradScaler | None = None  # fp16's (ScaledPrecision); saved in checkpoints when set

    def __init__(self, device: torch.device, dtype: torch.dtype | None = None):
        self.device = device
        self.dtype = dtype  # None: float32, no autocast

    @classmethod
    def for_args(cls, args: Any, device: torch.device, comm: Comm | None = None) -> Precision:
        if getattr(args, "fp16", False):
            if device.type != "cuda":
                raise ArgumentError("fp16", f"needs a CUDA device (float16 with a gradient scaler), and this "
                                            f"process trains on {device}; on a CPU use bf16")
            return ScaledPrecision(device, AgreedGradScaler("cuda", comm=comm))
        return cls(device, torch.bfloat16 if args.bf16 else None)

    def autocast(self, cache_enabled: bool | None = True) -> Any:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype, cache_enabled=cache_enabled)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping: the gradients as the loss made them (nothing to undo without scaling)."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer step; whether it was taken (the schedule steps only with it)."""
        optimizer.step()
        return True


class AgreedGradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler for data parallelism: every rank skips or takes a step alike.

    torch's scaler unscales and checks the .grad of every parameter of the optimizer. Here it is every gradient
    (`step_gradients`: under ZeRO stage 2 this rank's shards too, which keep no .grad), and the found-inf flag is
    the max over the ranks: a rank whose gradients hold no inf must still skip when another's do, or the replicas
    part (stage 1/2), and the all-gathers after the step would not match. `comm` None: ddpkit's
    ZeroRedundancyOptimizer's ranks agree (its own group), other optimizers decide alone. Under plain DDP the
    averaged gradients are the same everywhere, so the agreement changes nothing there but costs one all-reduce of
    one number per step (the scaler's step reads found-inf on the host anyway). The scale therefore moves the same
    on every rank, and the state_dict rank 0 saves is every rank's. Overriding `_unscale_grads_` is what torch's
    own FSDP ShardedGradScaler does for the same reason.
    """

    def __init__(self, device: str = "cuda", comm: Comm | None = None, **kwargs: Any):
        super().__init__(device, **kwargs)
        self.comm = comm
        self.skipped = False  # whether the last unscaled step found inf/nan on some rank
        self.found_here = False  # whether this rank's own gradients held it (what a rank-local scaler would use)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in step_gradients(optimizer):
            if grad.dtype == torch.float16 and not allow_fp16:
                raise ValueError("Attempting to unscale FP16 gradients: fp16 keeps the weights in float32 (autocast "
                                 "runs the float16 operations); build the model in float32, not .half()")
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
        with torch.no_grad():
            for (device, _), grads in by_kind.items():
                found = torch.zeros_like(found_inf, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device))
                found_inf += found.to(found_inf.device)
        found = found_inf.item()
        self.found_here = bool(found)
        comm = self.comm if self.comm is not None else agreeing_comm(optimizer)
        if comm is not None:
            found = max_over_ranks(comm, found, "fp16: inf/nan gradients on any rank?", found_inf.device)
        found_inf.fill_(1.0 if found else 0.0)
        self.skipped = bool(found)
        return {found_inf.device: found_inf}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        # ddpkit's ZeRO at stage 2 says it scales by itself (_step_supports_amp_scaling), so that torch's own
        # scaler, blind to the shards, reaches its step and is refused there; this one unscales the shards itself.
        hidden = optimizer.__dict__.pop("_step_supports_amp_scaling", None)
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            if hidden is not None:
                optimizer._step_supports_amp_scaling = hidden


class ScaledPrecision(Precision):
    """fp16: forward under float16 autocast, the loss scaled before backward, the gradients unscaled before
    clipping, the step skipped when they hold inf/nan (on every rank alike) and the scale updated after it."""

    def __init__(self, device: torch.device, scaler: AgreedGradScaler, dtype: torch.dtype = torch.float16):
        super().__init__(device, dtype)
        self.scaler = scaler

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        self.scaler.step(optimizer)  # skipped when found-inf (agreed over the ranks) is set
        self.scaler.update()  # halved after a skip; doubled after growth_interval clean steps
        return not self.scaler.skipped


__all__ = ["AgreedGradScaler", "Precision", "ScaledPrecision"]
