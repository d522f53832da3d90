"""The only caller of torch.distributed collectives in ddpkit.

Every collective goes through a `Comm`, which numbers it and remembers what it was for (iteration, bucket,
bytes), so that a stall or an order mismatch can be explained by naming the collective, not just timed out.
Collectives on one process group form one sequence on every rank, so there is one `Comm` per group
(`Comm.for_group`): a single counter is what makes sequence numbers comparable across ranks.
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

from . import env
from .env import DistEnv
from .monitor import PeerFailedError, StallError, StallMonitor

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
        self.pg = (group or dist.distributed_c10d._get_default_group()) if self.active else None
        self.rank = dist.get_rank(group) if self.active else 0
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.backend = dist.get_backend(group) if self.active else "none"
        self.seq = 0
        self.log: collections.deque[CollectiveRecord] = collections.deque(maxlen=log_size)
        self.monitor: StallMonitor | None = None
        self.open_sync_windows = 0  # reducers on this group inside a synchronised backward (see Reducer)

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

    @property
    def distributed(self) -> bool:
        return self.active and self.world_size > 1

    def start_monitor(self, threshold_s: float, restart: int = 0) -> StallMonitor | None:
        """Explain collectives that wait longer than `threshold_s` (see ddpkit.monitor).

        restart: the elastic restart count; a restarted job must not read what the failed attempt posted.
        """
        if self.monitor is None and self.distributed:
            store = dist.distributed_c10d._get_default_store()
            group = f"{dist.get_process_group_ranks(self.pg)[0]}-{self.world_size}"
            self.monitor = StallMonitor(store, self.rank, self.world_size, threshold_s,
                                        prefix=f"attempt_{restart}/{group}/")
        return self.monitor

    def stop_monitor(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None

    def _record(self, op: str, what: str, nbytes: int) -> CollectiveRecord:
        self.seq += 1
        record = CollectiveRecord(self.seq, op, what, nbytes, time.monotonic())
        self.log.append(record)
        return record

    @contextlib.contextmanager
    def _blocking(self, record: CollectiveRecord) -> Iterator[None]:
        """Around every wait: tell the monitor, and turn a timeout into an explanation of the stall."""
        monitor = self.monitor
        if monitor is not None:
            monitor.enter(record.seq, record.op, record.what)
        began = time.monotonic()
        try:
            yield
        except (RuntimeError, dist.DistError) as exc:
            waited = time.monotonic() - began
            if monitor is None or isinstance(exc, (StallError, PeerFailedError)) or (
                    waited < monitor.threshold_s and "timed out" not in str(exc).lower()):
                raise  # not a stall: a bad argument, or a peer that failed fast
            try:
                explanation = monitor.diagnosis_of(record.seq) or monitor.explain()
            except Exception:  # noqa: BLE001 - the store may be gone with the failed peer
                explanation = f"rank {self.rank} waited in collective #{record.seq} {record.op} ({record.what})"
            raise StallError(f"{explanation}\n(the collective failed with: {exc})") from exc
        finally:
            if monitor is not None:
                monitor.leave(record.seq, record.op, record.what)

    def wait(self, pending: Any, record: CollectiveRecord | None = None) -> Any:
        """Wait for an asynchronous collective: a `Pending` from `all_reduce(async_op=True)`, or a Future with
        the `record` of what it is (from `note`)."""
        if isinstance(pending, Pending):
            with self._blocking(pending.record):
                pending.work.wait()
            return None
        if isinstance(pending, torch._C.Future):
            record = record or CollectiveRecord(self.seq, "future", "", 0, time.monotonic())
            with self._blocking(record):
                return pending.wait()
        pending.wait()
        return None

    def note(self, op: str, what: str, nbytes: int = 0) -> CollectiveRecord:
        """Number and log a collective issued elsewhere (a comm hook's), so that waits on it are explained."""
        return self._record(op, what, nbytes)

    def global_rank(self, group_rank: int) -> int:
        """The global rank of this group's rank `group_rank` (collectives take global ranks as src)."""
        if self.group is None or not self.active:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -- tensors ------------------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, what: str = "", async_op: bool = False,
                   op: dist.ReduceOp = dist.ReduceOp.SUM):
        """Sum (by default) `tensor` in place over the group. async_op=True returns what `wait` takes."""
        record = self._record("all_reduce", what, tensor.numel() * tensor.element_size())
        if not self.distributed:
            return _DoneWork(tensor) if async_op else None
        if async_op:
            return Pending(dist.all_reduce(tensor, op=op, group=self.group, async_op=True), record)
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
                              async_op: bool = False, op: dist.ReduceOp = dist.ReduceOp.SUM):
        """Sum (by default) the flat `input` over the group and leave this rank's equal share of the result,
        elements [rank * n, (rank + 1) * n) with n = output.numel(), in `output`. async_op as in all_reduce."""
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, it needs output's "
                             f"{output.numel()} times the world size {self.world_size}")
        record = self._record("reduce_scatter", what, input.numel() * input.element_size())
        if not self.distributed:
            output.copy_(input.reshape(output.shape))
            return _DoneWork(output) if async_op else None
        # torch 2.13 renamed it reduce_scatter_single; older versions have only reduce_scatter_tensor.
        collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        if async_op:
            return Pending(collective(output, input, op=op, group=self.group, async_op=True), record)
        with self._blocking(record):
            collective(output, input, op=op, group=self.group)
        return None

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, what: str = "",
                               async_op: bool = False):
        """Every rank's `input` concatenated in rank order into the flat `output` (world size times as large)."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, it needs input's "
                             f"{input.numel()} times the world size {self.world_size}")
        record = self._record("all_gather", what, output.numel() * output.element_size())
        if not self.distributed:
            output.copy_(input.reshape(output.shape))
            return _DoneWork(output) if async_op else None
        collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        if async_op:
            return Pending(collective(output, input, group=self.group, async_op=True), record)
        with self._blocking(record):
            collective(output, input, group=self.group)
        return None

    def broadcast(self, tensor: torch.Tensor, src: int = 0, what: str = "") -> None:
        record = self._record("broadcast", what, tensor.numel() * tensor.element_size())
        if self.distributed:
            with self._blocking(record):
                dist.broadcast(tensor, src=self.global_rank(src), group=self.group)

    def all_gather(self, tensor: torch.Tensor, what: str = "") -> torch.Tensor:
        """Every rank's `tensor` stacked along a new first dimension, in rank order."""
        record = self._record("all_gather", what, tensor.numel() * tensor.element_size() * self.world_size)
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
                            t.copy_(flat[offset:offset + nbytes].view(t.dtype).view(t.shape))
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
        record = self._record("barrier", what, 0)
        if not self.distributed:
            return
        with self._blocking(record):
            if self.backend == "nccl" and device is not None and device.type == "cuda":
                dist.barrier(group=self.group, device_ids=[device.index])
            else:
                dist.barrier(group=self.group)


@dataclasses.dataclass
class Pending:
    """An asynchronous collective in flight; `Comm.wait` waits for it."""

    work: Any
    record: CollectiveRecord


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


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's contents as a flat uint8 tensor (a view when it is contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


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


def init_process_group(backend: str | None = None, timeout: float | None = None, device_type: str | None = None,
                       join_timeout: float | None = None, stall_seconds: float | None = None) -> DistEnv:
    """Join the launcher's world (see `ddpkit.env.init_process_group`) and start the stall inspector.

    stall_seconds: a collective waiting longer than this is explained (who never arrived, and where);
    default: a fifth of the timeout, at most 5 minutes; 0 turns the inspector off.
    """
    world = env.init_process_group(backend, timeout, device_type, join_timeout=join_timeout)
    if world.world_size > 1 and stall_seconds != 0:
        threshold = stall_seconds if stall_seconds is not None else min(world.timeout.total_seconds() / 5, 300.0)
        Comm.for_group(None).start_monitor(threshold, world.restart)
    return world


def destroy_process_group() -> None:
    """Stop the stall inspector and leave the world; a no-op without a process group."""
    if dist.is_available() and dist.is_initialized():
        Comm.for_group(None).stop_monitor()
    env.destroy_process_group()


def barrier(world: DistEnv | None = None, what: str = "barrier") -> None:
    """Wait for every rank of the default group; a no-op in a world of one or without a process group."""
    Comm.for_group(None).barrier(what, world.device if world is not None else None)


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
