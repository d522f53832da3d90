"""Backward hooks, buckets launched in order while backward runs, and the end-of-backward finalize.

Read top-down, the life of one backward pass (a `BackwardPass`):

1. Arm. The first autograd node of the backward pass (the node that produced a forward output, on which the
   DDP wrapper registered a pre-hook) opens a BackwardPass and queues its finalize on the autograd engine, so that
   it runs once the *outermost* backward is done, also under reentrant checkpointing. (When no output node
   could take the hook, the first gradient hook opens it instead; inside a reentrant checkpoint that is an
   inner backward, whose end then reduces early: the gradients stay right, at the cost of extra all-reduces.)
   Whether the pass synchronises was decided at forward time; `prepare_for_backward` overrides that for the
   next backward, as torch's reducer does.
2. Hook. Each parameter's post-accumulate-grad hook counts how often its gradient was accumulated. When the
   count reaches the number learned in the first iteration, the parameter is ready; a bucket whose parameters
   are all ready is launched, strictly in bucket-index order on every rank, so collectives always match. With
   several wrappers on one process group inside one backward, buckets wait for the finalizes instead, which run
   in the same order on every rank.
3. Launch. The bucket (ddpkit.engine.buckets) copies its gradients into its flat storage, divided by the divisor (the
   world size unless told otherwise), and hands it to the reduction (ddpkit.engine.reductions: an all-reduce, a comm
   hook, or a reduce-scatter into this rank's shard) asynchronously while backward goes on. The per-parameter
   usage flags go with the last bucket: in its all-reduce, beside the shards of gloo's point-to-point
   reduce-scatter, or as their own small collective right after it (ddpkit.engine.reductions says which).
4. Finalize. Buckets that never filled (their parameters got no gradient on this rank) are launched with
   whatever gradient their parameters hold (zeros for none), every bucket is awaited and written back. A
   parameter no rank used keeps its gradient as it was (None stays None); one used by some ranks gets the
   average over all ranks, as one process on the concatenated batch would.

The first synchronised backward pass only learns: it records the order in which gradients became ready and how many
times each was accumulated, reduces everything at its end, and builds the buckets in rank 0's ready order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Variable

from ddpkit.distributed.comm import Comm
from ddpkit.engine.backward_pass import Uses, BackwardPass
from ddpkit.engine.buckets import Bucket, BucketLayout, GradBucket, ParamSpec, layout_buckets, assign_buckets, ready_order
from ddpkit.engine.reductions import AllReduce, CommHook, CommHookReduction, ReduceScatter, Reduction
from ddpkit.timeline.record import BACKWARD, BUCKET_READY, FIRST_GRAD, NULL_RECORDER, copy_in

__all__ = ["Reducer", "Bucket", "BucketLayout", "GradBucket", "ParamSpec", "assign_buckets", "ready_order",
           "Reduction", "AllReduce", "CommHookReduction", "ReduceScatter", "CommHook", "BackwardPass"]

# torch's default bucket size; the first bucket is small because its gradients (the last layers') are ready
# first and launching it early starts communication sooner (torch makes the same choice, 1 MiB).
DEFAULT_BUCKET_CAP_MB = 25.0
FIRST_BUCKET_CAP_MB = 1.0

# torch's words (its tests match them), raised as RuntimeError as torch's are
HOOK_ONCE = "register_comm_hook or register_builtin_comm_hook can only be called once: a hook is already registered"

# Gradients of at least this many elements are divided into their bucket the moment they are ready (one fused
# div-out while the gradient is still in cache, overlapping the rest of backward); smaller ones are copied
# together when their bucket launches, one foreach call per bucket, because per-call overhead dominates for them.
# 32K elements (128 KiB in float32) was where the two ways broke even in `python -m ddpkit.bench` on the CPU.
EAGER_NUMEL = 1 << 15


class Reducer:
    """Averages the gradients of `params` over `comm`'s ranks during backward.

    divisor: what the summed gradients are divided by (None: the world size, an average); it may be changed
    between backward passes. reduction: how buckets are reduced (None: an all-reduce); see `set_reduction`.
    """

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], comm: Comm,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, gradient_as_bucket_view: bool = False,
                 first_bucket_cap_mb: float = FIRST_BUCKET_CAP_MB,
                 default_sync: Callable[[], bool | None] = lambda: True, divisor: float | None = None,
                 reduction: Reduction | None = None):
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
        # Whether a backward that no forward's output armed synchronises; None: it stays local (no forward of the
        # wrapper led to it: a backward through the bare module, as torch's reducer leaves it)
        self.default_sync = default_sync
        self.armed = 0  # backward passes armed so far (a forward's decision is for the next one only)
        self.divisor = divisor
        self.reduction: Reduction = reduction or AllReduce(comm)
        self.specs = [ParamSpec(p.numel(), p.element_size(), p.dtype, p.device) for p in params]
        n = len(params)
        # The plan, learned in the first synchronised backward pass:
        self.learning = True
        self.buckets: list[Bucket] = []
        self.bucket_of: list[int] = [0] * n
        self.position: list[int] = [0] * n  # a parameter's place among its bucket's members
        self.expected: list[int] = [1] * n  # accumulations per backward
        self.rebuilt_order: list[int] | None = None  # rank 0's ready order the buckets were built from
        self.eager = [p.numel() >= EAGER_NUMEL for p in params]
        # Parameters the forward pass could not reach (find_unused_parameters): ready from the start.
        self.unreachable: list[int] = []
        self.unreachable_set: frozenset[int] = frozenset()
        self.backward_pass: BackwardPass | None = None  # the latest backward pass
        self.uses = Uses(n)  # since the last synchronised finalize, so no_sync micro-batches count as uses
        self.synced_passes = 0  # synchronised backward passes finalized
        self._launched_before_finalize = 0  # of the last finalized synchronised pass (launched_during_backward)
        self._sync_requested = False  # prepare_for_backward: the next backward synchronises
        self.recorder = NULL_RECORDER  # the timeline, when one records (set by the DDP wrapper)
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
                         for i, p in enumerate(params)]

    def set_reduction(self, reduction: Reduction) -> None:
        """Reduce buckets with `reduction` from now on; only before the first backward (it shapes the buckets)."""
        if self.synced_passes > 0 or not self.learning:
            raise RuntimeError("the reduction must be chosen before the first backward pass")
        self.reduction = reduction

    @property
    def launched_during_backward(self) -> int:
        """Buckets launched before the finalize: of the synchronised backward running now, else of the last one
        (a compiled backward's pieces read it while it runs)."""
        backward_pass = self.backward_pass
        if backward_pass is not None and backward_pass.open and backward_pass.sync:
            return backward_pass.launched_during_backward
        return self._launched_before_finalize

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        if isinstance(self.reduction, CommHookReduction):
            raise RuntimeError(HOOK_ONCE)
        if self.synced_passes > 0:
            raise RuntimeError("register_comm_hook must be called before the first backward pass")
        self.set_reduction(CommHookReduction(self.comm, state, hook))

    @property
    def comm_hook(self) -> CommHook | None:
        return self.reduction.hook if isinstance(self.reduction, CommHookReduction) else None

    # -- 1. arm --------------------------------------------------------------------------------------------------
    def arm(self, sync: bool) -> None:
        """Open a BackwardPass for the backward that is starting (called from its first autograd node)."""
        task = torch._C._current_graph_task_id()
        backward_pass = self.backward_pass
        if backward_pass is not None and backward_pass.open:
            if task == backward_pass.graph_task:  # several DDP outputs feed one backward: one pass
                if sync and not backward_pass.sync:
                    self._open_sync(backward_pass)
                return
            self._abandon(backward_pass)  # the previous backward raised before its finalize ran
        sync, self._sync_requested = sync or self._sync_requested, False
        self.armed += 1
        backward_pass = self.backward_pass = BackwardPass(task, self.recorder.begin())
        if sync:
            self._open_sync(backward_pass)
        Variable._execution_engine.queue_callback(functools.partial(self._finalize, backward_pass))

    def _open_sync(self, backward_pass: BackwardPass) -> None:
        divisor = self.comm.world_size if self.divisor is None else self.divisor
        backward_pass.open_sync(len(self.params), self.buckets, divisor, self.synced_passes + 1)
        self.comm.open_sync_windows += 1
        if not self.learning:
            for i in self.unreachable:
                backward_pass.fires[i] = self.expected[i]
                self._count_ready(backward_pass, i)

    def _close(self, backward_pass: BackwardPass) -> None:
        if backward_pass.sync:
            self.comm.open_sync_windows -= 1
        backward_pass.open = False

    def _abandon(self, backward_pass: BackwardPass) -> None:
        """The previous backward raised before its finalize: drop what it counted (its uses too)."""
        for bucket, handle in zip(self.buckets, backward_pass.inflight):
            if handle is not None:
                bucket.wait(handle)
        if backward_pass.usage is not None:
            self.comm.wait(backward_pass.usage)
        self._close(backward_pass)
        self.uses = Uses(len(self.params))

    def prepare_for_backward(self, outputs: Any = ()) -> None:
        """torch's reducer method (accelerate's trigger_sync_in_backward calls it): the next backward pass
        synchronises, whatever its forward decided. Its outputs are not walked: that backward waits for every
        parameter (find_unused_parameters' early launches are skipped once), which is always correct."""
        self._sync_requested = True
        self.set_unreachable([])

    # -- 2. hook -------------------------------------------------------------------------------------------------
    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        backward_pass = self.backward_pass
        if backward_pass is None or not backward_pass.open:
            # No armed output reached this backward (the forward's outputs were not tensors we could find, or no
            # forward of the wrapper made them).
            sync = self.default_sync()
            if sync is None and not self._sync_requested:
                return
            self.arm(bool(sync))
            backward_pass = self.backward_pass
        uses = self.uses
        if not uses.flags[index]:
            uses.flags[index] = True
            uses.count += 1
        if not backward_pass.sync:
            return
        fires = backward_pass.fires
        count = fires[index] + 1
        fires[index] = count
        if self.learning:
            backward_pass.fired_order.append(index)
            return
        expected = self.expected[index]
        if count == expected:  # the common case, kept lean: this runs once per parameter per backward
            if self.eager[index] and self.reduction.divides:
                b = self.bucket_of[index]
                if self.buckets[b].fill_one(self.position[index], backward_pass.divisor):
                    backward_pass.filled[index] = True
            self._count_ready(backward_pass, index)
        elif count > expected:
            self._extra_gradient(backward_pass, index, count, expected)

    def _extra_gradient(self, backward_pass: BackwardPass, index: int, count: int, expected: int) -> None:
        launched = backward_pass.next_launch > self.bucket_of[index]
        if launched and index in self.unreachable_set:
            raise RuntimeError(
                f"parameter '{self.names[index]}' received a gradient although find_unused_parameters' walk "
                "of the forward graph found no path to it, and its bucket was already reduced. Something in "
                "the forward hid the parameter from the graph (a custom autograd Function that runs autograd "
                "inside its backward, say). Construct the wrapper with find_unused_parameters=False: ddpkit "
                "handles unused parameters without it.")
        if launched:
            raise RuntimeError(
                f"parameter '{self.names[index]}' received gradient number {count} in this backward pass "
                f"after its bucket was already reduced; in the first iteration it received {expected}. The "
                "graph changed how often this parameter is used in one backward pass (a layer called a "
                "different number of times under reentrant activation checkpointing, say). Keep that number "
                "fixed from one iteration to the next, or use checkpoint(..., use_reentrant=False).")
        # Still in time: its gradient is copied when the bucket launches. A parameter the forward pass
        # could not reach (find_unused_parameters) keeps its count; any other learns the new one.
        backward_pass.filled[index] = False
        if index not in self.unreachable_set:
            self.expected[index] = count

    def _count_ready(self, backward_pass: BackwardPass, index: int) -> None:
        b = self.bucket_of[index]
        if self.recorder.active:
            self._record_ready(backward_pass, b)
        backward_pass.missing[b] -= 1
        if backward_pass.missing[b] == 0:
            self._launch_ready(backward_pass)

    def _record_ready(self, backward_pass: BackwardPass, b: int) -> None:
        """The timeline's instants: bucket b's first parameter is ready now, or its last one is."""
        missing = backward_pass.missing[b]
        if missing == len(self.buckets[b].members):
            self.recorder.instant(FIRST_GRAD, "bucket", {"bucket": b})
        if missing == 1:
            self.recorder.instant(BUCKET_READY, "bucket", {"bucket": b})

    # -- 3. launch -----------------------------------------------------------------------------------------------
    def _launch_ready(self, backward_pass: BackwardPass) -> None:
        """Launch every complete bucket that is next in index order.

        Only while this is the one reducer of its process group with an open synchronised pass: with two wrappers in one
        backward (a model and a sub-model, a GAN's two halves) the interleaving of their launches would depend
        on which parameters each rank used, and the collectives would pair up wrongly across ranks. Then every
        bucket waits for its finalize, and the finalizes run in the order the passes opened, on every rank.
        """
        if self.comm.open_sync_windows > 1:
            return
        buckets, missing = self.buckets, backward_pass.missing
        while backward_pass.next_launch < len(buckets) and missing[backward_pass.next_launch] == 0:
            self._launch(backward_pass, buckets[backward_pass.next_launch])
            backward_pass.launched_during_backward += 1

    def _launch(self, backward_pass: BackwardPass, bucket: Bucket) -> None:
        backward_pass.next_launch += 1
        # The copy-in span holds the collective's issue too: the timeline reads the launch from it.
        with torch.no_grad(), self.recorder.span(copy_in(bucket.index), "copy", {"bucket": bucket.index}):
            bucket.fill(backward_pass.filled, backward_pass.divisor if self.reduction.divides else None)
            if bucket.usage_numel:
                backward_pass.usage_counts = self._write_usage(bucket.usage)
            backward_pass.inflight[bucket.index] = bucket.launch(backward_pass.number)
        if backward_pass.next_launch == len(self.buckets) and not bucket.usage_numel and not self.reduction.chains:
            self._launch_usage(backward_pass)

    def _write_usage(self, into: torch.Tensor) -> torch.Tensor:
        """This rank's usage flags (1 for a parameter used since the last synchronised backward, else 0) into
        `into`, one element per parameter. Summed over the ranks, an element is above zero exactly where some
        rank used the parameter, in int32 and in reduction.FLAG_DTYPES: sums of zeros and ones never round a
        one away."""
        if self.uses.count == len(self.params):
            return into.fill_(1)
        # From pinned memory, asynchronously: a pageable copy to a GPU would stall the CPU here, mid-backward, until
        # the device drained (the caching host allocator keeps the pinned block until the copy is done).
        flags = torch.tensor(self.uses.flags, dtype=into.dtype, pin_memory=into.is_cuda)
        return into.copy_(flags, non_blocking=into.is_cuda)

    def _launch_usage(self, backward_pass: BackwardPass) -> None:
        """Sum over the ranks, per parameter, whether it was used since the last synchronised backward.

        The flags are written when the last bucket launches: launches go in index order, so every use of this
        pass is known then, and it is the same place on every rank. Most reductions carry them in that
        bucket's collective (ddpkit.engine.reductions); where one cannot (a comm hook, a native reduce-scatter), they
        get this collective of their own, issued right after that bucket. It is never skipped: only a
        collective every rank skips may be skipped, and whether some rank left a parameter unused is known to
        that rank alone. It runs beside the last bucket's reduction (gloo works on two threads; NCCL queues it
        behind), so finalize's wait for it is mostly covered by the wait for that bucket. (Not waiting at all
        there is no option: a collective left unwaited at the last step can be cut off when the process group
        is destroyed, seen in testing.)
        """
        device = self.params[0].device  # NCCL needs the counts on the device
        counts = self._write_usage(torch.empty(len(self.params), dtype=torch.int32, device=device))
        backward_pass.usage_counts = counts
        backward_pass.usage = self.sum_usage(counts, backward_pass.number)

    def sum_usage(self, counts: torch.Tensor, number: int) -> Any:
        """Start the usage counts' own collective for synchronised backward `number`, under the name every rank
        gives it (join's shadow backward issues it too, with zeros)."""
        return self.comm.all_reduce(counts, f"parameter usage, backward {number}", async_op=True)

    # -- 4. finalize ---------------------------------------------------------------------------------------------
    def _finalize(self, backward_pass: BackwardPass) -> None:
        self._close(backward_pass)
        if not backward_pass.sync:
            self.recorder.end(BACKWARD, "backward", backward_pass.began)
            return  # no_sync: gradients stay local and keep accumulating; their uses are remembered
        self.synced_passes += 1
        if self.learning:
            self._build_buckets(backward_pass)
        for bucket in self.buckets[backward_pass.next_launch:]:
            self._launch(backward_pass, bucket)
        results = [bucket.wait(handle) for bucket, handle in zip(self.buckets, backward_pass.inflight)]
        backward_pass.inflight = [None] * len(self.buckets)
        if self.reduction.chains and not self.buckets[-1].usage_numel:
            self._launch_usage(backward_pass)  # after the last collective the hook chained (reduction.chains)
        if backward_pass.usage is not None:
            self.comm.wait(backward_pass.usage)
            backward_pass.usage = None
        everywhere_used = None
        if self.uses.count < len(self.params):  # otherwise every parameter was used here, so somewhere
            everywhere_used = (backward_pass.usage_counts > 0).tolist()
        backward_pass.usage_counts = None  # a view into the last bucket's storage, which a reduce-scatter releases
        with torch.no_grad():
            for bucket, result in zip(self.buckets, results):
                bucket.write_back(result, everywhere_used)
        self.uses = Uses(len(self.params))
        self._launched_before_finalize = backward_pass.launched_during_backward
        self.recorder.end(BACKWARD, "backward", backward_pass.began)

    def learn_without_gradients(self) -> None:
        """End the learning pass on a rank without a backward of its own (join: it ran out of data before the
        first synchronised backward). The bucket order comes from rank 0 as in the others' first backward; when
        rank 0 is this rank, its order is the default one, which is as good for matching collectives."""
        backward_pass = BackwardPass(-1)
        backward_pass.open_sync(len(self.params), self.buckets, 1.0, self.synced_passes + 1)
        self._build_buckets(backward_pass)

    def _build_buckets(self, backward_pass: BackwardPass) -> None:
        """End of the learning pass: buckets in rank 0's ready order, accumulation counts from this rank."""
        order = ready_order(backward_pass.fired_order, len(self.params))
        if self.comm.distributed:  # with rank 0's bucket caps: a rank given another bucket_cap_mb still matches
            shared = torch.tensor([*order, self.cap_bytes, self.first_cap_bytes], dtype=torch.int64,
                                  device=self.params[0].device)  # NCCL needs it there
            self.comm.broadcast(shared, src=0, what="bucket order")
            *order, self.cap_bytes, self.first_cap_bytes = shared.tolist()
        self.rebuilt_order = order
        self.expected = [max(count, 1) for count in backward_pass.fires]
        plan = assign_buckets(self.specs, order, self.cap_bytes, self.first_cap_bytes)
        layouts = layout_buckets(plan, self.specs, self.reduction.shards)
        last = layouts[-1]
        carried = len(self.params) if self.reduction.carries_usage(last) else 0
        self.buckets = [Bucket(layout, self.params, self.comm, self.reduction, layout is last,
                               self.gradient_as_bucket_view, carried if layout is last else 0)
                        for layout in layouts]
        for layout in layouts:
            for position, i in enumerate(layout.members):
                self.bucket_of[i] = layout.index
                self.position[i] = position
        backward_pass.start_buckets(self.buckets)
        self.learning = False

    # -- find_unused_parameters and introspection ----------------------------------------------------------------
    def set_unreachable(self, unreachable: list[int]) -> None:
        """Parameters the coming backward cannot reach: their buckets need not wait for them."""
        self.unreachable = unreachable
        self.unreachable_set = frozenset(unreachable)

    def bucket_plan(self) -> list[list[str]]:
        """The current buckets as lists of parameter names (empty until the first synchronised backward)."""
        return [[self.names[i] for i in bucket.members] for bucket in self.buckets]

    def layouts(self) -> list[BucketLayout]:
        """Where each parameter lies in each bucket's flat storage (empty until the first synchronised backward)."""
        return [bucket.layout for bucket in self.buckets]
