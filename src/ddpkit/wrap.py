"""How the Trainer readies a model for data-parallel training, one function per way, applied in order under an
`if` (torchtitan's parallelize.py reads the same way): gradient checkpointing, the device, then our DDP.

    model, wrapped = prepare_model(model, args, world)   # wrapped: what forward/backward run on
"""

from __future__ import annotations

from torch import nn

from .args import ArgumentError, TrainingArguments
from .zero_trainer import zero_ddp_kwargs
from .ddp import DistributedDataParallel
from .env import DistEnv


def apply_gradient_checkpointing(model: nn.Module) -> None:
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ArgumentError("gradient_checkpointing", f"{type(model).__name__} has no gradient_checkpointing_enable()"
                                                      "; add one (torch.utils.checkpoint) or drop the flag")
    enable()


def apply_ddp(model: nn.Module, args: TrainingArguments, world: DistEnv) -> DistributedDataParallel:
    cuda = world.device.type == "cuda"
    return DistributedDataParallel(model, device_ids=[world.device.index] if cuda else None,
                                   find_unused_parameters=args.find_unused_parameters,
                                   broadcast_buffers=args.broadcast_buffers, bucket_cap_mb=args.ddp_bucket_cap_mb,
                                   **zero_ddp_kwargs(args.ddp_zero_stage))


def prepare_model(model: nn.Module, args: TrainingArguments, world: DistEnv) -> tuple[nn.Module, nn.Module]:
    """The model on this rank's device, and the module training runs (the DDP wrapper in a world of many)."""
    if args.gradient_checkpointing:
        apply_gradient_checkpointing(model)
    model = model.to(world.device)
    wrapped = apply_ddp(model, args, world) if world.world_size > 1 else model
    return model, wrapped


__all__ = ["apply_ddp", "apply_gradient_checkpointing", "prepare_model"]
