"""ZeRO stage 2's gradient side, what DistributedDataParallel(zero_stage=2) plugs into its reducer.

While backward runs, each bucket is reduce-scattered (ddpkit.engine.reductions.ReduceScatter): this rank receives the
average of its flat shard of the bucket, `BucketLayout.shard_pieces(rank)` says which slices of which parameters
that is. `GradShards` keeps those shards (summed over synchronised backward passes until zero_grad, as .grad
would be), and drops the parameters' local .grad, so after backward a rank holds 1/N of the gradients. A
ZeroRedundancyOptimizer built on the module's parameters finds this object on them, steps on the shards and
all-gathers the updated parameter shards bucket by bucket, asynchronously: they run while the caller does what
comes between the step and the next forward (the scheduler, zero_grad, the next batch) and on into that
forward. Until its bucket's gather is in, a parameter is held (ddpkit.engine.params_in_flight): the first torch function
that reads it, in the forward or anywhere else (evaluation on the unwrapped module, a weight tied by hand as
`F.linear(x, self.other.weight)`, an EMA, `p.detach()`), waits for that bucket first. So the first layer starts
once its own bucket is in while the later buckets are still on the wire, and no read, whoever makes it, sees
a stale value. The wrapper's forward waits for whatever it did not read when it returns (or raises), and for
everything before it starts under torch.compile (a traced frame must see plain parameters); reading or
loading the module's state_dict waits for everything too.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ddpkit._utils.raising import callers_level
from ddpkit.distributed.comm import Comm
from ddpkit.engine.buckets import Bucket
from ddpkit.engine.params_in_flight import hold, release
from ddpkit.engine.partition import Piece, Partition
from ddpkit.engine.reductions import ReduceScatter

ATTRIBUTE = "_ddpkit_grad_shards"  # on each parameter: the GradShards that hold its gradient
STAGES = (0, 2)


def check_zero_stage(stage: Any) -> int:
    if isinstance(stage, bool) or stage not in STAGES:
        hint = (" (stage 1 shards only the optimizer state: keep zero_stage=0 and use "
                "ddpkit.ZeroRedundancyOptimizer)") if stage == 1 else ""
        raise ValueError(f"zero_stage must be 0 (DDP) or 2 (gradients sharded too), got {stage!r}{hint}")
    return int(stage)


def _refuse_strided(module: nn.Module, params: list[nn.Parameter]) -> None:
    """Each rank's updated flat slice of a bucket is gathered straight into the parameters: views of them, which
    a parameter that is not contiguous (channels_last, a transpose) cannot give."""
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    for param in params:
        if not param.is_contiguous():
            raise ValueError(f"zero_stage=2 needs contiguous parameters, and {names.get(id(param), 'one')!r} "
                             f"{tuple(param.shape)} is not (strides {param.stride()}, channels_last or a view): "
                             "use zero_stage=0 with ddpkit.ZeroRedundancyOptimizer (stage 1 steps such a "
                             "parameter whole), or make it contiguous (model.to(memory_format=torch."
                             "contiguous_format))")


class GradShards:
    def __init__(self, module: nn.Module, params: list[nn.Parameter], comm: Comm):
        _refuse_strided(module, params)
        self.comm = comm
        self.params = params
        self.reduction = ReduceScatter(comm, on_shard=self._receive)
        self.buckets: dict[int, Bucket] = {}  # known after the first synchronised backward
        self.grads: dict[int, torch.Tensor] = {}  # bucket index -> this rank's averaged shard, accumulated
        self.used: dict[int, list[bool]] = {}  # bucket index -> per member: some rank gave it a gradient
        self.consumer: Any = None  # the ZeroRedundancyOptimizer stepping on these shards
        self.stepped = self.warned = False  # stepped on since zero_grad; said so once (_receive)
        self.gathers: dict[int, Any] = {}  # bucket index -> (unit, handle, device, stream) of its all-gather
        for param in params:
            setattr(param, ATTRIBUTE, Owner(self))
        self.module = module
        self._reading = False  # inside the wrapper's forward, where each parameter waits for its bucket when read
        # The module called unwrapped (evaluation; under torch.func or TorchScript, which read the parameters
        # without torch functions), its state_dict read (a checkpoint, perhaps keep_vars=True, handing out the
        # parameters themselves) or loaded (the receives land straight in the parameters: late ones would
        # overwrite the loaded weights): wait for every gather first.
        _drop_inert_hooks(module)  # a module unpickled with an earlier wrapper's: one set of hooks, the live one
        self._hooks = (module.register_forward_pre_hook(WaitAll(self, unless_reading=True)),
                       module.register_state_dict_pre_hook(WaitAll(self)),
                       module.register_load_state_dict_pre_hook(WaitAll(self)))

    # -- backward: keep the shard, drop the local gradients ------------------------------------------------------
    def _receive(self, bucket: Bucket, shard: torch.Tensor, everywhere_used: list[bool] | None) -> None:
        if self.consumer is None:
            raise RuntimeError("DistributedDataParallel(zero_stage=2) keeps only this rank's shard of the "
                               "gradients, which only ddpkit.ZeroRedundancyOptimizer can step; build one on the "
                               "wrapped model's parameters before the first backward (or use zero_stage=0)")
        index = bucket.index
        if index not in self.buckets:
            self.buckets[index] = bucket
        used = [everywhere_used is None or everywhere_used[i] for i in bucket.members]
        if index in self.grads and self.stepped and not self.warned:
            self.warned = True
            warnings.warn("zero_stage=2: this backward adds to gradients an optimizer step has already used. "
                          "If they were meant to be cleared, note that clearing the inner module's .grad "
                          "(model.module.zero_grad()) cannot reach them: they are this rank's shards. Call "
                          "optimizer.zero_grad() or model.zero_grad() on the wrapper instead.",
                          stacklevel=callers_level())
        if index in self.grads:  # a second synchronised backward before zero_grad: sums, as .grad does
            self.grads[index].add_(shard)
            self.used[index] = [a or b for a, b in zip(self.used[index], used)]
        else:
            self.grads[index] = shard  # the reduction's own tensor (the bucket's storage is released)
            self.used[index] = used
        for position, param in enumerate(bucket.params):
            if used[position]:
                param.grad = None  # this rank's local sum is in the reduced shard now

    def held_bytes(self) -> int:
        """Bytes of gradient storage this rank holds now: the buckets' flat storage (while made), the shards
        (in flight and accumulated) and the parameters' .grad, each storage counted once."""
        tensors = [b.storage for b in self.buckets.values() if b.allocated] + self.reduction.held()
        tensors += list(self.grads.values()) + [p.grad for p in self.params if p.grad is not None]
        return storage_bytes(tensors)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the shards. set_to_none=False keeps them, zeroed, as the unsharded .grad stays a zero tensor:
        a parameter that had a gradient is then stepped with zeros when the next backward gives it none
        (its weight decay and momentum go on), as torch's optimizers step every parameter whose .grad is set."""
        if set_to_none:
            self.grads.clear()
            self.used.clear()
        else:
            for shard in self.grads.values():
                shard.zero_()
        self.stepped = False

    def stepped_on(self) -> None:
        """The optimizer stepped on the shards: a backward adding to them before zero_grad is suspect (below)."""
        self.stepped = True

    def grad_of(self, index: int, offset: int, numel: int, member: int) -> torch.Tensor | None:
        """The averaged gradient of a shard piece; None when no rank gave that parameter one (it is skipped,
        as the unsharded optimizer skips a parameter whose .grad is None)."""
        shard = self.grads.get(index)
        if shard is None or not self.used[index][member]:
            return None
        return shard[offset:offset + numel]

    def piece_grad(self, index: int, piece: Piece) -> torch.Tensor | None:
        """grad_of for a ZeRO unit's piece of bucket `index`."""
        return self.grad_of(index, piece.offset, piece.numel, piece.param)

    # -- after the step: parameters gathered bucket by bucket -----------------------------------------------------
    def add_gather(self, index: int, unit: Any, handle: Any) -> None:
        """Bucket `index`'s parameters are being gathered: the first read of any of them waits (ddpkit.engine.params_in_flight)."""
        device = unit.params[0].device  # read before holding: a held parameter's every read waits
        self.gathers[index] = (unit, handle, device, _current_stream(device))
        if hold(unit.params, lambda: self.wait(index)):
            self.wait(index)  # some parameter could not be marked: no read of it may come first

    def wait(self, index: int) -> None:
        pending = self.gathers.pop(index, None)
        if pending is not None:
            unit, handle, device, issued_on = pending
            try:
                unit.finish_gather(handle)
                # On an accelerator the wait orders only the stream current here after the gather. The first read
                # may come on a side stream (an EMA under torch.cuda.stream(s)); once released, the parameters
                # are read without waits, so the stream the step ran on (the next forward's) is ordered too.
                now = _current_stream(device)
                if now is not None and now != issued_on:
                    issued_on.wait_stream(now)
            finally:
                release(unit.params)

    def wait_all(self) -> None:
        for index in sorted(self.gathers):
            self.wait(index)

    @contextlib.contextmanager
    def forward_reads(self) -> Iterator[None]:
        """Around the wrapper's forward: each read of a parameter waits for its own bucket (module docstring)."""
        if self.gathers and _compiled(self.module):
            self.wait_all()  # torch.compile: Dynamo guards on the parameters' class, and would recompile (or fall
            # back to running uncompiled) if it found held ones
        self._reading = True
        try:
            yield
        finally:
            self._reading = False
            self.wait_all()  # what no function read: the parameters of unused layers


def refuse_blind_scaler(optimizer: Any) -> None:
    """Stage 2's optimizer stepped by torch.amp.GradScaler, which set these two attributes first (it calls such a
    step directly, as the optimizer says it scales by itself): that scaler unscales and checks .grad, which stage
    2 does not keep, so it would step the shards still scaled."""
    if hasattr(optimizer, "found_inf") or getattr(optimizer, "grad_scale", None) is not None:
        for name in ("found_inf", "grad_scale"):
            optimizer.__dict__.pop(name, None)
        raise RuntimeError("torch.amp.GradScaler cannot scale a DistributedDataParallel(zero_stage=2) model's "
                           "gradients: it unscales and checks each parameter's .grad, and stage 2 keeps only this "
                           "rank's shard of them. Use ddpkit.AgreedGradScaler (a GradScaler that unscales the "
                           "shards and skips a step on every rank alike) in its place, or zero_stage=1")


def grad_shards_of(params: list[nn.Parameter]) -> GradShards | None:
    """The stage-2 gradient shards the parameters belong to (DistributedDataParallel(zero_stage=2)), if any."""
    owners = (getattr(p, ATTRIBUTE, None) for p in params)
    found = {id(s): s for s in (getattr(o, "shards", None) for o in owners) if s is not None}
    if len(found) > 1:
        raise ValueError("these parameters belong to several DistributedDataParallel(zero_stage=2) models; "
                         "build one ZeroRedundancyOptimizer per model")
    return next(iter(found.values()), None)


class Owner:
    """What each parameter carries (ATTRIBUTE): the GradShards that hold its gradient, for the optimizer to find.
    Pickled or copied with the parameter (torch.save(p), an EMA's deepcopy of the module) it comes back empty:
    the copy belongs to no stage-2 model, and the process group it would drag along cannot be pickled."""

    def __init__(self, shards: GradShards | None):
        self.shards = shards

    def __reduce__(self) -> tuple:
        # An empty OrderedDict, not an Owner: a saved parameter must load under torch.load(weights_only=True),
        # which rebuilds only the globals torch allows (OrderedDict is one); no `shards` there reads as none.
        return collections.OrderedDict, ()


class WaitAll:
    """A hook on the user's module: wait for every gather in flight (see GradShards.__init__). Like Owner, it
    pickles and copies as an inert hook, so that the module can be saved or copied whole."""

    def __init__(self, shards: GradShards | None, unless_reading: bool = False):
        self.shards, self.unless_reading = shards, unless_reading

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        shards = self.shards
        if shards is not None and not (self.unless_reading and shards._reading):
            shards.wait_all()

    def __reduce__(self) -> tuple:
        return WaitAll, (None,)


def _drop_inert_hooks(module: nn.Module) -> None:
    for hooks in (module._forward_pre_hooks, module._state_dict_pre_hooks, module._load_state_dict_pre_hooks):
        for key, hook in list(hooks.items()):
            hook = getattr(hook, "hook", hook)  # load pre-hooks come wrapped by torch (.hook)
            if isinstance(hook, WaitAll) and hook.shards is None:
                del hooks[key]


def _compiled(module: nn.Module) -> bool:
    """Whether this forward may run compiled code: inside a frame torch.compile traces (compile(DDP(model))),
    through a compiled module in the tree (DDP(compile(model)), model.compile() on a submodule), or anywhere once
    this process compiled a graph (a compiled function the forward calls). Dynamo must see plain parameters."""
    if torch._C._dynamo.eval_frame.get_eval_frame_callback() is not None:
        return True
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    if dynamo is None:
        return False
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is not None and utils.counters["stats"]["unique_graphs"] > 0:
        return True
    return any(isinstance(m, dynamo.OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in module.modules())


def _current_stream(device: torch.device) -> Any:
    """The stream work on `device` is queued on now; None on the CPU, where a wait is a wait."""
    if device.type == "cpu":
        return None
    return getattr(torch, device.type).current_stream(device)


def unit_plan(layout: Any) -> Partition:
    """A bucket's shards as a ZeRO unit: rank r owns the pieces of its shard, numbered by member position."""
    position = {member: p for p, member in enumerate(layout.members)}
    segments = tuple(tuple(Piece(position[s.param], s.start, s.stop, s.shard_offset)
                           for s in layout.shard_pieces(rank)) for rank in range(layout.shards))
    return Partition(tuple(layout.numels), segments, layout.shard_numel, whole=False)


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once, whole)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
