"""The rest of torch's DistributedDataParallel surface, on ddpkit's fields.

ddpkit's wrapper subclasses torch's without running torch's constructor, so any torch method it inherited
would run on an object without torch's fields and fail confusingly. Every method and property torch's class
defines beyond nn.Module's is therefore either implemented here or in ddp.py, refused with a NotImplementedError
that names ddpkit and what to use instead (REFUSED), or inherited on purpose because it needs none of torch's
fields (INHERITED). tests/engine/test_torch_surface.py walks torch's class and fails on any name in none of the three.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ddpkit.engine import comm_hooks as hooks
from ddpkit.engine.join import DDPJoinHook, refuse_stage_2

# The element type names torch's logging data gives (c10's TypeMeta names: "float", not "float32").
_TYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
               torch.bfloat16: "c10::BFloat16"}

# torch's own methods that read no field of torch's wrapper: they work on ours as they are.
INHERITED = frozenset({
    "_active_ddp_module",  # the class attribute Dynamo reads; ddpkit sets it on torch's class (ddp.py)
    "scatter", "gather",  # torch's scatter/gather helpers on self.dim
    "_get_parameters",  # a generator over a module's parameters
    "_get_data_parallel_params", "_set_params_and_buffers_to_ignore_for_model",  # static, on a plain module
})  # and torch's override of nn.Module.train, which only returns self

_ENGINE = "ddpkit's own reducer does this work, and nothing needs to call it"
_JOIN = ("it is a piece of torch's join() machinery, which ddpkit's join hook (ddpkit.engine.join) replaces: use "
         "model.join() or torch.distributed.algorithms.join.Join([model, ...])")
_OPTIM = "ddpkit's reducer knows no optimizer: call optimizer.step() after backward"
REFUSED: dict[str, str] = {
    **dict.fromkeys(("_register_accum_grad_hook", "_fire_reducer_autograd_hook", "_ddp_init_helper",
                     "_build_params_for_reducer", "_assign_modules_buffers", "_build_debug_param_to_name_mapping",
                     "_clear_grad_buffer", "_lazy_init", "_distributed_broadcast_coalesced",
                     "_default_broadcast_coalesced", "_check_sync_bufs_pre_fwd", "_check_sync_bufs_post_fwd",
                     "_sync_buffers", "_sync_module_buffers", "_find_common_rank", "_check_comm_hook",
                     "_passing_sync_batchnorm_handle"), _ENGINE),
    **dict.fromkeys(("_check_global_requires_backward_grad_sync", "_check_and_sync_module_buffers",
                     "_sync_final_model", "_match_all_reduce_for_bwd_pass", "_match_unused_params_allreduce"),
                    _JOIN),
    **dict.fromkeys(("_register_fused_optim", "_setup_in_backward_optimizers"), _OPTIM),
    **dict.fromkeys(("_delayed_all_reduce_hook", "_register_delay_all_reduce_hook"),
                    "delayed all-reduce (delay_all_reduce_named_params) is not supported"),
    **dict.fromkeys(("_root_copy_hook", "_module_wait_for_copy_hook"),
                    "DDP-native mixed precision is not supported: use torch.autocast around the forward"),
    "_register_buffer_comm_hook": "buffers are broadcast from rank 0 at each training forward; "
                                  "forward_sync_buffers=False turns that off",
    "_remove_autograd_hooks": "train `model.module` without the wrapper instead",
    "_set_sparse_metadata": "sparse gradients are refused at construction",
    "_update_process_group": "build a new DistributedDataParallel over the new process group",
}


def _refusal(name: str, instead: str):
    def refused(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(f"DistributedDataParallel.{name} is torch's, and ddpkit's wrapper does not "
                                  f"provide it: {instead}")

    refused.__name__ = name
    refused.__qualname__ = f"DistributedDataParallel.{name}"
    refused.ddpkit_refused = True
    return refused


def install_refusals(cls: type) -> None:
    """Give `cls` a refusing method for every name in REFUSED that it does not implement itself."""
    for name, instead in REFUSED.items():
        if name not in cls.__dict__:
            setattr(cls, name, _refusal(name, instead))


class TorchSurface:
    """Implementations of torch's smaller methods; DistributedDataParallel inherits them before torch's."""

    # -- Joinable ------------------------------------------------------------------------------------------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """What torch's Join runs on a rank that ran out of data (see ddpkit.engine.join); the one keyword it reads is
        torch's: divide_by_initial_world_size (default True)."""
        refuse_stage_2(self.zero_stage == 2)  # a joined rank's zero buckets would land in its real shard
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def join_process_group(self) -> dist.ProcessGroup | None:
        """The group the gradients are reduced over (None without any process group)."""
        return self._comm.pg

    # -- small torch APIs ------------------------------------------------------------------------------------------
    @property
    def _distributed_rank(self) -> int:
        return self._comm.rank

    def will_sync_module_buffers(self) -> bool:
        """Whether the next training forward broadcasts the module's buffers from rank 0 (torch's rule)."""
        return self.reducer is not None and bool(self.require_forward_param_sync) and \
            self.forward_sync_buffers and self._buffers_seen > 0

    def _log_and_throw(self, err_type: type[BaseException], err_msg: str):
        raise err_type(err_msg)

    def _check_reducer_finalized(self) -> None:
        """Raise if the last backward pass did not finish its reduction (it raised half-way, say)."""
        backward_pass = self.reducer.backward_pass if self.reducer is not None else None
        if backward_pass is not None and backward_pass.open:
            raise RuntimeError("the last backward pass through DistributedDataParallel did not finish reducing "
                               "its gradients (it raised before its end?); run a complete backward pass")

    def _set_static_graph(self) -> None:
        """Accepted for compatibility (accelerate calls it): ddpkit learns the graph in the first iteration.
        torch's checks: once only (a warning), and before the first training forward (a RuntimeError)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
            return
        self.static_graph = True  # torch's is set before its reducer raises
        if self._training_forwards:  # forwards with grad and synchronisation asked, torch's reducer's iterations
            raise RuntimeError("set_static_graph() should be called before training loop starts and after "
                               "DistributedDataParallel is constructed.")
        if self.find_unused_parameters:
            warnings.warn("You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` "
                          "will detect unused parameters automatically, so you do not need to set "
                          "find_unused_parameters=true, just be sure these unused parameters will not change "
                          "during training loop while calling `_set_static_graph`.", stacklevel=2)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Accepted for compatibility; ddpkit records no runtime statistics, so the rate changes nothing."""
        if sample_rate < 1:
            raise ValueError(f"the runtime logging sample rate must be at least 1, got {sample_rate}")

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Accepted for compatibility: ddpkit never copies the forward's outputs, so there is nothing to turn off."""
        self._ddp_sink_clone = bool(val)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's two built-in hooks, mapped to ddpkit's Python ones (same averages)."""
        builtin = {dist.BuiltinCommHookType.ALLREDUCE: hooks.allreduce_hook,
                   dist.BuiltinCommHookType.FP16_COMPRESS: hooks.fp16_compress_hook}
        if comm_hook_type not in builtin:
            raise ValueError(f"unknown built-in comm hook {comm_hook_type!r}; torch has ALLREDUCE and FP16_COMPRESS")
        self.register_comm_hook(None, builtin[comm_hook_type])

    @classmethod
    def _get_active_ddp_module(cls):
        """The wrapper whose forward is running, for Dynamo's DDPOptimizer (see ddp.py's _inside_ddp_forward)."""
        return TorchDDP._active_ddp_module

    def to_kwargs(self, inputs: tuple, kwargs: dict, device_id: int):
        from torch.distributed.utils import _to_kwargs

        device_type = next(self.module.parameters()).device.type
        return _to_kwargs(inputs, kwargs, torch.device(device_type, device_id), False)

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's keys where ddpkit has the same fact (strings and integers, as torch's), plus ddpkit's own."""
        params = [p for _, p in self._named_trainable()]
        reducer = self.reducer
        buckets = [] if reducer is None else [sum(params[i].numel() * params[i].element_size() for i in members)
                                              for members in (b.members for b in reducer.buckets)]
        return {
            "module_name": type(self.module).__name__,
            "backend_name": self._comm.backend,
            "world_size": self._comm.world_size,
            "rank": self._comm.rank,
            "device_ids": "" if self.device_ids is None else ",".join(map(str, self.device_ids)),
            "output_device": -1 if self.output_device is None else self.output_device,
            "broadcast_buffers": int(self.forward_sync_buffers),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "static_graph": int(self.static_graph),
            "has_sync_bn": int(any(isinstance(m, torch.nn.SyncBatchNorm) for m in self.module.modules())),
            "is_multi_device_module": int(len({p.device for p in params}) > 1),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "dtypes": ", ".join(sorted({_TYPE_NAMES.get(p.dtype, str(p.dtype).replace("torch.", "")) for p in params})),
            "bucket_sizes": ", ".join(map(str, buckets)),
            "iteration": 0 if reducer is None else reducer.synced_passes,
            "comm_hook": "" if reducer is None or reducer.comm_hook is None else
            getattr(reducer.comm_hook, "__qualname__", repr(reducer.comm_hook)),
            "has_rebuilt_buckets": int(bool(buckets)),  # ddpkit builds its buckets once, at the first backward
            "rebuilt_bucket_sizes": ", ".join(map(str, buckets)),
            **_environment(self._comm.backend),
            "ddpkit": 1,
        }


def _environment(backend: str) -> dict[str, Any]:
    """The launch environment torch's logging data reports: variables as set ("N/A" when not), gloo's threads."""
    names = ["MASTER_ADDR", "MASTER_PORT", "TORCH_DISTRIBUTED_DEBUG", "CUDA_VISIBLE_DEVICES"]
    names += ["GLOO_SOCKET_IFNAME", "GLOO_DEVICE_TRANSPORT"] if backend == "gloo" else []
    found: dict[str, Any] = {name.lower(): os.environ.get(name, "N/A") for name in names}
    if backend == "gloo":
        found["gloo_num_threads"] = 2  # torch's default for the gloo backend of a DDP process group
    return found
