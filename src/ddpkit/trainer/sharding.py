"""How the Trainer chooses plain DDP, ZeRO stage 1 or ZeRO stage 2 (`TrainingArguments.ddp_zero_stage`), one small
function per way, in the manner of torchtitan's parallelize functions:

    ddp_kwargs = zero_ddp_kwargs(stage)                      # what DistributedDataParallel adds for the stage
    optimizer = apply_zero(groups, stage, torch.optim.AdamW, lr=...)   # the optimizer the stage needs
    norm = clip_grad_norm(optimizer, params, max_norm)       # global norm: over the shards at stage 2
    grads = step_gradients(optimizer)                        # what this rank's step reads (fp16 unscales them)
"""

from __future__ import annotations

from typing import Any

import torch

from ddpkit.distributed.comm import Comm
from ddpkit.zero.optimizer import ZeroRedundancyOptimizer


def zero_ddp_kwargs(stage: int) -> dict[str, Any]:
    """Stage 2 is chosen on the wrapper (it reduce-scatters the buckets); stages 0 and 1 are plain DDP there."""
    return {"zero_stage": 2} if stage == 2 else {}


def apply_zero(groups: list[dict[str, Any]], stage: int, optimizer_class: type[torch.optim.Optimizer],
               **defaults: Any) -> torch.optim.Optimizer:
    """Stage 0: the optimizer itself; stages 1 and 2: each rank keeps the state of its shard only."""
    if stage == 0:
        return optimizer_class(groups, **defaults)
    return ZeroRedundancyOptimizer(groups, optimizer_class, **defaults)


def clip_grad_norm(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_, or its sharded form at stage 2 (which leaves no .grad). At stage 1 every
    rank holds every averaged .grad, so torch's own clips them: the same bits as stage 0 (the sharded norm sums
    the pieces' squares, torch takes the norm of each tensor's norm, and the two differ in the last bit), and
    every .grad clipped alike on every rank, for a callback that reads them before the step."""
    if isinstance(optimizer, ZeroRedundancyOptimizer) and optimizer.grad_shards is not None:
        return float(optimizer.clip_grad_norm_(max_norm))
    with_grad = [p for p in params if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(with_grad, max_norm).item() if with_grad else 0.0


def wait_for_params(optimizer: torch.optim.Optimizer | None) -> None:
    """Make the parameters final: stage 2 leaves the last all-gathers in flight (torch functions reading a
    parameter wait for them; code reading its memory otherwise would see the step before the last one)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.wait_for_params()


def step_gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients of the optimizer's parameters, as views that may be changed in place (fp16 unscales them):
    every .grad, and under ZeRO stage 2 this rank's shards of the buckets (which keep no .grad). At stage 1 every
    .grad, not only this rank's slices: torch.nn.utils.clip_grad_norm_(model.parameters()) after unscale_ reads
    them all (torch's recipe), and must not find them still scaled."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer._ensure_built()  # stage 2 partitions by the buckets at the first step: as clip_grad_norm_ does
        grads += [g for unit in optimizer.units if unit.index >= 0 for g in unit.grads()]  # stage 2's shards
    return grads


def agreeing_comm(optimizer: torch.optim.Optimizer) -> Comm | None:
    """Who must agree on a step being skipped: ZeRO's ranks (each checks only the gradients it holds), else no one
    (DDP's averaged gradients are the same everywhere)."""
    return optimizer.comm if isinstance(optimizer, ZeroRedundancyOptimizer) else None
