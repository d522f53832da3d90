"""What DistributedDataParallel's constructor checks, each as a plain function.

Every check raises the exception type torch's wrapper raises for the same misuse (so that code and tests
written against torch's keep working), with a message that says what was wrong and how to fix it. Where
torch accepts something ddpkit cannot do, the error is NotImplementedError (a RuntimeError) naming ddpkit.
Where torch silently accepts nonsense (a bucket of zero bytes, `output_device=0` without `device_ids`, a
`device_ids` entry that is not the module's device), ddpkit refuses it with ValueError, torch's type for the
neighbouring misuses.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.distributed.comm import Comm
from ddpkit.engine.reducer import DEFAULT_BUCKET_CAP_MB
from ddpkit.errors import ReplicaDivergenceError


def process_group_of(process_group: dist.ProcessGroup | None, device_mesh: Any) -> dist.ProcessGroup | None:
    """The group to reduce over: `process_group`, or the one dimension of `device_mesh` (None: the default)."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments: pass one of them to "
                           "DistributedDataParallel")
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}: pass the data-parallel "
                           "dimension, e.g. mesh['dp']")
    if device_mesh._get_root_mesh() != device_mesh:
        raise NotImplementedError("ddpkit's DistributedDataParallel does not combine with tensor parallelism "
                                  "(a mesh sliced out of a larger one); use torch.nn.parallel's wrapper there")
    return device_mesh.get_group(mesh_dim=0)


def refuse_torch_only(delay_all_reduce_named_params: Any, param_to_hook_all_reduce: Any, mixed_precision: Any,
                      bucket_cap_mb_list: Any) -> None:
    """torch's arguments that ddpkit's engine does not implement (torch's pairing rule is checked first)."""
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce go together: "
                         "pass both or neither")
    given = [name for name, value in (("delay_all_reduce_named_params", delay_all_reduce_named_params),
                                      ("param_to_hook_all_reduce", param_to_hook_all_reduce),
                                      ("mixed_precision", mixed_precision),
                                      ("bucket_cap_mb_list", bucket_cap_mb_list)) if value is not None]
    if given:
        raise NotImplementedError(f"ddpkit's DistributedDataParallel does not support {given}; drop them "
                                  "(for mixed precision use torch.autocast around the forward) or use "
                                  "torch.nn.parallel.DistributedDataParallel")


def names_to_ignore(module: nn.Module) -> set[str]:
    """Parameter and buffer names the wrapper leaves alone: torch's `module._ddp_params_and_buffers_to_ignore`
    (set by `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`)."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def trainable_parameters(module: nn.Module, ignore: set[str]) -> list[tuple[str, nn.Parameter]]:
    """The parameters to reduce, by name, in registration order (a parameter shared by two layers once)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignore]
    if not named:
        raise RuntimeError("DistributedDataParallel needs a module with at least one parameter that requires "
                           "a gradient; this one has none, so there is nothing to synchronise")
    for name, param in named:
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise RuntimeError(f"parameter '{name}' is not initialised yet (a lazy module): run one forward pass "
                               "on a sample batch before wrapping the module")
    sparse = [name for name, m in module.named_modules() if getattr(m, "sparse", False) is True]
    if sparse:
        raise NotImplementedError(f"module {sparse[0]!r} produces sparse gradients, which ddpkit's buckets do not "
                                  "hold; construct it with sparse=False (dense gradients are all-reduced in "
                                  "buckets) or use torch.nn.parallel.DistributedDataParallel")
    return named


def devices(named: list[tuple[str, nn.Parameter]], device_ids, output_device) -> tuple[list[int] | None, Any]:
    """torch's (device_ids, output_device) attributes: the module's one CUDA device, or (None, None)."""
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"device_ids must hold exactly one device (this process's), got {device_ids}; "
                         "ddpkit runs one process per device")
    placed = {p.device for _, p in named}
    kinds = {d.type for d in placed}
    if len(kinds) != 1:
        raise ValueError(f"the module's parameters are on several kinds of device {sorted(kinds)}; move the "
                         "whole module to one kind (module.to(device)) before wrapping it")
    if not device_ids:  # torch takes [] for None
        if output_device is not None:
            raise ValueError("output_device is only meaningful together with device_ids")
        return None, None
    if len(placed) != 1 or kinds != {"cuda"}:
        raise ValueError(f"device_ids={device_ids} is only for a module on one CUDA device, but this module's "
                         f"parameters are on {sorted(map(str, placed))}; leave device_ids=None for CPU or "
                         "multi-device modules")
    index = _cuda_index(device_ids[0])
    (device,) = placed
    if device.index != index:
        raise ValueError(f"device_ids={device_ids} but the module is on {device}; move it with "
                         f"module.to('cuda:{index}') or pass device_ids=[{device.index}]")
    return [index], index if output_device is None else _cuda_index(output_device)


def _cuda_index(device: int | str | torch.device) -> int:
    """A device's index; "cuda" without one is the current device, as torch's wrapper reads it."""
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(forward_sync_buffers, buffers broadcast at construction), with torch 2.13's precedence.

    forward_sync_buffers, when given, decides the broadcast at each forward and buffers are always synced at
    construction; otherwise the deprecated broadcast_buffers (default True) decides both.
    """
    if broadcast_buffers is not None:  # torch 2.13 warns whenever it is given
        warnings.warn("both broadcast_buffers and forward_sync_buffers were given to DistributedDataParallel; "
                      "broadcast_buffers is deprecated and ignored when forward_sync_buffers is given"
                      if forward_sync_buffers is not None else
                      "broadcast_buffers is deprecated: use forward_sync_buffers. Unlike broadcast_buffers=False, "
                      "forward_sync_buffers=False still broadcasts rank 0's buffers at construction; keep "
                      "broadcast_buffers=False where buffers must stay rank-local", FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    forward = True if broadcast_buffers is None else bool(broadcast_buffers)
    return forward, forward


def no_sync_batchnorm_on_cpu(module: nn.Module, named: list[tuple[str, nn.Parameter]]) -> None:
    """torch's refusal, with its type and words: SyncBatchNorm needs a GPU module."""
    on_cpu = (named[0][1].device.type if named else "cpu") == "cpu"
    if on_cpu and any(isinstance(layer, nn.SyncBatchNorm) for layer in module.modules()):
        raise ValueError("SyncBatchNorm layers only work with GPU modules: move the module to its GPU before "
                         "wrapping it, or use BatchNorm on the CPU")


def bucket_cap(bucket_cap_mb: float | None) -> float:
    cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else float(bucket_cap_mb)
    if not cap > 0:
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb}")
    return cap


def warn_check_reduction(check_reduction: bool) -> None:
    if check_reduction:
        warnings.warn("check_reduction is deprecated (in torch too) and changes nothing: ddpkit always completes "
                      "the reduction, also when parameters get no gradient", FutureWarning, stacklevel=3)


# -- the same model on every rank (a collective) ------------------------------------------------------------------
def check_same_model(module: nn.Module, comm: Comm, ignore: set[str]) -> None:
    """Fail on every rank, with the same message, when any rank's model differs from rank 0's."""
    every = comm.all_gather_object(_signature(module, ignore), what="model check")
    reference = every[0]
    for rank, other in enumerate(every[1:], start=1):
        problem = _first_difference(reference, other)
        if problem is not None:
            raise RuntimeError(f"the model on rank {rank} differs from rank 0's: {problem}. Every rank must build "
                               "the same model (same layers, shapes, dtypes and requires_grad) before wrapping it")


def _signature(module: nn.Module, ignore: set[str]) -> list[tuple]:
    params = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad)
              for n, p in module.named_parameters() if n not in ignore]
    buffers = [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers() if n not in ignore]
    return params + buffers


def _first_difference(reference: list[tuple], other: list[tuple]) -> str | None:
    for position, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return f"entry {position} is {_describe(b)} there but {_describe(a)} on rank 0"
    if len(reference) != len(other):
        longer, which = (reference, "rank 0") if len(reference) > len(other) else (other, "it")
        extra = longer[min(len(reference), len(other))]
        return (f"{len(other)} parameters and buffers there, {len(reference)} on rank 0; the first extra one "
                f"({which}) is {_describe(extra)}")
    return None


def _describe(entry: tuple) -> str:
    kind, name, shape, dtype, *rest = entry
    grad = "" if not rest else (", requires_grad" if rest[0] else ", frozen")
    return f"{kind} '{name}' {list(shape)} {dtype.replace('torch.', '')}{grad}"


def check_replicas(module: nn.Module, comm: Comm, what: str) -> None:
    """DistributedDataParallel.check_replicas: one all-gather of each parameter's float64 sum and sum of squares,
    compared bit for bit with rank 0's; raises on every rank, naming the first diverging rank and parameter."""
    named = list(module.named_parameters())
    with torch.no_grad():
        prints = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()]) for _, p in named])
    every = comm.all_gather(prints.view(torch.int64), what).cpu()
    for rank in range(1, every.shape[0]):
        rows = (every[rank] != every[0]).any(dim=1).nonzero()
        if len(rows):
            name = named[int(rows[0])][0]
            raise ReplicaDivergenceError(
                f"rank {rank}'s replica differs from rank 0's, first at parameter '{name}' ({len(rows)} "
                "parameter(s) differ). Something changed parameters on one rank only: an update outside "
                "backward/optimizer.step, a non-deterministic op applied to parameters, or a rank that skipped an "
                "optimizer step")


def check_comm_hook(hook: Any) -> None:
    """torch's checks of a comm hook, with its exception types: callable, and where annotated (with objects:
    a string annotation, from `from __future__ import annotations`, is taken on trust), a GradBucket in and a
    Future of a tensor out. Not torch's refusal of its bf16_compress_hook on a build without CUDA 11+ and NCCL
    2.10+ (a TypeError on every CPU-only torch): the hook averages correctly on gloo too, and is taken."""
    import inspect

    if not callable(hook):
        raise TypeError("Communication hook must be callable: hook(state, bucket) -> torch.futures.Future")
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing annotated to check
    bucket = signature.parameters.get("bucket")
    annotation = bucket.annotation if bucket is not None else inspect.Parameter.empty
    if not isinstance(annotation, str) and annotation not in (inspect.Parameter.empty, dist.GradBucket):
        raise ValueError(f"Communication hook: bucket annotation should be dist.GradBucket (it is {annotation!r})")
    returned = signature.return_annotation
    if not isinstance(returned, str) and returned not in (inspect.Signature.empty, torch.futures.Future[torch.Tensor]):
        raise ValueError(f"Communication hook: return annotation should be torch.futures.Future[torch.Tensor] (it "
                         f"is {returned!r})")
