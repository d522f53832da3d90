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

from ddpkit.args.training_args import TrainingArguments
from ddpkit.args.validation import SCHEDULERS, parse_optim_args
from ddpkit.errors import ArgumentError
from ddpkit.trainer.sharding import apply_zero
from ddpkit.zero.optimizer import ZeroRedundancyOptimizer


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


def decay_parameter_names(module: nn.Module) -> list[str]:
    """The names of the parameters weight decay applies to, listed as Transformers' get_decay_parameter_names lists
    them: each child's first (a tied weight under each of its names), then the module's own; none of an nn.LayerNorm,
    none whose name says bias or norm."""
    names = [f"{child_name}.{name}" for child_name, child in module.named_children()
             if not isinstance(child, nn.LayerNorm) for name in decay_parameter_names(child)]
    return [name for name in names + list(module._parameters) if not NO_DECAY_NAME.search(name.lower())]


def given_optimizers(optimizers: tuple[Any, Any], args: TrainingArguments, world_size: int,
                     cls_and_kwargs: Any = None) -> tuple[Any, Any]:
    """Trainer(optimizers=(optimizer, scheduler)) as given, checked against ddp_zero_stage, which shards the
    optimizer the Trainer makes: one the caller built would train unsharded at stage 1 without a word, and at
    stage 2 (whose wrapper keeps only this rank's shard of the gradients, no .grad) fail at the first backward.
    cls_and_kwargs (Transformers' optimizer_cls_and_kwargs) is checked too: a class and a dict, and not beside
    an optimizer (Transformers refuses the two together)."""
    if cls_and_kwargs is not None:
        _check_cls_and_kwargs(cls_and_kwargs)
        if optimizers[0] is not None:
            raise RuntimeError("Trainer got both optimizers and optimizer_cls_and_kwargs: pass one of them")
    optimizer, stage = optimizers[0], args.ddp_zero_stage if world_size > 1 else 0
    if optimizer is None or stage == 0 or (stage == 1 and isinstance(optimizer, ZeroRedundancyOptimizer)):
        return optimizers
    raise ArgumentError("ddp_zero_stage", f"is {stage}, which shards the optimizer the Trainer makes, but "
                        f"Trainer(optimizers=...) gave a {type(optimizer).__name__} built outside it: leave the "
                        "optimizer None (args.optim is made and sharded), or override Trainer.create_optimizer, "
                        "which runs once the model is wrapped, to build a ddpkit.ZeroRedundancyOptimizer on "
                        "self.model.parameters()" + (", or pass such an optimizer" if stage == 1 else "") +
                        ", or set ddp_zero_stage=0")


def _check_cls_and_kwargs(given: Any) -> None:
    pair = isinstance(given, (tuple, list)) and len(given) == 2
    if not (pair and isinstance(given[0], type) and issubclass(given[0], torch.optim.Optimizer)
            and isinstance(given[1], dict)):
        raise TypeError("optimizer_cls_and_kwargs must be (an optimizer class, a dict of its keyword arguments), "
                        f"such as (torch.optim.SGD, {{'lr': 0.1}}); got {given!r}")


def create_optimizer(model: nn.Module, args: TrainingArguments, world_size: int = 1,
                     cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None
                     ) -> torch.optim.Optimizer:
    """args.optim (or the class and its keyword arguments of `cls_and_kwargs`, Transformers'
    optimizer_cls_and_kwargs), with weight decay on every parameter but biases and norms (`no_decay`). Under
    ddp_zero_stage 1 or 2 (and more than one rank) each rank keeps the state of its shard only (ddpkit.zero;
    adafactor, and any class not known to be elementwise, gets whole parameters there)."""
    params = [p for p in model.parameters() if p.requires_grad]
    skipped = no_decay(model)
    groups = [{"params": [p for p in params if id(p) not in skipped], "weight_decay": args.weight_decay},
              {"params": [p for p in params if id(p) in skipped], "weight_decay": 0.0}]
    stage = args.ddp_zero_stage if world_size > 1 else 0
    cls, options = optimizer_class(args) if cls_and_kwargs is None else tuple(cls_and_kwargs)
    return apply_zero([g for g in groups if g["params"]], stage, cls, **options)


def get_scheduler(name: str, optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                  scheduler_kwargs: dict[str, Any] | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """The Transformers schedules: a linear warmup from 0 (none for constant), then the schedule's factor of the
    learning rate. scheduler_kwargs are lr_scheduler_kwargs, with Transformers' defaults."""
    if name not in SCHEDULERS:
        raise ArgumentError("lr_scheduler_type", f"unknown schedule {name!r}")
    kw = dict(scheduler_kwargs or {})
    decay = _decay(name, kw, optimizer.defaults["lr"], warmup_steps)

    def factor(step: int) -> float:
        if name != "constant" and step < warmup_steps:
            return step / max(1, warmup_steps)
        return decay(step, (step - warmup_steps) / max(1, total_steps - warmup_steps), total_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _decay(name: str, kw: dict[str, Any], lr: float, warmup_steps: int):
    """The factor after warmup, of (step, progress from 0 to 1 over the steps after warmup, total steps)."""
    if name in ("constant", "constant_with_warmup"):
        return lambda step, progress, total: 1.0
    if name == "linear":
        return lambda step, progress, total: max(0.0, 1.0 - progress)
    if name == "cosine":  # num_cycles 0.5: half a period, 1 -> 0
        cycles = kw.get("num_cycles", 0.5)
        return lambda step, progress, total: max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress)))
    if name == "cosine_with_restarts":  # num_cycles half-periods from 1 to 0, each starting again at 1
        cycles = kw.get("num_cycles", 1)
        return lambda step, progress, total: 0.0 if progress >= 1.0 else max(
            0.0, 0.5 * (1.0 + math.cos(math.pi * ((cycles * progress) % 1.0))))
    if name == "polynomial":
        # From lr to lr_end as (1 - progress) ** power, then lr_end; a factor of lr, which LambdaLR multiplies in.
        lr_end, power = kw.get("lr_end", 1e-7), kw.get("power", 1.0)
        return lambda step, progress, total: (lr_end if step > total else (lr - lr_end) * (
            1 - progress) ** power + lr_end) / lr
    # inverse_sqrt: 1 at the end of warmup, then sqrt(timescale / (step - warmup + timescale))
    timescale = kw.get("timescale") or warmup_steps or 10_000
    return lambda step, progress, total: 1.0 / math.sqrt((step + timescale - warmup_steps) / timescale)


__all__ = ["create_optimizer", "get_scheduler", "optimizer_class"]
