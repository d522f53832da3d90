"""Gradient buckets, backward hooks, asynchronous all-reduce and the end-of-backward finalize.

Read top-down, the life of one synchronised backward pass (a "window"):

1. Arm. The first autograd node of the backward pass (the node that produced a forward output, on which the
   DDP wrapper registered a pre-hook) opens the window and queues `_finalize` on the autograd engine, so that
   it runs once the *outermost* backward is done, also under reentrant checkpointing. (When no output node
   could take the hook, the first gradient hook opens it instead; inside a reentrant checkpoint that is an
   inner backward, whose end then reduces early: the gradients stay right, at the cost of extra all-reduces.)
2. Hook. Each parameter's post-accumulate-grad hook counts how often its gradient was accumulated. When the
   count reaches the number learned in the first iteration, the parameter is ready; a bucket whose parameters
   are all ready is launched, strictly in bucket-index order on every rank, so collectives always match. With
   several wrappers on one process group inside one backward, buckets wait for the finalizes instead, which run
   in the same order on every rank.
3. Launch. The bucket's gradients are copied into its flat buffer, divided by the world size and all-reduced
   asynchronously (or handed to a comm hook) while backward goes on.
4. Finalize. Buckets that never filled (their parameters got no gradient on this rank) are launched with
   whatever gradient their parameters hold (zeros for none), every bucket is awaited, and the averages are
   written back. A usage count per parameter travels at the end of the last bucket: a parameter no rank used
   keeps its gradient as it was (None stays None), one used by some ranks gets the average over all ranks,
   as one process on the concatenated batch would.

The first synchronised window only learns: it records the order in which gradients became ready and how many
times each was accumulated, reduces everything at its end, and builds the buckets in rank 0's ready order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd import Variable

from .comm import Comm
from .timeline_record import BACKWARD, BUCKET_READY, FIRST_GRAD, NULL_RECORDER, copy_in

# torch's default bucket size; the first bucket is small because its gradients (the last layers') are ready
# first and launching it early starts communication sooner (torch makes the same choice, 1 MiB).
DEFAULT_BUCKET_CAP_MB = 25.0
FIRST_BUCKET_CAP_MB = 1.0

# Gradients of at least this many elements are divided into their bucket the moment they are ready (one fused
# div-out while the gradient is still in cache, overlapping the rest of backward); smaller ones are copied
# together when their bucket launches, one foreach call per bucket, because per-call overhead dominates for them.
# 32K elements (128 KiB in float32) was where the two ways broke even in `python -m ddpkit.bench` on the CPU.
EAGER_NUMEL = 1 << 15

CommHook = Callable[[Any, "GradBucket"], torch.futures.Future]


# -- the bucket plan: pure -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know about one parameter."""

    numel: int
    element_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


def plan_buckets(specs: Sequence[ParamSpec], order: Sequence[int], cap_bytes: int,
                 first_cap_bytes: int | None = None) -> list[list[int]]:
    """Group parameter indices into buckets.

    Parameters are taken in `order` (the order their gradients are expected to be ready); each (dtype,
    device) gets its own buckets; a bucket is closed as soon as it holds at least its cap (the first bucket of each
    kind uses `first_cap_bytes`), so it overshoots by at most its last parameter. That is torch's rule, and it is
    what makes the first bucket useful for overlap: with two 4 MiB layers behind a tiny head, a strict cap would
    leave the head alone in the first bucket and everything else in one bucket that launches only at the end.
    Buckets are numbered by the position of their first parameter in `order`, so bucket 0 is the first ready.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    if sorted(order) != list(range(len(specs))):
        raise ValueError("order must be a permutation of the parameter indices")
    first_cap = cap_bytes if first_cap_bytes is None else min(first_cap_bytes, cap_bytes)
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed_count: dict[tuple, int] = {}
    done: list[list[int]] = []
    for index in order:
        spec = specs[index]
        kind = (spec.dtype, spec.device)
        bucket = open_buckets.setdefault(kind, [])
        bucket.append(index)
        open_bytes[kind] = open_bytes.get(kind, 0) + spec.nbytes
        limit = first_cap if closed_count.get(kind, 0) == 0 else cap_bytes
        if open_bytes[kind] >= limit:
            done.append(bucket)
            closed_count[kind] = closed_count.get(kind, 0) + 1
            open_buckets[kind] = []
            open_bytes[kind] = 0
    done.extend(b for b in open_buckets.values() if b)
    position = {index: pos for pos, index in enumerate(order)}
    done.sort(key=lambda bucket: position[bucket[0]])
    return done


def ready_order(fired: Sequence[int], num_params: int) -> list[int]:
    """The order in which parameters became ready: by their last hook firing; never-fired ones last, in
    reverse registration order (the order backward usually visits them)."""
    last = {index: pos for pos, index in enumerate(fired)}
    seen = sorted(last, key=last.__getitem__)
    rest = [i for i in reversed(range(num_params)) if i not in last]
    return seen + rest


# -- buckets at run time ---------------------------------------------------------------------------------------
class GradBucket:
    """One bucket as a comm hook sees it (the surface of torch's GradBucket)."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], buffer: torch.Tensor, comm: Comm,
                 is_last: bool):
        self._index = index
        self._params = params
        self._buffer = buffer
        self._is_last = is_last
        self.comm = comm
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradients of this bucket; a hook reduces it and returns it (or a tensor of its size)."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        return list(self.views)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._is_last


class _Bucket:
    """Run-time state of one bucket: its storage and, per window, how far it got."""

    def __init__(self, index: int, members: list[int], params: list[torch.nn.Parameter], comm: Comm,
                 is_last: bool, flag_slots: int):
        numel = sum(params[i].numel() for i in members)
        first = params[members[0]]
        # The last bucket carries one usage count per parameter after its gradients (see _finalize).
        self.storage = torch.zeros(numel + flag_slots, dtype=first.dtype, device=first.device)
        self.members = members
        self.params = [params[i] for i in members]
        self.grad_numel = numel
        self.public = GradBucket(index, [params[i] for i in members], self.storage[:numel], comm, is_last)
        self.views = self.public.views
        self.flags = self.storage[numel:] if flag_slots else None
        self.pending = len(members)
        self.launched = False
        self.work: Any = None
        self.future: torch.futures.Future | None = None
        self.record: Any = None  # what the comm hook's collective is, for the stall inspector


class Reducer:
    """Averages the gradients of `params` over `comm`'s ranks during backward."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], comm: Comm,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, gradient_as_bucket_view: bool = False,
                 first_bucket_cap_mb: float = FIRST_BUCKET_CAP_MB,
                 default_sync: Callable[[], bool] = lambda: True):
        if not params:
            raise ValueError("there are no parameters that require a gradient to reduce")
        self.params = params
        self.names = names
        self.comm = comm
        self.cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.first_cap_bytes = int(first_bucket_cap_mb * 1024 * 1024)
        if self.cap_bytes <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.default_sync = default_sync  # whether a backward that no forward armed should synchronise
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: Any = None
        self.specs = [ParamSpec(p.numel(), p.element_size(), p.dtype, p.device) for p in params]
        n = len(params)
        self.buckets: list[_Bucket] = []
        self.bucket_of: list[int] = [0] * n
        self.expected: list[int] = [1] * n  # accumulations per backward, learned in the first window
        self.learning = True
        self.fired_order: list[int] = []
        self.rebuilt_order: list[int] | None = None  # rank 0's ready order the buckets were built from
        # Per synchronised window:
        self.armed = False
        self.sync = False
        self.graph_task: int | None = None
        self.fires: list[int] = [0] * n
        self.next_launch = 0
        # Since the last synchronised finalize (so no_sync micro-batches count as uses):
        self.used: list[bool] = [False] * n
        self.num_used = 0
        # Parameters the forward pass could not reach (find_unused_parameters): ready from the start.
        self.unreachable: list[int] = []
        self.unreachable_set: frozenset[int] = frozenset()
        self.eager = [p.numel() >= EAGER_NUMEL for p in params]
        self.filled = [False] * n  # per window: the gradient is already divided into its bucket view
        self.view_of: list[torch.Tensor | None] = [None] * n
        self.windows = 0
        self.launched_during_backward = 0  # buckets of the current/last window launched before its finalize
        self.recorder = NULL_RECORDER  # the timeline, when one records (set by the DDP wrapper)
        self._backward_began: float | None = None
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                         for i, p in enumerate(params)]

    # -- 1. arm --------------------------------------------------------------------------------------------------
    def arm(self, sync: bool) -> None:
        """Open a window for the backward pass that is starting (called from its first autograd node)."""
        task = torch._C._current_graph_task_id()
        if self.armed:
            if task == self.graph_task:  # several DDP outputs feed one backward: one window
                if sync and not self.sync:
                    self._open_sync()
                return
            self._abandon()  # the previous backward raised before its finalize ran
        self.armed = True
        self._backward_began = self.recorder.begin()
        self.sync = False
        self.graph_task = task
        if sync:
            self._open_sync()
        Variable._execution_engine.queue_callback(self._finalize)

    def _open_sync(self) -> None:
        self.sync = True
        self.comm.open_sync_windows += 1
        self.fires = [0] * len(self.params)
        self.filled = [False] * len(self.params)
        self.next_launch = 0
        self.launched_during_backward = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.members)
            bucket.launched = False
        if not self.learning:
            for i in self.unreachable:
                self.fires[i] = self.expected[i]
                self._count_ready(i)

    def _close(self) -> None:
        if self.sync:
            self.comm.open_sync_windows -= 1
        self.armed = False

    def _abandon(self) -> None:
        """The previous backward raised before its finalize: drop what it counted (its uses too)."""
        for bucket in self.buckets:
            if bucket.launched:
                self._wait(bucket)
        self._close()
        self.used = [False] * len(self.params)
        self.num_used = 0
        self.fired_order = []

    # -- 2. hook -------------------------------------------------------------------------------------------------
    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        if not self.armed:
            # No armed output reached this backward (the forward's outputs were not tensors we could wrap).
            self.arm(self.default_sync())
        used = self.used
        if not used[index]:
            used[index] = True
            self.num_used += 1
        if not self.sync:
            return
        fires = self.fires
        count = fires[index] + 1
        fires[index] = count
        if self.learning:
            self.fired_order.append(index)
            return
        expected = self.expected[index]
        if count == expected:  # the common case, kept lean: this runs once per parameter per backward
            if self.eager[index] and self.comm_hook is None:
                self._fill_one(index)
            bucket = self.buckets[self.bucket_of[index]]
            if self.recorder.active and bucket.pending == len(bucket.members):
                self.recorder.instant(FIRST_GRAD, "bucket", {"bucket": bucket.public.index()})
            bucket.pending -= 1
            if bucket.pending == 0:
                if self.recorder.active:
                    self.recorder.instant(BUCKET_READY, "bucket", {"bucket": bucket.public.index()})
                self._launch_ready()
        elif count > expected:
            bucket = self.buckets[self.bucket_of[index]]
            if bucket.launched and index in self.unreachable_set:
                raise RuntimeError(
                    f"parameter '{self.names[index]}' received a gradient although find_unused_parameters' walk "
                    "of the forward graph found no path to it, and its bucket was already reduced. Something in "
                    "the forward hid the parameter from the graph (a custom autograd Function that runs autograd "
                    "inside its backward, say). Construct the wrapper with find_unused_parameters=False: ddpkit "
                    "handles unused parameters without it."
                )
            if bucket.launched:
                raise RuntimeError(
                    f"parameter '{self.names[index]}' received gradient number {count} in this backward pass "
                    f"after its bucket was already reduced; in the first iteration it received {expected}. The "
                    "graph changed how often this parameter is used in one backward pass (a layer called a "
                    "different number of times under reentrant activation checkpointing, say). Keep that number "
                    "fixed from one iteration to the next, or use checkpoint(..., use_reentrant=False)."
                )
            # Still in time: its gradient is copied when the bucket launches. A parameter the forward pass
            # could not reach (find_unused_parameters) keeps its count; any other learns the new one.
            self.filled[index] = False
            if index not in self.unreachable_set:
                self.expected[index] = count

    def _count_ready(self, index: int) -> None:
        bucket = self.buckets[self.bucket_of[index]]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    # -- 3. launch -----------------------------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        """Launch every complete bucket that is next in index order.

        Only while this is the one reducer of its process group with an open window: with two wrappers in one
        backward (a model and a sub-model, a GAN's two halves) the interleaving of their launches would depend
        on which parameters each rank used, and the collectives would pair up wrongly across ranks. Then every
        bucket waits for its finalize, and the finalizes run in the order the windows opened, on every rank.
        """
        if self.comm.open_sync_windows > 1:
            return
        while self.next_launch < len(self.buckets) and self.buckets[self.next_launch].pending == 0:
            self._launch(self.buckets[self.next_launch])
            self.launched_during_backward += 1

    def _launch(self, bucket: _Bucket) -> None:
        self.next_launch += 1
        bucket.launched = True
        index = bucket.public.index()
        with torch.no_grad(), self.recorder.span(copy_in(index), "copy", {"bucket": index}):
            self._fill(bucket, divide=self.comm_hook is None)
            if bucket.flags is not None:
                # The last bucket launches after every other one, so every use of this window is known here.
                if self.num_used == len(self.params):
                    bucket.flags.fill_(1)
                else:
                    bucket.flags.copy_(torch.tensor(self.used, dtype=bucket.flags.dtype))
            what = f"bucket {bucket.public.index()}, backward {self.windows + 1}"
            if self.comm_hook is None:
                bucket.work = self.comm.all_reduce(bucket.storage, what, async_op=True)
            else:
                bucket.record = self.comm.note("comm_hook", what, bucket.grad_numel * bucket.storage.element_size())
                bucket.future = self.comm_hook(self.comm_hook_state, bucket.public)
                if not isinstance(bucket.future, torch._C.Future):
                    raise TypeError("a comm hook must return a torch.futures.Future of the reduced bucket tensor")
                if bucket.flags is not None:
                    bucket.work = self.comm.all_reduce(bucket.flags, f"parameter usage, {what}", async_op=True)

    def _fill_one(self, index: int) -> None:
        """Divide one ready gradient into its bucket view now (see EAGER_NUMEL)."""
        view, grad = self.view_of[index], self.params[index].grad
        if grad.data_ptr() == view.data_ptr():
            return  # already in place (gradient_as_bucket_view); divided at launch, when no more can arrive
        with torch.no_grad():
            # Average = sum of (grad / world): dividing first keeps low-precision sums from overflowing.
            torch.div(grad, self.comm.world_size, out=view)
        self.filled[index] = True

    def _fill(self, bucket: _Bucket, divide: bool) -> None:
        """Copy the gradients not yet in the bucket into its buffer (zeros where there is none), and divide them
        by the world size unless a comm hook does the reducing."""
        dst, src, in_place = [], [], []
        zeros = 0
        as_view, filled = self.gradient_as_bucket_view, self.filled
        for i, param, view in zip(bucket.members, bucket.params, bucket.views):
            if filled[i]:
                continue
            grad = param.grad
            if grad is None:
                view.zero_()
                zeros += 1
            elif as_view and grad.data_ptr() == view.data_ptr():  # already accumulated in place
                in_place.append(view)
            else:
                dst.append(view)
                src.append(grad)
        if dst:
            torch._foreach_copy_(dst, src)
        if not divide:
            return
        # Average = sum of (grad / world): dividing first keeps low-precision sums from overflowing.
        if len(dst) + len(in_place) + zeros == len(bucket.members):
            bucket.public.buffer().div_(self.comm.world_size)  # one pass: far cheaper than a foreach of many
        elif dst or in_place:
            torch._foreach_div_(dst + in_place, self.comm.world_size)

    # -- 4. finalize ---------------------------------------------------------------------------------------------
    def _finalize(self) -> None:
        self._close()
        if not self.sync:
            self.recorder.end(BACKWARD, "backward", self._backward_began)
            return  # no_sync: gradients stay local and keep accumulating; their uses are remembered
        self.windows += 1
        if self.learning:
            self._build_buckets()
        for bucket in self.buckets[self.next_launch:]:
            self._launch(bucket)
        last = self.buckets[-1]
        results = [self._wait(bucket) for bucket in self.buckets]
        everywhere_used = None
        if self.num_used < len(self.params):  # otherwise every parameter was used here, so somewhere
            everywhere_used = (last.flags > 0).tolist()
        with torch.no_grad():
            for bucket, result in zip(self.buckets, results):
                if result is not None and result is not bucket.public.buffer():
                    bucket.public.buffer().copy_(result)
                self._write_back(bucket, everywhere_used)
        self.used = [False] * len(self.params)
        self.num_used = 0
        self.recorder.end(BACKWARD, "backward", self._backward_began)

    def _write_back(self, bucket: _Bucket, everywhere_used: list[bool] | None) -> None:
        if everywhere_used is None and not self.gradient_as_bucket_view:
            grads = [p.grad for p in bucket.params]
            if all(g is not None for g in grads):  # the common case: one call for the whole bucket
                torch._foreach_copy_(grads, bucket.views)
                return
        dst, src = [], []
        for i, view in zip(bucket.members, bucket.views):
            if everywhere_used is not None and not everywhere_used[i]:
                continue  # no rank used it: its gradient stays as it was, None included
            param = self.params[i]
            if self.gradient_as_bucket_view:
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    param.grad = view
            elif param.grad is None:
                param.grad = view.clone()
            else:
                dst.append(param.grad)
                src.append(view)
        if dst:
            torch._foreach_copy_(dst, src)

    def _build_buckets(self) -> None:
        """End of the learning window: buckets in rank 0's ready order, accumulation counts from this rank."""
        order = ready_order(self.fired_order, len(self.params))
        if self.comm.distributed:
            shared = torch.tensor(order, dtype=torch.int64, device=self.params[0].device)  # NCCL needs it there
            self.comm.broadcast(shared, src=0, what="bucket order")
            order = shared.tolist()
        self.rebuilt_order = order
        self.expected = [max(count, 1) for count in self.fires]
        plan = plan_buckets(self.specs, order, self.cap_bytes, self.first_cap_bytes)
        self.buckets = []
        for b, members in enumerate(plan):
            is_last = b == len(plan) - 1
            self.buckets.append(_Bucket(b, members, self.params, self.comm, is_last,
                                        len(self.params) if is_last else 0))
            for i, view in zip(members, self.buckets[-1].views):
                self.bucket_of[i] = b
                self.view_of[i] = view
        self.next_launch = 0
        self.learning = False
        self.fired_order = []

    def prepare_for_backward(self, outputs: Any = ()) -> None:
        """torch's reducer method, which accelerate's trigger_sync_in_backward calls. Nothing to prepare here:
        a backward that no forward armed takes the wrapper's require_backward_grad_sync when it starts."""

    # -- find_unused_parameters -------------------------------------------------------------------------------
    def set_unreachable(self, unreachable: list[int]) -> None:
        """Parameters the coming backward cannot reach: their buckets need not wait for them."""
        self.unreachable = unreachable
        self.unreachable_set = frozenset(unreachable)

    def bucket_plan(self) -> list[list[str]]:
        """The current buckets as lists of parameter names (empty until the first synchronised backward)."""
        return [[self.names[i] for i in bucket.members] for bucket in self.buckets]


    def _wait(self, bucket: _Bucket) -> torch.Tensor | None:
        """Wait for a launched bucket; the tensor a comm hook produced, or None for the built-in all-reduce."""
        result = None
        if bucket.future is not None:
            result = self.comm.wait(bucket.future, bucket.record)
            bucket.future = None
            if isinstance(result, (list, tuple)):
                result = result[0]
        if bucket.work is not None:
            self.comm.wait(bucket.work)
            bucket.work = None
        return result

