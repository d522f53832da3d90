"""The optimizer and learning-rate schedules of the Trainer, with the Transformers defaults and names.

    optimizer = create_optimizer(model, args, world.world_size)   # args.optim, sharded under ddp_zero_stage 1/2
    scheduler = get_scheduler("cosine", optimizer, warmup_steps=10, total_steps=100)
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from .args import ArgumentError, TrainingArguments
from .validation import parse_optim_args
from .zero_trainer import apply_zero

SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")


def optimizer_class(args: TrainingArguments) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """args.optim's torch class and its keyword arguments (weight decay aside: it is set per param group).

    As Transformers: AdamW takes adam_beta1/2 and adam_epsilon, sgd and adafactor only the learning rate (and
    optim_args). adafactor is torch.optim.Adafactor, where lr caps the relative step size min(lr, 1/sqrt(t)) that
    is scaled by each parameter's RMS; Transformers' own Adafactor runs with relative_step=False instead, so one
    learning rate does not give the same steps in the two."""
    options: dict[str, Any] = {"lr": args.learning_rate, **parse_optim_args(args.optim_args, args.optim)}
    if args.optim in ("adamw_torch", "adamw_torch_fused"):
        options.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
        if args.optim == "adamw_torch_fused":
            options["fused"] = True  # torch 2.13 has the fused kernel on CPU too
        return torch.optim.AdamW, options
    if args.optim == "sgd":
        return torch.optim.SGD, options
    if args.optim == "adafactor":
        return torch.optim.Adafactor, options
    raise ArgumentError("optim", f"unknown optimizer {args.optim!r}")


# Transformers' rule for the parameters weight decay leaves alone, by name (lower-cased): biases and norms'.
NO_DECAY_NAME = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def no_decay(model: nn.Module) -> set[int]:
    """The ids of the parameters that get no weight decay, as Transformers' Trainer chooses them: those of
    nn.LayerNorm layers and those whose name says bias or norm (T5's relative_attention_bias too), whatever their
    shape (CLIP's 0-dim logit_scale is decayed)."""
    skipped = {id(p) for module in model.modules() if isinstance(module, nn.LayerNorm) for p in module.parameters()}
    return skipped | {id(p) for name, p in model.named_parameters() if NO_DECAY_NAME.search(name.lower())}


def create_optimizer(model: nn.Module, args: TrainingArguments, world_size: int = 1) -> torch.optim.Optimizer:
    """args.optim, with weight decay on every parameter but biases and norms (`no_decay`). Under ddp_zero_stage
    1 or 2 (and more than one rank) each rank keeps the state of its shard only (ddpkit.zero; adafactor, which
    needs whole tensors, gets whole parameters there)."""
    params = [p for p in model.parameters() if p.requires_grad]
    skipped = no_decay(model)
    groups = [{"params": [p for p in params if id(p) not in skipped], "weight_decay": args.weight_decay},
              {"params": [p for p in params if id(p) in skipped], "weight_decay": 0.0}]
    stage = args.ddp_zero_stage if world_size > 1 else 0
    cls, options = optimizer_class(args)
    return apply_zero([g for g in groups if g["params"]], stage, cls, **options)


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


__all__ = ["create_optimizer", "get_scheduler", "optimizer_class"]
