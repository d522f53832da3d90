"""DistributedDataParallel: a drop-in for torch's wrapper, on ddpkit's own reducer.

    world = ddpkit.init_process_group()
    model = ddpkit.DistributedDataParallel(net.to(world.device), device_ids=[world.local_rank] if cuda else None)
    loss = model(x).loss_fn(...); loss.backward()      # gradients averaged over every rank
    with model.no_sync():                              # accumulate locally, reduce on the next synced backward
        model(x2).sum().backward()

What differs from torch's: a parameter that gets no gradient never hangs and never lets replicas diverge,
whatever `find_unused_parameters` says (see `Reducer`); `find_unused_parameters=True` only adds a walk of
the autograd graph after each forward, so that buckets holding parameters the forward did not reach are
launched during backward instead of at its end (a graph with custom autograd Functions, reentrant
checkpointing among them, is treated as reaching every parameter). Two backward passes after two forwards,
and layers used several times under reentrant activation checkpointing, give the gradients one process
would compute.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils._pytree import tree_flatten, tree_unflatten

from .comm import Comm
from .reducer import DEFAULT_BUCKET_CAP_MB, CommHook, Reducer
from .timeline import recorder_for
from .timeline_record import FORWARD, NULL_RECORDER


class DistributedDataParallel(TorchDDP):
    """Replicates `module` on every rank and averages its gradients during backward.

    The arguments are torch's, with the same meanings and defaults; `check_reduction` and `static_graph` are
    accepted for compatibility and change nothing (unused parameters and reentrant checkpointing are always
    handled; see the module docstring).

    It subclasses torch's wrapper only so that code which asks `isinstance(model, DistributedDataParallel)`
    (accelerate's and the Transformers Trainer's unwrapping, torch.distributed.checkpoint) treats it as one;
    none of torch's engine runs: its constructor is skipped and every method that matters is ours.
    """

    def __init__(self, module: nn.Module, device_ids: list[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool | None = True, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, init_sync: bool = True, **unsupported: Any):
        nn.Module.__init__(self)  # not torch's constructor: its reducer is exactly what we replace
        if unsupported:
            raise TypeError(f"ddpkit's DistributedDataParallel does not support {sorted(unsupported)}; "
                            "drop them or use torch.nn.parallel.DistributedDataParallel")
        self.module = module
        self.device_ids, self.output_device = _check_devices(module, device_ids, output_device)
        self.dim = dim
        self._broadcast_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.bucket_cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else float(bucket_cap_mb)
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb}")
        self.bucket_bytes_cap = int(self.bucket_cap_mb * 1024 * 1024)  # torch's name; torch.compile reads it
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DistributedDataParallel needs a module with at least one parameter that requires "
                             "a gradient; this one has none, so there is nothing to synchronise")
        sparse = [name for name, m in module.named_modules() if getattr(m, "sparse", False) is True]
        if sparse:
            raise ValueError(f"module {sparse[0]!r} produces sparse gradients, which ddpkit's buckets do not hold; "
                             "construct it with sparse=False (dense gradients are all-reduced in buckets)")
        self._comm = Comm.for_group(process_group)
        self.process_group = process_group
        self._buffers_to_sync = [b for b in module.buffers()] if self._broadcast_buffers else []
        if self._comm.distributed:
            _check_same_model(module, self._comm)
            if init_sync:
                self._comm.broadcast_tensors([p.detach() for p in module.parameters()]
                                             + list(module.buffers()), src=0, what="init parameters and buffers")
        self.reducer: Reducer | None = None
        if self._comm.distributed:
            self.reducer = Reducer([p for _, p in named], [n for n, _ in named], self._comm, self.bucket_cap_mb,
                                   gradient_as_bucket_view, default_sync=lambda: self.require_backward_grad_sync)
            self.reducer.recorder = recorder_for(self._comm)  # the timeline, when one records (else a no-op)
            self._param_index = {id(p): i for i, (_, p) in enumerate(named)}
            self._reached: set[int] = set()
            self._reached_window = -1

    @property
    def broadcast_buffers(self) -> bool:
        return self._broadcast_buffers

    def __getstate__(self):
        raise TypeError("a DistributedDataParallel wrapper cannot be pickled (it holds a process group); "
                        "pickle or save `model.module` instead")

    # -- the forward skeleton ------------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        recorder = self.reducer.recorder if self.reducer is not None else NULL_RECORDER
        with recorder.span(FORWARD, "forward"):  # also torch's record_function of that name, under a profiler
            inputs, kwargs = self._pre_forward(inputs, kwargs)
            output = self.module(*inputs, **kwargs)
            return self._post_forward(output)

    def _pre_forward(self, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.device_ids:
            device = torch.device("cuda", self.device_ids[0])
            inputs, kwargs = _move_to(inputs, device), _move_to(kwargs, device)
        if self.reducer is not None and torch.is_grad_enabled() and self._buffers_to_sync:
            # Running statistics and the like come from rank 0 at every training forward.
            self._comm.broadcast_tensors(self._buffers_to_sync, src=0, what="module buffers")
        return inputs, kwargs

    def _post_forward(self, output: Any) -> Any:
        if self.reducer is None or not torch.is_grad_enabled():
            return output
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        nodes = {t.grad_fn for t in tensors if t.grad_fn is not None}
        if not nodes:
            return output  # nothing to arm: the first gradient hook opens the window instead
        sync = self.require_backward_grad_sync  # decided here, at forward time, as torch's wrapper does
        if sync and self.find_unused_parameters:
            self._note_reachable(tensors)
        # A pre-hook on the nodes that produced the outputs runs first in the backward pass that uses them, in
        # the outermost graph task, and costs no copy: the outputs are returned as they are, so users may even
        # change them in place.
        arm = functools.partial(_arm_window, self.reducer, sync)
        for node in nodes:
            node.register_prehook(arm)
        return output

    def _note_reachable(self, outputs: list[torch.Tensor]) -> None:
        """Walk the graph the forward built; parameters it cannot reach need not be waited for in backward."""
        if self._reached_window != self.reducer.windows:  # the first forward since the last synced backward
            self._reached = set()
            self._reached_window = self.reducer.windows
        seen: set = set()
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if isinstance(node, torch.autograd.function.BackwardCFunction):
                # A custom autograd Function may run autograd inside its backward (reentrant checkpointing
                # does) and reach parameters the graph does not show: assume every parameter is reachable.
                self._reached = set(range(len(self.reducer.params)))
                break
            variable = getattr(node, "variable", None)
            if variable is not None:
                index = self._param_index.get(id(variable))
                if index is not None:
                    self._reached.add(index)
            stack.extend(next_node for next_node, _ in node.next_functions)
        self.reducer.set_unreachable([i for i in range(len(self.reducer.params)) if i not in self._reached])

    # -- the torch surface ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward passes run inside accumulate gradients locally; the next synchronised backward
        reduces the sum. As with torch's wrapper, the forward decides: a backward of a forward run inside does
        not synchronise, whether or not it runs inside too."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the bucket all-reduce by `hook(state, bucket) -> Future[Tensor]`, before the first backward."""
        if not callable(hook):
            raise TypeError("the comm hook must be callable as hook(state, bucket) -> torch.futures.Future")
        if self.reducer is None:
            self._comm_hook = (state, hook)  # a world of one never communicates; kept for introspection
            return
        if self.reducer.comm_hook is not None:
            raise RuntimeError("a comm hook is already registered; register_comm_hook may be called only once")
        if self.reducer.windows > 0:
            raise RuntimeError("register_comm_hook must be called before the first backward pass")
        self.reducer.comm_hook, self.reducer.comm_hook_state = hook, state

    def will_sync_module_buffers(self) -> bool:
        return self.reducer is not None and bool(self._buffers_to_sync)

    def _set_static_graph(self) -> None:
        """Accepted for compatibility (accelerate calls it): ddpkit learns the graph in the first iteration."""
        self.static_graph = True

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        raise NotImplementedError("uneven inputs through join() are not supported yet; give every rank the same "
                                  "number of batches (ddpkit.DistributedSampler does) or use ddpkit's Trainer")

    def check_replicas(self, what: str = "replica check") -> None:
        """Fail on every rank, naming the first diverging rank and parameter, if any replica differs from rank 0's.

        Costs one all-gather of two float64 numbers per parameter (a sum and a sum of squares, compared bit for
        bit); cheap enough to run every few hundred steps.
        """
        if self.reducer is None:
            return
        named = [(n, p) for n, p in self.module.named_parameters()]
        with torch.no_grad():
            prints = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()]) for _, p in named])
        every = self._comm.all_gather(prints.view(torch.int64), what).cpu()
        for rank in range(1, every.shape[0]):
            rows = (every[rank] != every[0]).any(dim=1).nonzero()
            if len(rows):
                name = named[int(rows[0])][0]
                raise ReplicaDivergenceError(
                    f"rank {rank}'s replica differs from rank 0's, first at parameter '{name}' "
                    f"({len(rows)} parameter(s) differ). Something changed parameters on one rank only: an "
                    "update outside backward/optimizer.step, a non-deterministic op applied to parameters, or "
                    "a rank that skipped an optimizer step")

    @property
    def bucket_plan(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (empty in a world of one or before the first backward)."""
        return self.reducer.bucket_plan() if self.reducer is not None else []


class ReplicaDivergenceError(RuntimeError):
    """The replicas of the model are no longer identical across ranks."""


def _arm_window(reducer: Reducer, sync: bool, grad_outputs: Any) -> None:
    """Pre-hook of the forward's output nodes: open the reducer's window for the backward that is starting."""
    reducer.arm(sync)


def _move_to(obj: Any, device: torch.device) -> Any:
    flat, spec = tree_flatten(obj)
    return tree_unflatten([t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in flat],
                          spec)


def _check_devices(module: nn.Module, device_ids, output_device):
    devices = {p.device for p in module.parameters()}
    if device_ids is None:
        if output_device is not None:
            raise ValueError("output_device is only meaningful together with device_ids")
        return None, None
    if len(device_ids) != 1:
        raise ValueError(f"device_ids must hold exactly one device (this process's), got {device_ids}; "
                         "ddpkit runs one process per device")
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"device_ids={device_ids} is only for a module on one CUDA device, but this module's "
                         f"parameters are on {sorted(map(str, devices))}; leave device_ids=None for CPU or "
                         "multi-device modules")
    wanted = torch.device("cuda", device_ids[0]) if isinstance(device_ids[0], int) else torch.device(device_ids[0])
    index = wanted.index
    (device,) = devices
    if device.index != index:
        raise ValueError(f"device_ids={device_ids} but the module is on {device}; move it with "
                         f"module.to('cuda:{index}') or pass device_ids=[{device.index}]")
    if output_device is None:
        return [index], index
    return [index], torch.device("cuda", output_device).index if isinstance(output_device, int) \
        else torch.device(output_device).index


def _signature(module: nn.Module) -> list[tuple]:
    params = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    buffers = [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
    return params + buffers


def _check_same_model(module: nn.Module, comm: Comm) -> None:
    """Fail on every rank, with the same message, when any rank's model differs from rank 0's."""
    mine = _signature(module)
    every = comm.all_gather_object(mine, what="model check")
    reference = every[0]
    for rank, other in enumerate(every[1:], start=1):
        problem = _first_difference(reference, other)
        if problem is not None:
            raise RuntimeError(f"the model on rank {rank} differs from rank 0's: {problem}. Every rank must build "
                               "the same model (same layers, shapes, dtypes and requires_grad) before wrapping it")


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

