"""Gradient buckets: the plan (which parameters share a flat buffer, where each one lies in it) and the bucket
itself, which fills its buffer, launches its reduction, waits for it and writes the result back.

The plan and the layout are pure (unit-tested without processes). A `Bucket` lives as long as its plan; what
one backward pass does with it (how many of its gradients are still missing, its collective in flight) belongs to the
reducer's `BackwardPass`. How a filled bucket is reduced, and where the result goes, is its `Reduction`'s business
(see ddpkit.engine.reductions): all-reduce and reduce-scatter differ there and nowhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ddpkit.distributed.comm import Comm
    from ddpkit.engine.reductions import Reduction


# -- the plan: pure --------------------------------------------------------------------------------------------
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


def assign_buckets(specs: Sequence[ParamSpec], order: Sequence[int], cap_bytes: int,
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


@dataclasses.dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls into one rank's shard of a bucket."""

    param: int        # the parameter's index (the reducer's numbering)
    start: int        # first element of the parameter (flattened) in the shard
    stop: int         # one past the last
    shard_offset: int  # where that first element lies in the shard


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Where a bucket's parameters lie in its flat storage: what a sharding optimizer reads.

    The storage holds `numel` gradient elements, parameter after parameter in `members` order, then zeros up to
    `padded_numel`, a multiple of `shards`, so that it splits into `shards` equal flat shards; shard r (rank r's)
    is elements [r * shard_numel, (r + 1) * shard_numel).
    """

    index: int
    members: tuple[int, ...]
    numels: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    shards: int = 1

    @property
    def offsets(self) -> tuple[int, ...]:
        out, at = [], 0
        for n in self.numels:
            out.append(at)
            at += n
        return tuple(out)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.shards)  # ceil: the padding goes to the last shards

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.shards

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard_pieces(self, rank: int) -> list[ShardPiece]:
        """The slices of parameters that rank `rank`'s shard holds, in shard order (padding left out)."""
        lo, hi = self.shard_range(rank)
        pieces = []
        for member, offset, n in zip(self.members, self.offsets, self.numels):
            begin, end = max(lo, offset), min(hi, offset + n)
            if begin < end:
                pieces.append(ShardPiece(member, begin - offset, end - offset, begin - lo))
        return pieces


def layout_buckets(plan: list[list[int]], specs: Sequence[ParamSpec], shards: int = 1) -> list[BucketLayout]:
    return [BucketLayout(b, tuple(members), tuple(specs[i].numel for i in members), specs[members[0]].dtype,
                         specs[members[0]].device, shards) for b, members in enumerate(plan)]


# -- buckets at run time ---------------------------------------------------------------------------------------
class GradBucket:
    """One bucket as a comm hook sees it (the surface of torch's GradBucket)."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], buffer: torch.Tensor, comm: Comm,
                 is_last: bool, strides: list[tuple[int, ...] | None]):
        self._index = index
        self._params = params
        self._buffer = buffer
        self._is_last = is_last
        self.comm = comm
        # The reducer's views: a dense parameter's takes its strides (`strides`, as torch's reducer lays them out):
        # autograd makes gradients in the parameter's layout (channels_last, a transpose), so they keep it in the
        # bucket, and as `.grad` too.
        self.views: list[torch.Tensor] = [
            piece.view(p.shape) if stride is None else piece.as_strided(p.shape, stride)
            for p, piece, stride in zip(params, self._pieces(), strides)]

    def _pieces(self) -> list[torch.Tensor]:
        pieces, offset = [], 0
        for p in self._params:
            pieces.append(self._buffer[offset:offset + p.numel()])
            offset += p.numel()
        return pieces

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradients of this bucket; a hook reduces it and returns it (or a tensor of its size)."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        """torch's: each parameter's gradient as a row-major view of the buffer, whatever the parameter's layout
        (hooks view them so: PowerSGD's `tensor.view(rows, -1)`)."""
        return [piece.view(p.shape) for p, piece in zip(self._params, self._pieces())]

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._is_last


class Bucket:
    """One bucket's storage and the four steps of its life in a synchronised backward pass.

    The flat storage is made when it is first needed (the first gradient copied in) and lives until `release`:
    DDP's reductions never release it (the parameters' .grad may be views into it, gradient_as_bucket_view),
    a reduce-scatter releases it once this rank's shard is taken (ZeRO stage 2 keeps only the shard), and the
    next fill makes it again.
    """

    def __init__(self, layout: BucketLayout, params: list[torch.nn.Parameter], comm: Comm, reduction: Reduction,
                 is_last: bool, as_view: bool, usage_numel: int = 0):
        self.layout = layout
        self.index = layout.index
        self.members = list(layout.members)
        self.params = [params[i] for i in layout.members]
        self.reduction = reduction
        self.comm = comm
        self.is_last = is_last
        self.as_view = as_view  # gradient_as_bucket_view: the parameters' .grad become views into the storage
        self.usage_numel = usage_numel  # the usage flags after the padding, when the reduction carries them here
        self._storage: torch.Tensor | None = None
        self._public: GradBucket | None = None
        # Each parameter's layout in the storage, once (stage 2 makes the storage again at every backward).
        self._strides = [p.stride() if p.stride() != _row_major(p.shape) and _dense(p) else None
                         for p in self.params]

    # -- the storage, made on demand ----------------------------------------------------------------------------
    def _allocate(self) -> None:
        layout = self.layout
        # empty, not zeros: every fill writes each parameter's view (a copy, a division into it or zeros); only
        # the shard padding past the gradients is never written, and it must stay zero for the reduction.
        storage = torch.empty(layout.padded_numel + self.usage_numel, dtype=layout.dtype, device=layout.device)
        storage[layout.numel:].zero_()
        self._public = GradBucket(layout.index, self.params, storage[:layout.numel], self.comm, self.is_last,
                                  self._strides)
        self._storage = storage

    @property
    def storage(self) -> torch.Tensor:
        if self._storage is None:
            self._allocate()
        return self._storage

    @property
    def usage(self) -> torch.Tensor:
        """Where the usage flags lie in the storage (empty unless this bucket carries them), one per parameter."""
        return self.storage[self.layout.padded_numel:]

    @property
    def flat(self) -> torch.Tensor:
        """The storage without the shard padding."""
        return self.public.buffer()

    @property
    def public(self) -> GradBucket:
        if self._public is None:
            self._allocate()
        return self._public

    @property
    def views(self) -> list[torch.Tensor]:
        """Each parameter's gradient, shaped like it, in the storage."""
        return self.public.views

    @property
    def allocated(self) -> bool:
        return self._storage is not None

    def release(self) -> None:
        """Drop the storage (a reduction calls this once nothing of it is needed); the next fill makes it anew."""
        self._storage = self._public = None

    # -- fill ----------------------------------------------------------------------------------------------------
    def fill_one(self, position: int, divisor: float) -> bool:
        """Divide one ready gradient into its view now (see reducer.EAGER_NUMEL); False if it is the view."""
        view, grad = self.views[position], self.params[position].grad
        if grad.data_ptr() == view.data_ptr():
            return False  # accumulated in place (gradient_as_bucket_view): divided at launch, when all is in
        if grad.dtype != view.dtype:
            raise _converted(self.params[position], grad, view)
        with torch.no_grad():  # a gradient of create_graph=True requires grad itself
            # Average = sum of (grad / divisor): dividing first keeps low-precision sums from overflowing. Copied
            # gradients are multiplied by the reciprocal, as torch's reducer does (see fill).
            torch.mul(grad, 1.0 / divisor, out=view)
        return True

    def fill(self, filled: list[bool], divisor: float | None) -> None:
        """Copy the gradients not yet in the storage into it (zeros where there is none) and divide them by
        `divisor` (None: the reduction divides, as a comm hook does)."""
        dst, src, in_place = [], [], []
        zeros = 0
        as_view = self.as_view
        for i, param, view in zip(self.members, self.params, self.views):
            if filled[i]:
                continue
            grad = param.grad
            if grad is None:
                view.zero_()
                zeros += 1
            elif as_view and grad.data_ptr() == view.data_ptr():  # already accumulated in place
                in_place.append(view)
            else:
                if grad.dtype != view.dtype:  # the copy would round it to the bucket's dtype, silently
                    raise _converted(param, grad, view)
                dst.append(view)
                src.append(grad)
        if dst:
            torch._foreach_copy_(dst, src)
        if divisor is None:
            return
        # Average = sum of (grad / divisor): dividing first keeps low-precision sums from overflowing. As torch's
        # reducer: a copied gradient times the reciprocal, one accumulated in its view divided (for 2 ranks the
        # two are the same; on 3, gloo's ring adds an element in an order set by its offset in the buffer, so
        # the sums are torch's bits only where the buffers are laid out alike).
        if not in_place and len(dst) + zeros == len(self.members):
            self.flat.mul_(1.0 / divisor)  # one pass: far cheaper than a foreach of many
        elif not dst and len(in_place) + zeros == len(self.members):
            self.flat.div_(divisor)
        else:
            if dst:
                torch._foreach_mul_(dst, 1.0 / divisor)
            if in_place:
                torch._foreach_div_(in_place, divisor)

    # -- launch, wait, write back: the reduction's part ----------------------------------------------------------
    def launch(self, backward: int) -> Any:
        """Start reducing the filled storage for synchronised backward number `backward`, under the name every
        rank gives this collective (join's stand-ins too); what `wait` takes."""
        return self.reduction.start(self, f"bucket {self.index}, backward {backward}")

    def wait(self, handle: Any) -> torch.Tensor | None:
        return self.reduction.wait(self, handle)

    def write_back(self, result: torch.Tensor | None, everywhere_used: list[bool] | None) -> None:
        """everywhere_used: per parameter (the reducer's numbering), whether any rank used it since the last
        synchronised backward; None when every parameter was."""
        self.reduction.finish(self, result, everywhere_used)

    def copy_to_grads(self, everywhere_used: list[bool] | None) -> None:
        """The whole averaged bucket into its parameters' .grad (what DDP's reductions finish with)."""
        if everywhere_used is None and not self.as_view:
            grads = [p.grad for p in self.params]
            if all(g is not None for g in grads):  # the common case: one call for the whole bucket
                torch._foreach_copy_(grads, self.views)
                return
        dst, src = [], []
        for i, param, view in zip(self.members, self.params, self.views):
            if everywhere_used is not None and not everywhere_used[i]:
                continue  # no rank used it: its gradient stays as it was, None included
            if self.as_view:
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    param.grad = view
            elif param.grad is None:
                param.grad = view.clone()
            else:
                dst.append(param.grad)
                src.append(view)
        if dst:
            torch._foreach_copy_(dst, src)


def _converted(param: torch.Tensor, grad: torch.Tensor, view: torch.Tensor) -> RuntimeError:
    return RuntimeError(f"a {tuple(param.shape)} parameter's gradient is {grad.dtype} but its bucket holds "
                        f"{view.dtype}: the model's parameters changed dtype after DistributedDataParallel wrapped "
                        "them (model.double() or .half() after wrapping). Convert the module first, then wrap it")


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _dense(t: torch.Tensor) -> bool:
    """Whether the tensor's elements fill one block of memory, each once, in some order of its dimensions."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda dim: (dim[1], dim[0])):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True
