"""The only caller of torch.distributed collectives in ddpkit.

Every collective goes through a `Comm`, which numbers it and remembers what it was for (iteration, bucket,
bytes), so that a stall or an order mismatch can be explained by naming the collective, not just timed out.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import pickle
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .env import DistEnv

# Tensors are broadcast in flat chunks of at most this size; torch uses the same 250 MiB for its init broadcast.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


@dataclasses.dataclass
class CollectiveRecord:
    seq: int
    op: str
    what: str
    nbytes: int
    started: float


class Comm:
    """Collectives over one process group, numbered and logged.

    group=None is the default (world) group. Without any process group, or in a world of one, every
    collective is a local no-op that returns its input, so code written for N ranks runs on one.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, log_size: int = 64):
        self.group = group
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.backend = dist.get_backend(group) if self.active else "none"
        self.seq = 0
        self.log: collections.deque[CollectiveRecord] = collections.deque(maxlen=log_size)

    @property
    def distributed(self) -> bool:
        return self.active and self.world_size > 1

    def _record(self, op: str, what: str, nbytes: int) -> None:
        self.seq += 1
        self.log.append(CollectiveRecord(self.seq, op, what, nbytes, time.monotonic()))

    def global_rank(self, group_rank: int) -> int:
        """The global rank of this group's rank `group_rank` (collectives take global ranks as src)."""
        if self.group is None or not self.active:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -- tensors ------------------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, what: str = "", async_op: bool = False,
                   op: dist.ReduceOp = dist.ReduceOp.SUM):
        """Sum (by default) `tensor` in place over the group. async_op=True returns the Work to wait on."""
        self._record("all_reduce", what, tensor.numel() * tensor.element_size())
        if not self.distributed:
            return _DoneWork(tensor) if async_op else None
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def all_reduce_future(self, tensor: torch.Tensor, what: str = "") -> torch.futures.Future:
        """Sum `tensor` in place; a Future whose value is the tensor (the shape comm hooks return)."""
        work = self.all_reduce(tensor, what, async_op=True)
        if isinstance(work, _DoneWork):
            return work.get_future()
        return work.get_future().then(lambda fut: fut.value()[0])

    def broadcast(self, tensor: torch.Tensor, src: int = 0, what: str = "") -> None:
        self._record("broadcast", what, tensor.numel() * tensor.element_size())
        if self.distributed:
            dist.broadcast(tensor, src=self.global_rank(src), group=self.group)

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int = 0, what: str = "") -> None:
        """Broadcast many tensors from `src` in place, flattened into few messages (one per dtype and device)."""
        if not self.distributed or not tensors:
            return
        groups: dict[tuple, list[torch.Tensor]] = collections.defaultdict(list)
        for t in tensors:
            groups[(t.dtype, t.device)].append(t)
        for same_kind in groups.values():
            for chunk in _chunks(same_kind, BROADCAST_CHUNK_BYTES):
                flat = _flatten_dense_tensors([t.detach() for t in chunk])
                self.broadcast(flat, src, what)
                if self.rank != src:
                    with torch.no_grad():
                        for t, synced in zip(chunk, _unflatten_dense_tensors(flat, chunk)):
                            t.copy_(synced)

    # -- Python objects -----------------------------------------------------------------------------------------
    def all_gather_object(self, obj: Any, what: str = "") -> list[Any]:
        """Every rank's `obj`, in rank order."""
        self._record("all_gather_object", what, len(pickle.dumps(obj)))
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0, what: str = "") -> Any:
        """`src`'s `obj` on every rank."""
        self._record("broadcast_object", what, 0)
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group)
        return box[0]

    def barrier(self, what: str = "", device: torch.device | None = None) -> None:
        """Wait for every rank of the group."""
        self._record("barrier", what, 0)
        if not self.distributed:
            return
        if self.backend == "nccl" and device is not None and device.type == "cuda":
            dist.barrier(group=self.group, device_ids=[device.index])
        else:
            dist.barrier(group=self.group)


class _DoneWork:
    """The Work of a collective that needed no communication (a world of one)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.tensor)
        return fut


def _chunks(tensors: list[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > cap_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(t)
        size += nbytes
    if chunk:
        yield chunk


def barrier(world: DistEnv | None = None) -> None:
    """Wait for every rank of the default group; a no-op in a world of one or without a process group."""
    Comm().barrier("barrier", world.device if world is not None else None)


@contextlib.contextmanager
def main_process_first(world: DistEnv, local: bool = False) -> Iterator[None]:
    """Run the body on the main process first (downloads, caches), then on the others.

    local=True: the first process of each node goes first instead of global rank 0.
    """
    first = world.is_local_main if local else world.is_main
    if not first:
        barrier(world)
    try:
        yield
    finally:
        if first:
            barrier(world)
