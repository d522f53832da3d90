"""The optimizer and learning-rate schedules of the Trainer, with the Transformers defaults and names."""

from __future__ import annotations

import math

import torch
from torch import nn

from .args import ArgumentError, TrainingArguments
from .zero_trainer import apply_zero

SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")


def create_optimizer(model: nn.Module, args: TrainingArguments, world_size: int = 1) -> torch.optim.Optimizer:
    """AdamW; biases and norm weights (every parameter of fewer than 2 dimensions) get no weight decay. Under
    ddp_zero_stage 1 or 2 (and more than one rank) each rank keeps the state of its shard only (ddpkit.zero)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    stage = args.ddp_zero_stage if world_size > 1 else 0
    return apply_zero([g for g in groups if g["params"]], stage, torch.optim.AdamW, lr=args.learning_rate,
                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)


def get_scheduler(name: str, optimizer: torch.optim.Optimizer, warmup_steps: int,
                  total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The Transformers schedules: a linear warmup from 0, then linear or cosine decay to 0, or constant."""

    def factor(step: int) -> float:
        if name != "constant" and step < warmup_steps:
            return step / max(1, warmup_steps)
        if name in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        if name == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # cosine: half a period, 1 -> 0

    if name not in SCHEDULES:
        raise ArgumentError("lr_scheduler_type", f"unknown schedule {name!r}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


__all__ = ["create_optimizer", "get_scheduler"]
