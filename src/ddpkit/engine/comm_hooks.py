"""Built-in comm hooks: `ddp.register_comm_hook(state, hook)` with `hook(state, bucket) -> Future[Tensor]`.

`state` may be None (the bucket's own process group) or a `ddpkit.Comm` over another group. Every hook returns
the bucket's *average* over the ranks.
"""

from __future__ import annotations

import torch

from ddpkit.distributed.comm import Comm
from ddpkit.engine.buckets import GradBucket


def _comm(state: Comm | None, bucket: GradBucket) -> Comm:
    return state if isinstance(state, Comm) else bucket.comm


def allreduce_hook(state: Comm | None, bucket: GradBucket) -> torch.futures.Future:
    """The default reduction as a hook: average in the bucket's own dtype."""
    comm = _comm(state, bucket)
    buffer = bucket.buffer()
    buffer.div_(comm.world_size)  # divide first: sums of already-averaged terms cannot overflow
    return comm.all_reduce_future(buffer, f"bucket {bucket.index()}")


def _compress_hook(dtype: torch.dtype):
    def hook(state: Comm | None, bucket: GradBucket) -> torch.futures.Future:
        comm = _comm(state, bucket)
        buffer = bucket.buffer()
        # torch's order, for its bits: cast, then divide in the compressed dtype before the sum (a sum of
        # world_size half-precision values could overflow where their mean won't).
        compressed = buffer.to(dtype).div_(comm.world_size)
        future = comm.all_reduce_future(compressed, f"bucket {bucket.index()} ({dtype})")

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(fut.value())
            return buffer

        return future.then(decompress)

    hook.__name__ = f"{str(dtype).replace('torch.', '')}_compress_hook"
    return hook


fp16_compress_hook = _compress_hook(torch.float16)
fp16_compress_hook.__doc__ = "Average in float16: half the bytes on the wire, about 3 decimal digits kept."
bf16_compress_hook = _compress_hook(torch.bfloat16)
bf16_compress_hook.__doc__ = "Average in bfloat16: half the bytes, float32's range, about 2 decimal digits kept."
