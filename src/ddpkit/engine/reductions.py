"""How a filled bucket is reduced across the ranks and where the result goes: the reducer's one plug-in point.

The reducer decides which gradients go into which bucket, when a bucket is full, the launch order (the same on
every rank) and the divisor; a `Reduction` decides only the collective and the write-back:

    shards    the bucket's storage is padded to a multiple of this and split into that many equal flat shards
    divides   whether the bucket is divided by the divisor while it is filled (a comm hook divides itself)
    chains    whether its collectives may still be issued after start() returned, from other threads (a comm
              hook's future callbacks): the reducer's own collective then waits until every bucket is in
    carries_usage(layout)  whether the per-parameter usage flags can travel in the collective of the bucket laid
              out so (after its gradients and padding: `Bucket.usage`), summed over the ranks there; the reducer
              puts them in the last bucket's when they can, else they are a collective of their own
    start(bucket, what) -> handle            issue the asynchronous collective on bucket.storage
    wait(bucket, handle) -> Tensor | None    wait for it; a tensor when the result is not in the storage
    finish(bucket, result, everywhere_used)  after every bucket was awaited: put the result where it belongs

`AllReduce` (DDP's default) and `CommHookReduction` (DDP's register_comm_hook) write the average into the
parameters' .grad. `ReduceScatter` keeps only this rank's flat shard of each bucket, for a sharding optimizer
(ZeRO stage 2) that reads `Bucket.layout` to know which slice of which parameter each shard element is; it
writes nothing into .grad. A reduction knows no optimizer: whoever plugs it in passes `on_shard`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddpkit.distributed.comm import Comm
from ddpkit.engine.buckets import Bucket

CommHook = Callable[[Any, Any], torch.futures.Future]  # hook(state, GradBucket) -> Future of the reduced tensor
# Where sums of 0/1 usage flags stay exact and above zero: float8 has no infinity, and 448 ranks would make NaN.
FLAG_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
OnShard = Callable[[Bucket, torch.Tensor, "list[bool] | None"], None]


class Reduction:
    """The interface every reduction has (see the module docstring); `wait` is shared."""

    shards = 1
    divides = True
    chains = False

    def __init__(self, comm: Comm):
        self.comm = comm

    def carries_usage(self, layout: Any) -> bool:
        return False

    def start(self, bucket: Bucket, what: str) -> Any:
        raise NotImplementedError

    def wait(self, bucket: Bucket, handle: Any) -> torch.Tensor | None:
        self.comm.wait(handle)
        return None

    def finish(self, bucket: Bucket, result: torch.Tensor | None, everywhere_used: list[bool] | None) -> None:
        raise NotImplementedError


class AllReduce(Reduction):
    """DDP's reduction: the divided bucket summed in place on every rank, then copied into the .grad.

    It sums the usage flags too, in the last bucket's collective: a collective of its own for them cost about
    3 ms of CPU a step on 2 gloo ranks (the bench transformer: 68.6 ms of CPU a step against torch DDP's 66.1;
    66.5 without it), for a few bytes. A comm hook cannot carry them (it reduces the gradients it is shown), so
    its buckets keep the collective of their own, as do buckets of other dtypes than FLAG_DTYPES. A subclass
    whose `start` reduces anything but the whole storage must say False here.
    """

    def carries_usage(self, layout: Any) -> bool:
        return layout.dtype in FLAG_DTYPES

    def start(self, bucket: Bucket, what: str) -> Any:
        return self.comm.all_reduce(bucket.storage, what, async_op=True)

    def finish(self, bucket: Bucket, result: torch.Tensor | None, everywhere_used: list[bool] | None) -> None:
        bucket.copy_to_grads(everywhere_used)


class CommHookReduction(AllReduce):
    """`hook(state, GradBucket) -> Future[Tensor]` reduces each bucket (torch's register_comm_hook contract): it
    gets the undivided local sums and returns the average."""

    divides = False
    # Its collectives may go on being issued from its futures' callbacks, on other threads (PowerSGD chains
    # several per bucket), until those futures complete: a collective of the reducer's own must come after all
    # of them, or the ranks could pair it with one of the hook's (gloo's "collective mismatch").
    chains = True

    def __init__(self, comm: Comm, state: Any, hook: CommHook):
        super().__init__(comm)
        self.state, self.hook = state, hook

    def carries_usage(self, layout: Any) -> bool:
        return False

    def start(self, bucket: Bucket, what: str) -> Any:
        record = self.comm.note("comm_hook", what, bucket.flat.numel() * bucket.flat.element_size(),
                                bucket.flat.device)
        future = self.hook(self.state, bucket.public)
        if not isinstance(future, torch._C.Future):  # torch's type and words
            kind = type(future)
            raise RuntimeError("DDP communication hook's callback must return a torch.futures.Future object, but "
                               f"got {kind.__module__}.{kind.__qualname__}: return the future of the reduced bucket")
        return future, record

    def wait(self, bucket: Bucket, handle: Any) -> torch.Tensor | None:
        future, record = handle
        result = self.comm.wait(future, record)
        if isinstance(result, (list, tuple)):
            result = result[0]
        if isinstance(result, torch.Tensor) and result.numel() != bucket.flat.numel():
            raise RuntimeError(f"the comm hook returned a tensor of {result.numel()} elements for bucket "
                               f"{bucket.index}, which holds {bucket.flat.numel()}: a hook's future must hold the "
                               "reduced bucket, bucket.buffer()'s size (see torch's register_comm_hook)")
        return result

    def finish(self, bucket: Bucket, result: torch.Tensor | None, everywhere_used: list[bool] | None) -> None:
        if result is not None and result is not bucket.flat:
            bucket.flat.copy_(result)
        super().finish(bucket, result, everywhere_used)


class ReduceScatter(Reduction):
    """Each bucket averaged into this rank's flat shard of it, and only that shard kept (ZeRO stage 2).

    `on_shard(bucket, shard, everywhere_used)` is called at the end of each synchronised backward with this
    rank's averaged shard of the bucket (the layout's `shard_pieces(rank)` says which parameter slices it holds;
    its padding tail is zero): a tensor of its own, which the callee may keep. Then the bucket's storage is
    released, so that after backward a rank holds 1/N of the gradients, not the whole buckets besides; the
    next backward's fill makes it again. The parameters' .grad keep this rank's local sums: the owner of the
    shards drops them (or not).

    The collective is `Comm.reduce_scatter_tensor`: native on NCCL, and on gloo (whose own is slower than its
    all-reduce) composed from point-to-point sends, half the bytes of an all-reduce received (see ddpkit.distributed.comm).
    A shard cannot carry the usage flags (each rank receives only its own part of the bucket); the composed one
    sends them to every peer beside the shards, in the same collective (`rider`), and the native one leaves
    them to a collective of their own.
    """

    def __init__(self, comm: Comm, on_shard: OnShard | None = None):
        super().__init__(comm)
        self.shards = comm.world_size
        self.on_shard = on_shard
        self._outputs: dict[int, torch.Tensor] = {}  # bucket index -> its shard, from launch until finish

    def carries_usage(self, layout: Any) -> bool:
        return self.comm.point_to_point(layout.device) and layout.dtype in FLAG_DTYPES

    def start(self, bucket: Bucket, what: str) -> Any:
        layout = bucket.layout
        lo, hi = layout.shard_range(self.comm.rank)
        out = self._outputs[bucket.index] = bucket.storage.new_empty(hi - lo)  # handed over in finish: new
        gradients = bucket.storage[:layout.padded_numel]
        rider = bucket.usage if bucket.usage_numel else None
        return self.comm.reduce_scatter_tensor(out, gradients, what, async_op=True, rider=rider)

    def finish(self, bucket: Bucket, result: torch.Tensor | None, everywhere_used: list[bool] | None) -> None:
        shard = self._outputs.pop(bucket.index)
        bucket.release()
        if self.on_shard is not None:
            self.on_shard(bucket, shard, everywhere_used)

    def held(self) -> list[torch.Tensor]:
        """The shard outputs this reduction still holds (between launch and finish)."""
        return list(self._outputs.values())
