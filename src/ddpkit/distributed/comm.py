"""The only caller of torch.distributed collectives in ddpkit.

Every collective goes through a `Comm`, which numbers it and remembers what it was for (iteration, bucket,
bytes), so that a stall or an order mismatch can be explained by naming the collective, not just timed out.
Collectives on one process group form one sequence on every rank, so there is one `Comm` per group
(`Comm.for_group`): a single counter is what makes sequence numbers comparable across ranks.

A Comm knows only a list of observers (`CommObserver`: the stall inspector is one, a timeline another) and tells
each of them every event of every collective: issued, the main thread's wait begins and ends, finished. It
imports none of them; with no observer attached an event costs one test of an empty list. Where the backend's
wait returns before the collective completed (NCCL's, on the GPU: `deferred_on` says where), each wait also
hands the observers a test of its completion (`CommObserver.deferred`), so that a stall there can be seen.
"""

from __future__ import annotations

import collections
import contextlib
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed import point_to_point as pairwise
from ddpkit.distributed.collective import (  # noqa: F401 - CollectiveRecord and CommObserver: part of this module's API
    BROADCAST_CHUNK_BYTES,
    CollectiveRecord,
    CommObserver,
    Exchange,
    Observed,
    Pending,
    _as_bytes,
    _chunks,
    _DoneWork,
    completes_later,
)
from ddpkit.distributed.env import DistEnv


class Comm(Observed):
    """Collectives over one process group, numbered and logged.

    group=None is the default (world) group. Without any process group, or in a world of one, every
    collective is a local no-op that returns its input, so code written for N ranks runs on one.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, log_size: int = 64):
        self.group = group
        self.active = dist.is_available() and dist.is_initialized()
        self.pg = (group or dist.distributed_c10d._get_default_group()) if self.active else None
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.backend = dist.get_backend(group) if self.active else "none"
        super().__init__(log_size)
        # Reduce-scatter and all-gather of CPU tensors as point-to-point messages (ddpkit.distributed.point_to_point says why, with
        # the figures): gloo's own collectives for them are slower. Tests set False to compare.
        self.pairwise = self.backend == "gloo"
        self.open_sync_windows = 0  # reducers on this group inside a synchronised backward (see Reducer)

    # One Comm per process group, found from the group: torch's DDP constructor (which ours mirrors) receives
    # only a ProcessGroup, and ProcessGroup objects take no attributes, so the Comm cannot travel with it.
    _shared: dict[int, Comm] = {}

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None = None) -> Comm:
        """The one Comm of `group` (None: the default group) in this process."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(group)
        pg = group or dist.distributed_c10d._get_default_group()
        comm = cls._shared.get(id(pg))
        if comm is None or comm.pg is not pg:  # a new process group where an old one was
            comm = cls._shared[id(pg)] = cls(group)
        return comm

    @classmethod
    def forget_groups(cls) -> None:
        """After destroy_process_group: hold no destroyed group, which interpreter exit would tear down, where
        gloo's threads abort a finished job (SIGABRT) in most runs. A subgroup's Comm keeps its group object."""
        for comm in cls._shared.values():
            comm.pg = None
        cls._shared.clear()

    @property
    def distributed(self) -> bool:
        return self.active and self.world_size > 1

    def deferred_on(self, device: torch.device | None) -> torch.device | None:
        """`device` when this group's backend completes collectives of its tensors after their wait returned
        (NCCL on CUDA: see `collective.completes_later`), so that observers are handed a test of completion."""
        return device if device is not None and completes_later(self.backend, device.type) else None

    def global_rank(self, group_rank: int) -> int:
        """The global rank of this group's rank `group_rank` (collectives take global ranks as src)."""
        if self.group is None or not self.active:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -- tensors ------------------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, what: str = "", async_op: bool = False,
                   op: dist.ReduceOp = dist.ReduceOp.SUM):
        """Sum (by default) `tensor` in place over the group. async_op=True returns what `wait` takes."""
        record = self._record("all_reduce", what, tensor.numel() * tensor.element_size(),
                              self.deferred_on(tensor.device))
        if not self.distributed:
            return _DoneWork(tensor) if async_op else None
        if async_op:
            return self._pending(dist.all_reduce(tensor, op=op, group=self.group, async_op=True), record)
        with self._blocking(record):
            dist.all_reduce(tensor, op=op, group=self.group)
        return None

    def all_reduce_future(self, tensor: torch.Tensor, what: str = "") -> torch.futures.Future:
        """Sum `tensor` in place; a Future whose value is the tensor (the shape comm hooks return)."""
        work = self.all_reduce(tensor, what, async_op=True)
        if isinstance(work, _DoneWork):
            return work.get_future()
        return work.work.get_future().then(lambda fut: fut.value()[0])

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, what: str = "",
                              async_op: bool = False, op: dist.ReduceOp = dist.ReduceOp.SUM,
                              rider: torch.Tensor | None = None):
        """Sum (by default) the flat `input` over the group and leave this rank's equal share of the result,
        elements [rank * n, (rank + 1) * n) with n = output.numel(), in `output`. async_op as in all_reduce.
        rider: a small tensor summed whole over the group in place, in the same collective (the point-to-point
        path only: the caller checks `point_to_point`; elsewhere it is an error)."""
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, it needs output's "
                             f"{output.numel()} times the world size {self.world_size}")
        riders = [] if rider is None else [rider]
        pairs = self.distributed and op == dist.ReduceOp.SUM and self._pairs(output, input, *riders)
        if rider is not None and self.distributed and not pairs:
            raise ValueError("reduce_scatter_tensor: a rider travels only with the point-to-point reduce-scatter "
                             "(gloo, a sum, CPU tensors of one dtype, contiguous); all-reduce it on its own instead")
        record = self._record("reduce_scatter", what, input.numel() * input.element_size(),
                              self.deferred_on(input.device))
        if not self.distributed:
            output.copy_(input.reshape(output.shape))
            return _DoneWork(output) if async_op else None
        if pairs:
            plan = pairwise.reduce_scatter(output.view(-1), input.view(-1), self.rank, self.world_size, rider)
            exchange = self._exchange(record, *plan)
            return exchange if async_op else self.wait(exchange)
        # torch 2.13 renamed it reduce_scatter_single; older versions have only reduce_scatter_tensor.
        collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        if async_op:
            return self._pending(collective(output, input, op=op, group=self.group, async_op=True), record)
        with self._blocking(record):
            collective(output, input, op=op, group=self.group)
        return None

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, what: str = "",
                               async_op: bool = False):
        """Every rank's `input` concatenated in rank order into the flat `output` (world size times as large)."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, it needs input's "
                             f"{input.numel()} times the world size {self.world_size}")
        record = self._record("all_gather", what, output.numel() * output.element_size(),
                              self.deferred_on(output.device))
        if not self.distributed:
            output.copy_(input.reshape(output.shape))
            return _DoneWork(output) if async_op else None
        pending = self._all_gather_flat(output, input, record)
        return pending if async_op else self.wait(pending)

    def all_gather_pieces(self, pieces: Sequence[Sequence[torch.Tensor]], what: str = "",
                          async_op: bool = False):
        """Every rank's own tensors into the matching tensors of every other rank. `pieces[r]` are, on every
        rank, the tensors rank r's values go into (`pieces[self.rank]`: what this rank sends); the same count,
        dtype and sizes on every rank. On gloo they travel straight from and into those tensors (views of
        parameters: nothing packed, nothing copied); elsewhere through one flat all-gather."""
        some = next((t for part in pieces for t in part), None)
        record = self._record("all_gather", what, sum(t.numel() * t.element_size() for p in pieces for t in p),
                              self.deferred_on(None if some is None else some.device))
        if not self.distributed:
            return _DoneWork(None) if async_op else None
        if some is None:
            return _DoneWork(None) if async_op else None
        if self._pairs(some) and pairwise.direct(pieces):
            pending = self._exchange(record, *pairwise.all_gather_pieces(pieces, self.rank))
        else:
            out, mine, unpack = pairwise.packed(pieces, self.rank)
            pending = self._all_gather_flat(out, mine, record)
            pending.then = unpack
        return pending if async_op else self.wait(pending)

    def _all_gather_flat(self, output: torch.Tensor, input: torch.Tensor, record: CollectiveRecord) -> Any:
        if self._pairs(output, input):
            return self._exchange(record, *pairwise.all_gather(output.view(-1), input.view(-1), self.rank,
                                                               self.world_size))
        collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return self._pending(collective(output, input, group=self.group, async_op=True), record)

    def _pending(self, work: Any, record: CollectiveRecord) -> Pending:
        if self.observers:
            self._watch(work, record)
        return Pending(work, record)

    # gloo's reduce-scatter and all-gather are slower than point-to-point messages (ddpkit.distributed.point_to_point: the plans
    # and the figures); NCCL keeps its native collectives.
    def point_to_point(self, device: torch.device) -> bool:
        """Whether reduce-scatter and all-gather of tensors on `device` go as point-to-point messages (gloo's CPU
        tensors), the path on which a reduce-scatter can carry a rider."""
        return self.pairwise and device.type == "cpu"

    def _pairs(self, *tensors: torch.Tensor) -> bool:
        """Whether the point-to-point path takes these tensors: on its device, contiguous (the messages are flat
        views of them; gloo's own collectives take any layout), of one dtype (else gloo's refusal, below)."""
        if not all(self.point_to_point(t.device) and t.is_contiguous() for t in tensors):
            return False
        if len({t.dtype for t in tensors}) > 1:  # received bytes would be read as the output's dtype: garbage
            raise RuntimeError(f"the output and input tensors must have the same dtype, got "
                               f"{' and '.join(str(t.dtype) for t in tensors)}: convert one of them (.to(dtype))")
        return True

    def _exchange(self, record: CollectiveRecord, sends: list[pairwise.Message], receives: list[pairwise.Message],
                  then: Any = None) -> Exchange:
        """Post every receive and send of a plan at once. Tagged with the collective's sequence number (the same
        on every rank) and each message's number: no message is taken for another, in flight at once or not."""
        base = (record.seq % (1 << 21)) << 8
        # Global ranks as src and dst, which torch 2.4 takes too (group_src and group_dst came later).
        works = [dist.irecv(t, self.global_rank(peer), self.group, base + k % 256) for peer, t, k in receives]
        works += [dist.isend(t, self.global_rank(peer), self.group, base + k % 256) for peer, t, k in sends]
        return Exchange(works, record, then)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, what: str = "") -> None:
        record = self._record("broadcast", what, tensor.numel() * tensor.element_size(),
                              self.deferred_on(tensor.device))
        if self.distributed:
            with self._blocking(record):
                dist.broadcast(tensor, src=self.global_rank(src), group=self.group)

    def all_gather(self, tensor: torch.Tensor, what: str = "") -> torch.Tensor:
        """Every rank's `tensor` stacked along a new first dimension, in rank order."""
        record = self._record("all_gather", what, tensor.numel() * tensor.element_size() * self.world_size,
                              self.deferred_on(tensor.device))
        if not self.distributed:
            return tensor.unsqueeze(0).clone()
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self._blocking(record):
            dist.all_gather(out, tensor.contiguous(), group=self.group)
        return torch.stack(out)

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int = 0, what: str = "") -> None:
        """Broadcast many tensors from `src` in place, as few messages as possible: their bytes, whatever their
        dtypes, packed into one flat buffer per device (and per 250 MiB), so each forward pays one latency."""
        if not self.distributed or not tensors:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = collections.defaultdict(list)
        # Widest elements first: every tensor then starts at an offset its element size divides, so its bytes
        # can be viewed back as its dtype.
        for t in sorted(tensors, key=lambda t: -t.element_size()):
            by_device[t.device].append(t)
        for same_device in by_device.values():
            for chunk in _chunks(same_device, BROADCAST_CHUNK_BYTES):
                flat = torch.cat([_as_bytes(t) for t in chunk])
                self.broadcast(flat, src, what)
                if self.rank != src:
                    with torch.no_grad():
                        offset = 0
                        for t in chunk:
                            nbytes = t.numel() * t.element_size()
                            # Through .data, as torch's broadcast writes them: the autograd version stays, so a
                            # graph that saved a BatchNorm's running stats (a second forward before backward) holds
                            t.data.copy_(flat[offset:offset + nbytes].view(t.dtype).view(t.shape))
                            offset += nbytes

    # -- Python objects -----------------------------------------------------------------------------------------
    def all_gather_object(self, obj: Any, what: str = "") -> list[Any]:
        """Every rank's `obj`, in rank order."""
        record = self._record("all_gather_object", what, len(pickle.dumps(obj)))
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._blocking(record):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_object(self, obj: Any, dst: int = 0, what: str = "") -> list[Any] | None:
        """Every rank's `obj` in rank order on rank `dst` (None elsewhere): only `dst` holds them all."""
        record = self._record("gather_object", what, len(pickle.dumps(obj)))
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        with self._blocking(record):
            dist.gather_object(obj, out, dst=self.global_rank(dst), group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0, what: str = "") -> Any:
        """`src`'s `obj` on every rank."""
        record = self._record("broadcast_object", what, 0)
        if not self.distributed:
            return obj
        box = [obj]
        with self._blocking(record):
            dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group)
        return box[0]

    def barrier(self, what: str = "", device: torch.device | None = None) -> None:
        """Wait for every rank of the group."""
        record = self._record("barrier", what, 0, self.deferred_on(device))
        if not self.distributed:
            return
        with self._blocking(record):
            if self.backend == "nccl" and device is not None and device.type == "cuda":
                dist.barrier(group=self.group, device_ids=[device.index])
            else:
                dist.barrier(group=self.group)


def barrier(world: DistEnv | None = None, what: str = "barrier") -> None:
    """Wait for every rank of the default group; a no-op in a world of one or without a process group."""
    Comm.for_group(None).barrier(what, world.device if world is not None else None)


@contextlib.contextmanager
def main_process_first(world: DistEnv, local: bool = False) -> Iterator[None]:
    """Run the body on the main process first (downloads, caches), then on the others; local=True: the first
    process of each node goes first instead of global rank 0."""
    first = world.is_local_main if local else world.is_main
    if not first:
        barrier(world)
    try:
        yield
    finally:
        if first:
            barrier(world)


# -- agreements: what the ranks decide together ---------------------------------------------------------------------
# Named for what they decide, so that code above the communication layer (the Trainer) states the agreement and
# never builds a tensor or calls a collective itself. Each is one collective on `comm`'s group, so every rank must
# call it at the same point. Numbers travel as float64: counts are exact up to 2**53.

def sum_over_ranks(comm: Comm, values: torch.Tensor | Sequence[float], what: str,
                   device: torch.device | None = None) -> list[float]:
    """The element-wise sum over the ranks of `values` (a tensor, left untouched, or numbers), as floats; device:
    where the numbers are summed (NCCL needs a CUDA tensor), a tensor's own device by default."""
    if isinstance(values, torch.Tensor):
        total = values.detach().to(torch.float64).reshape(-1).clone()
    else:
        total = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    comm.all_reduce(total, what=what)
    return total.tolist()


def max_over_ranks(comm: Comm, value: float, what: str, device: torch.device | None = None) -> float:
    """The largest `value` any rank holds."""
    box = torch.tensor([float(value)], dtype=torch.float64, device=device)
    comm.all_reduce(box, what=what, op=dist.ReduceOp.MAX)
    return box.item()


def decided_by_main(comm: Comm, value: Any, what: str) -> Any:
    """Rank 0's `value` on every rank: for decisions only rank 0 can take (what its file system holds), which
    every rank must take alike. Other ranks' `value` is ignored (pass None)."""
    return comm.broadcast_object(value, src=0, what=what)


def flags_of_main(comm: Comm, flags: Sequence[bool], what: str, device: torch.device | None = None) -> list[bool]:
    """Rank 0's `flags` on every rank (one broadcast)."""
    box = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64, device=device)
    comm.broadcast(box, src=0, what=what)
    return [v > 0 for v in box.tolist()]


def gather_objects(comm: Comm, obj: Any, what: str) -> list[Any]:
    """Every rank's picklable `obj`, in rank order, on every rank."""
    return comm.all_gather_object(obj, what=what)

