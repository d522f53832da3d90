"""Checks of training arguments: each field's range and the rules between fields, raising `ArgumentError` that
names the culprit. `ddpkit.args.training_args.TrainingArguments` runs them when it is built; this module imports nothing of
ddpkit's and knows the arguments only by their field names.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import ArgumentError

# The lr_scheduler_kwargs each schedule takes (Transformers' schedule functions' keyword arguments).
SCHEDULER_KWARGS: dict[str, tuple[str, ...]] = {"linear": (), "cosine": ("num_cycles",),
                                                "cosine_with_restarts": ("num_cycles",),
                                                "polynomial": ("lr_end", "power"), "constant": (),
                                                "constant_with_warmup": (), "inverse_sqrt": ("timescale",)}
SCHEDULERS = tuple(SCHEDULER_KWARGS)
STRATEGIES = ("no", "steps", "epoch")
SAVE_STRATEGIES = (*STRATEGIES, "best")  # best: at an evaluation that beats the best metric so far
DDP_BACKENDS = ("nccl", "gloo", "mpi", "xccl", "ccl", "hccl", "cncl", "mccl", "ucc")
REPORTERS = ("tensorboard",)  # integrations ddpkit speaks; "all" means these, "none" none
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adafactor")  # Transformers' names (ddpkit.trainer.optimizers)
# The keys optim_args may set for each optimizer (Transformers' "k1=v1,k2=v2"), and the type of each value.
OPTIM_ARGS: dict[str, dict[str, type]] = {"adamw_torch": {}, "adamw_torch_fused": {},
                                          "sgd": {"momentum": float, "dampening": float, "nesterov": bool},
                                          "adafactor": {"beta2_decay": float, "d": float}}


def _backend_usable(backend: str) -> str | None:
    """Why `backend` cannot run on this machine, or None when it can (checked without a process group)."""
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        return "nccl needs CUDA GPUs and a torch build with NCCL; none is visible here (use gloo on CPU)"
    if backend == "gloo" and not dist.is_gloo_available():
        return "this torch build has no gloo"
    if backend == "mpi" and not dist.is_mpi_available():
        return "this torch build has no MPI support"
    if backend in ("xccl", "ccl") and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        return f"{backend} needs Intel XPUs, and none is visible"
    if backend == "hccl" and not hasattr(torch, "npu"):
        return "hccl needs Ascend NPUs (torch_npu), and none is visible"
    if backend == "cncl" and not hasattr(torch, "mlu"):
        return "cncl needs Cambricon MLUs (torch_mlu), and none is visible"
    if backend == "mccl" and not hasattr(torch, "musa"):
        return "mccl needs Moore Threads GPUs (torch_musa), and none is visible"
    if backend == "ucc" and not getattr(dist, "is_ucc_available", lambda: False)():
        return "this torch build has no UCC support"
    return None


def _unwritable(folder: str) -> str | None:
    """Why `folder` could not be created or written into, or None (looks only: creates nothing)."""
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    if not os.path.isdir(path):
        return f"{path} is a file, not a folder"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"no permission to write in {path}"
    return None


def validate(args: Any) -> None:
    """Raise `ArgumentError` for the first invalid value or contradictory combination."""

    def need(ok: bool, field: str, message: str) -> None:
        if not ok:
            raise ArgumentError(field, f"{message} (got {getattr(args, field)!r})")

    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        need(getattr(args, name) >= 1, name, "must be >= 1")
    for name in ("learning_rate", "weight_decay", "adam_epsilon", "max_grad_norm", "warmup_steps"):
        need(getattr(args, name) >= 0, name, "must be >= 0")
    for name in ("adam_beta1", "adam_beta2"):
        need(0 <= getattr(args, name) < 1, name, "must be in [0, 1)")
    for name in ("learning_rate", "max_grad_norm", "num_train_epochs", "adam_epsilon", "ddp_timeout", "warmup_steps"):
        need(math.isfinite(getattr(args, name)), name, "must be finite")
    need(args.max_steps == -1 or args.max_steps > 0, "max_steps", "must be > 0, or -1 to train by epochs")
    need(args.max_steps > 0 or args.num_train_epochs > 0, "num_train_epochs",
         "must be > 0 when max_steps is not set")
    need(args.lr_scheduler_type in SCHEDULERS, "lr_scheduler_type", f"must be one of {', '.join(SCHEDULERS)}")
    need(0 <= args.warmup_ratio <= 1, "warmup_ratio", "must be in [0, 1]")
    for name, allowed in (("eval_strategy", STRATEGIES), ("save_strategy", SAVE_STRATEGIES),
                          ("logging_strategy", STRATEGIES)):
        need(getattr(args, name) in allowed, name, f"must be one of {', '.join(allowed)}")
    for name in ("logging_steps", "eval_steps", "save_steps"):
        value = getattr(args, name)
        need(0 < value < math.inf, name, "must be > 0 and finite (a float < 1 is a fraction of the total steps)")
        need(not 1 < value < math.inf or float(value).is_integer(), name,
             "must be a whole number of steps when above 1 (a float below 1 is a fraction of the total steps)")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        need(float(getattr(args, name)).is_integer(), name, "must be a whole number")
    need(args.warmup_steps < 1 or float(args.warmup_steps).is_integer(), "warmup_steps",
         "must be a whole number, or a float below 1 (a fraction of the total steps)")
    need(args.neftune_noise_alpha is None or args.neftune_noise_alpha >= 0, "neftune_noise_alpha", "must be >= 0")
    need(args.save_total_limit is None or args.save_total_limit >= 1, "save_total_limit",
         "must be >= 1, or unset to keep every checkpoint")
    need(0 <= args.seed < 2**32, "seed", "must be in [0, 2**32) (numpy's seed range)")
    need(args.data_seed is None or 0 <= args.data_seed < 2**32, "data_seed", "must be in [0, 2**32)")
    need(bool(args.output_dir), "output_dir", "must name a folder")
    if args.output_dir:
        problem = _unwritable(args.output_dir)
        need(problem is None, "output_dir", f"cannot be written: {problem}")
    unknown = [r for r in args.report_to if r not in (*REPORTERS, "all", "none")]
    need(not unknown, "report_to", f"ddpkit reports to {', '.join(REPORTERS)}, all or none; unknown: {unknown}")
    need(not ("none" in args.report_to and len(args.report_to) > 1), "report_to",
         "'none' cannot be combined with integrations")
    resume = args.resume_from_checkpoint
    need(resume in (None, True) or (isinstance(resume, str) and os.path.isdir(resume)), "resume_from_checkpoint",
         "must be an existing checkpoint folder, or 'true' for the newest in output_dir")
    need(args.label_names is None or (isinstance(args.label_names, list) and all(
        isinstance(n, str) and n for n in args.label_names)), "label_names", "must be a list of batch keys")
    _validate_scheduler_kwargs(args, need)
    _validate_loaders(args, need)
    _validate_evaluation(args, need)
    _validate_best_model(args, need)
    _validate_ddp(args, need)
    _validate_flags(args, need)
    if args.bf16:
        need(torch.cuda.is_available() is False or torch.cuda.is_bf16_supported(), "bf16",
             "this GPU does not support bfloat16")


def _validate_scheduler_kwargs(args: Any, need: Callable[[bool, str, str], None]) -> None:
    """lr_scheduler_kwargs: the keys lr_scheduler_type takes, with values in their range."""
    kwargs = args.lr_scheduler_kwargs
    need(kwargs is None or isinstance(kwargs, dict), "lr_scheduler_kwargs", "must be a dict (JSON on the command "
         "line)")
    kwargs = kwargs or {}
    allowed = SCHEDULER_KWARGS.get(args.lr_scheduler_type, ())
    unknown = sorted(set(kwargs) - set(allowed))
    need(not unknown, "lr_scheduler_kwargs", f"{args.lr_scheduler_type} takes {', '.join(allowed) or 'none'}; "
         f"unknown: {unknown}")
    for key, value in kwargs.items():
        need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
             "lr_scheduler_kwargs", f"{key} must be a finite number")
    need(kwargs.get("num_cycles", 1) > 0 and kwargs.get("power", 1.0) > 0 and kwargs.get("lr_end", 0) >= 0,
         "lr_scheduler_kwargs", "num_cycles and power must be > 0, lr_end >= 0")
    need(kwargs.get("timescale", 1) >= 1, "lr_scheduler_kwargs", "timescale must be >= 1 step")
    if args.lr_scheduler_type == "polynomial":  # as Transformers: it decays from learning_rate down to lr_end
        need(kwargs.get("lr_end", 1e-7) < args.learning_rate, "lr_scheduler_kwargs",
             f"lr_end ({kwargs.get('lr_end', 1e-7)}) must be below learning_rate ({args.learning_rate})")


def _validate_evaluation(args: Any, need: Callable[[bool, str, str], None]) -> None:
    need(args.eval_delay >= 0, "eval_delay", "must be >= 0 (steps or epochs before the first evaluation)")
    need(set(args.include_for_metrics) <= {"inputs", "loss"}, "include_for_metrics", "takes inputs and loss only")
    need(args.eval_accumulation_steps is None or args.eval_accumulation_steps >= 1, "eval_accumulation_steps",
         "must be >= 1, or unset")


def _validate_loaders(args: Any, need: Callable[[bool, str, str], None]) -> None:
    need(args.train_sampling_strategy in ("random", "sequential", "group_by_length"), "train_sampling_strategy",
         "must be random, sequential or group_by_length (Transformers' batch_rebalance is not ddpkit's: "
         "group_by_length batches samples of similar length together)")
    need(args.dataloader_num_workers >= 0, "dataloader_num_workers", "must be >= 0")
    need(args.dataloader_multiprocessing_context in (None, "fork", "spawn", "forkserver"),
         "dataloader_multiprocessing_context", "must be fork, spawn or forkserver, or unset")
    for name in ("dataloader_persistent_workers", "dataloader_prefetch_factor",  # torch's DataLoader refuses them
                 "dataloader_multiprocessing_context"):
        need(args.dataloader_num_workers > 0 or getattr(args, name) in (None, False), name,
             "needs worker processes: set dataloader_num_workers > 0")
    need(args.dataloader_prefetch_factor is None or args.dataloader_prefetch_factor >= 1, "dataloader_prefetch_factor",
         "must be >= 1")


def _validate_best_model(args: Any, need: Callable[[bool, str, str], None]) -> None:
    """load_best_model_at_end ranks the checkpoints by an evaluation made at the step each was saved;
    save_strategy best saves at the evaluations that beat the best metric_for_best_model so far."""
    if args.save_strategy == "best":
        need(args.eval_strategy != "no", "save_strategy", "best saves after an evaluation that beats the best so "
             "far: set eval_strategy to steps or epoch (and pass an eval_dataset)")
        need(args.metric_for_best_model is not None, "save_strategy", "best needs metric_for_best_model (the "
             "metric that decides what is best), as in Transformers")
        return
    if not args.load_best_model_at_end:
        return
    need(args.eval_strategy != "no", "load_best_model_at_end", "needs evaluations: set eval_strategy to steps or "
         "epoch (and pass an eval_dataset)")
    need(args.save_strategy == args.eval_strategy, "load_best_model_at_end", f"needs save_strategy to match "
         f"eval_strategy (got save_strategy={args.save_strategy}, eval_strategy={args.eval_strategy}): a "
         "checkpoint is ranked by the evaluation of the step it was saved at")
    if args.save_strategy != "steps":
        return
    ratios = [args.save_steps < 1, args.eval_steps < 1]
    need(all(ratios) or not any(ratios), "load_best_model_at_end", f"needs save_steps ({args.save_steps}) and "
         f"eval_steps ({args.eval_steps}) both in steps or both fractions of the total, so that every checkpoint "
         "has an evaluation")
    # As Transformers: fractions compared in millionths (0.3 and 0.6 are not multiples in binary floating point)
    scale = 1 if args.save_steps >= 1 else 1_000_000
    need(round(args.save_steps * scale) % round(args.eval_steps * scale) == 0, "load_best_model_at_end",
         f"needs save_steps ({args.save_steps}) to be a multiple of eval_steps ({args.eval_steps}), so that every "
         "checkpoint has an evaluation")


def _validate_ddp(args: Any, need: Callable[[bool, str, str], None]) -> None:
    """The ddp_* fields and the DDP settings other fields imply."""
    need(args.ddp_timeout > 0, "ddp_timeout", "must be > 0 seconds")
    need(args.ddp_stall_seconds is None or 0 <= args.ddp_stall_seconds < args.ddp_timeout, "ddp_stall_seconds",
         "must be >= 0 and below ddp_timeout (it explains a stall before the timeout ends it)")
    need(args.ddp_replica_check_steps >= 0, "ddp_replica_check_steps", "must be >= 0 (0: never)")
    steps = (args.ddp_timeline_steps or "1:1").split(":") if isinstance(args.ddp_timeline_steps or "", str) else []
    need(len(steps) == 2 and all(s.strip().isdigit() and int(s) >= 1 for s in steps) and int(steps[0]) <= int(
        steps[1]), "ddp_timeline_steps", "must be A:B with 1 <= A <= B (optimizer steps, both included)")
    need(args.ddp_zero_stage in (0, 1, 2) and not isinstance(args.ddp_zero_stage, bool), "ddp_zero_stage",
         "must be 0 (DDP), 1 (optimizer state sharded) or 2 (gradients too)")
    need(args.ddp_bucket_cap_mb is None or args.ddp_bucket_cap_mb > 0, "ddp_bucket_cap_mb", "must be > 0 MiB")
    if args.ddp_backend is not None:
        need(args.ddp_backend in DDP_BACKENDS, "ddp_backend", f"must be one of {', '.join(DDP_BACKENDS)}")
        why = _backend_usable(args.ddp_backend)
        need(why is None, "ddp_backend", f"cannot run here: {why}")
    # The Transformers guide: with gradient checkpointing the re-run forward marks parameters used twice, which
    # find_unused_parameters reports as an error, and buffers must not be re-broadcast mid-recomputation.
    if args.gradient_checkpointing:
        need(args.ddp_find_unused_parameters is not True, "ddp_find_unused_parameters",
             "cannot be true together with gradient_checkpointing; leave it unset or set it false")
        need(args.ddp_broadcast_buffers is not True, "ddp_broadcast_buffers",
             "cannot be true together with gradient_checkpointing; leave it unset or set it false")


# -- fp16, torch_compile, optim (issue 12) ------------------------------------------------------------------------

def parse_optim_args(text: str | None, optim: str) -> dict[str, float | bool]:
    """optim_args "k1=v1,k2=v2" as keyword arguments of `optim`'s class; ArgumentError naming a bad key or value."""
    allowed, out = OPTIM_ARGS.get(optim, {}), {}
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not eq or key not in allowed:
            keys = ", ".join(allowed) or "none"
            raise ArgumentError("optim_args", f"{item!r} is not key=value with a key {optim} takes (its keys: "
                                              f"{keys}); write them as k1=v1,k2=v2")
        if allowed[key] is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ArgumentError("optim_args", f"{key} must be true or false (got {value!r})")
            out[key] = value.lower() in ("true", "1")
        else:
            try:
                out[key] = float(value)
            except ValueError:
                raise ArgumentError("optim_args", f"{key} must be a number (got {value!r})") from None
    return out


def _validate_flags(args: Any, need: Callable[[bool, str, str], None]) -> None:
    """fp16, the torch_compile fields and optim: Transformers' flags, checked before any process group."""
    need(not (args.fp16 and args.bf16), "fp16", "cannot be combined with bf16: choose one (bf16 needs no gradient "
                                                "scaler where the hardware has it)")
    need(not args.fp16 or torch.cuda.is_available(), "fp16", "needs a CUDA GPU (float16 autocast with a gradient "
                                                             "scaler) and none is visible here; on a CPU use bf16")
    need(args.optim in OPTIMIZERS, "optim", f"must be one of {', '.join(OPTIMIZERS)}")
    need(args.include_num_input_tokens_seen in ("no", "all", "non_padding"), "include_num_input_tokens_seen",
         "must be no, all or non_padding (or a bool: True is all)")
    need(0 <= args.label_smoothing_factor < 1, "label_smoothing_factor", "must be >= 0 (0: none) and below 1")
    need(args.torch_empty_cache_steps is None or (float(args.torch_empty_cache_steps).is_integer() and
                                                  args.torch_empty_cache_steps >= 1), "torch_empty_cache_steps",
         "must be a whole number of steps >= 1, or unset")
    options = parse_optim_args(args.optim_args, args.optim)
    need(not options.get("nesterov") or (options.get("momentum", 0) > 0 and options.get("dampening", 0) == 0),
         "optim_args", "nesterov=true needs momentum > 0 and dampening=0 (torch.optim.SGD's rule)")
    need(all(v >= 0 for k, v in options.items() if k in ("momentum", "dampening")), "optim_args",
         "momentum and dampening must be >= 0")
    need(options.get("beta2_decay", -0.8) <= 0 and options.get("d", 1.0) >= 1, "optim_args",
         "adafactor takes beta2_decay <= 0 and d >= 1 (torch.optim.Adafactor's rules)")
    need(not (args.optim == "adafactor" and args.ddp_zero_stage == 2), "optim", "adafactor needs whole tensors "
         "(row and column statistics), but ddp_zero_stage=2 gives each rank flat slices; use ddp_zero_stage 0 or 1")
    if not args.torch_compile:
        return
    from torch._dynamo import list_backends  # only when compiling: it takes seconds to import

    need(args.torch_compile_backend in list_backends(exclude_tags=()), "torch_compile_backend",
         f"must be one of torch.compile's backends ({', '.join(list_backends())}, or a debug one such as eager "
         "or aot_eager)")
    if args.torch_compile_mode is not None:
        from torch._inductor import list_mode_options

        modes = list(list_mode_options())
        need(args.torch_compile_mode in modes, "torch_compile_mode", f"must be one of {', '.join(modes)}, or unset")
        need(args.torch_compile_backend == "inductor", "torch_compile_mode", "is inductor's; with "
             f"torch_compile_backend={args.torch_compile_backend!r} leave it unset")


__all__ = ["ArgumentError", "OPTIMIZERS", "OPTIM_ARGS", "parse_optim_args", "validate"]
