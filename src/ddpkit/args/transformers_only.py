"""The fields of Transformers' TrainingArguments that ddpkit's have not, each with Transformers' default and what
to do instead. A script written for Transformers passes some of them: left at Transformers' default (what
ddpkit's Trainer does anyway) they are taken and dropped; set to anything else they raise `ForeignArgument`,
which says what ddpkit offers in their place, not only that the keyword is unknown. Of ddpkit, imports only
ddpkit.args.validation (ArgumentError).
"""

from __future__ import annotations

import copy
from typing import Any

from ddpkit.errors import ArgumentError

_SHARDING = "ddpkit shards across its ranks itself: ddp_zero_stage=1 or 2 (ZeRO stages 1 and 2)"
_HUB = "ddpkit uploads nothing: push output_dir (from_pretrained loads it and every checkpoint) with huggingface_hub"
_TRACKING = "ddpkit reports to tensorboard only (report_to)"
_LOGS = "ddpkit logs on rank 0; every rank's output is in the launcher's files (ddpkit launch --log-dir)"
_EVAL = "ddpkit's evaluation gathers every rank's predictions, in dataset order, for compute_metrics on every rank"
_NOT_YET = "ddpkit's Trainer does not implement it"
_LOADER = "ddpkit's Trainer takes its batches in order: a resume continues at the exact next sample"

# name -> (Transformers' default, what to do instead)
FOREIGN: dict[str, tuple[Any, str]] = {
    "deepspeed": (None, _SHARDING), "fsdp": (None, _SHARDING), "fsdp_config": (None, _SHARDING),
    "parallelism_config": (None, _SHARDING), "accelerator_config": (None, "ddpkit does not run on accelerate"),
    "push_to_hub": (False, _HUB), "hub_model_id": (None, _HUB), "hub_strategy": ("every_save", _HUB),
    "hub_token": (None, _HUB), "hub_private_repo": (None, _HUB), "hub_always_push": (False, _HUB),
    "hub_revision": (None, _HUB),
    "project": ("huggingface", _TRACKING), "trackio_space_id": (None, _TRACKING),
    "trackio_bucket_id": (None, _TRACKING), "trackio_static_space_id": (None, _TRACKING),
    "log_level": ("passive", _LOGS), "log_level_replica": ("warning", _LOGS), "log_on_each_node": (True, _LOGS),
    "save_on_each_node": (False, "rank 0 writes every checkpoint into output_dir: give the nodes a shared one"),
    "skip_memory_metrics": (True, "ddpkit reports no memory metrics"),
    "average_tokens_across_devices": (True, "ddpkit always divides the loss by the items of every rank's batches "
                                            "(the loss one process would compute over the global batch)"),
    "eval_use_gather_object": (False, _EVAL),
    "bf16_full_eval": (False, "evaluation runs under the training precision (bf16 or fp16 autocast)"),
    "fp16_full_eval": (False, "evaluation runs under the training precision (bf16 or fp16 autocast)"),
    "dataloader_in_order": (True, _LOADER),
    "ignore_data_skip": (False, "a resume continues at the exact next sample, without replaying the data"),
    "activation_checkpointing": (None, "use gradient_checkpointing"),
    "activation_checkpointing_kwargs": (None, "use gradient_checkpointing"),
    "tf32": (None, "set torch.backends.cuda.matmul.allow_tf32 yourself"),
    "debug": ("", "ddpkit explains a stalled collective itself (ddp_stall_seconds)"),
    **{name: (default, _NOT_YET) for name, default in (
        ("use_liger_kernel", False),
        ("liger_kernel_config", None),
        ("auto_find_batch_size", False), ("optim_target_modules", None), ("enable_jit_checkpoint", False),
        ("use_cache", False))},
}


# Values Transformers' TrainingArguments turns its defaults into (__post_init__, to_dict): as good as the default.
NORMALISED: dict[str, list[Any]] = {
    "hub_token": ["<HUB_TOKEN>"], "debug": [[]], "activation_checkpointing": [False],
    "accelerator_config": [{"split_batches": False, "dispatch_batches": None, "even_batches": True,
                            "use_seedable_sampler": True, "non_blocking": False, "gradient_accumulation_kwargs": None}],
}


class ForeignDropping(type):
    """TrainingArguments' metaclass: every construction (of a subclass too, whose dataclass __init__ is its own)
    drops the Transformers-only keyword arguments at Transformers' default and refuses the others."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        own = getattr(cls, "__dataclass_fields__", {})  # a subclass may declare one of these names: its own field
        kept = {name: value for name, value in kwargs.items() if name in own}
        return super().__call__(*args, **without_foreign({k: v for k, v in kwargs.items() if k not in own}), **kept)


class ForeignDefaults:
    """The Transformers-only fields as attributes of TrainingArguments, at Transformers' default, the only value
    ddpkit takes (a Transformers script may read one off its arguments); a copy where it is a
    list or dict. Setting one to another value raises ForeignArgument; to the default, nothing changes."""

    def __getattr__(self, name: str) -> Any:  # only for names that are no field, property nor method
        if name in FOREIGN:  # as Transformers' __post_init__ leaves it (debug: [], not "")
            return copy.deepcopy(NORMALISED[name][0] if name in NORMALISED else FOREIGN[name][0])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in FOREIGN and name not in getattr(type(self), "__dataclass_fields__", {}):
            without_foreign({name: value})  # ForeignArgument unless it is the default: then dropped, as at __init__
            return
        super().__setattr__(name, value)


class ForeignArgument(ArgumentError, TypeError):
    """A Transformers-only training argument set to something other than Transformers' default: an ArgumentError
    naming the field, and a TypeError as the unknown keyword it is to the dataclass."""

    def __init__(self, field: str, value: Any):
        super().__init__(field, f"{field}={value!r} {explain(field)}")


def explain(field: str, on_command_line: bool = False) -> str:
    default, instead = FOREIGN[field]
    allowed = "" if on_command_line else f" (or at Transformers' default, {default!r})"
    return (f"is a Transformers TrainingArguments field that ddpkit's TrainingArguments has not: {instead}. Leave "
            f"it out{allowed}; --help lists every field ddpkit takes")


def without_foreign(values: dict[str, Any]) -> dict[str, Any]:
    """`values` without the Transformers-only fields at Transformers' default; ForeignArgument for another value."""
    for name in values.keys() & FOREIGN.keys():
        if values[name] != FOREIGN[name][0] and values[name] not in NORMALISED.get(name, []):
            raise ForeignArgument(name, values[name])
    return {name: value for name, value in values.items() if name not in FOREIGN}


def foreign_flag(tokens: list[str]) -> str | None:
    """The first command-line token that names a Transformers-only field (--push_to_hub, --log-level=info)."""
    for token in tokens:
        name = token.partition("=")[0]
        if name.startswith("--") and name[2:].replace("-", "_") in FOREIGN:
            return name[2:].replace("-", "_")
    return None


__all__ = ["FOREIGN", "NORMALISED", "ForeignArgument", "ForeignDefaults", "ForeignDropping", "explain", "foreign_flag",
           "without_foreign"]
