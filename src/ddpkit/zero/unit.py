"""One unit of a ZeroRedundancyOptimizer at run time: the parameters of one param group with one dtype and
device, this rank's pieces of them (what its local optimizer steps), and the all-gather that makes every
replica whole again after the step; and the gradient clipping that reads every unit's shard (clip_shards_).
The plan (who owns what) is ddpkit.engine.partition's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed.comm import Comm
from ddpkit.engine.partition import Piece, Partition


class Unit:
    """groups: each parameter's param group. grad_of(piece): where the averaged gradient of a piece is (stage 2:
    the reducer's shard of a bucket); None: the piece's slice of its parameter's .grad (stage 1)."""

    def __init__(self, name: str, indices: list[int], params: list[torch.nn.Parameter], groups: list[int],
                 plan: Partition, comm: Comm, bucket_view: bool,
                 grad_of: Callable[[Piece], torch.Tensor | None] | None = None, index: int = -1):
        self.name = name
        self.index = index  # stage 2: the reducer's bucket
        self.indices = indices  # the parameters' global indices (state_dict numbering)
        self.params = params
        self.groups = groups
        self.plan = plan
        self.comm = comm
        self.rank = comm.rank
        self.grad_of = grad_of or self._param_grad
        self.mine: tuple[Piece, ...] = plan.segments[comm.rank]
        self.starts = plan.param_start()
        self.flat: torch.Tensor | None = None  # parameters_as_bucket_view: the parameters live in it
        if bucket_view:
            self._pack()
        # What the local optimizer holds: the parameter itself for whole pieces of a shape-aware optimizer, a
        # flat view of its elements otherwise. Updating a view updates the parameter: no copy in, no copy out.
        self.locals: list[torch.Tensor] = [self._local(piece) for piece in self.mine]
        self.memory = [(p.data_ptr(), p.dtype, p.shape, p.device) for p in params]  # where `follow` expects them

    def _pack(self) -> None:
        """Move the parameters into one flat buffer laid out as the all-gather leaves it, as views of it."""
        plan = self.plan
        self.flat = torch.zeros(plan.segment_numel * plan.world_size, dtype=self.params[0].dtype,
                                device=self.params[0].device)
        for position in range(len(self.params)):
            self._repack(position)

    @torch.no_grad()
    def _repack(self, position: int) -> None:
        param, start = self.params[position], self.starts[position]
        view = self.flat[start:start + param.numel()].view_as(param)
        view.copy_(param)
        param.data = view

    def follow(self, units: list[Unit]) -> None:
        """Before a step: where `p.data = ...` (torch.nn.utils.vector_to_parameters, a loader) gave a parameter
        new memory since the last one, step and gather that memory, as an unsharded optimizer would. The
        optimizer's state stays with the parameter. `units`: all the optimizer's (read only when memory moved)."""
        for position, (param, (pointer, dtype, shape, device)) in enumerate(zip(self.params, self.memory)):
            if param.data_ptr() == pointer:
                continue
            if (param.dtype, param.shape, param.device) != (dtype, shape, device):
                raise ValueError(f"parameter {self.indices[position]} became {param.dtype} {tuple(param.shape)} "
                                 f"on {param.device} after the ZeroRedundancyOptimizer was built for {dtype} "
                                 f"{tuple(shape)} on {device}; its shards cannot change: build the optimizer "
                                 "after converting or moving the model")
            if any(other is not param and _overlap(param, other) for unit in units for other in unit.params):
                # Owned by different ranks, the two gathers would write the same memory with different values.
                raise ValueError(f"parameter {self.indices[position]} now shares its memory with another "
                                 "parameter (tied through .data after the ZeroRedundancyOptimizer was built); "
                                 "tie the parameters themselves (b.weight = a.weight) before building it")
            if self.flat is not None:
                self._repack(position)  # the all-gather writes into the flat buffer: the parameter lives there
            elif not self.plan.whole:
                for piece, local in zip(self.mine, self.locals):
                    if piece.param == position:
                        self._point(local, piece)
            self.memory[position] = (param.data_ptr(), dtype, shape, device)

    def _local(self, piece: Piece) -> torch.Tensor:
        param = self.params[piece.param]
        if self.plan.whole:
            return param
        return self._point(torch.empty(0, dtype=param.dtype, device=param.device), piece)

    def _point(self, local: torch.Tensor, piece: Piece) -> torch.Tensor:
        """`local` made a flat view of the piece's elements in its parameter's memory. A tensor of its own (not
        a view made by slicing) so that `follow` can point the same object, the optimizer state's key, anew."""
        param = self.params[piece.param]
        if not param.is_contiguous():
            raise ValueError(f"parameter {self.indices[piece.param]} ({tuple(param.shape)}) is not contiguous, "
                             "so its flat slices cannot be views of it; make it contiguous "
                             "(param.data = param.data.contiguous())")
        with torch.no_grad():
            return local.set_(param.untyped_storage(), param.storage_offset() + piece.start,
                              (piece.stop - piece.start,))

    # -- around the local step ------------------------------------------------------------------------------------
    def _param_grad(self, piece: Piece) -> torch.Tensor | None:
        grad = self.params[piece.param].grad
        return None if grad is None else grad.detach().reshape(-1)[piece.start:piece.stop]

    def lend_grads(self) -> None:
        """Give each flat view its averaged gradient (a view: no copy)."""
        if self.plan.whole:
            return
        for piece, local in zip(self.mine, self.locals):
            local.grad = self.grad_of(piece)

    def take_back_grads(self) -> None:
        if not self.plan.whole:
            for local in self.locals:
                local.grad = None

    def grads(self) -> list[torch.Tensor]:
        """The gradients this rank's optimizer reads (its shard), for the global norm: a stage-2 bucket's
        parameters that are not this optimizer's (indices None: another optimizer's, or none's) are left out, and
        so are gradients of 0 elements, which add nothing to a norm (and torch's inf-norm kernel refuses them)."""
        if self.plan.whole:
            return [p.grad for p in self.locals if p.grad is not None and p.numel()]
        mine = [piece for piece in self.mine if self.indices[piece.param] is not None and piece.numel]
        return [g for g in map(self.grad_of, mine) if g is not None]

    # -- the all-gather -------------------------------------------------------------------------------------------
    # Without bucket_view every rank's updated pieces go straight into the other ranks' parameters
    # (Comm.all_gather_pieces: on gloo point-to-point from and into the parameters' own memory, nothing packed or
    # copied; elsewhere through one flat buffer). With bucket_view the parameters are views of one flat buffer
    # laid out as the all-gather leaves it, and this rank's segment of it is the input: in place, no copy either.
    def start_gather(self) -> Any:
        """Every rank's updated segment into every rank (asynchronously); `finish_gather` takes the handle."""
        plan = self.plan
        size = plan.segment_numel
        if size == 0:
            return None
        what = f"zero params, {self.name}"
        # Every rank's parameters change in place, as an unsharded step changes them: autograd must know, so
        # that a graph saved before the step raises at its backward instead of reading the new weights.
        torch.autograd.graph.increment_version(self.params)
        if self.flat is None:
            return self.comm.all_gather_pieces([[self._view(p) for p in segment] for segment in plan.segments],
                                               what, async_op=True)
        mine = self.flat[self.rank * size:(self.rank + 1) * size]
        return self.comm.all_gather_into_tensor(self.flat, mine, what, async_op=True)

    def finish_gather(self, handle: Any) -> None:
        if handle is not None:
            self.comm.wait(handle)

    def _view(self, piece: Piece) -> torch.Tensor:
        """The piece's elements in its parameter: a flat view, or the parameter itself for a whole piece (a
        shape-aware optimizer's, perhaps not contiguous: then it travels through a buffer)."""
        param = self.params[piece.param].detach()
        if self.plan.whole:
            return param
        return param.view(-1)[piece.start:piece.stop]


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' elements share memory (any byte)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def relending(closure: Any, units: list[Unit]) -> Any:
    """The closure handed to the wrapped optimizer's step (torch's class hands it over): run with gradients on,
    then the units lend their flat views again, of the .grad its backward made (views lent before it would be
    of the old ones). Anything not callable goes as it came, as torch's passes it."""
    if not callable(closure):
        return closure

    def run() -> Any:
        with torch.enable_grad():
            loss = closure()
        for unit in units:
            unit.lend_grads()
        return loss

    return run


def step_units(optim: torch.optim.Optimizer, units: list[Unit], stage_2: bool, one_step: bool,
               kwargs: dict[str, Any], closure: Any = None) -> tuple[list[tuple[Unit, Any]], Any]:
    """Unit by unit, step the shard with the local optimizer `optim` and start its all-gather, which runs while
    the next unit steps (each local step sees only that unit's gradients; an elementwise optimizer skips the
    others). Stage 2: the first layers' buckets, last in index order, are gathered first, so that the next
    forward starts sooner. Stage 1 waits for every gather in step(): the largest units go first, their transfers
    running while the smaller ones step. `one_step` (whole parameters, which step with their own .grad; step
    kwargs; any class but torch's own, whose step may count or log): one local step for all units, on every
    rank, as torch's class does, with the closure if any (`relending`). Returns the gathers and what that one
    step returned."""
    ordered = list(reversed(units))
    if not stage_2:
        ordered.sort(key=lambda unit: -unit.plan.segment_numel)
    if one_step:
        for unit in ordered:
            unit.lend_grads()
        try:
            returned = optim.step(**kwargs) if closure is None else \
                optim.step(closure=relending(closure, ordered), **kwargs)
        finally:
            for unit in ordered:
                unit.take_back_grads()
        return [(unit, unit.start_gather()) for unit in ordered], returned
    started = []
    for unit in ordered:
        if unit.mine:
            unit.lend_grads()
            try:
                optim.step()
            finally:
                unit.take_back_grads()
        started.append((unit, unit.start_gather()))
    return started, None


def clip_shards_(units: list[Unit], comm: Comm, max_norm: float, norm_type: float = 2.0,
                 whole: bool = False) -> torch.Tensor:
    """The global gradient norm from every rank's shard, and each shard scaled as torch's clip would; whole
    (stage 1, where every rank holds every averaged .grad): every .grad of the units' parameters scaled instead,
    alike on every rank."""
    norm_type = float(norm_type)
    if norm_type == 0:  # torch's counts the gradients that are not all zero: a piece cannot tell for its tensor
        raise ValueError("clip_grad_norm_ over shards takes a norm_type other than 0 (torch's 0-norm counts the "
                         "parameters whose gradient is not all zero, which no rank's shard can tell)")
    grads = [g for unit in units for g in unit.grads()]
    # The pieces' norms in float32 at least (a bf16 norm of each piece would round where torch's rounds each whole
    # tensor's), float64 kept; the same dtype on every rank (the units are), for the collective. The total comes
    # back in torch's dtype (the gradients' own, promoted: bf16 for bf16 gradients), and clips as torch's does.
    dtypes = [p.dtype for u in units for p in u.params]
    exact = functools.reduce(torch.promote_types, dtypes[1:], dtypes[0]) if dtypes else torch.float32
    wide = torch.promote_types(exact, torch.float32)
    device = units[0].params[0].device if units else torch.device("cpu")
    extreme = torch.amax if norm_type > 0 else torch.amin  # the inf-norms: the largest or smallest |element|
    if grads:
        norms = torch.stack(torch._foreach_norm(grads, norm_type, dtype=wide))
        local = extreme(norms) if math.isinf(norm_type) else norms.pow(norm_type).sum()
    else:
        local = torch.zeros((), dtype=wide, device=device)
    if math.isinf(norm_type):
        # Gathered, not all-reduced with MAX or MIN: gloo's drop a NaN that a later rank holds (max(5, nan) is 5
        # there), and a NaN gradient must give a NaN norm, as torch's does. With it, whether the rank has any.
        every = comm.all_gather(torch.stack([local, local.new_tensor(float(bool(grads)))]), "zero grad norm")
        held = every[every[:, 1] > 0, 0]
        total = extreme(held) if held.numel() else local.new_zeros(())  # no gradient anywhere: 0, as torch's
    else:
        total = local.reshape(1).clone()
        comm.all_reduce(total, "zero grad norm", op=dist.ReduceOp.SUM)
        total = total[0].pow(1.0 / norm_type)
    total = total.to(exact if units else torch.float32)
    # torch's formula: scale by max_norm / (norm + 1e-6), never up.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    scaled = list({id(p.grad): p.grad for unit in units for p in unit.params if p.grad is not None}.values()) \
        if whole else grads  # each tensor once (tied parameters share one)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for grad in scaled:
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (grad_device, dtype), same in by_kind.items():
        torch._foreach_mul_(same, coef.to(grad_device, dtype))
    return total
