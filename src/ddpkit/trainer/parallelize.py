"""How the Trainer readies a model for data-parallel training, one function per way, applied in order under an
`if` (torchtitan's parallelize.py reads the same way): gradient checkpointing, the device, our DDP, compile.

    model, wrapped = prepare_model(model, args, world)   # wrapped: what forward/backward run on
    ddp = ddp_of(wrapped)                                # the DDP wrapper, compiled or not (None: a world of one)

`model` is always the plain module, never a compiled one: saving, checkpoints and evaluation use it, so their
state_dict keys never carry torch.compile's `_orig_mod.` prefix, whatever the caller passed in.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddpkit.args.training_args import TrainingArguments
from ddpkit.distributed.env import DistEnv
from ddpkit.engine.ddp import DistributedDataParallel
from ddpkit.errors import ArgumentError
from ddpkit.trainer.sharding import zero_ddp_kwargs


def apply_gradient_checkpointing(model: nn.Module, kwargs: dict | None = None) -> None:
    """Activation checkpointing as Transformers 5 asks a model for it: every_n_layers and offload out of
    gradient_checkpointing_kwargs, the rest (or None for an empty dict) for torch.utils.checkpoint, given to
    activation_checkpointing_enable, else to gradient_checkpointing_enable (its older name; a model of one's own
    whose method takes no arguments gets none where none were set)."""
    rest = dict(kwargs or {})
    layers = {name: rest.pop(name) for name in ("every_n_layers", "offload") if name in rest}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs=rest or None, **layers)
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ArgumentError("gradient_checkpointing", f"{type(model).__name__} has no gradient_checkpointing_enable()"
                                                      "; add one (torch.utils.checkpoint) or drop the flag")
    if kwargs is None:
        enable()
    else:
        enable(gradient_checkpointing_kwargs=rest or None, **layers)


def apply_ddp(model: nn.Module, args: TrainingArguments, world: DistEnv) -> DistributedDataParallel:
    """ddp_broadcast_buffers in Transformers' meaning, torch's broadcast_buffers: False also keeps rank 0's
    buffers out at construction (forward_sync_buffers=False would not), without torch 2.13's deprecation warning,
    which is for callers of the wrapper, not for a Trainer's user."""
    cuda = world.device.type == "cuda"
    static_graph = {} if args.ddp_static_graph is None else {"static_graph": args.ddp_static_graph}  # Transformers'
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "broadcast_buffers is deprecated", FutureWarning)
        return DistributedDataParallel(model, device_ids=[world.device.index] if cuda else None,
                                       find_unused_parameters=args.find_unused_parameters,
                                       broadcast_buffers=args.broadcast_buffers, bucket_cap_mb=args.ddp_bucket_cap_mb,
                                       **zero_ddp_kwargs(args.ddp_zero_stage), **static_graph)


def apply_compile(wrapped: nn.Module, args: TrainingArguments) -> nn.Module:
    """torch.compile(DDP(model)), as torch users write it: while the wrapper's forward runs, Dynamo's DDPOptimizer
    splits the compiled graph at the wrapper's bucket boundaries (ddpkit's DDP tells Dynamo its buckets, see
    engine/ddp.py), so each bucket's all-reduce starts while the compiled backward of the layers before it still runs."""
    return torch.compile(wrapped, backend=args.torch_compile_backend, mode=args.torch_compile_mode)


def _plain(model: nn.Module) -> nn.Module:
    """The module inside torch.compile's wrapper (OptimizedModule keeps it as _orig_mod), or the module itself."""
    dynamo = sys.modules.get("torch._dynamo")  # not imported yet: nothing is compiled (and importing takes seconds)
    return model._orig_mod if dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule) else model


def ddp_of(wrapped: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper that training runs, inside torch.compile's wrapper or not; None in a world of one."""
    inner = _plain(wrapped)
    return inner if isinstance(inner, DistributedDataParallel) else None


def model_from(model: nn.Module | None, model_init: Callable[..., nn.Module] | None,
               optimizers: tuple[Any, Any] = (None, None)) -> nn.Module:
    """The model the Trainer trains, by Transformers' rules (and errors): `model`, or model_init's, called with no
    argument or with the trial None where it takes one; not both, and no optimizers beside model_init (they would
    hold another model's parameters)."""
    if model_init is None:
        if model is None:
            raise RuntimeError("`Trainer` requires either a `model` or `model_init` argument")
        return model
    if model is not None:
        raise ValueError("`Trainer` requires either a `model` or `model_init` argument, but not both.")
    if any(given is not None for given in optimizers):
        raise RuntimeError("Passing a `model_init` is incompatible with providing the `optimizers` argument: "
                           "override create_optimizer (and create_scheduler) instead")
    count = len(inspect.signature(model_init).parameters)
    if count > 1:
        raise RuntimeError("model_init should have 0 or 1 argument.")
    made = model_init(None) if count == 1 else model_init()
    if made is None:
        raise RuntimeError("model_init should not return None.")
    return made


def prepare_model(model: nn.Module, args: TrainingArguments, world: DistEnv) -> tuple[nn.Module, nn.Module]:
    """The plain model on this rank's device, and the module training runs (the DDP wrapper in a world of many,
    compiled under torch_compile). A model the caller compiled already trains compiled, as DDP(compile(model))."""
    if args.torch_compile and _plain(model) is not model:
        raise ArgumentError("torch_compile", "the model is compiled already (torch.compile); pass the plain module "
                                             "with torch_compile, or the compiled one without it")
    if args.gradient_checkpointing:
        apply_gradient_checkpointing(_plain(model), args.gradient_checkpointing_kwargs)
    model = model.to(world.device)
    wrapped = apply_ddp(model, args, world) if world.world_size > 1 else model
    if args.torch_compile:
        wrapped = apply_compile(wrapped, args)
    return _plain(model), wrapped


__all__ = ["apply_compile", "apply_ddp", "apply_gradient_checkpointing", "ddp_of", "model_from", "prepare_model"]
